"""Memory collector: host memory (as ``free`` reports it) and memory pressure."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import psutil
from prometheus_client.core import Metric

from .base import Collector, Signals, emit_pressure, gauge, pressure_families
from .options import option, parse_bool


@dataclass
class MemorySample:
    total: int
    available: int
    used: int
    free: int
    pressure: list[tuple[str, float]]


@dataclass(frozen=True)
class MemorySettings:
    enabled: bool = option(True, parse_bool, "Export host memory and memory pressure.")


class MemoryCollector(Collector):
    name = "memory"
    never_blocks = True
    section = "collectors.memory"
    Settings = MemorySettings
    signals: ClassVar[dict[str, tuple[str, ...]]] = {"memory_used_ratio": ()}
    latest: MemorySample | None = None

    def sample(self) -> bool:
        vm = psutil.virtual_memory()
        self.latest = MemorySample(vm.total, vm.available, vm.used, vm.free,
                                   pressure_families(self.env.paths, "memory"))
        return True

    def clear(self) -> None:
        self.latest = None

    def rule_signals(self) -> Signals:
        s = self.latest
        if s is None or not s.total:
            return {}
        return {"memory_used_ratio": [({}, (s.total - s.available) / s.total)]}

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
