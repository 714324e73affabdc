"""Rules: parsed from YAML (with file and line in every error), evaluated by a pure engine.

The engine keeps each signal series' recent history on monotonic time and returns transitions
(pending, firing, resolved); it neither logs, captures nor reads a clock. Its metrics come from its
state at scrape time, so a new series shows at once and a series whose GPU or job is gone disappears.
"""

from __future__ import annotations

import logging
import math
import operator
import re
import threading
from array import array
from bisect import bisect_left, insort
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.core import Metric

from tfprofd.exporter.base import Signals, counter, gauge
from tfprofd.exporter.options import parse_bool, parse_duration, shown

from .problems import Problem

log = logging.getLogger("tfprofd.rules")

# signal name -> (collector that produces it, label names its series carry)
Catalog = Mapping[str, tuple[str, tuple[str, ...]]]
Labels = tuple[tuple[str, str], ...]

STATE_LABELS = ("gpu", "gpu_instance_id", "training_job", "worker", "device")
_AGGREGATE = re.compile(r"last|mean|min|max|increase|p([1-9]|[1-9][0-9])")  # whole: "p50\n" is none
DEFAULT_RULES = Path(__file__).with_name("default_rules.yaml")
# Sample timestamps jitter by a few ms; without slack a condition held for exactly `for` would wait one
# more sampling interval.
FOR_SLACK_SECONDS = 0.05
# A window kept sorted that this many samples entered or left since is sorted afresh: sorting 600 values
# costs about as much as taking 40 out and putting 40 in one by one.
RESORT_AFTER = 64
FOUND_KEPT = 64  # windows an Axis remembers where they start (a few per rule joined to its signal)


@dataclass(frozen=True)
class Condition:
    signal: str
    aggregate: str = "last"
    window: float = 0.0
    below: float | None = None
    above: float | None = None
    below_baseline: float | None = None  # fire when the aggregate < ratio x baseline median
    above_baseline: float | None = None
    baseline: float = 600.0  # seconds of history before the window that form the baseline

    @property
    def uses_baseline(self) -> bool:
        return self.below_baseline is not None or self.above_baseline is not None


@dataclass(frozen=True)
class Rule:
    name: str
    description: str
    conditions: tuple[Condition, ...]
    for_seconds: float = 0.0
    while_training: bool = True
    capture: bool = True
    cooldown: float = 900.0


# ---- parsing, with line numbers ----

_RULE_KEYS = {"name", "description", "for", "while_training", "capture", "cooldown", "and"}
_RULE_FIELDS = (("for", "for_seconds", parse_duration), ("cooldown", "cooldown", parse_duration),
                ("while_training", "while_training", parse_bool), ("capture", "capture", parse_bool))
_CONDITION_KEYS = {"signal", "aggregate", "window", "below", "above", "below_baseline", "above_baseline",
                   "baseline"}
_COMPARISONS = ("below", "above", "below_baseline", "above_baseline")

Items = dict[str, tuple[Any, int, yaml.Node]]


def _items(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Items:
    """{key: (value, line, value node)} of a mapping node; keys that are not plain scalars become text."""
    out: Items = {}
    for key_node, value_node in node.value:
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) else f"<{key_node.tag}>"
        out[str(key)] = (loader.construct_object(value_node, deep=True), key_node.start_mark.line + 1, value_node)
    return out


def _typed_fields(items: Items, fields: tuple[tuple[str, str, Callable[[Any], Any]], ...],
                  where: Callable[[int], str], key: str, problems: list[Problem]) -> dict[str, Any]:
    """Parse the optional fields present in ``items`` as {attribute: value}; record each bad one."""
    out: dict[str, Any] = {}
    for yaml_key, attr, parse in fields:
        if yaml_key in items:
            raw, line, _ = items[yaml_key]
            try:
                out[attr] = parse(raw)
            except ValueError as exc:
                problems.append(Problem(where(line), f"{key}.{yaml_key}", str(exc)))
    return out


def _condition(items: Items, catalog: Catalog, where: Callable[[int], str], key: str, line0: int,
               problems: list[Problem]) -> Condition | None:
    start = len(problems)
    for unknown in sorted(set(items) - _CONDITION_KEYS - _RULE_KEYS):
        problems.append(Problem(where(items[unknown][1]), f"{key}.{unknown}", "unknown key"))
    values: dict[str, Any] = {}
    signal, line, _ = items.get("signal", (None, line0, None))
    if not isinstance(signal, str) or signal not in catalog:
        problems.append(Problem(where(line), f"{key}.signal",
                                f"expected one of {', '.join(catalog)}, got {shown(signal)}"))
    values["signal"] = signal
    aggregate, line, _ = items.get("aggregate", ("last", line0, None))
    if not isinstance(aggregate, str) or not _AGGREGATE.fullmatch(aggregate):
        problems.append(Problem(where(line), f"{key}.aggregate",
                                f"expected last, mean, min, max, increase or pNN, got {shown(aggregate)}"))
    values["aggregate"] = aggregate
    values.update(_typed_fields(items, (("window", "window", parse_duration),
                                        ("baseline", "baseline", parse_duration)), where, key, problems))
    comparisons = [n for n in _COMPARISONS if n in items]
    if len(comparisons) != 1:
        line = min((items[n][1] for n in comparisons), default=line0)
        problems.append(Problem(where(line), key, "needs exactly one of below, above, below_baseline, above_baseline"))
    for name in comparisons:
        raw, line, _ = items[name]
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
            problems.append(Problem(where(line), f"{key}.{name}", f"expected a finite number, got {shown(raw)}"))
        elif name.endswith("_baseline") and raw < 0:
            problems.append(Problem(where(line), f"{key}.{name}", f"expected a ratio of 0 or more, got {shown(raw)}"))
        else:
            values[name] = float(raw)
    if values.get("aggregate") != "last" and not values.get("window"):
        problems.append(Problem(where(items.get("aggregate", (None, line0))[1]), f"{key}.window",
                                f"aggregate {values.get('aggregate')} needs a window"))
    return Condition(**values) if len(problems) == start else None


def parse_rules(loader: yaml.SafeLoader, node: yaml.Node, path: str, catalog: Catalog,
                problems: list[Problem]) -> list[Rule]:
    """Rules from the ``rules:`` YAML node; every problem is appended with its file and line."""

    def where(line: int) -> str:
        return f"{path}:{line}" if line else path

    if not isinstance(node, yaml.SequenceNode):
        problems.append(Problem(where(node.start_mark.line + 1), "rules", "expected a list of rules"))
        return []
    rules, names = [], set()
    for index, item in enumerate(node.value):
        key, line0 = f"rules[{index}]", item.start_mark.line + 1
        if not isinstance(item, yaml.MappingNode):
            problems.append(Problem(where(line0), key, "expected a mapping"))
            continue
        items = _items(loader, item)
        start = len(problems)
        name, line, _ = items.get("name", (None, line0, None))
        if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", name):
            problems.append(Problem(where(line), f"{key}.name", f"expected a snake_case name, got {shown(name)}"))
        elif name in names:
            problems.append(Problem(where(line), f"{key}.name", f"duplicate rule name {name!r}"))
        names.add(name)
        conditions = [_condition({k: v for k, v in items.items() if k not in _RULE_KEYS},
                                 catalog, where, key, line0, problems)]
        if "and" in items:
            _, line, extra = items["and"]
            if not isinstance(extra, yaml.SequenceNode) or not all(isinstance(e, yaml.MappingNode)
                                                                   for e in extra.value):
                problems.append(Problem(where(line), f"{key}.and", "expected a list of conditions"))
            else:
                for j, cond in enumerate(extra.value):
                    sub = _items(loader, cond)
                    for stray in sorted(set(sub) & (_RULE_KEYS - _CONDITION_KEYS)):
                        problems.append(Problem(where(sub[stray][1]), f"{key}.and[{j}].{stray}", "unknown key"))
                    conditions.append(_condition({k: v for k, v in sub.items() if k not in _RULE_KEYS}, catalog,
                                                 where, f"{key}.and[{j}]", cond.start_mark.line + 1, problems))
        options = _typed_fields(items, _RULE_FIELDS, where, key, problems)
        description = items.get("description", ("", 0, None))[0]
        if not isinstance(description, (str, type(None))):
            problems.append(Problem(where(items["description"][1]), f"{key}.description", "expected text"))
        if len(problems) == start:
            rules.append(Rule(name=name, description=str(description or ""),
                              conditions=tuple(c for c in conditions if c), **options))
    return rules


# ---- evaluation ----


def mean(values: Sequence[float]) -> float:
    """statistics.fmean, which is this: the agent evaluates rules every sample, and importing ``statistics``
    (with fractions and decimal) would cost it 0.5 MB of resident memory for two one-line functions."""
    return math.fsum(values) / len(values)


def _percentile(q: int) -> Callable[[Sequence[float]], float]:
    def percentile(values: Sequence[float]) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]
    return percentile


# each aggregate as a function of its own: the rules aggregate a window of each series every sample, and a
# chain of comparisons on the name was a tenth of it (issue 24)
_AGGREGATES: dict[str, Callable[[Sequence[float]], float]] = {
    "last": operator.itemgetter(-1), "mean": mean, "min": min, "max": max,
    "increase": lambda values: values[-1] - values[0], **{f"p{q}": _percentile(q) for q in range(1, 100)}}


def aggregate(values: Sequence[float], how: str) -> float:
    return _AGGREGATES[how](values)


class Axis:
    """The sample times of a signal, oldest first, shared by its series: the rules engine gives every series of a
    signal a value at each of its samples (a series that misses one is gone, or starts again: ``History.push``),
    so one time axis serves them all. A window is found once a sample for all of them, and 1,000 jobs' series no
    longer each keep and search an array of times of their own: ~30 cache misses a series and sample, 40% of the
    rules' CPU (issue 24), and 5.6 kB a series. Indices are global: the n-th time this axis took is index n,
    whatever was dropped since."""

    __slots__ = ("_found", "_start", "dropped", "times")

    def __init__(self) -> None:
        self.times = array("d")
        self.dropped = 0  # times deleted from the front of the array so far: a global index minus it is an offset
        self._start = 0  # times before this offset are dropped (deleted once they are half the array)
        # index(t) since the last change: every series asks for the same t (at most FOUND_KEPT: a signal whose
        # collector stalled is still asked by rules joined to it, with another t at each of their samples)
        self._found: dict[float, int] = {}

    @property
    def first(self) -> int:
        """The global index of the oldest time kept."""
        return self.dropped + self._start

    @property
    def end(self) -> int:
        """The global index the next time will have."""
        return self.dropped + len(self.times)

    def append(self, t: float) -> None:
        """Add a time no older than the last one."""
        self.times.append(t)
        if self._found:
            self._found.clear()

    def drop_before(self, t: float) -> bool:
        """Drop the times before ``t``; True where the array was compacted (its series may compact theirs)."""
        times, start = self.times, self._start
        if start == len(times) or times[start] >= t:
            return False  # nothing to drop (a signal younger than what the rules keep: no bisection each sample)
        if start + 1 < len(times) and times[start + 1] >= t:
            start += 1  # one time (a signal sampled as often as its window slides: no bisection either)
        else:
            start = bisect_left(times, t, start)
        if self._found:
            self._found.clear()
        if start > 64 and 2 * start > len(times):
            del times[:start]
            self.dropped += start
            self._start = 0
            return True
        self._start = start
        return False

    def index(self, t: float) -> int:
        """The global index of the first time kept at ``t`` or later (``end`` where there is none)."""
        found = self._found.get(t)
        if found is None:
            if len(self._found) >= FOUND_KEPT:
                self._found.clear()
            found = self._found[t] = bisect_left(self.times, t, self._start) + self.dropped
        return found


class History:
    """One series' samples (monotonic time, value), oldest first: its values in an array of doubles (8 bytes a
    sample where a deque of tuples took about 90: a thousand jobs' two throughput series over the 10 min
    baseline window took 110 MB, issue 24), its times on an ``Axis``: its own, or its signal's, shared with
    the signal's other series (``Engine``). A window is found by bisection of the times, not a scan."""

    __slots__ = ("_axis", "_base", "_sorted", "_values")

    def __init__(self, samples: Iterable[tuple[float, float]] = ()):
        self._axis = Axis()
        self._values = array("d")
        self._base = 0  # the global index of ``_values[0]`` on the axis
        # a sliding window's values kept sorted, by the caller's key: (first sample, end sample, values), global
        self._sorted: dict[Hashable, tuple[int, int, array]] | None = None
        for t, v in samples:
            self.append(t, v)

    def append(self, t: float, value: float) -> None:
        """Add a sample no older than the last one (a history with an axis of its own)."""
        self._axis.append(t)
        self._values.append(value)

    def push(self, value: float, end: int) -> None:
        """The value at the time its shared axis took last, whose global index is ``end`` (the caller's, once for
        every series of the axis). A history that missed a time of its axis (its signal came in a sample without
        it, and it was not removed: a collector's bug, an exception halfway through a sample) starts again from
        this value: the samples after a gap would otherwise go with the wrong times."""
        values = self._values
        if self._base + len(values) != end:
            del values[:]
            self._base, self._sorted = end, None
        values.append(value)

    def drop_before(self, t: float) -> None:
        if self._axis.drop_before(t):
            self.compact()

    def compact(self) -> None:
        """Delete the values whose times the axis dropped (half the array or more: not at every sample)."""
        skip = self._axis.first - self._base
        if skip > 0:
            del self._values[:skip]
            self._base += skip

    def _first(self) -> int:
        """The global index of the oldest sample kept."""
        first = self._axis.first
        return first if first > self._base else self._base

    def _index(self, t: float, least: int) -> int:
        """The global index of the first of its samples at ``t`` or later, from ``least`` to its end."""
        found = self._axis.index(t)
        end = self._base + len(self._values)  # before the axis's where a value is missing (see ``push``)
        return least if found < least else end if found > end else found

    def __len__(self) -> int:
        return max(self._base + len(self._values) - self._first(), 0)

    def __iter__(self) -> Iterator[tuple[float, float]]:
        first, axis, end = self._first(), self._axis, self._base + len(self._values)
        return zip(axis.times[first - axis.dropped:end - axis.dropped], self._values[first - self._base:], strict=True)

    def last(self) -> float:
        return self._values[-1]

    def between(self, start: float, end: float = math.inf) -> array:
        """The values of the samples at ``start`` <= t < ``end``, as an array: not a list, which made a float object
        of each value (the rules aggregate a window of each of 1,000 jobs' series every sample: 12% of their CPU,
        issue 24)."""
        first = self._index(start, self._first())
        last = self._base + len(self._values) if end == math.inf else self._index(end, first)
        return self._values[first - self._base:last - self._base]

    def since(self, start: float) -> tuple[array, int] | None:
        """``between(start)``, or the last value alone where no sample is that recent (what a rule aggregates), and
        where the window begins (the baseline before it ends there: ``median_bounds``'s ``last``); None where no
        sample is kept. In one call: the rules ask it of 1,000 jobs' series every sample, and the steps it took
        apart (``len``, the first sample kept, the window's) were a fifth of the rules' CPU (issue 24)."""
        values, base = self._values, self._base
        end, first = base + len(values), self._axis.first
        if first < base:
            first = base
        if end <= first:
            return None
        at = self._axis.index(start)
        at = first if at < first else end if at > end else at
        return (values[at - base:] if at < end else values[-1:]), at

    def forget_sorted(self) -> None:
        """Drop the windows kept sorted (the rules changed: a window no rule uses any more must not stay)."""
        self._sorted = None

    def median_between(self, start: float, end: float, key: Hashable, least: int = 1) -> float | None:
        """``median(self.between(start, end))``, None with fewer than ``least`` samples. The window named
        ``key`` is kept sorted from one call to the next: as it slides, the samples that left it are taken
        out and the new ones put in (a 10-minute baseline of 1,000 jobs' series sorted afresh every sample
        cost ~9% of a core, issue 24). Values are finite (Engine.observe keeps no NaN)."""
        first = self._index(start, self._first())
        last = self._index(end, first)
        if last - first < max(least, 1):
            return None
        base, values = self._base, self._values
        if self._sorted is None:
            self._sorted = {}
        kept = self._sorted.get(key)
        if (kept is None or not base <= kept[0] <= first <= kept[1] <= last
                or first - kept[0] + last - kept[1] > RESORT_AFTER):
            ordered = array("d", sorted(values[first - base:last - base]))
        else:
            ordered = kept[2]
            for value in values[kept[0] - base:first - base]:
                del ordered[bisect_left(ordered, value)]
            for value in values[kept[1] - base:last - base]:
                insort(ordered, value)
        self._sorted[key] = (first, last, ordered)
        middle = len(ordered) // 2  # as statistics.median takes it (see ``mean``)
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    def median_bounds(self, start: float, end: float, key: Hashable, least: int = 1,
                      last: int | None = None) -> tuple[float, float] | None:
        """``(low, high)`` with low <= ``median_between(start, end, key, least)`` <= high (None where that is
        None), from the window named ``key`` as it was last kept sorted, without bringing it up to date: a
        sample that entered the window since moves the median down by a rank at most, one that left it up by
        a rank at most, so the bounds are the kept values that many ranks either side of the middle (both
        the median while nothing changed; -inf or inf past the kept values). ``Engine`` rules need the median
        itself only where the bounds cannot decide a comparison: most samples of a steady job. ``last``: the index
        of the first sample at ``end`` or later, where known (``since``)."""
        first = self._index(start, self._first())
        if last is None:
            last = self._index(end, first)
        count = last - first
        if count < least or not count:
            return None
        kept = self._sorted.get(key) if self._sorted is not None else None
        if kept is None:
            return -math.inf, math.inf
        k0, k1, ordered = kept
        overlap = (last if last < k1 else k1) - (first if first > k0 else k0)  # samples in both windows (min and
        if overlap < 0:                                                        # max calls cost a tenth of this)
            overlap = 0
        entered, left = count - overlap, k1 - k0 - overlap
        # the median's ranks moved down by ``entered`` and up by ``left``, taken as median_between takes it
        # (sums round monotonically, overflow to inf included: a bound computed alike is a bound)
        middle, above = count // 2, count // 2 + left < len(ordered)
        if count % 2:
            return (ordered[middle - entered] if middle >= entered else -math.inf,
                    ordered[middle + left] if above else math.inf)
        return ((ordered[middle - 1 - entered] + ordered[middle - entered]) / 2 if middle > entered else -math.inf,
                (ordered[middle - 1 + left] + ordered[middle + left]) / 2 if above else math.inf)


def holds(condition: Condition, history: History, now: float) -> tuple[bool, float | None]:
    """Whether the condition holds on a series' history at ``now``, and the value it compared."""
    start = now - condition.window
    window = history.since(start)
    if window is None:
        return False, None
    recent, end = window
    value = aggregate(recent, condition.aggregate)
    if condition.below is not None:
        return value < condition.below, value
    if condition.above is not None:
        return value > condition.above, value
    key = (condition.window, condition.baseline)
    bounds = history.median_bounds(start - condition.baseline, start, key, 3, end)
    if bounds is None:  # no baseline yet (fewer than 3 samples): never fire on a job's first minutes
        return False, value
    below = condition.below_baseline is not None
    ratio = condition.below_baseline if below else condition.above_baseline or 0.0
    if ratio > 0:  # ratio x median grows with the median (0 x inf would be NaN): the bounds may decide
        low, high = ratio * bounds[0], ratio * bounds[1]
        if (value >= high) if below else (value <= low):
            return False, value
        if (value < low) if below else (value > high):
            return True, value
    middle = history.median_between(start - condition.baseline, start, key, 3)
    assert middle is not None  # the same window as the bounds'
    return (value < ratio * middle) if below else (value > ratio * middle), value


class _Series(History):
    """One series of a signal: its history, and the state of each rule whose primary signal it is (by rule name)."""

    __slots__ = ("key", "seen", "states")

    def __init__(self, key: Labels, axis: Axis):
        """A series of the signal whose times ``axis`` holds, from the time it took last on."""
        super().__init__()
        self._axis, self._base = axis, axis.end - 1
        self.key = key
        self.seen = 0  # the Engine's sample that last brought a value of it
        self.states: dict[str, _State] = {}


PENDING, FIRING, RESOLVED = "pending", "firing", "resolved"
CLEARED = "cleared"  # a pending rule's condition stopped holding before the rule fired


@dataclass(frozen=True)
class Transition:
    kind: str  # PENDING, FIRING, RESOLVED or CLEARED
    rule: Rule
    labels: dict[str, str]
    value: float | None
    why: str = ""  # for RESOLVED: "condition cleared", "series gone", "rule removed"


@dataclass(slots=True)
class _State:
    pending_since: float | None = None
    active: bool = False
    value: float | None = None


@dataclass
class Engine:
    """Keeps signal histories on monotonic time, evaluates rules, and returns what changed."""

    rules: list[Rule]
    catalog: Catalog
    # signal -> series -> its history and rule states: a rule reads its own signal's series, and a job's series of
    # another signal by one lookup, so evaluating n series costs O(n), not O(n²) (1,000 jobs, issue 24)
    _series: dict[str, dict[Labels, _Series]] = field(default_factory=dict)
    _axes: dict[str, Axis] = field(default_factory=dict)  # signal -> the times of its samples (see Axis)
    _firings: dict[str, int] = field(default_factory=dict)
    _firing_jobs: dict[str, int] = field(default_factory=dict)  # training_job -> its active states
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # bumped whenever a state comes, goes or changes activity, or the rules change: collect() builds its
    # rule_active family (a series per rule and job: 3,000 with 1,000 jobs) again only then
    _version: int = 0
    _collected: tuple[int, list[Metric]] | None = None
    # signal -> id(labels dict) -> (that dict, its series), for the dicts of the last sample: a collector that
    # hands the same dict again (a job's, every second) has its series found without a key made or hashed (see
    # Signals); the dict is kept with its series, so no other object can have its id meanwhile
    _keys: dict[str, dict[int, tuple[dict[str, str], _Series]]] = field(default_factory=dict)
    _samples: int = 0  # observe() calls so far: a series seen in this one has it as its ``seen``

    def set_rules(self, rules: list[Rule]) -> list[Transition]:
        """Replace the rules; firing series of rules that are gone or changed resolve, pending ones clear."""
        with self._lock:
            old = {r.name: r for r in self.rules}
            self.rules = list(rules)
            self._version += 1
            for every in self._series.values():
                for series in every.values():
                    series.forget_sorted()  # each rule's baseline is sorted again at its next evaluation
            kept = {r.name for r in rules if old.get(r.name) == r}
            out = []
            for name, rule in old.items():
                if name in kept:
                    continue
                for series in self._series.get(rule.conditions[0].signal, {}).values():
                    state = series.states.pop(name, None)
                    if state is None:
                        continue
                    if state.active or state.pending_since is not None:
                        out.append(Transition(RESOLVED if state.active else CLEARED, rule, dict(series.key),
                                              state.value, "rule removed or changed"))
                    self._set_active(series.key, state, False)
                    self._version += 1
            return out

    def _set_active(self, labels: Labels, state: _State, active: bool) -> None:
        """Change a state's activity, keeping the count of active states per training job (firing_jobs)."""
        if state.active == active:
            return
        state.active = active
        self._version += 1
        job = dict(labels).get("training_job")
        if job is not None:
            count = self._firing_jobs.get(job, 0) + (1 if active else -1)
            if count:
                self._firing_jobs[job] = count
            else:
                self._firing_jobs.pop(job, None)

    def _keep_seconds(self) -> float:
        return max((c.window + (c.baseline if c.uses_baseline else 0) + 5
                    for r in self.rules for c in r.conditions), default=60.0)

    def observe(self, source: str, now: float, signals: Signals,
                training: Callable[[dict[str, str]], bool]) -> list[Transition]:
        """Record one sample of a collector's signals (at monotonic time ``now``) and evaluate the rules
        that use them; ``training(labels)`` says whether a job trains where a series is."""
        with self._lock:
            oldest = now - self._keep_seconds()
            self._samples += 1
            sample, finite = self._samples, math.isfinite
            seen: dict[str, int] = {}
            for signal, sent in signals.items():
                every = self._series.setdefault(signal, {})
                axis = self._axes.get(signal)
                if axis is None:
                    axis = self._axes[signal] = Axis()
                axis.append(now)
                end = axis.end - 1  # the index of this sample's time, for each of its series' values
                known, current = self._keys.get(signal, {}), {}
                self._keys[signal] = current
                count = 0
                for labels, value in sent:
                    if not finite(value):
                        continue
                    same = id(labels)
                    entry = current[same] = known.get(same) or (labels, self._find(every, labels, axis))
                    series = entry[1]
                    if series.seen != sample:  # a value each sample (a second of the same series is not one)
                        series.seen = sample
                        count += 1
                        series.push(value, end)
                seen[signal] = count
                if axis.drop_before(oldest):
                    for series in every.values():
                        series.compact()
            gone: dict[str, list[_Series]] = {}
            for signal, every in self._series.items():
                if self.catalog[signal][0] != source:
                    continue
                if signal not in signals:
                    self._keys.pop(signal, None)
                if seen.get(signal, 0) < len(every):  # some of its series did not come: their GPU, job or
                    # interface is gone
                    gone[signal] = [every.pop(k) for k in [k for k, s in every.items() if s.seen != sample]]
            return self._evaluate(source, now, training, gone)

    @staticmethod
    def _find(every: dict[Labels, _Series], labels: dict[str, str], axis: Axis) -> _Series:
        """The series of these labels, made where there is none (from the sample ``axis`` took last)."""
        key = tuple(sorted(labels.items()))
        series = every.get(key)
        if series is None:
            series = every[key] = _Series(key, axis)
        return series

    def _matching(self, condition: Condition, labels: dict[str, str]) -> list[_Series]:
        """The series of ``condition.signal`` that match the primary series' labels."""
        wanted = self.catalog[condition.signal][1]
        every = self._series.get(condition.signal, {})
        shared = {k: v for k, v in labels.items() if k in wanted}
        if not shared:  # every series (a host signal joined to a GPU's or job's)
            return list(every.values())
        if len(shared) == len(wanted):  # the one series with these labels: a lookup, not a scan
            series = every.get(tuple(sorted(shared.items())))
            return [] if series is None else [series]
        return [s for key, s in every.items() if all(dict(key).get(k) == v for k, v in shared.items())]

    def _evaluate(self, source: str, now: float, training: Callable[[dict[str, str]], bool],
                  gone: dict[str, list[_Series]]) -> list[Transition]:
        out: list[Transition] = []
        for rule in self.rules:
            if not any(self.catalog[c.signal][0] == source for c in rule.conditions):
                continue
            primary, extras, name = rule.conditions[0], rule.conditions[1:], rule.name
            for series in self._series.get(primary.signal, {}).values():
                ok, value = holds(primary, series, now)
                state = series.states.get(name)
                if state is None:
                    state = series.states[name] = _State()
                    self._version += 1
                state.value = value
                if not (ok or state.active or state.pending_since is not None):
                    continue  # nothing holds or held: no labels to make (most series, most samples)
                labels = dict(series.key)
                for extra in extras:
                    ok = ok and any(holds(extra, h, now)[0] for h in self._matching(extra, labels))
                if ok and rule.while_training:
                    ok = training(labels)
                if not ok:
                    if state.active:
                        out.append(Transition(RESOLVED, rule, labels, value, "condition cleared"))
                    elif state.pending_since is not None:
                        out.append(Transition(CLEARED, rule, labels, value, "condition cleared before firing"))
                    state.pending_since = None
                    self._set_active(series.key, state, False)
                    continue
                if state.pending_since is None:
                    state.pending_since = now
                    out.append(Transition(PENDING, rule, labels, value))
                if not state.active and now - state.pending_since >= rule.for_seconds - FOR_SLACK_SECONDS:
                    self._set_active(series.key, state, True)
                    self._firings[name] = self._firings.get(name, 0) + 1
                    out.append(Transition(FIRING, rule, labels, value))
            for series in gone.get(primary.signal, ()):
                state = series.states.pop(name, None)
                if state is None:
                    continue
                self._version += 1
                if state.active:
                    out.append(Transition(RESOLVED, rule, dict(series.key), state.value, "series gone"))
                    self._set_active(series.key, state, False)
                elif state.pending_since is not None:
                    out.append(Transition(CLEARED, rule, dict(series.key), state.value, "series gone"))
        return out

    def history(self, signal: str, labels: dict[str, str]) -> list[tuple[float, float]]:
        """The recent (monotonic time, value) samples of every series of ``signal`` matching ``labels``."""
        with self._lock:
            return sorted(p for key, h in self._series.get(signal, {}).items()
                          if all(dict(key).get(k) == v for k, v in labels.items()) for p in h)

    def firing_jobs(self) -> frozenset[str]:
        """The training jobs for a series of which some rule fires."""
        with self._lock:
            return frozenset(self._firing_jobs)

    def collect(self) -> list[Metric]:
        """The rules' families; the same objects while no state came, went or changed (see ``_version``)."""
        with self._lock:
            if self._collected is not None and self._collected[0] == self._version:
                return self._collected[1]
            version = self._version
            states = sorted(((rule.name, series.key), state.active) for rule in self.rules
                            for series in self._series.get(rule.conditions[0].signal, {}).values()
                            if (state := series.states.get(rule.name)) is not None)
            firings = dict(self._firings)
            names = [r.name for r in self.rules]
        families: list[Metric] = [
            gauge("rule_active", "Whether the rule is firing (1) or not (0) for the GPU, job or device.",
                  ["rule", *STATE_LABELS], (([name, *(dict(labels).get(k, "") for k in STATE_LABELS)], float(active))
                                            for (name, labels), active in states)),
            counter("rule_firings", "Total times the rule started firing.", ["rule"],
                    (([name], firings.get(name, 0)) for name in names))]
        with self._lock:
            if self._version == version:
                self._collected = (version, families)
        return families


def describe(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "host"


def log_transition(t: Transition) -> None:
    value = "n/a" if t.value is None else f"{t.value:.4g}"
    where = describe(t.labels)
    if t.kind == PENDING:
        log.info("rule %s pending for %s (value %s, fires after %gs)", t.rule.name, where, value, t.rule.for_seconds)
    elif t.kind == CLEARED:
        log.info("rule %s no longer pending for %s (%s; value %s)", t.rule.name, where, t.why, value)
    elif t.kind == FIRING:
        log.warning("rule %s firing for %s: %s (value %s)", t.rule.name, where, t.rule.description, value)
    else:
        log.info("rule %s resolved for %s (%s; value %s)", t.rule.name, where, t.why, value)
