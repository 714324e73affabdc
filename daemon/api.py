"""The control API: captures on demand (``POST /api/v1/captures``) and the Alertmanager webhook."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .captures import CaptureLimit, CaptureManager, Target
from .httpserver import HttpError, Request, Response, Router, json_response

log = logging.getLogger("tfprofd.api")

CAPTURE_OPTIONS = {"host_tracer_level": (0, 3), "device_tracer_level": (0, 1), "python_tracer_level": (0, 1),
                   "delay_ms": (0, 60000)}
SEEN_ALERTS_KEPT = 1000

# (job, gpu) -> one list of targets per capture to start; raises HttpError 404/400 when none fit.
Resolver = Callable[[str | None, str | None], list[list[Target]]]


def _int_in(body: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HttpError(400, f"{key} must be an integer in {low}..{high}, got {value!r}")
    return value


def parse_capture_body(body: Any) -> dict[str, Any]:
    """Validate the optional body of POST /api/v1/captures."""
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise HttpError(400, "body must be a JSON object")
    unknown = set(body) - {"job", "gpu", "duration_ms", "options"}
    if unknown:
        raise HttpError(400, f"unknown field(s): {', '.join(sorted(unknown))}; expected job, gpu, duration_ms, "
                             "options")
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
    return {"job": str(body["job"]) if "job" in body else None, "gpu": str(body["gpu"]) if "gpu" in body else None,
            "duration_ms": _int_in(body, "duration_ms", 100, 60000), "options": parsed}


class ControlApi:
    def __init__(self, router: Router, captures: CaptureManager, resolve: Resolver,
                 host_match: Callable[[dict[str, str]], bool], state_dir: Path):
        self.captures = captures
        self.resolve = resolve
        self.host_match = host_match
        self._seen_path = state_dir / "alerts_seen.json"
        self._seen: OrderedDict[str, float] = self._load_seen()
        self._seen_lock = threading.Lock()
        router.add("GET", "/api/v1/captures", self.list_captures)
        router.add("POST", "/api/v1/captures", self.create_capture)
        router.add("GET", "/api/v1/captures/{capture_id}", self.get_capture)
        router.add("POST", "/api/v1/alerts", self.alerts)

    # ---- captures ----

    def list_captures(self, request: Request) -> Response:
        return json_response(200, {"captures": [r.public() for r in self.captures.list()]})

    def get_capture(self, request: Request) -> Response:
        record = self.captures.get(request.params["capture_id"])
        if record is None:
            raise HttpError(404, f"no capture {request.params['capture_id']!r}")
        return json_response(200, record.public())

    def create_capture(self, request: Request) -> Response:
        body = parse_capture_body(request.json())
        groups = self.resolve(body["job"], body["gpu"])
        if len(groups) > 1:
            jobs = sorted({g[0].job for g in groups})
            raise HttpError(400, f"several training jobs report here ({', '.join(jobs)}); name one with \"job\"",
                            jobs=jobs)
        try:
            record = self.captures.start("manual", groups[0], duration_ms=body["duration_ms"], options=body["options"],
                                         gpu=body["gpu"])
        except CaptureLimit as exc:
            raise HttpError(exc.status, exc.reason) from None
        return json_response(202, {"id": record.id, "status": record.status, "job": record.job,
                                   "url": f"/api/v1/captures/{record.id}"})

    # ---- Alertmanager webhook (payload version 4) ----

    def _load_seen(self) -> OrderedDict[str, float]:
        try:
            return OrderedDict(json.loads(self._seen_path.read_text()))
        except (OSError, ValueError):
            return OrderedDict()

    def _remember(self, key: str, now: float) -> bool:
        """True the first time an alert instance (fingerprint + startsAt) is seen, persisted across restarts."""
        with self._seen_lock:
            if key in self._seen:
                return False
            self._seen[key] = now
            while len(self._seen) > SEEN_ALERTS_KEPT:
                self._seen.popitem(last=False)
            tmp = self._seen_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._seen))
            os.replace(tmp, self._seen_path)
            return True

    def alerts(self, request: Request) -> Response:
        payload = request.json()
        if not isinstance(payload, dict) or not isinstance(payload.get("alerts"), list):
            raise HttpError(400, "expected an Alertmanager webhook payload: an object with an \"alerts\" list")
        if str(payload.get("version", "4")) != "4":
            raise HttpError(400, f"unsupported webhook payload version {payload.get('version')!r}; expected \"4\"")
        outcome: dict[str, list[Any]] = {"captures": [], "ignored": []}
        for index, alert in enumerate(payload["alerts"]):
            if not isinstance(alert, dict) or not isinstance(alert.get("labels"), dict):
                raise HttpError(400, f"alerts[{index}] must be an object with a labels object")
            labels = {str(k): str(v) for k, v in alert["labels"].items()}
            name = labels.get("alertname", "?")
            if alert.get("status") != "firing":
                outcome["ignored"].append({"alert": name, "why": "resolved"})
                continue
            if not self.host_match(labels):
                outcome["ignored"].append({"alert": name, "why": "another host"})
                continue
            key = f"{alert.get('fingerprint', '')}|{alert.get('startsAt', '')}"
            if not self._remember(key, time.time()):
                outcome["ignored"].append({"alert": name, "why": "already handled"})
                log.info("alert %s already handled (fingerprint %s, startsAt %s)", name, alert.get("fingerprint"),
                         alert.get("startsAt"))
                continue
            try:
                groups = self.resolve(labels.get("training_job"), labels.get("gpu"))
            except HttpError as exc:
                outcome["ignored"].append({"alert": name, "why": exc.reason})
                log.info("alert %s: no capture: %s", name, exc.reason)
                continue
            for group in groups:
                try:
                    record = self.captures.start("alert", group, alert=name, gpu=labels.get("gpu"))
                    outcome["captures"].append(record.id)
                except CaptureLimit as exc:  # answer 2xx anyway: a retry would not help
                    outcome["ignored"].append({"alert": name, "why": exc.reason})
                    log.info("alert %s: no capture: %s", name, exc.reason)
        return json_response(200, outcome)


def alert_is_for_host(labels: dict[str, str], label: str, value: str) -> bool:
    """Whether an alert's ``label`` names this host (``value``, else the host name), or its host:port does."""
    expected = value or socket.gethostname()
    got = labels.get(label)
    if got is None:
        return False
    return got == expected or got.rsplit(":", 1)[0].strip("[]") == expected
