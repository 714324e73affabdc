"""Captures: start them (policy permitting), run them in worker processes, analyse, record, retain.

A capture's thread owns its record from ``running`` to a final status: whatever goes wrong in between
(a worker that crashes, a full disk, a bug), the record ends ``failed`` with the reason and its
processes are free again. Metrics are computed from the records at scrape time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.core import Metric

from tfprofd.exporter.base import Clock, counter, gauge

from .analysis import CaptureAnalysis, compare, with_comparison  # stdlib only: xprof loads in the worker alone
from .config import CaptureSettings
from .errors import AgentStopping, AmbiguousJob, DomainError, StorageError
from .hostcontext import HostContext, HostLoad, HostMonitor, apply
from .jobs import JobRegistry, Target
from .pending import PendingCaptures, PendingEntry, run_on_pending
from .policy import Admission, CapturePolicy
from .records import ACTIVE, FINISHED, TRIGGERS, CaptureRecord, RecordStore, new_id
from .workers import CAPTURE_WORKER, WATCH_AFTER_S, WorkerPool

log = logging.getLogger("tfprofd.captures")

# The NVIDIA driver's control device: on every host where the driver is loaded, also where NVML cannot be read.
NVIDIA_CONTROL = "/dev/nvidiactl"

AGENT_MODE_DIR = 0o750  # the agent writes the trace itself: its group may read, nobody else


def default_analysis_memory(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """A quarter of the memory this agent may use: the host's, or its cgroup (v2) limit where that is lower."""
    total = psutil.virtual_memory().total
    with contextlib.suppress(OSError, ValueError):
        for line in (proc / "self" / "cgroup").read_text().splitlines():
            if line.startswith("0::"):
                limit = (cgroup_root / line[3:].lstrip("/") / "memory.max").read_text().strip()
                if limit.isdigit():
                    total = min(total, int(limit))
    return total // 4


class CaptureService:
    def __init__(self, settings: Callable[[], CaptureSettings], store: RecordStore, policy: CapturePolicy,
                 jobs: JobRegistry, clock: Clock, host: HostMonitor | None = None):
        self.settings = settings
        self.host = host
        self.store = store
        self.policy = policy
        self.jobs = jobs
        self.clock = clock
        self.capture_workers = WorkerPool("capture", limit=8, prestart=CAPTURE_WORKER)  # start(): one waits
        self.analysis_workers = WorkerPool("analysis", limit=2)  # xprof needs 200-450 MB each
        self._records: dict[str, CaptureRecord] = {}
        # each job's baseline records (``_keep``, ``_drop``): the baseline scheduler asks for a steady job's newest at
        # each sample, and a scan of every record for each of 1,000 jobs, each keeping its newest baseline, read a
        # million records a sample (issue 24)
        self._baseline_records: dict[str, list[CaptureRecord]] = {}
        self._finished: dict[tuple[str, str], int] = {}
        self._discarded: dict[str, int] = {}  # rule -> captures taken on pending and discarded
        self.pending = PendingCaptures(clock.monotonic)
        self._threads: set[threading.Thread] = set()
        self._stopping = False  # stop() began: no capture starts
        self._stopped = False
        self._lock = threading.Lock()
        self.on_change: Callable[[], None] = lambda: None  # a record started or ended: its metrics changed
        for record in store.load():
            if record.status not in FINISHED:
                record.status, record.reason = "failed", "agent_restarted"
                record.detail = "the agent stopped while this capture ran"
                record.finished_at = record.finished_at or clock.time()
                self._save(record)
            self._keep(record)
        if self._records:
            log.info("loaded %d capture record(s) from %s", len(self._records), store.records_dir)

    # ---- asking for captures ----

    def request(self, trigger: str, job: str | None = None, gpu: str | None = None, *, one_job: bool = False,
                duration_ms: int | None = None, options: dict[str, int] | None = None, rule: str | None = None,
                alert: str | None = None, cooldown: float = 0.0, start_at_ns: int | None = None,
                pending: PendingEntry | None = None, lookback: float | None = None) -> list[CaptureRecord]:
        """Start captures for a job, a GPU, or every job (one per job). Raises the registry's and the policy's
        domain errors, AmbiguousJob (``one_job`` and several match) and StorageError."""
        groups = self.jobs.targets(job, gpu)
        if one_job and len(groups) > 1:
            jobs = sorted(g[0].job for g in groups)
            raise AmbiguousJob(f"several training jobs report here ({', '.join(jobs)}); name one with \"job\"",
                               jobs=jobs)
        records, errors = [], []
        for group in groups:  # one job's refusal does not stop the others' captures
            try:
                records.append(self.start(trigger, group, duration_ms=duration_ms, options=options, rule=rule,
                                          alert=alert, gpu=gpu, cooldown=cooldown, start_at_ns=start_at_ns,
                                          pending=pending, lookback=lookback))
            except DomainError as exc:
                errors.append(exc)
                if len(groups) > 1:
                    log.info("no capture of job %s: %s", group[0].job, exc.reason)
        if not records:
            raise errors[0]
        return records

    def start(self, trigger: str, targets: list[Target], *, duration_ms: int | None = None,
              options: dict[str, int] | None = None, rule: str | None = None, alert: str | None = None,
              gpu: str | None = None, cooldown: float = 0.0, start_at_ns: int | None = None,
              pending: PendingEntry | None = None, lookback: float | None = None) -> CaptureRecord:
        """Start one capture; at ``start_at_ns`` (Unix ns, a job-wide capture's common instant) if given;
        ``pending``: started as its rule went pending, kept only if the rule fires; ``lookback``: the seconds
        of the past its rule measured (the record says whether other processes starved the job then)."""
        self.ensure_running()
        s = self.settings()
        budget = None if trigger == "baseline" else s.max_per_hour  # baselines keep their own schedule
        admission = self.policy.admit(targets, budget, rule=rule, cooldown=cooldown, automatic=trigger != "manual")
        now = self.clock.time()
        rate, batch = self.jobs.throughput(targets[0].job)
        record = CaptureRecord(id=new_id(now), trigger=trigger, job=targets[0].job,
                               targets=[asdict(t) for t in targets], requested_at=now,
                               duration_ms=duration_ms or int(s.duration * 1000), mode=s.mode, rule=rule, alert=alert,
                               gpu=gpu, context={"samples_per_second": rate, "batch_size": batch})
        try:
            directory = self.store.create_capture_dir(record.id, s.dir_mode if s.mode == "server" else AGENT_MODE_DIR)
            record.directory = str(directory)
            self.store.save(record)
        except OSError as exc:
            self.policy.release(admission, refund=True)
            if record.directory:  # a directory without its record: retention would never see it (a full disk)
                self.store.delete(record)
            raise StorageError(f"cannot create the capture's directory or record: {exc}") from None
        with self._lock:
            self._keep(record)
        self.on_change()
        log.info("capture %s started: trigger=%s job=%s targets=%s duration=%dms%s", record.id, trigger, record.job,
                 ",".join(t.address for t in targets), record.duration_ms, f" rule={rule}" if rule else "")
        request = {"mode": s.mode, "targets": [t.address for t in targets], "duration_ms": record.duration_ms,
                   "logdir": record.directory, "max_trace_bytes": s.max_trace_bytes,
                   "host_tracer_level": s.host_tracer_level, "device_tracer_level": s.device_tracer_level,
                   "python_tracer_level": s.python_tracer_level, "delay_ms": int(s.delay * 1000), **(options or {})}
        request["watch_s"] = WATCH_AFTER_S if self.traces_gpu(request) else 0.0
        if start_at_ns is not None:  # agent mode starts every worker then; server mode waits as long
            ahead_ms = int((start_at_ns / 1e9 - self.clock.time()) * 1000)
            request.update(start_at_ns=start_at_ns, delay_ms=max(0, ahead_ms))
        before = self.host.load_before(record.job, lookback) if self.host is not None else None
        if before is not None and before.contention is not None:
            log.warning("capture %s: other processes starved job %s before it: %s", record.id, record.job,
                        before.contention.why)
        thread = threading.Thread(target=self._run, args=(record, request, admission, before, pending), daemon=True,
                                  name=f"tfprofd-capture-{record.id}")
        with self._lock:
            self._threads.add(thread)
        thread.start()
        return record

    # ---- running one ----

    def _run(self, record: CaptureRecord, request: dict[str, Any], admission: Admission,
             before: HostLoad | None = None, pending: PendingEntry | None = None) -> None:
        try:
            if pending is not None:  # started when its rule went pending: kept only if the rule fires
                run_on_pending(self, record, request, admission, pending, before)
            else:
                self._capture(record, request, admission, before)
            if record.status == "analyzing":
                self._save(record)
                self._analyze(record)
        except Exception as exc:  # whatever happens, the record ends and the process is free
            log.exception("capture %s failed unexpectedly", record.id)
            record.status, record.reason, record.detail = "failed", "error", f"{type(exc).__name__}: {exc}"
        finally:
            self.policy.release(admission)
            if record.status in ACTIVE:
                record.status, record.reason = "failed", record.reason or "error"
            record.finished_at = record.finished_at or self.clock.time()
            record.bytes = self.store.capture_bytes(record.id)
            with self._lock:
                key = (record.trigger, record.status)
                self._finished[key] = self._finished.get(key, 0) + 1
                self._threads.discard(threading.current_thread())
            self._save(record)
            self.on_change()
            self.enforce_retention()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def ensure_running(self) -> None:
        """Raises AgentStopping once ``stop()`` began: no capture starts then."""
        if self._stopping:
            raise AgentStopping("the agent is stopping: it starts no capture")

    def traces_gpu(self, request: dict[str, Any]) -> bool:
        """Whether a capture traces a GPU: its device tracer is on and the host has an NVIDIA GPU (NVML lists one,
        or, where NVML cannot be read, the driver's control device exists). There a profiling session can kill the
        job (README, Known issues): no snapshot ring, and a process that answers with no trace is watched."""
        return request["device_tracer_level"] > 0 and (self.jobs.gpus_listed() or os.path.exists(NVIDIA_CONTROL))

    def _capture(self, record: CaptureRecord, request: dict[str, Any], admission: Admission,
                 before: HostLoad | None = None) -> None:
        # counted from the trace's start: a delay (captures.delay, options.delay_ms) or a job-wide capture's common
        # instant (start_at_ns) comes first, and the worker was killed before it began; after the trace, a process
        # that answered with none is watched for a crash
        timeout = (self.settings().timeout + record.duration_ms / 1000 + request.get("delay_ms", 0) / 1000
                   + request["watch_s"])
        window = self._host(lambda host: host.open(record.job))
        try:
            outcome = self.capture_workers.run(CAPTURE_WORKER, [], json.dumps(request), timeout)
        finally:  # a window left open would keep every later sample (a worker that cannot even start raises)
            if isinstance(window, HostContext):  # the window could not be opened: the record says why
                record.host = window
            elif window is not None:
                record.host = self._host(lambda host: host.close(window, before))
                if record.host is not None and record.host.contention is not None:
                    log.warning("capture %s: other processes starved job %s: %s", record.id, record.job,
                                record.host.contention.why)
        if outcome.pid is not None:
            log.info("capture %s: worker pid %d (%s)", record.id, outcome.pid,
                     "pre-started" if outcome.prestarted else "started on request: none was waiting")
        result = outcome.result or {
            "status": "failed",
            "reason": {"timeout": "timeout", "stopped": "agent_stopped"}.get(outcome.status, "error"),
            "detail": {"timeout": f"no answer from the profiler server within {timeout:.0f}s; the worker was killed",
                       "stopped": "the agent stopped during the capture"}.get(outcome.status, outcome.detail)}
        self.policy.release(admission)  # the process is free once its trace is taken; analysis may take long
        record.started_at = result.get("rpc_sent_at")
        record.files = list(result.get("files", []))
        record.finished_at = self.clock.time()
        record.bytes = self.store.capture_bytes(record.id)  # before the status: a reader sees a final record whole
        status = "analyzing" if result["status"] == "done" and self.settings().analyze else result["status"]
        record.status, record.reason, record.detail = status, result.get("reason"), result.get("detail")
        if result["status"] == "done":
            log.info("capture %s done: %d file(s) in %s", record.id, len(record.files), record.directory)
        else:
            log.warning("capture %s failed: %s: %s", record.id, record.reason, record.detail)
        self.hold_if_died(record, result)

    def hold_if_died(self, record: CaptureRecord, result: dict[str, Any]) -> None:
        """A worker's result names the processes that died during (or just after) the capture (``died``, their
        addresses): no automatic capture of the job for ``captures.hold``."""
        died = result.get("died")
        if not died:
            return
        hold = self.settings().hold
        self.policy.hold(record.job, hold)
        log.warning("capture %s: process(es) at %s of job %s died during (or just after) the capture%s", record.id,
                    ", ".join(died), record.job,
                    f"; no automatic capture of the job for {hold:.0f}s (captures.hold)" if hold else "")

    def _host(self, measure: Callable[[HostMonitor], Any]) -> Any:
        """A host measurement; one that fails is logged and leaves a note, never the capture failed."""
        if self.host is None:
            return None
        try:
            return measure(self.host)
        except Exception as exc:
            log.exception("host context: measuring the capture window failed")
            return HostContext(0.0, note=f"measuring the host failed: {type(exc).__name__}: {exc}")

    def _analyze(self, record: CaptureRecord) -> None:
        """Analyse the trace in a worker process (xprof needs 200 MB and more the agent must not hold); the
        worker's timeout counts from its start, the wait for a free one is bounded on its own."""
        settings = self.settings()
        timeout, queue = settings.analysis_timeout, settings.analysis_queue_timeout
        budget = settings.analysis_max_memory or default_analysis_memory()
        module, args = "tfprofd.daemon.analysis", [record.directory, "--json", "--max-memory", str(budget)]
        if (record.context or {}).get("on_pending"):  # split at the drop, say when the trace begins
            drop_at = record.context.get("drop_at")
            module, args = "tfprofd.daemon.analysis.onset", [*args, *(["--drop-at", str(drop_at)] if drop_at else [])]
        outcome = self.analysis_workers.run(module, args, "", timeout, queue_timeout=queue)
        if outcome.queued_s >= 1:
            log.info("capture %s waited %.0fs for a free analysis worker", record.id, outcome.queued_s)
        raw = outcome.result
        record.bytes = self.store.capture_bytes(record.id)  # before the final status
        result, detail = None, (raw or {}).get("error") if raw is not None else None
        reason = "too_large" if raw is not None and raw.get("reason") == "too_large" else "analysis_error"
        if raw is not None and detail is None:
            try:
                result = CaptureAnalysis.from_json(raw)
            except ValueError as exc:
                detail = f"the analysis worker printed a malformed analysis: {exc}"
        if result is None:
            detail = detail or {
                "timeout": f"analysis did not finish within {timeout:.0f}s (captures.analysis_timeout) of its start; "
                           f"take shorter captures or raise captures.analysis_timeout",
                "queued": f"no free analysis worker within {queue:.0f}s (captures.analysis_queue_timeout): too many "
                          f"captures at once; analyse it with `tfprofd analyze {record.directory}`",
                "stopped": "the agent stopped during the analysis"}.get(outcome.status, outcome.detail)
            reason = {"stopped": "agent_stopped", "queued": "analysis_queued"}.get(outcome.status, reason)
            record.status, record.reason, record.detail = "analysis_failed", reason, detail
            log.warning("capture %s: analysis failed: %s (raw files kept in %s)", record.id, detail, record.directory)
            return
        base = self.baseline_of(record)
        if base is not None and base.analysis is not None:
            comparison = compare(base.analysis, result, _context(base, record, "samples_per_second"),
                                 _context(base, record, "batch_size"))
            if comparison is not None:
                result = with_comparison(result, replace(comparison, baseline_id=base.id))
        result, cause = apply(result, record.host, record.rule)  # the trace's verdict joined with the host's
        if cause is not None and record.rule:
            lifted = self.policy.forgive(record.rule, frozenset(t["address"] for t in record.targets))
            log.info("capture %s found host contention: rule %s's cooldown for job %s %s", record.id, record.rule,
                     record.job, "is lifted" if lifted else "is not (none ran, or it was lifted once within it)")
        record.status, record.analysis = "done", result
        log.info("capture %s analysed: job=%s %s", record.id, record.job, result.summary)

    def count_discarded(self, rule: str) -> None:
        with self._lock:
            self._discarded[rule] = self._discarded.get(rule, 0) + 1

    def _save(self, record: CaptureRecord) -> None:
        if self._stopped and record.status in ACTIVE:  # stop() saved it final
            return
        try:
            self.store.save(record)
        except OSError as exc:  # the record stays right in memory; it is lost only if the agent restarts
            log.error("capture %s: cannot save its record: %s", record.id, exc)

    # ---- reading ----

    def list(self) -> list[CaptureRecord]:
        with self._lock:
            return sorted(self._records.values(), key=lambda r: r.requested_at, reverse=True)

    def get(self, capture_id: str) -> CaptureRecord | None:
        with self._lock:
            return self._records.get(capture_id)

    def _baselines(self, job: str, analysed: bool) -> list[CaptureRecord]:
        """The job's baseline captures, newest first (with an analysis only, if ``analysed``)."""
        with self._lock:
            return self._baselines_locked(job, analysed)

    def _baselines_locked(self, job: str, analysed: bool = True) -> list[CaptureRecord]:
        records = [r for r in self._baseline_records.get(job, ())
                   if not analysed or (r.status == "done" and r.analysis is not None and r.analysis.steps)]
        return sorted(records, key=lambda r: -r.requested_at)

    def _keep(self, record: CaptureRecord) -> None:
        """Hold a record (with the lock held, or before any thread runs)."""
        self._records[record.id] = record
        if record.trigger == "baseline":
            self._baseline_records.setdefault(record.job, []).append(record)

    def _drop(self, record_id: str) -> None:
        """Let a record go (with the lock held)."""
        record = self._records.pop(record_id, None)
        if record is not None and record.trigger == "baseline":
            kept = [r for r in self._baseline_records.get(record.job, ()) if r is not record]
            if kept:
                self._baseline_records[record.job] = kept
            else:
                self._baseline_records.pop(record.job, None)

    def baseline_of(self, record: CaptureRecord) -> CaptureRecord | None:
        """The newest analysed baseline of the record's job taken before it (none for a baseline itself)."""
        if record.trigger == "baseline":
            return None
        with self._lock:
            return self._baseline_before_locked(record.job, record.requested_at)

    def _baseline_before_locked(self, job: str, at: float) -> CaptureRecord | None:
        """The job's newest analysed baseline asked for before ``at``: what a capture asked for then compares with."""
        return next((b for b in self._baselines_locked(job) if b.requested_at < at), None)

    def last_baseline_time(self, job: str) -> float | None:
        """When the job's newest baseline capture was asked for (Unix time), analysed or not."""
        newest = self._baselines(job, analysed=False)
        return newest[0].requested_at if newest else None

    # ---- retention ----

    def enforce_retention(self) -> None:
        """Delete the oldest finished captures beyond captures.keep or captures.max_bytes."""
        s = self.settings()
        now = self.clock.time()
        with self._lock:
            # the baseline each job's next captures compare with stays: the newest asked for before now, not one from
            # the future (asked for before the wall clock stepped back)
            kept = {b.id for job in self._baseline_records if (b := self._baseline_before_locked(job, now))}
            finished = sorted((r for r in self._records.values() if r.status in FINISHED and r.id not in kept),
                              key=lambda r: r.requested_at)
        total = sum(r.bytes for r in finished)
        while finished and (len(finished) > s.keep or total > s.max_bytes):
            oldest = finished.pop(0)
            total -= oldest.bytes
            freed = self.store.delete(oldest)
            with self._lock:
                self._drop(oldest.id)
            log.info("capture %s deleted by retention (keep %d, max %d bytes): %d bytes freed", oldest.id, s.keep,
                     s.max_bytes, freed)

    # ---- lifecycle ----

    def start_workers(self) -> None:
        """Start keeping a capture worker waiting for the next capture."""
        self.capture_workers.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Kill running workers; their records finish as failed (agent_stopped), not silently lost.

        A capture thread that has not ended within ``timeout`` (a busy host) may not end before the process
        exits: its record is saved final here, and nothing saves it active again."""
        self._stopping = True
        self.pending.stop()
        self.capture_workers.stop()
        self.analysis_workers.stop()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout / max(len(threads), 1))
        with self._lock:
            self._stopped = True
            left = [r for r in self._records.values() if r.status in ACTIVE]
        for record in left:
            self._save(replace(
                record, status="failed", reason="agent_stopped", finished_at=record.finished_at or self.clock.time(),
                detail=f"the agent stopped during the {'analysis' if record.status == 'analyzing' else 'capture'}"))

    # ---- metrics, from the records at scrape time ----

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            records = list(self._records.values())
            counts = {(t, s): self._finished.get((t, s), 0) for t in TRIGGERS for s in FINISHED}
            discarded = sorted(self._discarded.items())
        known = self.jobs.jobs()
        yield counter("captures", "Captures finished since the agent started, by trigger and final status.",
                      ["trigger", "status"], (([t, s], n) for (t, s), n in sorted(counts.items())))
        yield counter("captures_discarded", "Captures started when their rule went pending and discarded because "
                      "the rule did not fire (they still counted against the hourly budget and cooldown).", ["rule"],
                      (([rule], n) for rule, n in discarded))
        yield gauge("captures_running", "Captures in progress (tracing or being analysed).", [],
                    [((), sum(1 for r in records if r.status in ACTIVE))])
        spare = self.capture_workers.state()
        yield gauge("capture_worker_ready", "Whether a capture worker is started and waiting for the next capture "
                    "(1) or not (0: the next capture starts one, which takes longer).", [], [((), float(spare.ready))])
        yield counter("capture_workers_used", "Capture workers handed a capture, by how they started: prestarted "
                      "(waiting, ready) or cold (none was waiting).", ["start"],
                      (([start], n) for start, n in sorted(spare.used.items())))
        yield counter("capture_worker_idle_exits", "Pre-started capture workers that exited while waiting (killed, "
                      "crashed) and were replaced; /healthz says what happened to the latest.", [],
                      [((), spare.idle_exits)])
        yield gauge("capture_held_seconds", "Seconds left before automatic captures of the job run again (a process "
                    "of it died during or just after a capture; captures.hold).", ["training_job"],
                    (([job], left) for job, left in sorted(self.policy.held().items())))
        last: dict[str, float] = {}
        latest: dict[str, CaptureRecord] = {}
        for r in sorted(records, key=lambda r: r.requested_at):
            if r.job not in known:  # a job that no longer reports keeps its records, not its series
                continue
            last[r.job] = r.requested_at
            if r.analysis is not None:
                latest[r.job] = r
        analysed = sorted(latest.items())
        yield gauge("capture_input_bound_ratio", "Input-bound ratio (input wait / step time) of the job's latest "
                    "analysed capture.", ["training_job"],
                    (([job], r.analysis.lead.input_bound_ratio) for job, r in analysed
                     if r.analysis is not None and r.analysis.lead.input_bound_ratio is not None))
        yield gauge("capture_step_seconds", "Mean step time in the job's latest analysed capture, in seconds.",
                    ["training_job"], (([job], r.analysis.lead.step_time_ms.mean / 1000) for job, r in analysed
                                       if r.analysis is not None and r.analysis.lead.step_time_ms is not None))
        yield gauge("capture_bottleneck_info", "Bottleneck named by the job's latest analysed capture; the value is "
                    "1.", ["training_job", "kind"], (([job, r.analysis.bottleneck], 1)
                                                     for job, r in analysed if r.analysis is not None))
        yield gauge("capture_last_timestamp_seconds", "Unix time of the latest capture of the training job.",
                    ["training_job"], (([job], ts) for job, ts in sorted(last.items())))
        rows = []
        for job, r in analysed:
            pair = [("latest", r)]
            base = self.baseline_of(r) if r.trigger != "baseline" else r
            if base is not None:
                pair.append(("baseline", base))
            for which, rec in pair:
                parts = rec.analysis.lead.breakdown_ms if rec.analysis is not None else None
                rows.extend(([job, which, part], ms / 1000) for part, ms in (parts.items() if parts else []))
        yield gauge("capture_step_breakdown_seconds", "Mean time per step in each part of the step (waiting for input, "
                    "device compute, ...) in the job's latest analysed capture and in its baseline.",
                    ["training_job", "capture", "part"], rows)


def _context(base: CaptureRecord, record: CaptureRecord, key: str) -> tuple[float | None, float | None]:
    before, after = ((r.context or {}).get(key) for r in (base, record))
    return before, after
