"""Sampling: each collector's runner publishes an immutable snapshot per sample to its subscribers
(rendering, the job registry, the rules). A collector that calls a library or a peer that may block (NVML,
the kubelet) samples on a thread of its own, so a hung call cannot stall the others; those that only read
/proc, /sys and memory (``Collector.never_blocks``) take turns on one shared thread.

A subscriber that raises is logged and isolated; the thread keeps sampling. A thread that dies anyway,
a collector whose own background thread died, and a sample that is overdue (blocked inside a library
call) all make the runner unhealthy: /healthz answers 503, tfprofd_collector_success reads 0 and the
collector's last values are no longer served.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client.core import Metric

from tfprofd.exporter.base import Clock, Collector, Signals

log = logging.getLogger("tfprofd.sampler")
T = TypeVar("T")


@dataclass(frozen=True)
class Snapshot:
    """What one sample of one collector produced; never changed after it is published.

    ``families`` builds the collector's metric families from its latest sample when called: they are
    made only when a scrape is due to read them (see exposition.py), not on every sample.
    """

    collector: str
    wall_time: float
    monotonic: float
    success: bool
    duration: float
    signals: Signals
    facts: tuple[Any, ...]
    families: Callable[[], Iterable[Metric]] = field(compare=False, repr=False)

    def fact(self, kind: type[T]) -> T | None:
        return next((f for f in self.facts if isinstance(f, kind)), None)


@dataclass(frozen=True)
class RunnerState:
    """How a collector's sampling stands, for /healthz and the self metrics."""

    success: bool
    duration: float
    last_sample_wall: float
    healthy: bool
    problem: str | None


Subscriber = Callable[[Snapshot], None]
WAKE_RATE = 10  # extra samples a second a collector's wake() may cause at most


class CollectorRunner:
    """Samples one collector every ``interval()`` seconds on a ``SamplingThread`` until stopped, isolating
    its failures."""

    def __init__(self, collector: Collector, interval: Callable[[], float], clock: Clock,
                 subscribers: Sequence[Subscriber] = ()):
        self.collector = collector
        self.name = collector.name
        self.interval = interval
        self.clock = clock
        self.subscribers = list(subscribers)
        self.latest: Snapshot | None = None
        self._sampling_since: float | None = None  # monotonic start of the sample in progress
        self._last_done = 0.0  # monotonic end of the latest sample
        self._died: str | None = None
        self._stopped = False
        self._asked = True  # a sample is wanted before the next interval: the first one, at once
        self._thread: SamplingThread | None = None
        collector.set_wake(self._wake)
        self.first_sample = threading.Event()
        self._failing_logged = False
        self._subscriber_errors: dict[str, str] = {}

    def start(self, thread: SamplingThread | None = None) -> None:
        """Sample on ``thread`` (shared with other collectors), or on a thread of its own."""
        self._thread = thread or SamplingThread(self.name, self.interval, self.clock)
        self._thread.add(self)

    def stop(self) -> None:
        """Stop sampling without waiting: a sample that finishes afterwards is not published."""
        self._stopped = True
        if self._thread is not None:
            self._thread.remove(self)

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return not self._stopped

    def _wake(self) -> None:
        self._asked = True
        if self._thread is not None:
            self._thread.wake()

    def asked_at(self) -> float | None:
        """When a woken sample may be taken (at most WAKE_RATE a second), if one was asked for."""
        return self._last_done + 1 / WAKE_RATE if self._asked else None

    def died(self, why: str) -> None:
        self._died = why

    def stale_after(self) -> float:
        """A sample in progress or a snapshot older than this means the collector is stuck."""
        return max(3 * self.interval(), 10.0)

    def state(self) -> RunnerState:
        now = self.clock.monotonic()
        snap = self.latest
        problem = self._died or self.collector.problem()
        since = self._sampling_since
        if problem is None and since is not None and now - since > self.stale_after():
            problem = f"sample in progress for {now - since:.0f}s (blocked in a library call?)"
        if problem is None and snap is not None and now - self._last_done > self.stale_after() and since is None:
            problem = f"no sample for {now - self._last_done:.0f}s"
        if problem is None and snap is None:
            problem = "no sample yet"
        return RunnerState(success=bool(snap and snap.success) and problem is None,
                           duration=snap.duration if snap else 0.0, last_sample_wall=snap.wall_time if snap else 0.0,
                           healthy=problem is None, problem=problem)

    def serving(self) -> Snapshot | None:
        """The snapshot to serve: none while the collector is stuck or dead (no stale values)."""
        return self.latest if self.state().healthy else None

    def sample_once(self) -> Snapshot:
        self._asked = False  # before sampling: a wake during the sample asks for another
        started, started_wall = self.clock.monotonic(), self.clock.time()
        self._sampling_since = started
        collector = self.collector
        error = None
        try:
            ok = bool(collector.sample())
            signals, facts = collector.rule_signals(), collector.facts()
        except Exception as exc:  # a collector's failure must never stop the loop
            ok, error = False, f"{type(exc).__name__}: {exc}"
            collector.clear()
            signals, facts = {}, ()
        finally:
            self._last_done = self.clock.monotonic()
            self._sampling_since = None
        snapshot = Snapshot(self.name, started_wall, started, ok, self.clock.monotonic() - started, signals, facts,
                            collector.collect)
        if error and not self._failing_logged:
            log.warning("collector %s failed: %s", self.name, error)
            self._failing_logged = True
        elif ok and self._failing_logged:
            log.info("collector %s recovered", self.name)
            self._failing_logged = False
        self._publish(snapshot)
        self.latest = snapshot
        self.first_sample.set()
        return snapshot

    def _publish(self, snapshot: Snapshot) -> None:
        if not self._stopped:  # a sample that outlived stop() (blocked in a library call) is dropped
            self._notify(snapshot)

    def _notify(self, snapshot: Snapshot) -> None:
        for subscriber in self.subscribers:
            name = getattr(subscriber, "__qualname__", repr(subscriber))
            try:
                subscriber(snapshot)
            except Exception as exc:  # one subscriber's failure must not stop sampling or the others
                message = f"{type(exc).__name__}: {exc}"
                if self._subscriber_errors.get(name) != message:
                    log.exception("collector %s: %s failed on a snapshot (sampling goes on)", self.name, name)
                    self._subscriber_errors[name] = message
            else:
                self._subscriber_errors.pop(name, None)


class SamplingThread:
    """One thread that samples its runners in turn, every ``interval()`` seconds and when one is woken.

    Waking a thread that slept a second cost ~0.3-0.6 ms of cold caches on this project's 2-core machine,
    more than reading /proc does: six collectors each on a thread of their own were six such wakes a second
    (issue 24). A runner's own thread ends once the runner is removed; a ``shared`` one runs until ``stop()``."""

    def __init__(self, name: str, interval: Callable[[], float], clock: Clock, shared: bool = False):
        self.interval = interval
        self.clock = clock
        self.shared = shared
        self._runners: list[CollectorRunner] = []
        self._lock = threading.Lock()
        self._woken = threading.Event()
        self._stopped = False
        self._started = False
        self._died: str | None = None
        self._thread = threading.Thread(target=self._guarded_loop, name=f"tfprofd-{name}", daemon=True)

    def add(self, runner: CollectorRunner) -> None:
        """Sample ``runner`` from now on: at once, then each interval (never, with health red, if the thread
        died)."""
        with self._lock:
            self._runners.append(runner)
            if self._died is not None:
                runner.died(self._died)
            elif not self._started:
                self._started = True
                self._thread.start()
        self._woken.set()

    def remove(self, runner: CollectorRunner) -> None:
        with self._lock:
            if runner in self._runners:
                self._runners.remove(runner)
            if not self.shared and not self._runners:
                self._stopped = True
        self._woken.set()

    def stop(self) -> None:
        self._stopped = True
        self._woken.set()

    def wake(self) -> None:
        self._woken.set()

    def join(self, timeout: float) -> None:
        if self._started:
            self._thread.join(timeout)

    def _guarded_loop(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a dead sampling thread must turn its collectors' health red
            with self._lock:
                self._died = f"sampling thread died: {type(exc).__name__}: {exc}"
                runners = list(self._runners)
            for runner in runners:
                runner.died(self._died)
            log.exception("sampling thread died (collectors %s); their metrics are no longer served",
                          ", ".join(r.name for r in runners))

    def _loop(self) -> None:
        next_due = self.clock.monotonic()
        while not self._stopped:
            self._woken.clear()  # before sampling: a wake during the samples asks again
            with self._lock:
                runners = list(self._runners)
            now = self.clock.monotonic()
            scheduled = now >= next_due
            for runner in runners:
                asked = runner.asked_at()
                if runner.running and (scheduled or (asked is not None and asked <= now)):
                    runner.sample_once()
            now = self.clock.monotonic()
            if scheduled:  # schedule the next; fell behind (slow collector, suspended host): skip, don't burst
                next_due = max(next_due + self.interval(), now)
            asked = min((a for r in runners if (a := r.asked_at()) is not None), default=None)
            if asked is not None and asked > now:  # a wake came too soon after a sample: wait it out, not for
                time.sleep(max(min(asked, next_due) - now, 0.0))  # more wakes (a flood); past due: sample now
            elif asked is None:
                self._woken.wait(max(next_due - now, 0) if runners else None)


def states(runners: Mapping[str, CollectorRunner]) -> dict[str, RunnerState]:
    return {name: runner.state() for name, runner in list(runners.items())}
