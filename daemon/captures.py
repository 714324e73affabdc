"""Profile captures: start them in worker processes, keep a record of each on disk, enforce limits."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import Metric

from tfprofd.exporter.base import Clock, Collector, counter, gauge

log = logging.getLogger("tfprofd.captures")

TRIGGERS = ("rule", "alert", "manual")
FINISHED = ("done", "failed", "analysis_failed")


@dataclass
class Target:
    """One training process to profile."""

    job: str
    worker: str
    address: str  # the profiler server's host:port


@dataclass
class CaptureRecord:
    id: str
    trigger: str
    job: str
    targets: list[dict[str, str]]
    requested_at: float
    duration_ms: int
    mode: str
    rule: str | None = None
    alert: str | None = None
    gpu: str | None = None
    status: str = "running"
    reason: str | None = None
    detail: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    directory: str = ""
    analysis: dict[str, Any] | None = None

    def public(self) -> dict[str, Any]:
        return asdict(self)


class CaptureLimit(Exception):
    """A capture that cannot start now: 409 (process busy) or 429 (rate limit)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


class CaptureManager(Collector):
    """Starts captures, persists their records under ``<state_dir>/captures/<id>/``, and exports metrics."""

    name = "captures"

    def __init__(self, root: Path, settings: Callable[[], dict[str, Any]], clock: Clock | None = None):
        self.root = root
        self.settings = settings
        self.clock = clock or Clock()
        self.records: dict[str, CaptureRecord] = {}
        self._busy: set[str] = set()
        self._recent: list[float] = []
        self._finished: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._workers: set[subprocess.Popen] = set()
        self._stopping = threading.Event()
        self.root.mkdir(parents=True, exist_ok=True)
        self._load()

    # ---- records on disk ----

    def _load(self) -> None:
        for path in sorted(self.root.glob("*/record.json")):
            try:
                record = CaptureRecord(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                log.error("unreadable capture record %s: %s (left in place)", path, exc)
                continue
            if record.status not in FINISHED:
                record.status, record.reason = "failed", "agent_restarted"
                record.detail = "the agent stopped while this capture ran"
                record.finished_at = record.finished_at or self.clock.time()
                self._save(record)
            self.records[record.id] = record
        if self.records:
            log.info("loaded %d capture record(s) from %s", len(self.records), self.root)

    def _save(self, record: CaptureRecord) -> None:
        directory = self.root / record.id
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / "record.json.tmp"
        tmp.write_text(json.dumps(record.public(), indent=1, sort_keys=True))
        os.replace(tmp, directory / "record.json")
        self.version += 1

    def update(self, record: CaptureRecord) -> None:
        with self._lock:
            self._save(record)

    def list(self) -> list[CaptureRecord]:
        with self._lock:
            return sorted(self.records.values(), key=lambda r: r.requested_at, reverse=True)

    def get(self, capture_id: str) -> CaptureRecord | None:
        with self._lock:
            return self.records.get(capture_id)

    # ---- starting ----

    def start(self, trigger: str, targets: list[Target], duration_ms: int | None = None,
              options: dict[str, int] | None = None, rule: str | None = None, alert: str | None = None,
              gpu: str | None = None) -> CaptureRecord:
        """Start a capture in the background; raise CaptureLimit if the process is busy or the rate is spent."""
        s = self.settings()
        now = self.clock.time()
        with self._lock:
            busy = [t.address for t in targets if t.address in self._busy]
            if busy:
                raise CaptureLimit(409, f"a capture of {', '.join(busy)} is already running")
            self._recent = [t for t in self._recent if now - t < 3600]
            if len(self._recent) >= s["max_per_hour"]:
                raise CaptureLimit(429, f"capture limit reached: {s['max_per_hour']} per hour "
                                        "(captures.max_per_hour)")
            self._recent.append(now)
            self._busy.update(t.address for t in targets)
            capture_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)
            record = CaptureRecord(
                id=capture_id, trigger=trigger, job=targets[0].job,
                targets=[asdict(t) for t in targets], requested_at=now,
                duration_ms=duration_ms or s["duration_ms"], mode=s["mode"], rule=rule, alert=alert, gpu=gpu,
                directory=str(self.root / capture_id),
            )
            self.records[capture_id] = record
            self._save(record)
        log.info("capture %s started: trigger=%s job=%s targets=%s duration=%dms%s", record.id, trigger,
                 record.job, ",".join(t.address for t in targets), record.duration_ms,
                 f" rule={rule}" if rule else "")
        request = {"mode": s["mode"], "targets": [t.address for t in targets], "duration_ms": record.duration_ms,
                   "logdir": record.directory, **s["options"], **(options or {})}
        thread = threading.Thread(target=self._run, args=(record, request, targets), daemon=True,
                                  name=f"tfprofd-capture-{capture_id}")
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return record

    def _run(self, record: CaptureRecord, request: dict[str, Any], targets: list[Target]) -> None:
        s = self.settings()
        directory = Path(record.directory)
        # The profiler server in the training process writes here, maybe as another user.
        os.chmod(directory, s["dir_mode"])
        timeout = s["timeout"] + record.duration_ms / 1000
        try:
            result = self._spawn(request, timeout)
        finally:
            with self._lock:
                self._busy.difference_update(t.address for t in targets)
        record.started_at = result.get("rpc_sent_at")
        record.status = result["status"]
        record.reason = result.get("reason")
        record.detail = result.get("detail")
        record.files = result.get("files", [])
        record.finished_at = self.clock.time()
        os.chmod(directory, 0o755)
        record.bytes = _tree_bytes(directory)
        analyze = record.status == "done" and s["analyze"]
        if record.status == "done":
            log.info("capture %s done: %d file(s), %d bytes in %s", record.id, len(record.files), record.bytes,
                     record.directory)
        else:
            log.warning("capture %s failed: %s: %s", record.id, record.reason, record.detail)
        if analyze:
            record.status = "analyzing"
            self.update(record)
            self._analyze(record, s["analysis_timeout"])
        with self._lock:
            key = (record.trigger, record.status)
            self._finished[key] = self._finished.get(key, 0) + 1
            self._save(record)
        self.enforce_retention()

    def _worker(self, module: str, args: list[str], stdin: str, timeout: float) -> tuple[str, dict[str, Any] | None]:
        """Run ``python -m module`` with a hard timeout; ("ok", the JSON it printed) or (failure reason, None).

        Failure reasons: ``timeout`` (killed), ``agent_stopped`` (terminated by stop()), ``error: ...``.
        """
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with self._lock:
            self._workers.add(proc)
        try:
            out, err = proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return "timeout", None
        finally:
            with self._lock:
                self._workers.discard(proc)
        if self._stopping.is_set() and proc.returncode < 0:
            return "agent_stopped", None
        return _parse_result(out, proc.returncode, err)

    def stop(self) -> None:
        """Terminate running workers; their records finish as failed (agent_stopped), not silently lost."""
        self._stopping.set()
        with self._lock:
            workers = list(self._workers)
        for proc in workers:
            proc.terminate()

    def _analyze(self, record: CaptureRecord, timeout: float) -> None:
        """Analyse the trace in a worker process (xprof needs 200-450 MB the agent must not hold)."""
        outcome, result = self._worker("tfprofd.daemon.analysis",
                                       [record.directory, "--json", "--duration", str(record.duration_ms / 1000)],
                                       "", timeout)
        if result is None:
            detail = {"timeout": f"analysis did not finish within {timeout:.0f}s",
                      "agent_stopped": "the agent stopped during the analysis"}.get(outcome, outcome)
            result = {"error": detail}
        record.status = "done"
        if "error" in result:
            reason = "agent_stopped" if outcome == "agent_stopped" else "analysis_error"
            record.status, record.reason, record.detail = "analysis_failed", reason, result["error"]
            log.warning("capture %s: analysis failed: %s (raw files kept in %s)", record.id, result["error"],
                        record.directory)
        else:
            record.analysis = result
            log.info("capture %s analysed: job=%s bottleneck=%s input_bound=%s step=%s: %s", record.id, record.job,
                     result["bottleneck"], _pct(result.get("input_bound_ratio")),
                     _ms(result.get("step_time_ms", {}).get("mean")), result["summary"])
        record.bytes = _tree_bytes(Path(record.directory))  # xprof's cache files count too

    def _spawn(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        outcome, result = self._worker("tfprofd.daemon.capture_worker", [], json.dumps(request), timeout)
        if result is not None:
            return result
        if outcome == "timeout":
            return {"status": "failed", "reason": "timeout",
                    "detail": f"no answer from the profiler server within {timeout:.0f}s; the worker was killed"}
        if outcome == "agent_stopped":
            return {"status": "failed", "reason": "agent_stopped", "detail": "the agent stopped during the capture"}
        return {"status": "failed", "reason": "error", "detail": f"capture {outcome}"}

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    # ---- retention ----

    def enforce_retention(self) -> None:
        """Delete the oldest finished captures beyond captures.keep or captures.max_bytes."""
        s = self.settings()
        with self._lock:
            finished = sorted((r for r in self.records.values() if r.status in FINISHED), key=lambda r: r.requested_at)
            total = sum(r.bytes for r in finished)
            while finished and (len(finished) > s["keep"] or total > s["max_bytes"]):
                oldest = finished.pop(0)
                total -= oldest.bytes
                shutil.rmtree(self.root / oldest.id, ignore_errors=True)
                del self.records[oldest.id]
                self.version += 1
                log.info("capture %s deleted by retention (keep %d, max %d bytes)", oldest.id, s["keep"],
                         s["max_bytes"])

    # ---- metrics ----

    def sample(self) -> bool:
        return True

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            records = list(self.records.values())
            counts = {(t, s): self._finished.get((t, s), 0) for t in TRIGGERS for s in FINISHED}
        last: dict[str, float] = {}
        for r in records:
            last[r.job] = max(last.get(r.job, 0.0), r.requested_at)
        yield counter("captures", "Captures finished since the agent started, by trigger and final status.",
                      ["trigger", "status"], (([t, s], n) for (t, s), n in sorted(counts.items())))
        yield gauge("captures_running", "Captures in progress (tracing or being analysed).", [],
                    [((), sum(1 for r in records if r.status in ("running", "analyzing")))])
        latest: dict[str, CaptureRecord] = {}
        for r in sorted(records, key=lambda r: r.requested_at):
            if r.analysis is not None:
                latest[r.job] = r
        analysed = sorted(latest.items())
        yield gauge("capture_input_bound_ratio", "Input-bound ratio (input wait / step time) of the job's latest "
                    "analysed capture.", ["training_job"],
                    (([job], r.analysis["input_bound_ratio"]) for job, r in analysed
                     if r.analysis.get("input_bound_ratio") is not None))
        yield gauge("capture_step_seconds", "Mean step time in the job's latest analysed capture, in seconds.",
                    ["training_job"], (([job], r.analysis["step_time_ms"]["mean"] / 1000) for job, r in analysed
                                       if r.analysis.get("step_time_ms")))
        yield gauge("capture_bottleneck_info", "Bottleneck named by the job's latest analysed capture; the value is "
                    "1.", ["training_job", "kind"], (([job, r.analysis["bottleneck"]], 1) for job, r in analysed))
        yield gauge("capture_last_timestamp_seconds", "Unix time of the latest capture of the training job.",
                    ["training_job"], (([job], ts) for job, ts in sorted(last.items())))


def _parse_result(out: str, returncode: int, err: str) -> tuple[str, dict[str, Any] | None]:
    """A worker's JSON: all of stdout, or its last line (xprof's C++ logging also writes to stdout)."""
    for candidate in (out, out.strip().splitlines()[-1] if out.strip() else ""):
        try:
            return "ok", json.loads(candidate)
        except ValueError:
            continue
    return f"error: worker exited {returncode}: {err.strip()[-500:]}", None


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}ms"


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
