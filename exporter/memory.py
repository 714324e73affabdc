"""Memory collector: host memory (as ``free`` reports it) and memory pressure."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import psutil
from prometheus_client.core import Metric

from .base import Collector, HostPaths, emit_pressure, gauge, pressure_families


@dataclass
class MemorySample:
    total: int
    available: int
    used: int
    free: int
    pressure: list[tuple[str, float]]


class MemoryCollector(Collector):
    name = "memory"

    def __init__(self, paths: HostPaths):
        self.paths = paths
        self.latest: MemorySample | None = None

    def sample(self) -> bool:
        vm = psutil.virtual_memory()
        self.latest = MemorySample(vm.total, vm.available, vm.used, vm.free,
                                   pressure_families(self.paths, "memory"))
        return True

    def used_ratio(self) -> float | None:
        s = self.latest
        return (s.total - s.available) / s.total if s and s.total else None

    def collect(self) -> Iterator[Metric]:
        s = self.latest
        if s is None:
            return
        yield gauge("memory_total_bytes", "Total usable host memory in bytes (MemTotal).", [], [((), s.total)])
        yield gauge("memory_available_bytes",
                    "Host memory in bytes available to start new programs without swapping (MemAvailable).",
                    [], [((), s.available)])
        yield gauge("memory_used_bytes",
                    "Host memory in bytes in use, excluding buffers and page cache (as free reports it).",
                    [], [((), s.used)])
        yield gauge("memory_free_bytes", "Host memory in bytes not used for anything (MemFree).", [],
                    [((), s.free)])
        yield from emit_pressure("memory", s.pressure)
