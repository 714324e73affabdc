"""What every collector shares: the sample/collect split, the OS and clock seams, metric helpers.

A collector reads the system in ``sample()`` (called by the agent's sampling thread, never by a scrape)
and keeps the result. From that latest sample, ``collect()`` yields fresh metric families,
``rule_signals()`` the series the rules may watch (named in the class's ``signals``), and ``facts()``
typed facts other parts of the agent consume (which processes run on which GPU, which jobs train).
The agent publishes the three together as one immutable snapshot per sample.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

PREFIX = "tfprofd_"

# signal name -> series: (labels, value). A labels dict is never changed once handed out: a collector may hand
# the same one again for the same series (the rules engine then keeps its key instead of sorting it again).
Signals = Mapping[str, Sequence[tuple[dict[str, str], float]]]


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
    except (OSError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class Environment:
    """What the agent gives every collector: where /proc and /sys are, a clock, and (tests) an NVML module."""

    paths: HostPaths = field(default_factory=HostPaths)
    clock: Clock = field(default_factory=Clock)
    nvml: ModuleType | None = None


class Collector:
    """Base of every collector: subclasses set ``name``, ``section`` and ``Settings`` and implement
    ``sample()`` and ``collect()``."""

    name: ClassVar[str]
    section: ClassVar[str]  # the config section of its Settings, e.g. "collectors.cpu"
    Settings: ClassVar[type]  # a frozen dataclass of exporter.options.option() fields, `enabled` first
    signals: ClassVar[Mapping[str, tuple[str, ...]]] = {}  # rule signal -> label names of its series
    # whether sample() reads only the kernel's own files (/proc, /sys) and memory: such collectors share one
    # sampling thread; one that calls a library or a peer that may block (NVML, the kubelet) has its own
    never_blocks: ClassVar[bool] = False

    def __init__(self, settings: Any, env: Environment):
        self.settings = settings
        self.env = env
        self._wake: Callable[[], None] | None = None

    def set_wake(self, wake: Callable[[], None]) -> None:
        """Install the sampler's "sample now" callback (see ``wake``)."""
        self._wake = wake

    def wake(self) -> None:
        """Ask for a sample before the next interval, when the state changed in a way the rest of the agent
        should see soon (a new training process); any thread may call it."""
        if self._wake is not None:
            self._wake()

    def configure(self, settings: Any) -> None:
        """Apply a reloaded configuration (options marked restart keep their running value)."""
        self.settings = settings

    def sample(self) -> bool:
        """Read the system and keep the result. Return False on a partial failure; raise on a full one."""
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError

    def rule_signals(self) -> Signals:
        """The latest sample's series of the signals named in ``signals``."""
        return {}

    def facts(self) -> tuple[Any, ...]:
        """Typed facts of the latest sample for other parts of the agent (see the snapshot's ``fact``)."""
        return ()

    def problem(self) -> str | None:
        """Why a background thread of the collector stopped working, if one did."""
        return None

    def clear(self) -> None:
        """Forget the last sample (called after a failed one, so stale values are not served)."""

    def close(self) -> None:
        """Release what the collector opened (threads, sockets, handles)."""


class Sectioned:
    """Metric families whose series come in sections that change independently (one per training job).

    Iterating gives the families whole, as any reader expects. The exposition instead renders each
    section by itself and keeps its rendering while the section's token is the same object, so a sample
    costs what changed, not everything that exists: ``build(tokens)`` makes the families of those
    sections only (``build([])``: every family, without series, in order). ``lines(token, before)``, where
    given, writes a section's sample lines by hand, one string per family of ``build([])`` (the same in the
    text format and OpenMetrics), given what it returned for the section's last token (``before``, None the
    first time), whose unchanged lines it may reuse; it must be byte-identical to prometheus_client's
    rendering of ``build([token])`` (tests/test_many_jobs.py holds it so).
    """

    def __init__(self, head: Sequence[Metric], build: Callable[[Sequence[Any]], Iterable[Metric]],
                 sections: Sequence[tuple[Hashable, object]],
                 lines: Callable[[Any, Any], Sequence[str]] | None = None):
        self.head = head
        self.build = build
        self.sections = sections  # (key, token), in the order the series are written
        self.lines = lines

    def __iter__(self) -> Iterator[Metric]:
        yield from self.head
        yield from self.build([token for _, token in self.sections])


def label_value(value: str) -> str:
    """A label value (or OpenMetrics HELP text) escaped as prometheus_client escapes it."""
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def go_float(value: float) -> str:
    """A sample value as prometheus_client writes it (``floatToGoString``), without its cost for the integers
    and plain floats most samples are: Go's exponent form from 1e6 up (a long job's step and sample counts),
    and +Inf, -Inf, NaN. tests/test_exposition.py holds it to floatToGoString on random values."""
    kind = type(value)
    if kind is int:
        if -10**15 < value < 10**6:  # type: ignore[operator]
            return f"{value}.0"
        if 0 < value < 10**15:  # type: ignore[operator]  # exact as a float: written as floatToGoString writes it
            digits = str(value)
            return f"{f'{digits[0]}.{digits[1:]}'.rstrip('0.')}e+{len(digits) - 1:02d}"
    elif kind is float:
        text = repr(value)
        if value - value == 0:  # finite
            dot = text.find(".")
            if value <= 0 or dot <= 6:
                return text
            return f"{f'{text[0]}.{text[1:dot]}{text[dot + 1:]}'.rstrip('0.')}e+{dot - 1:02d}"
    return floatToGoString(value)


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
        for item in rest.split():
            name, _, value = item.partition("=")
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
