"""Baseline captures: one short capture of each job once it trains steadily, so that every later capture of
the job can say what changed ("step time 7.9 → 77.3 ms: +68.1 ms waiting for input").

A job is steady when it has trained for ``captures.baseline_after`` with no rule firing for it. Its
baseline is refreshed at most every ``captures.baseline_every`` and traces ``captures.baseline_duration``
(at most 2 s per hour per job, as the options' bounds keep it). Baselines keep their own schedule, outside
the hourly capture budget, and retention keeps each job's newest one.
"""

from __future__ import annotations

import logging
import math
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
_NEVER = (-math.inf, math.nan)  # a job with no baseline found (NaN: equal to no record's time)


class Baselines:
    def __init__(self, settings: Callable[[], CaptureSettings], captures: CaptureService, jobs: JobRegistry,
                 engine: Engine, clock: Clock):
        self.settings = settings
        self.captures = captures
        self.jobs = jobs
        self.engine = engine
        self.clock = clock
        self._steady_since: dict[str, float] = {}  # job -> since when it trains with no rule firing for it
        # job -> (when its newest baseline was asked for on the monotonic clock, as last found recent; that baseline's
        # record time): a record made before the wall clock stepped back is in the future, and its age on the wall
        # clock put the job's next baseline off by the step (a day ahead at boot: a day without one)
        self._taken: dict[str, tuple[float, float]] = {}

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """After each training sample: take the baseline of every job that is due for one. The work follows the
        jobs that are due, not every job: asking the engine and the capture store about each of 1,000 steady jobs
        at every sample cost more than the rest of the baselines' work together (issue 24). A job's newest
        baseline, once found recent, is not asked for again before ``baseline_every`` has passed since it."""
        if snapshot.fact(TrainingProcesses) is None:
            return
        s = self.settings()
        now, wall = self.clock.monotonic(), self.clock.time()
        training = self.jobs.training_jobs() if s.baseline else frozenset()
        steady, taken = self._steady_since, self._taken
        for job in steady.keys() - training:
            del steady[job]
            taken.pop(job, None)
        for job in training - steady.keys():
            steady[job] = now
        firing = self.engine.firing_jobs() & training
        for job in firing:
            steady[job] = now  # not steady: its baseline must show the job running well
        due = sorted(job for job, since in steady.items() if now - since >= s.baseline_after and job not in firing
                     and now - taken.get(job, _NEVER)[0] >= s.baseline_every)
        for job in due:
            last = self.captures.last_baseline_time(job)
            # a record already found is as old as the monotonic clock says (due: old enough); one from the future
            # is taken as just made
            if last is not None and last != taken.get(job, _NEVER)[1] and wall - last < s.baseline_every:
                taken[job] = (now - max(wall - last, 0.0), last)
                continue
            since, steady[job] = steady[job], now  # taken or refused, the next try waits a steady stretch again
            try:
                self.captures.request("baseline", job, duration_ms=int(s.baseline_duration * 1000))
                # due again baseline_every from now, whatever the wall clock does: the store's newest may even be a
                # record from the future still (it orders them by wall time), which its answer would never pass
                taken[job] = (now, self.captures.last_baseline_time(job))
                log.info("job %s has trained steadily for %.0fs: baseline capture started", job, now - since)
            except DomainError as exc:
                log.info("job %s: no baseline capture now: %s", job, exc.reason)
