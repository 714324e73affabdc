"""tfprofd's own health: per-collector success, duration and last-sample time, and build info."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import Metric

from .base import Collector, gauge


@dataclass
class SampleStatus:
    """The outcome of a collector's latest sample, kept by the daemon's sampling loop."""

    success: bool = False
    duration: float = 0.0
    timestamp: float = 0.0


class SelfCollector(Collector):
    name = "self"

    def __init__(self, version: str, statuses: Callable[[], dict[str, SampleStatus]]):
        self.version = version
        self.statuses = statuses

    def sample(self) -> bool:
        return True

    def collect(self) -> Iterator[Metric]:
        statuses = sorted(self.statuses().items())
        yield gauge("build_info", "tfprofd build information; the value is 1.", ["version", "python_version"],
                    [((self.version, platform.python_version()), 1)])
        yield gauge("collector_success", "Whether the collector's latest sample succeeded (1) or not (0).",
                    ["collector"], (((name,), float(s.success)) for name, s in statuses))
        yield gauge("collector_duration_seconds", "How long the collector's latest sample took, in seconds.",
                    ["collector"], (((name,), s.duration) for name, s in statuses))
        yield gauge("collector_last_sample_timestamp_seconds",
                    "Unix time of the collector's latest sample.",
                    ["collector"], (((name,), s.timestamp) for name, s in statuses if s.timestamp))
