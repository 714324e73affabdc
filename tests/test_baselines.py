"""The baseline scheduler: which jobs get a baseline capture, when, and what it asks at each sample."""

from __future__ import annotations

import pytest

from tfprofd.daemon.baselines import Baselines
from tfprofd.daemon.config import CaptureSettings
from tfprofd.daemon.errors import CaptureBusy
from tfprofd.exporter.training import TrainingProcesses

from helpers import FakeClock


class Store:
    """The capture service's two answers the scheduler uses: it records each baseline asked for (the newest per
    job by wall time, as the service orders them) and counts how often a job's newest was asked for."""

    def __init__(self, clock: FakeClock, refuse: set[str] = frozenset()):
        self.clock, self.refuse = clock, refuse
        self.taken: dict[str, float] = {}
        self.requests: list[str] = []
        self.questions = 0

    def last_baseline_time(self, job: str) -> float | None:
        self.questions += 1
        return self.taken.get(job)

    def request(self, trigger: str, job: str, duration_ms: int) -> None:
        assert trigger == "baseline"
        self.requests.append(job)
        if job in self.refuse:
            raise CaptureBusy(f"{job} is being captured")
        self.taken[job] = max(self.taken.get(job, self.clock.time()), self.clock.time())  # newest by wall time


class Jobs:
    def __init__(self, training: set[str]):
        self.training = training

    def training_jobs(self) -> frozenset[str]:
        return frozenset(self.training)


class Engine:
    def __init__(self) -> None:
        self.firing: set[str] = set()

    def firing_jobs(self) -> frozenset[str]:
        return frozenset(self.firing)


class Sample:
    def fact(self, kind):
        return TrainingProcesses(()) if kind is TrainingProcesses else None


def scheduler(training: set[str], **settings):
    clock = FakeClock()
    store, jobs, engine = Store(clock), Jobs(training), Engine()
    options = {"baseline_after": 60.0, "baseline_every": 3600.0, **settings}
    baselines = Baselines(lambda: CaptureSettings(**options), store, jobs, engine, clock)

    def sample(seconds: float = 1.0) -> None:
        clock.mono += seconds
        clock.wall += seconds
        baselines.on_snapshot(Sample())

    return sample, store, jobs, engine


def test_a_job_steady_for_baseline_after_gets_one_baseline_each_baseline_every():
    sample, store, *_ = scheduler({"b", "a"})
    for _ in range(60):  # the first sample finds them training: 59 s steady
        sample()
    assert store.requests == []
    sample()  # 60 s steady: both, in order
    assert store.requests == ["a", "b"]
    for _ in range(3599):
        sample()
    assert store.requests == ["a", "b"]
    sample()  # an hour since: a new one each
    assert store.requests == ["a", "b", "a", "b"]


def test_a_firing_rule_or_a_pause_in_training_restarts_the_steady_stretch():
    sample, store, jobs, engine = scheduler({"a", "b"})
    for _ in range(30):
        sample()
    engine.firing = {"a"}
    sample()
    engine.firing = set()
    jobs.training = {"a"}  # b stops training, and comes back later
    for _ in range(29):
        sample()
    jobs.training = {"a", "b"}
    for _ in range(30):
        sample()
    assert store.requests == []  # a fired 59 s ago, b came back 30 s ago
    sample()
    assert store.requests == ["a"]
    for _ in range(30):
        sample()
    assert store.requests == ["a", "b"]


def test_a_refused_baseline_is_tried_again_after_another_steady_stretch():
    sample, store, *_ = scheduler({"a"})
    store.refuse = {"a"}
    for _ in range(61):
        sample()
    assert store.requests == ["a"]
    store.refuse = set()
    for _ in range(59):
        sample()
    assert store.requests == ["a"]
    sample()
    assert store.requests == ["a", "a"]


def test_a_thousand_steady_jobs_with_recent_baselines_are_not_asked_about_at_every_sample():
    """Each of 1,000 steady jobs has a baseline from 10 minutes ago: a job's newest is found recent once, and not
    asked for again before an hour has passed since it (the scheduler asked the capture store about each at each
    sample: 1,000 questions a second, each a scan of every record then; issue 24)."""
    jobs = {f"job{i:04d}" for i in range(1000)}
    sample, store, _, _ = scheduler(jobs)
    store.taken = {job: store.clock.time() - 600 for job in jobs}
    for _ in range(300):
        sample()
    assert store.requests == [] and store.questions == len(jobs)
    for _ in range(3000):
        sample()
    assert sorted(store.requests) == sorted(jobs)  # an hour after their last: each gets its next


@pytest.mark.parametrize("pause", [False, True])
def test_a_baseline_taken_before_the_wall_clock_stepped_back_delays_the_next_by_baseline_every_not_by_the_step(pause):
    """A host that booted with its clock a day ahead takes a job's baseline, then NTP steps the clock back: the
    record's time is a day in the future. The job's next baseline comes about baseline_every later, as for any other,
    whether the job trained on or paused and came back (the scheduler waited for the wall clock to pass the record's
    time: a day and an hour without one)."""
    sample, store, jobs, _ = scheduler({"a"})
    for _ in range(61):
        sample()
    assert store.requests == ["a"]
    store.clock.wall -= 86400.0  # NTP corrects the clock
    if pause:  # the job pauses and trains again: the scheduler forgets what it knew of the job
        jobs.training = set()
        sample()
        jobs.training = {"a"}
    for _ in range(3700):  # steady again for baseline_after, the record found (its age unknown: taken as new), an hour
        sample()
    assert store.requests == ["a", "a"]
    for _ in range(2 * 3600):  # the record from the future is still the newest: one an hour all the same
        sample()
    assert store.requests == ["a"] * 4
