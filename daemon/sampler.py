"""The sampling loop: one thread per collector, so a hung NVML call cannot stall /proc sampling."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tfprofd.exporter.base import Clock, Collector
from tfprofd.exporter.selfstats import SampleStatus

log = logging.getLogger("tfprofd.sampler")


class CollectorRunner:
    """Samples one collector every ``interval()`` seconds until stopped, isolating its failures."""

    def __init__(self, collector: Collector, interval: Callable[[], float], clock: Clock,
                 on_sample: Callable[[str], None] | None = None):
        self.collector = collector
        self.interval = interval
        self.clock = clock
        self.on_sample = on_sample
        self.status = SampleStatus()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"tfprofd-{collector.name}", daemon=True)
        self._failing_since_logged = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def sample_once(self) -> None:
        started, started_wall = self.clock.monotonic(), self.clock.time()
        try:
            ok = self.collector.sample()
            error = None  # a collector that returns False has logged its own reason
        except Exception as exc:  # a collector's failure must never stop the loop
            ok, error = False, f"{type(exc).__name__}: {exc}"
            self.collector.clear()
        self.collector.version += 1
        self.status = SampleStatus(success=bool(ok), duration=self.clock.monotonic() - started,
                                   timestamp=started_wall)
        if error and not self._failing_since_logged:
            log.warning("collector %s failed: %s", self.collector.name, error)
            self._failing_since_logged = True
        elif ok and self._failing_since_logged:
            log.info("collector %s recovered", self.collector.name)
            self._failing_since_logged = False
        if self.on_sample:
            self.on_sample(self.collector.name)

    def _loop(self) -> None:
        next_due = self.clock.monotonic()
        while not self._stop.is_set():
            self.sample_once()
            next_due += self.interval()
            delay = next_due - self.clock.monotonic()
            if delay < 0:  # fell behind (slow collector or suspended host): skip, don't burst
                next_due = self.clock.monotonic()
                delay = 0
            self._stop.wait(delay)
