"""The control API: captures on demand and the Alertmanager webhook. The one place that turns the
agent's domain errors into HTTP status codes.

Every request needs ``Authorization: Bearer <token>`` (the scheme in any case). The token comes from
env ``TFPROFD_API_TOKEN`` or ``api.token_file``; without either the agent creates
``<state_dir>/api.token`` on first start, readable by its group, and ``tfprofd capture`` reads it.
A token file that is missing, empty or unreadable stops the agent from starting: it never runs open.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tfprofd.exporter.options import shown

from .captures import CaptureService
from .errors import (
    AgentStopping,
    AmbiguousJob,
    BudgetSpent,
    CaptureBusy,
    CaptureHeld,
    CoolingDown,
    DiscoveryFailed,
    DomainError,
    ForwardFailed,
    InvalidRequest,
    NoProfiler,
    NotFound,
    NoTrainingJob,
    StorageError,
)
from .forwarding import FORWARDED_HEADER, AlertForwarder
from .httpserver import HttpError, Request, Response, Router, json_response
from .jobcapture import JobCaptures
from .policy import CapturePolicy

log = logging.getLogger("tfprofd.api")

CAPTURE_OPTIONS = {"host_tracer_level": (0, 3), "device_tracer_level": (0, 1), "python_tracer_level": (0, 1),
                   "delay_ms": (0, 60000)}
STATUS: dict[type[DomainError], int] = {InvalidRequest: 400, AmbiguousJob: 400, NotFound: 404, CaptureBusy: 409,
                                        CoolingDown: 409, CaptureHeld: 409, BudgetSpent: 429,
                                        StorageError: 507, DiscoveryFailed: 502, AgentStopping: 503}
# Domain errors an Alertmanager retry can cure: the job may start reporting, the capture finish, the disk clear.
RETRYABLE = (NoTrainingJob, CaptureBusy, StorageError, AgentStopping)  # the restarted agent gets the retry
# The shipped straggler alert (prometheus/tfprofd-alerts.yaml): on the straggler's node, with a cluster to find the
# job's other agents, it captures every worker of the job and compares the one it names with the median worker.
STRAGGLER_ALERT = "TfprofdStraggler"


def http_error(exc: DomainError) -> HttpError:
    """The error's status, reason and ``code`` (its kind, e.g. ``no_training_job``: what a program, another agent
    among them, can rely on where the reason's words may change)."""
    status = next(STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS)
    code = re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).lower()
    return HttpError(status, exc.reason, code=code, **exc.details)


class TokenError(Exception):
    """The control API has no usable token; the agent must not start."""


class Token:
    """The control API's bearer token: from env, a file (re-read when it changes), or generated on first start."""

    def __init__(self, value: str, path: Path | None):
        self._value = value
        self._path = path
        self._stamp: tuple[int, int, int] | None = None
        if path is not None:
            self._value = self._read()

    @classmethod
    def resolve(cls, env_token: str, token_file: str, state_dir: Path) -> Token:
        if env_token.strip():
            return cls(env_token.strip(), None)
        if token_file:
            return cls("", Path(token_file))
        path = state_dir / "api.token"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        except FileExistsError:
            return cls("", path)
        except OSError as exc:
            raise TokenError(f"cannot create the API token file {path}: {exc.strerror}") from None
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        log.info("generated the control API token in %s (readable by the agent's group)", path)
        return cls("", path)

    def _read(self) -> str:
        assert self._path is not None
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd) as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise TokenError(f"API token file {self._path} is not a regular file")
                if st.st_mode & 0o004:
                    raise TokenError(f"API token file {self._path} is readable by every user (chmod o-r it)")
                value = f.read(4096).strip()
                self._stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError as exc:
            raise TokenError(f"cannot read the API token file {self._path}: {exc.strerror}") from None
        if not value:
            raise TokenError(f"the API token file {self._path} is empty")
        return value

    def current(self) -> str:
        """The token now (a changed file is re-read); raises TokenError if it became unusable."""
        if self._path is not None:
            try:
                st = os.stat(self._path, follow_symlinks=False)
                if (st.st_ino, st.st_size, st.st_mtime_ns) != self._stamp:
                    self._value = self._read()
            except OSError as exc:
                raise TokenError(f"cannot read the API token file {self._path}: {exc.strerror}") from None
        return self._value

    def authenticate(self, request: Request) -> None:
        """Raises HttpError 401 unless the request carries the token; runs before routing and body."""
        try:
            expected = self.current()
        except TokenError as exc:
            log.error("refusing control request: %s", exc)
            raise HttpError(401, "the agent cannot read its token; see its log") from None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected.encode()):
            raise HttpError(401, "missing or wrong bearer token (Authorization: Bearer <token>)")


def _int_in(body: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HttpError(400, f"{key} must be an integer in {low}..{high}, got {shown(value)}")
    return value


def parse_capture_body(body: Any) -> dict[str, Any]:
    """Validate the optional body of POST /api/v1/captures."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise HttpError(400, "body must be a JSON object")
    unknown = set(body) - {"job", "gpu", "duration_ms", "options", "scope", "start_at_ns", "trigger"}
    if unknown:
        raise HttpError(400, f"unknown field(s): {', '.join(sorted(unknown))}; expected job, gpu, duration_ms, "
                             "options, scope, start_at_ns, trigger")
    if body.get("trigger", "manual") not in ("manual", "alert"):  # an alert's job-wide capture: holds apply
        raise HttpError(400, f"trigger must be \"manual\" or \"alert\", got {shown(body['trigger'])}")
    if body.get("scope", "host") not in ("host", "job"):
        raise HttpError(400, f"scope must be \"host\" or \"job\", got {shown(body['scope'])}")
    if body.get("scope") == "job" and ("job" not in body or "gpu" in body or "start_at_ns" in body):
        raise HttpError(400, "a job-wide capture (scope \"job\") names a job, and no gpu or start_at_ns")
    for key in ("job", "gpu"):
        if key in body and (not isinstance(body[key], (str, int)) or isinstance(body[key], bool)):
            raise HttpError(400, f"{key} must be a string")
    options = body.get("options", {})
    if not isinstance(options, dict):
        raise HttpError(400, "options must be an object")
    unknown = set(options) - set(CAPTURE_OPTIONS)
    if unknown:
        raise HttpError(400, f"unknown option(s): {', '.join(sorted(unknown))}; expected "
                             f"{', '.join(CAPTURE_OPTIONS)}")
    parsed = {k: _int_in(options, k, *bounds) for k, bounds in CAPTURE_OPTIONS.items() if k in options}
    now_ns = time.time_ns()  # a peer's instant: from now to a minute ahead (clocks a little apart: a second back)
    return {"job": str(body["job"]) if "job" in body else None, "gpu": str(body["gpu"]) if "gpu" in body else None,
            "duration_ms": _int_in(body, "duration_ms", 100, 60000), "options": parsed,
            "scope": body.get("scope", "host"), "trigger": body.get("trigger", "manual"),
            "start_at_ns": _int_in(body, "start_at_ns", now_ns - 1_000_000_000, now_ns + 60_000_000_000)}


def alert_key(alert: dict[str, Any], labels: dict[str, str]) -> str:
    """What identifies one firing of an alert: Alertmanager's fingerprint and startsAt (labels if no fingerprint)."""
    fingerprint = alert.get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint:
        fingerprint = "labels:" + hashlib.sha256(json.dumps(sorted(labels.items())).encode()).hexdigest()[:16]
    return f"{fingerprint}|{alert.get('startsAt', '')}"


def alert_is_for_host(labels: dict[str, str], label: str, value: str) -> bool:
    """Whether an alert's ``label`` names this host (``value``, else the host name), or its host:port does."""
    expected = value or socket.gethostname()
    got = labels.get(label)
    if got is None:
        return False
    return got == expected or got.rsplit(":", 1)[0].strip("[]") == expected


class ControlApi:
    def __init__(self, router: Router, captures: CaptureService, policy: CapturePolicy,
                 host_match: Callable[[dict[str, str]], bool], forwarder: AlertForwarder | None = None,
                 jobwide: JobCaptures | None = None):
        self.captures = captures
        self.jobwide = jobwide
        self.policy = policy
        self.host_match = host_match
        self.forwarder = forwarder
        router.add("GET", "/api/v1/captures", self.list_captures)
        router.add("POST", "/api/v1/captures", self.create_capture)
        router.add("GET", "/api/v1/captures/{capture_id}", self.get_capture)
        router.add("POST", "/api/v1/alerts", self.alerts)
        router.add("GET", "/api/v1/peer", self.peer)

    def peer(self, request: Request) -> Response:
        """What a coordinating agent asks first: it times the round trip and learns whether it asked itself."""
        return json_response(200, {"agent": self.jobwide.agent_id if self.jobwide else "", "time_ns": time.time_ns()})

    # ---- captures ----

    def list_captures(self, request: Request) -> Response:
        """This agent's captures and the job-wide captures it coordinated, newest first; ``scope`` tells them apart
        (``host``: this host's workers; ``job``: a job record, every worker on every host)."""
        records = [(r.requested_at, {"scope": "host", **r.public()}) for r in self.captures.list()]
        records += [(r.requested_at, r.public()) for r in (self.jobwide.list() if self.jobwide else [])]
        return json_response(200, {"captures": [r for _, r in sorted(records, key=lambda r: -r[0])]})

    def get_capture(self, request: Request) -> Response:
        record = self.captures.get(request.params["capture_id"]) or (
            self.jobwide.get(request.params["capture_id"]) if self.jobwide else None)
        if record is None:
            raise HttpError(404, f"no capture {request.params['capture_id']!r}")
        return json_response(200, record.public())

    def create_capture(self, request: Request) -> Response:
        body = parse_capture_body(request.json())
        if body["scope"] == "job":
            return self._job_capture(request, body)
        try:
            [record] = self.captures.request(body["trigger"], body["job"], body["gpu"], one_job=True,
                                             duration_ms=body["duration_ms"], options=body["options"],
                                             start_at_ns=body["start_at_ns"])
        except DomainError as exc:
            raise http_error(exc) from None
        return json_response(202, {"id": record.id, "status": record.status, "job": record.job,
                                   "url": f"/api/v1/captures/{record.id}"})

    def _job_capture(self, request: Request, body: dict[str, Any]) -> Response:
        forwarded_by = request.headers.get(FORWARDED_HEADER.lower())
        if forwarded_by:
            raise HttpError(400, f"a job-wide capture asked by another agent ({forwarded_by}) never fans out again")
        if self.jobwide is None:
            raise HttpError(400, "this agent does not run job-wide captures")
        try:
            record = self.jobwide.start(body["job"], "manual", body["duration_ms"])
        except DomainError as exc:
            raise http_error(exc) from None
        return json_response(202, {"id": record.id, "status": record.status, "job": record.job, "scope": "job",
                                   "url": f"/api/v1/captures/{record.id}"})

    # ---- Alertmanager webhook (payload version 4) ----

    def alerts(self, request: Request) -> Response:
        payload = request.json()
        if not isinstance(payload, dict) or not isinstance(payload.get("alerts"), list):
            raise HttpError(400, "expected an Alertmanager webhook payload: an object with an \"alerts\" list")
        if str(payload.get("version", "4")) != "4":
            raise HttpError(400, f"unsupported webhook payload version {shown(payload.get('version'))}; expected "
                                 "\"4\"")
        for index, alert in enumerate(payload["alerts"]):
            if not isinstance(alert, dict) or not isinstance(alert.get("labels"), dict):
                raise HttpError(400, f"alerts[{index}] must be an object with a labels object")
        forwarded_by = request.headers.get(FORWARDED_HEADER.lower())
        outcome: dict[str, list[Any]] = {"captures": [], "ignored": [], "retry": [], "forwarded": []}
        elsewhere: dict[str, list[dict[str, Any]]] = {}
        for alert in payload["alerts"]:
            target = self._alert(alert, outcome, forwarded_by)
            if target is not None:
                elsewhere.setdefault(target, []).append(alert)
        for target, alerts in elsewhere.items():
            self._forward(target, payload, alerts, outcome)
        # 5xx makes Alertmanager send again; alerts already captured are remembered and not captured twice.
        return json_response(503 if outcome["retry"] else 200, outcome)

    def _forward(self, target: str, payload: dict[str, Any], alerts: list[dict[str, Any]],
                 outcome: dict[str, list[Any]]) -> None:
        assert self.forwarder is not None
        names = [str(a["labels"].get("alertname", "?")) for a in alerts]
        try:
            answer = self.forwarder.forward(target, payload, alerts)
        except ForwardFailed as exc:
            outcome["retry"].extend({"alert": name, "why": exc.reason} for name in names)
            log.warning("alerts %s for %s: not forwarded: %s", ", ".join(names), target, exc.reason)
            return
        outcome["forwarded"].append({"alerts": names, **answer})
        log.info("forwarded alerts %s to the agent at %s (it answered %d)", ", ".join(names), target, answer["status"])

    def _job_alert(self, alert: dict[str, Any], labels: dict[str, str], outcome: dict[str, list[Any]],
                   suspect: str | None = None) -> None:
        """A job-level alert (no host label, a training_job), or the straggler alert on the straggler's node
        (``suspect``: the worker it names): a job-wide capture, once per firing."""
        assert self.jobwide is not None
        name, key = labels.get("alertname", "?"), alert_key(alert, labels)
        if self.policy.alert_handled(key):
            outcome["ignored"].append({"alert": name, "why": "already handled"})
            return None
        try:
            record = self.jobwide.start(labels["training_job"], "alert", suspect=suspect)
        except (DiscoveryFailed, *RETRYABLE) as exc:  # Prometheus may answer, the job report, later
            outcome["retry"].append({"alert": name, "why": exc.reason})
            return None
        except DomainError as exc:
            outcome["ignored"].append({"alert": name, "why": exc.reason})
            return None
        self.policy.remember_alert(key)
        outcome["captures"].append(record.id)
        return None

    def _alert(self, alert: dict[str, Any], outcome: dict[str, list[Any]], forwarded_by: str | None) -> str | None:
        """Handle one alert for this host; for another host, the agent to forward it to (or None)."""
        labels = {str(k): str(v) for k, v in alert["labels"].items()}
        name = labels.get("alertname", "?")
        if alert.get("status") != "firing":
            outcome["ignored"].append({"alert": name, "why": "resolved"})
            return None
        if self.jobwide is not None and self.forwarder is not None and not forwarded_by and labels.get("training_job") \
                and not {self.forwarder.settings().host_label, self.forwarder.settings().forward_label} & set(labels):
            return self._job_alert(alert, labels, outcome)  # for the job, on no host: every host
        if not self.host_match(labels):
            target = self.forwarder.target(labels) if self.forwarder is not None and not forwarded_by else None
            if target is None:
                why = f"another host (forwarded by {forwarded_by}; never forwarded twice)" if forwarded_by \
                    else "another host"
                outcome["ignored"].append({"alert": name, "why": why})
            return target
        if name == STRAGGLER_ALERT and labels.get("training_job") and labels.get("worker") \
                and self.jobwide is not None and self.jobwide.configured():
            return self._job_alert(alert, labels, outcome, suspect=labels["worker"])
        key = alert_key(alert, labels)
        if self.policy.alert_handled(key):
            outcome["ignored"].append({"alert": name, "why": "already handled"})
            log.info("alert %s already handled (%s)", name, key)
            return None
        try:
            records = self.captures.request("alert", labels.get("training_job"), labels.get("gpu"), alert=name)
        except RETRYABLE as exc:
            outcome["retry"].append({"alert": name, "why": exc.reason})
            log.info("alert %s: no capture yet (%s); Alertmanager will send it again", name, exc.reason)
            return None
        except (NoProfiler, BudgetSpent, CoolingDown, CaptureHeld) as exc:  # a retry would not help
            if isinstance(exc, NoProfiler):
                self.policy.remember_alert(key)
            outcome["ignored"].append({"alert": name, "why": exc.reason})
            log.info("alert %s: no capture: %s", name, exc.reason)
            return None
        self.policy.remember_alert(key)
        outcome["captures"].extend(r.id for r in records)
        return None
