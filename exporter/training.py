"""Training collector: receives the hook's reports over UDP, validates them, and exports throughput per job.

Series are labelled ``training_job`` and ``worker`` (``job`` belongs to Prometheus' scrape target). A
job that stops reporting is marked down after ``down_after`` and forgotten after ``expire_after``.
Counters survive a restart of the training process (its counters start over at 0: the agent adds
them to what it had) and a restart of the agent (the hook's counters are cumulative).
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import HistogramMetricFamily, Metric

from .base import PREFIX, Clock, Collector, counter, gauge
from .hook import PHASES, SCHEMA_VERSION, STEP_BUCKETS

log = logging.getLogger("tfprofd.training")

REJECT_REASONS = ("too_large", "malformed_json", "not_an_object", "unknown_version", "invalid_field", "stale",
                  "counter_decreased")
_NAME = re.compile(r"^[A-Za-z0-9_.:/@+-]{1,128}$")
_MAX_COUNT = 2**53


class Rejected(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Report:
    job: str
    worker: str
    pid: int
    seq: int
    time: float
    process_start: float
    phase: str
    epoch: int
    steps: int
    samples: int
    batch_size: int | None
    step_count: int
    step_sum: float
    step_buckets: tuple[int, ...]
    first_step_seconds: float | None
    profiler: str | None


def _int(data: dict[str, Any], key: str, optional: bool = False) -> int | None:
    value = data.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_COUNT:
        raise Rejected("invalid_field", f"{key} must be an integer in 0..2^53, got {value!r}")
    return value


def _float(data: dict[str, Any], key: str, optional: bool = False) -> float | None:
    value = data.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e12:
        raise Rejected("invalid_field", f"{key} must be a non-negative number, got {value!r}")
    return float(value)


def _name(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not _NAME.match(value):
        raise Rejected("invalid_field", f"{key} must be 1-128 characters of [A-Za-z0-9_.:/@+-], got {value!r}")
    return value


def parse_report(payload: bytes, max_bytes: int) -> Report:
    """Validate one datagram of the hook's schema (README: "Hook report schema"); raise Rejected."""
    if len(payload) > max_bytes:
        raise Rejected("too_large", f"{len(payload)} bytes > {max_bytes}")
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, ValueError) as exc:
        raise Rejected("malformed_json", str(exc)) from None
    if not isinstance(data, dict):
        raise Rejected("not_an_object", type(data).__name__)
    if data.get("v") != SCHEMA_VERSION:
        raise Rejected("unknown_version", repr(data.get("v")))
    phase = data.get("phase")
    if phase not in PHASES:
        raise Rejected("invalid_field", f"phase must be one of {PHASES}, got {phase!r}")
    step = data.get("step_seconds")
    if not isinstance(step, dict):
        raise Rejected("invalid_field", "step_seconds must be an object")
    buckets = step.get("buckets")
    if (not isinstance(buckets, list) or len(buckets) != len(STEP_BUCKETS)
            or any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= _MAX_COUNT for b in buckets)
            or any(a > b for a, b in itertools.pairwise(buckets))):
        raise Rejected("invalid_field", f"step_seconds.buckets must be {len(STEP_BUCKETS)} non-decreasing counts")
    step_count = _int(step, "count")
    if buckets[-1] > step_count:
        raise Rejected("invalid_field", "step_seconds.count is below the last bucket")
    profiler = data.get("profiler")
    if profiler is not None and (not isinstance(profiler, str) or not re.match(r"^[A-Za-z0-9.\-\[\]:]{1,255}:\d+$",
                                                                             profiler)):
        raise Rejected("invalid_field", f"profiler must be host:port, got {profiler!r}")
    pid = _int(data, "pid")
    if not pid:
        raise Rejected("invalid_field", "pid must be positive")
    return Report(
        job=_name(data, "job"), worker=_name(data, "worker"), pid=pid, seq=_int(data, "seq"),
        time=_float(data, "time"), process_start=_float(data, "process_start"), phase=phase,
        epoch=_int(data, "epoch"), steps=_int(data, "steps"), samples=_int(data, "samples"),
        batch_size=_int(data, "batch_size", optional=True), step_count=step_count,
        step_sum=_float(step, "sum"), step_buckets=tuple(buckets),
        first_step_seconds=_float(data, "first_step_seconds", optional=True), profiler=profiler,
    )


@dataclass
class JobState:
    """What the agent knows of one (training_job, worker)."""

    latest: Report
    last_seen: float
    # Totals carried over from earlier processes of the same job, so counters never go backwards.
    base_steps: int = 0
    base_samples: int = 0
    base_step_count: int = 0
    base_step_sum: float = 0.0
    base_buckets: list[int] = field(default_factory=lambda: [0] * len(STEP_BUCKETS))
    samples_per_second: float | None = None
    recent_step_seconds: float | None = None  # mean step time between the last two reports

    @property
    def steps(self) -> int:
        return self.base_steps + self.latest.steps

    @property
    def samples(self) -> int:
        return self.base_samples + self.latest.samples


class TrainingCollector(Collector):
    name = "training"

    def __init__(self, address: tuple[str, int], max_bytes: int = 8192, down_after: float = 30.0,
                 expire_after: float = 600.0, clock: Clock | None = None,
                 gpu_processes: Callable[[], list[tuple[int, str, list[int]]]] | None = None):
        self.max_bytes = max_bytes
        self.down_after = down_after
        self.expire_after = expire_after
        self.clock = clock or Clock()
        self.gpu_processes = gpu_processes or (lambda: [])
        self.jobs: dict[tuple[str, str], JobState] = {}
        self.accepted = 0
        self.rejected = dict.fromkeys(REJECT_REASONS, 0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # ride out bursts from many workers
        self._sock.bind(address)
        self._sock.settimeout(0.2)
        self.address = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._receive_loop, name="tfprofd-hook-listener", daemon=True)
        self._thread.start()

    # ---- receiving ----

    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            try:
                payload = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            self.receive(payload)

    def receive(self, payload: bytes) -> bool:
        """Validate and apply one report; count and drop anything malformed."""
        try:
            report = parse_report(payload, self.max_bytes)
            with self._lock:
                self._apply(report)
                self.accepted += 1
                self.version += 1
            return True
        except Rejected as exc:
            with self._lock:
                self.rejected[exc.reason] += 1
                self.version += 1
            log.debug("hook report rejected: %s", exc)
            return False

    def _apply(self, report: Report) -> None:
        key = (report.job, report.worker)
        now = self.clock.monotonic()
        state = self.jobs.get(key)
        if state is None:
            self.jobs[key] = JobState(latest=report, last_seen=now)
            log.info("training job %s worker %s reporting (pid %d, profiler %s)", report.job, report.worker,
                     report.pid, report.profiler or "off")
            return
        previous = state.latest
        if report.pid != previous.pid or report.process_start != previous.process_start:
            # A new process of the same job: its counters start over, so carry the old ones forward.
            state.base_steps += previous.steps
            state.base_samples += previous.samples
            state.base_step_count += previous.step_count
            state.base_step_sum += previous.step_sum
            state.base_buckets = [a + b for a, b in zip(state.base_buckets, previous.step_buckets, strict=True)]
            state.samples_per_second = None
            log.info("training job %s worker %s restarted (pid %d -> %d)", report.job, report.worker,
                     previous.pid, report.pid)
        else:
            if report.seq <= previous.seq:
                raise Rejected("stale", f"seq {report.seq} after {previous.seq}")
            if report.steps < previous.steps or report.samples < previous.samples:
                raise Rejected("counter_decreased", f"steps {previous.steps}->{report.steps}")
            elapsed = report.time - previous.time
            if elapsed > 0:
                state.samples_per_second = (report.samples - previous.samples) / elapsed
            steps = report.step_count - previous.step_count
            if steps > 0:
                state.recent_step_seconds = (report.step_sum - previous.step_sum) / steps
        state.latest = report
        state.last_seen = now

    # ---- the collector interface ----

    def sample(self) -> bool:
        """Forget jobs that stopped reporting long ago."""
        now = self.clock.monotonic()
        with self._lock:
            for key, state in list(self.jobs.items()):
                if now - state.last_seen > self.expire_after:
                    del self.jobs[key]
                    log.info("training job %s worker %s expired after %.0fs without reports", *key,
                             self.expire_after)
        return True

    def active_jobs(self) -> dict[tuple[str, str], JobState]:
        now = self.clock.monotonic()
        with self._lock:
            return {k: s for k, s in self.jobs.items() if now - s.last_seen <= self.down_after}

    def job_gpus(self) -> list[tuple[int, str, str, str]]:
        """(gpu index, uuid, training_job, worker) for every GPU running a reporting job's process."""
        with self._lock:
            by_pid = {s.latest.pid: key for key, s in self.jobs.items()}
        out = []
        for index, uuid, pids in self.gpu_processes():
            for key in sorted({by_pid[p] for p in pids if p in by_pid}):
                out.append((index, uuid, *key))
        return out

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=1)

    def collect(self) -> Iterator[Metric]:
        now = self.clock.monotonic()
        with self._lock:
            jobs = sorted(self.jobs.items())
            rejected = sorted(self.rejected.items())
            accepted = self.accepted
        labels = ["training_job", "worker"]
        yield counter("hook_reports", "Total training-hook reports accepted.", [], [((), accepted)])
        yield counter("hook_reports_rejected", "Total training-hook reports rejected and dropped, by reason.",
                      ["reason"], (((reason,), n) for reason, n in rejected))
        yield gauge("training_up", "Whether the training job reported within the last down_after seconds.", labels,
                    ((key, 1.0 if now - s.last_seen <= self.down_after else 0.0) for key, s in jobs))
        yield counter("training_steps", "Total training steps the job has run.", labels,
                      ((key, s.steps) for key, s in jobs))
        yield counter("training_samples", "Total training samples (examples) the job has processed.", labels,
                      ((key, s.samples) for key, s in jobs))
        yield gauge("training_samples_per_second", "Training throughput between the job's last two reports.",
                    labels, ((key, s.samples_per_second) for key, s in jobs if s.samples_per_second is not None))
        yield gauge("training_batch_size", "Batch size the job declared.", labels,
                    ((key, s.latest.batch_size) for key, s in jobs if s.latest.batch_size is not None))
        yield gauge("training_epoch", "Current epoch of the job (0-based).", labels,
                    ((key, s.latest.epoch) for key, s in jobs))
        yield gauge("training_phase", "Whether the job is in this phase (1) or not (0).", [*labels, "phase"],
                    (([*key, phase], 1.0 if s.latest.phase == phase else 0.0) for key, s in jobs for phase in PHASES))
        yield gauge("training_first_step_seconds", "Seconds from process start to the job's first training step.",
                    labels, ((key, s.latest.first_step_seconds) for key, s in jobs
                             if s.latest.first_step_seconds is not None))
        yield gauge("training_info", "Training job metadata: the profiler server address; the value is 1.",
                    [*labels, "profiler_address"], (([*key, s.latest.profiler or ""], 1) for key, s in jobs))
        histogram = HistogramMetricFamily(PREFIX + "training_step_duration_seconds",
                                          "Duration of training steps as the hook measured them.", labels=labels)
        for key, s in jobs:
            counts = [a + b for a, b in zip(s.base_buckets, s.latest.step_buckets, strict=True)]
            total = s.base_step_count + s.latest.step_count
            buckets = [(repr(bound), float(c)) for bound, c in zip(STEP_BUCKETS, counts, strict=True)]
            buckets.append(("+Inf", float(total)))
            histogram.add_metric(list(key), buckets, s.base_step_sum + s.latest.step_sum)
        yield histogram
        yield gauge("gpu_job_info", "Which training job runs on which GPU (by NVML process list); the value is 1.",
                    ["gpu", "uuid", *labels], (([str(i), uuid, job, worker], 1)
                                               for i, uuid, job, worker in self.job_gpus()))
