"""CPU collector: seconds by mode (as node_exporter, summed over CPUs), utilization, load and CPU pressure."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import psutil
from prometheus_client.core import Metric

from .base import Collector, Signals, counter, emit_pressure, gauge, pressure_families
from .options import option, parse_bool

MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def parse_loadavg(text: str) -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages from /proc/loadavg."""
    one, five, fifteen = (float(v) for v in text.split()[:3])
    return one, five, fifteen


def cpu_seconds_by_mode(per_cpu: list) -> dict[str, float]:
    """Sum psutil's per-CPU times into seconds by mode; guest time stays inside user, as in /proc/stat."""
    return {mode: sum(getattr(t, mode, 0.0) for t in per_cpu) for mode in MODES}


def busy_ratios(previous: dict[str, float], current: dict[str, float]) -> tuple[float, float] | None:
    """(utilization, iowait) as fractions of all CPU time between two samples, or None if no time passed.

    Utilization counts every mode but idle and iowait, as ``top`` and node_exporter dashboards do.
    """
    delta = {mode: max(current[mode] - previous.get(mode, 0.0), 0.0) for mode in MODES}
    total = sum(delta.values())
    if total <= 0:
        return None
    return (total - delta["idle"] - delta["iowait"]) / total, delta["iowait"] / total


@dataclass
class CpuSample:
    seconds: dict[str, float]
    count: int
    utilization: float | None
    iowait: float | None
    load: tuple[float, float, float] | None
    pressure: list[tuple[str, float]]


@dataclass(frozen=True)
class CpuSettings:
    enabled: bool = option(True, parse_bool, "Export CPU time, utilization, load and pressure.")


class CpuCollector(Collector):
    name = "cpu"
    never_blocks = True
    section = "collectors.cpu"
    Settings = CpuSettings
    signals: ClassVar[dict[str, tuple[str, ...]]] = {"cpu_utilization": (), "cpu_iowait": ()}
    latest: CpuSample | None = None

    def sample(self) -> bool:
        per_cpu = psutil.cpu_times(percpu=True)
        seconds = cpu_seconds_by_mode(per_cpu)
        ratios = busy_ratios(self.latest.seconds, seconds) if self.latest else None
        if ratios is None and self.latest is not None:
            ratios = (self.latest.utilization, self.latest.iowait)
        loadavg = self.env.paths.read_proc("loadavg")
        self.latest = CpuSample(
            seconds=seconds,
            count=len(per_cpu),
            utilization=ratios[0] if ratios else None,
            iowait=ratios[1] if ratios else None,
            load=parse_loadavg(loadavg) if loadavg else None,
            pressure=pressure_families(self.env.paths, "cpu"),
        )
        return True

    def clear(self) -> None:
        self.latest = None

    def rule_signals(self) -> Signals:
        s = self.latest
        if s is None or s.utilization is None:
            return {}
        return {"cpu_utilization": [({}, s.utilization)], "cpu_iowait": [({}, s.iowait)]}

    def collect(self) -> Iterator[Metric]:
        s = self.latest
        if s is None:
            return
        yield counter("cpu_seconds", "Seconds the CPUs spent in each mode, summed over all CPUs.",
                      ["mode"], (((m,), v) for m, v in s.seconds.items()))
        yield gauge("cpus", "Number of logical CPUs.", [], [((), s.count)])
        if s.utilization is not None:
            yield gauge("cpu_utilization_ratio",
                        "Fraction of CPU time not idle or waiting for I/O over the last sampling interval.",
                        [], [((), s.utilization)])
            yield gauge("cpu_iowait_ratio",
                        "Fraction of CPU time spent waiting for I/O over the last sampling interval.",
                        [], [((), s.iowait)])
        if s.load is not None:
            for minutes, value in zip((1, 5, 15), s.load, strict=True):
                yield gauge(f"load{minutes}", f"{minutes}-minute load average.", [], [((), value)])
        yield from emit_pressure("cpu", [p for p in s.pressure if p[0] == "some"])
