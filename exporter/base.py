"""What every collector shares: the sample/collect split, the OS and clock seams, metric helpers.

A collector reads the system in ``sample()`` (called by the daemon's background loop, never by a scrape)
and keeps the result; ``collect()`` turns the latest sample into fresh metric families. A scrape
therefore never waits on NVML or /proc.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "tfprofd_"


class Clock:
    """Wall and monotonic time; tests substitute their own."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


@dataclass(frozen=True)
class HostPaths:
    """Where procfs and sysfs are mounted (``/host/proc`` in a container, a fixture tree in tests)."""

    procfs: Path = Path("/proc")
    sysfs: Path = Path("/sys")

    def read_proc(self, relative: str) -> str | None:
        """Text of a procfs file, or None if this kernel does not have it."""
        return _read(self.procfs / relative)

    def read_sys(self, relative: str) -> str | None:
        return _read(self.sysfs / relative)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError, PermissionError, OSError):
        return None


class Collector:
    """Base of every collector: subclasses implement ``sample()`` and ``collect()``."""

    name: str = ""
    version: int = 0  # bumped whenever the data behind collect() changes; keys the rendered-text cache
    latest: object = None  # the last sample, for collectors that keep one

    def sample(self) -> bool:
        """Read the system and keep the result. Return False on a partial failure; raise on a full one."""
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError

    def clear(self) -> None:
        """Forget the last sample (called after a failed one, so stale values are not served)."""
        self.latest = None

    def close(self) -> None:
        """Release what ``sample()`` opened (threads, handles)."""


def gauge(name: str, documentation: str, labels: Sequence[str],
          samples: Iterable[tuple[Sequence[str], float]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, documentation, labels=list(labels))
    for label_values, value in samples:
        family.add_metric(list(label_values), value)
    return family


def counter(name: str, documentation: str, labels: Sequence[str],
            samples: Iterable[tuple[Sequence[str], float]]) -> CounterMetricFamily:
    """A counter family; ``name`` is given without ``_total`` (the client appends it)."""
    family = CounterMetricFamily(PREFIX + name, documentation, labels=list(labels))
    for label_values, value in samples:
        family.add_metric(list(label_values), value)
    return family


def parse_pressure(text: str) -> dict[str, float]:
    """Cumulative stall seconds from a /proc/pressure/<resource> file: ``{"some": s, "full": s}``.

    Lines look like ``some avg10=0.00 avg60=0.00 avg300=0.00 total=12345`` (total in microseconds).
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        for field in rest.split():
            name, _, value = field.partition("=")
            if name == "total" and kind in ("some", "full"):
                out[kind] = int(value) / 1e6
    return out


def pressure_families(paths: HostPaths, resource: str) -> list[tuple[str, float]]:
    """(kind, seconds) pairs for one PSI resource, empty if the kernel has no PSI."""
    text = paths.read_proc(f"pressure/{resource}")
    return sorted(parse_pressure(text).items()) if text else []


def emit_pressure(resource: str, pressure: list[tuple[str, float]]) -> Iterator[Metric]:
    """node_exporter's PSI semantics: 'some' is time waiting, 'full' time fully stalled."""
    by_kind = dict(pressure)
    if "some" in by_kind:
        yield counter(f"pressure_{resource}_waiting_seconds",
                      f"Total time in seconds that some tasks waited for {resource} (PSI 'some').",
                      [], [((), by_kind["some"])])
    if "full" in by_kind:
        yield counter(f"pressure_{resource}_stalled_seconds",
                      f"Total time in seconds that all non-idle tasks stalled on {resource} (PSI 'full').",
                      [], [((), by_kind["full"])])
