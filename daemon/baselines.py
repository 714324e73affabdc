"""Baseline captures: one short capture of each job once it trains steadily, so that every later capture of
the job can say what changed ("step time 7.9 → 77.3 ms: +68.1 ms waiting for input").

A job is steady when it has trained for ``captures.baseline_after`` with no rule firing for it. Its
baseline is refreshed at most every ``captures.baseline_every`` and traces ``captures.baseline_duration``
(at most 2 s per hour per job, as the options' bounds keep it). Baselines keep their own schedule, outside
the hourly capture budget, and retention keeps each job's newest one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tfprofd.exporter.base import Clock
from tfprofd.exporter.training import TrainingProcesses

from .captures import CaptureService
from .config import CaptureSettings
from .errors import DomainError
from .jobs import JobRegistry
from .rules import Engine
from .sampler import Snapshot

log = logging.getLogger("tfprofd.baselines")


class Baselines:
    def __init__(self, settings: Callable[[], CaptureSettings], captures: CaptureService, jobs: JobRegistry,
                 engine: Engine, clock: Clock):
        self.settings = settings
        self.captures = captures
        self.jobs = jobs
        self.engine = engine
        self.clock = clock
        self._steady_since: dict[str, float] = {}

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """After each training sample: take the baseline of every job that is due for one."""
        if snapshot.fact(TrainingProcesses) is None:
            return
        s = self.settings()
        now = self.clock.monotonic()
        training = self.jobs.training_jobs() if s.baseline else set()
        self._steady_since = {job: since for job, since in self._steady_since.items() if job in training}
        for job in sorted(training):
            since = self._steady_since.setdefault(job, now)
            if self.engine.firing_for(job):
                self._steady_since[job] = now  # not steady: its baseline must show the job running well
                continue
            if now - since < s.baseline_after:
                continue  # not steady long enough yet (asked first: the capture store is not asked per job)
            last = self.captures.last_baseline_time(job)
            if last is not None and self.clock.time() - last < s.baseline_every:
                continue
            self._steady_since[job] = now  # taken or refused, the next try waits a steady stretch again
            try:
                self.captures.request("baseline", job, duration_ms=int(s.baseline_duration * 1000))
                log.info("job %s has trained steadily for %.0fs: baseline capture started", job, now - since)
            except DomainError as exc:
                log.info("job %s: no baseline capture now: %s", job, exc.reason)
