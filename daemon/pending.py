"""Captures started when a rule goes pending: kept only if the rule fires, else discarded.

``PendingCaptures`` tracks, per (rule, series), whether the rule fired, cleared or never decided before its
deadline. ``run_on_pending`` runs one such capture in the capture's thread: a ring of continuous-profiling
snapshots where the profiler server has them (``snapshot_worker``), else one capture at once; then it
waits for the rule and keeps or discards. Admission (busy, cooldown, hourly budget) is the policy's, as
for every capture: a discarded capture still counted, so a flapping rule cannot profile a job all the time.
A capture on pending that fails does not take the firing's turn: its cooldown is lifted (once per cooldown)
and the firing, before or after the failure, gets a capture of its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .hostcontext import HostContext
from .rules import CLEARED, FIRING, PENDING, RESOLVED, Transition
from .workers import CAPTURE_WORKER, Outcome, WorkerPool

if TYPE_CHECKING:
    from .captures import CaptureService
    from .hostcontext import HostLoad
    from .policy import Admission
    from .records import CaptureRecord

log = logging.getLogger("tfprofd.pending")

Key = tuple[str, tuple[tuple[str, str], ...]]
FIRED, CLEARED_OUT, EXPIRED, STOPPED = "fired", "cleared", "expired", "stopped"
GRACE_SECONDS = 5.0  # after the rule's `for`, the samples that may still make it fire


Recapture = Callable[[str], None]  # the firing's own capture of one job


@dataclass
class PendingEntry:
    """One pending rule series; its captures (one per job the rule covers) wait on ``decided``."""

    key: Key
    deadline: float  # monotonic: not fired by then = discarded
    drop_at: float | None = None  # Unix time of the drop, estimated from the hook's step times
    outcome: str = ""
    decided: threading.Event = field(default_factory=threading.Event)
    failed_jobs: list[str] = field(default_factory=list)  # jobs whose capture failed before the rule decided
    recapture: Recapture | None = None  # once fired, until the rule resolves: a job's capture anew


def key_of(t: Transition) -> Key:
    return t.rule.name, tuple(sorted(t.labels.items()))


class PendingCaptures:
    """The pending rule series that captures wait on, and the fired ones until they resolve (a capture kept for a
    firing may still fail, and the firing then captures that job anew)."""

    def __init__(self, monotonic: Any):
        self._monotonic = monotonic
        self._entries: dict[Key, PendingEntry] = {}
        self._fired: dict[Key, PendingEntry] = {}
        self._lock = threading.Lock()

    def open(self, key: Key, for_seconds: float, grace: float, drop_at: float | None) -> PendingEntry:
        entry = PendingEntry(key, self._monotonic() + for_seconds + grace, drop_at)
        with self._lock:
            old = self._entries.pop(key, None)
            self._entries[key] = entry
            self._forget_firing(key)
        if old is not None:
            self._decide(old, CLEARED_OUT)
        return entry

    @staticmethod
    def _decide(entry: PendingEntry, outcome: str) -> None:
        if not entry.decided.is_set():
            entry.outcome = outcome
            entry.decided.set()

    def _forget_firing(self, key: Key) -> None:
        fired = self._fired.pop(key, None)
        if fired is not None:
            fired.recapture = None

    def fire(self, key: Key, recapture: Recapture) -> list[str] | None:
        """The rule fired: the captures waiting on it are kept. None if it took none (capture the usual way); else
        the jobs whose capture already failed, for ``recapture``, which also runs for a kept capture that fails
        later (``failed``), until the rule resolves (``clear``)."""
        with self._lock:  # one step with ``failed``: a firing is never lost between the two
            entry = self._entries.pop(key, None)
            if entry is None or entry.decided.is_set():
                return None
            entry.recapture = recapture
            self._fired[key] = entry
            self._decide(entry, FIRED)
            return list(entry.failed_jobs)

    def clear(self, key: Key) -> None:
        """The rule cleared (before firing) or resolved: nothing is kept or captured anew for it any more."""
        with self._lock:
            entry = self._entries.pop(key, None)
            self._forget_firing(key)
        if entry is not None:
            self._decide(entry, CLEARED_OUT)

    def failed(self, entry: PendingEntry, job: str) -> Recapture | None:
        """The capture of ``job`` taken for ``entry`` failed; the other jobs' captures still wait on it. The firing's
        own capture if the rule fired and has not resolved; else None, and a firing to come captures ``job``."""
        with self._lock:
            if entry.outcome == FIRED:
                return entry.recapture
            entry.failed_jobs.append(job)
            return None

    def wait(self, entry: PendingEntry) -> str:
        if not entry.decided.wait(max(0.0, entry.deadline - self._monotonic())):
            with self._lock:
                if self._entries.get(entry.key) is entry:
                    del self._entries[entry.key]
            self._decide(entry, EXPIRED)
        return entry.outcome

    def stop(self) -> None:
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
            for key in list(self._fired):
                self._forget_firing(key)
        for entry in entries:
            self._decide(entry, STOPPED)


def on_transition(t: Transition, captures: CaptureService, on_pending: bool, interval: float,
                  drop_at: float | None) -> None:
    """What a capturing rule's transition does to captures (the policy's refusals are logged)."""
    from .errors import DomainError

    key = key_of(t)
    if t.kind in (CLEARED, RESOLVED):
        captures.pending.clear(key)
        return
    if t.kind not in (PENDING, FIRING) or (t.kind == PENDING and not on_pending):
        return
    entry = None

    def capture(job: str | None = None) -> None:
        """The rule's capture (of ``job`` only: a failed capture on pending taken anew for the firing)."""
        try:
            captures.request("rule", job or t.labels.get("training_job"), t.labels.get("gpu"), rule=t.rule.name,
                             cooldown=t.rule.cooldown, pending=entry, lookback=lookback(t, interval))
        except DomainError as exc:
            if entry is not None:
                captures.pending.clear(key)  # nothing waits on it: the firing captures the usual way
            log.info("rule %s: no capture%s: %s", t.rule.name, f" of job {job}" if job else "", exc.reason)
        except Exception:  # the rules' thread or a capture's goes on (a thread that cannot start, ...)
            if entry is not None:
                captures.pending.clear(key)
            log.exception("rule %s: the capture%s could not start", t.rule.name, f" of job {job}" if job else "")

    if t.kind == FIRING:
        failed = captures.pending.fire(key, capture)
        if failed is not None:
            log.info("rule %s fired: its capture taken on pending is kept%s", t.rule.name,
                     f"; captured anew where it failed ({', '.join(failed)})" if failed else "")
            for job in failed:
                capture(job)
            return
    else:
        entry = captures.pending.open(key, t.rule.for_seconds, max(GRACE_SECONDS, 3 * interval), drop_at)
    capture()


def lookback(t: Transition, interval: float) -> float:
    """The seconds of the past a rule had measured when it went pending or fired: its primary condition's window
    (one sample for a plain reading), and its ``for`` once firing."""
    span = max(t.rule.conditions[0].window, interval)
    return span + (t.rule.for_seconds if t.kind == FIRING else 0.0)


# ---- running one ----

class RingWorker:
    """A ring of snapshots in a capture worker of ``pool`` (the pre-started one: arming is an RPC, not a process
    start); talks to it over its stdin and stdout."""

    def __init__(self, pool: WorkerPool, request: dict[str, Any], queue_timeout: float):
        self.pool = pool
        self.prestarted = False
        self.proc: subprocess.Popen | None = None
        self._refused: Outcome | None = None
        self._stderr: deque[str] = deque(maxlen=20)
        taken = pool.take(CAPTURE_WORKER, queue_timeout)
        if isinstance(taken, Outcome):
            self._refused = taken
            return
        self.proc, self.prestarted = taken
        threading.Thread(target=self._drain, args=(self.proc,), daemon=True,
                         name=f"tfprofd-ring-stderr-{self.proc.pid}").start()
        self._send(json.dumps({**request, "ring": True}))

    def _drain(self, proc: subprocess.Popen) -> None:
        """Read its stderr (gRPC's logging) so it never blocks on a full pipe; the last lines explain a failure."""
        assert proc.stderr is not None
        with contextlib.suppress(OSError, ValueError):
            for line in proc.stderr:
                self._stderr.append(line.rstrip())

    def _send(self, line: str) -> None:
        try:
            assert self.proc is not None and self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it ended: its answer (or its absence) says why

    def answer(self, timeout: float) -> dict[str, Any]:
        """Its next JSON line; a failure result if it says nothing in time (it is then killed)."""
        if self.proc is None:
            refused = self._refused
            assert refused is not None
            return {"status": "failed", "reason": "agent_stopped" if refused.status == "stopped" else "error",
                    "detail": refused.detail}
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        try:
            result = json.loads(line)
            if isinstance(result, dict):
                return result
        except ValueError:
            pass
        self.close(wait=0.0)
        if self.pool.stopping:  # the agent killed it
            return {"status": "failed", "reason": "agent_stopped", "detail": "the agent stopped during the capture"}
        said = line.strip()[:300] or " / ".join(list(self._stderr)[-3:])[-300:] or "no output"
        return {"status": "failed", "reason": "timeout" if not ready else "error",
                "detail": f"the snapshot worker gave no answer within {timeout:.0f}s" if not ready
                else f"the snapshot worker ended: {said}"}

    def finish(self, command: str, timeout: float) -> dict[str, Any]:
        self._send(command)
        result = self.answer(timeout)
        self.close()
        return result

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def close(self, wait: float = 5.0) -> None:
        """The worker ends (killed if it still runs after ``wait`` seconds) and its place in the pool is free."""
        proc, self.proc = self.proc, None
        if proc is not None:
            self._refused = Outcome("error", None, "the snapshot worker ended")
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait)
            self.pool.put_back(proc)


def run_on_pending(service: CaptureService, record: CaptureRecord, request: dict[str, Any], admission: Admission,
                   entry: PendingEntry, before: HostLoad | None = None) -> None:
    """Take the capture of a pending rule, then keep it if the rule fires, else discard it."""
    s = service.settings()
    record.context = {**(record.context or {}), "on_pending": True, "drop_at": entry.drop_at}
    ring = None
    ringable = s.snapshots and request["mode"] == "agent" and len(request["targets"]) == 1
    if ringable and service.traces_gpu(request):
        ringable = False
        record.context["mode_reason"] = "no snapshot ring on a GPU host: its session restarts kill GPU jobs"
        log.info("capture %s: one capture at pending, no snapshot ring: a snapshot restarts the profiling session, "
                 "and on a GPU that kills the job (README, Captures)", record.id)
    if ringable:
        ring = RingWorker(service.capture_workers, {
            **request, "interval": s.snapshot_interval, "keep": s.snapshot_keep, "max_bytes": s.snapshot_max_bytes,
            "rpc_timeout": 30.0, "min_s": request["duration_ms"] / 1000,
            "deadline_s": max(0.0, entry.deadline - service.clock.monotonic()) + 60}, s.timeout)
        armed = ring.answer(s.timeout)
        log.info("capture %s: snapshot ring in worker %s (%s): %s", record.id, ring.pid,
                 "pre-started" if ring.prestarted else "started on request: none was waiting",
                 "armed" if armed.get("armed") else armed.get("status"))
        if armed.get("armed"):
            record.context["mode"] = "snapshots"
            window = service._host(lambda host: host.open(record.job))  # the host beside the ring, as a capture
            try:
                outcome = service.pending.wait(entry)
                result = ring.finish("keep" if outcome == FIRED else "drop",
                                     s.timeout + request["duration_ms"] / 1000)
            finally:
                ring.close()  # whatever happened, the worker ends and its place is free
            if isinstance(window, HostContext):  # the window could not be opened: the record says why
                record.host = window
            elif window is not None:
                record.host = service._host(lambda host: host.close(window, before))
            service.policy.release(admission)
            if outcome != FIRED:
                discard(service, record, outcome)
                return
            record.context["snapshots"] = result.get("snapshots", [])
            again = _failure(service, record, entry, result) if result["status"] == "failed" else None
            _apply(record, result, service.clock.time(), s.analyze)
            if again is not None:
                again(record.job)
            return
        ring.close()
        if armed.get("status") != "unimplemented":
            service.policy.release(admission)  # before the failure is known: the firing may capture anew at once
            again = _failure(service, record, entry, armed)
            _apply(record, armed, service.clock.time(), s.analyze)
            if again is not None:
                again(record.job)
            return
        log.info("capture %s: %s; one capture at pending instead", record.id, armed.get("detail"))
    record.context["mode"] = "capture"
    taken = replace(record)  # the record stays running until the rule decides
    try:
        service._capture(taken, request, admission, before)
    except Exception as exc:  # the capture failed: the firing's turn is kept all the same
        log.exception("capture %s failed unexpectedly", record.id)
        service.policy.release(admission)
        taken.status, taken.reason, taken.detail = "failed", "error", f"{type(exc).__name__}: {exc}"
        taken.finished_at = service.clock.time()
    record.started_at, record.host = taken.started_at, taken.host
    traced = taken.status in ("done", "analyzing")
    if traced:  # a reader of the record learns why a traced capture still says running
        record.detail = (f"traced; kept{' and analysed' if s.analyze else ''} once rule {record.rule} fires; "
                         "deleted if it stops pending, does not fire in time, or the agent stops first")
        outcome = service.pending.wait(entry)
        if outcome != FIRED:
            discard(service, record, outcome)
            return
    again = None if traced else _failure(service, record, entry, {"reason": taken.reason})
    for name in ("reason", "detail", "files", "finished_at", "bytes", "status"):  # status last: a whole record
        setattr(record, name, getattr(taken, name))
    if again is not None:  # the record says it failed now, not when the rule decides
        again(record.job)


def _failure(service: CaptureService, record: CaptureRecord, entry: PendingEntry,
             result: dict[str, Any]) -> Recapture | None:
    """The capture taken on pending failed (no server, no trace, a timeout): it does not take the firing's turn. A
    job that died is held (``captures.hold``); the rule's cooldown the capture booked is lifted, once per cooldown
    (shared with a contended capture's: a rule whose captures keep failing still waits); and if the rule has fired,
    its capture of the job anew is returned. Called before the record says failed, so that the next transition
    finds all this done; what it returns runs after."""
    service.hold_if_died(record, result)
    if record.rule:
        service.policy.forgive(record.rule, frozenset(t["address"] for t in record.targets))
    if result.get("reason") == "agent_stopped" or service.stopping:
        return None
    again = service.pending.failed(entry, record.job)
    if again is not None:
        log.info("capture %s taken on pending failed after rule %s fired: job %s is captured anew", record.id,
                 record.rule, record.job)
    return again


def _apply(record: CaptureRecord, result: dict[str, Any], now: float, analyze: bool) -> None:
    record.reason, record.detail = result.get("reason"), result.get("detail")
    record.started_at = result.get("rpc_sent_at")
    record.files = list(result.get("files", []))
    record.finished_at = now
    spans = [s for s in result.get("snapshots", []) if s.get("begin_ns") and s.get("end_ns")]
    if spans:
        record.duration_ms = int((spans[-1]["end_ns"] - spans[0]["begin_ns"]) / 1e6)
    status = result["status"]
    record.status = "analyzing" if status == "done" and analyze else status  # last: readers see a whole record


def discard(service: CaptureService, record: CaptureRecord, outcome: str) -> None:
    """Delete a capture's files and record it ``discarded`` (its rule never fired), counted by rule."""
    try:
        freed, left = service.store.state.remove_tree("captures", service.store.capture_dir(record.id).name)
    except OSError as exc:
        freed, left = 0, [str(exc)]
    for problem in left[:5]:
        log.warning("capture %s: could not delete %s", record.id, problem)
    record.reason, record.files = outcome, []
    record.detail = {CLEARED_OUT: "the rule stopped pending before it fired", EXPIRED: "the rule did not fire in time",
                     STOPPED: "the agent stopped before the rule fired"}.get(outcome, outcome)
    record.finished_at = record.finished_at or time.time()
    service.count_discarded(record.rule or "")
    record.status = "discarded"  # last: readers see a whole record
    log.info("capture %s discarded (%s): %d bytes freed", record.id, record.detail, freed)
