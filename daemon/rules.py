"""Rules: watch sampled signals, decide when training is slowed down, and trigger captures.

A rule compares an aggregate of a signal over a window (last, mean, min, max, a percentile, or the
increase) with a threshold or with the signal's own trailing baseline, optionally ANDed with other
conditions; it fires once that has held for ``for``. Rules are evaluated right after the collector
that feeds their signal samples, and ``for`` is measured from sample timestamps, so a rule with
``for: 30s`` fires within one sampling interval of 30 s after the drop began.
"""

from __future__ import annotations

import logging
import re
import statistics
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.core import Metric

from tfprofd.exporter.base import Collector, counter, gauge

from .config import Problem, parse_bool, parse_duration

log = logging.getLogger("tfprofd.rules")

# Signal name -> (collector that produces it, label names).
SIGNALS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gpu_utilization": ("nvml", ("gpu",)),
    "gpu_memory_used_ratio": ("nvml", ("gpu",)),
    "samples_per_second": ("training", ("training_job", "worker")),
    "step_seconds": ("training", ("training_job", "worker")),
    "seconds_without_first_step": ("training", ("training_job", "worker")),
    "cpu_utilization": ("cpu", ()),
    "cpu_iowait": ("cpu", ()),
    "memory_used_ratio": ("memory", ()),
    "network_receive_utilization": ("network", ("device",)),
    "network_transmit_utilization": ("network", ("device",)),
}
STATE_LABELS = ("gpu", "training_job", "worker", "device")
_AGGREGATE = re.compile(r"^(last|mean|min|max|increase|p([1-9]|[1-9][0-9]))$")
DEFAULT_RULES = Path(__file__).with_name("default_rules.yaml")
# Sample timestamps jitter by a few ms; without slack a condition held for exactly `for` would wait one
# more sampling interval.
FOR_SLACK_SECONDS = 0.05

Labels = tuple[tuple[str, str], ...]


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


def _node_items(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[str, tuple[Any, int]]:
    return {str(loader.construct_object(k)): (loader.construct_object(v, deep=True), k.start_mark.line + 1)
            for k, v in node.value}


def _typed_fields(items: dict[str, tuple[Any, int]], fields: tuple[tuple[str, str, Callable[[Any], Any]], ...],
                  where: Callable[[int], str], key: str, problems: list[Problem]) -> dict[str, Any]:
    """Parse the optional fields present in ``items`` as {attribute: value}; record each bad one."""
    out: dict[str, Any] = {}
    for yaml_key, attr, parse in fields:
        if yaml_key in items:
            raw, line = items[yaml_key]
            try:
                out[attr] = parse(raw)
            except ValueError as exc:
                problems.append(Problem(where(line), f"{key}.{yaml_key}", str(exc)))
    return out


def _condition(loader: yaml.SafeLoader, items: dict[str, tuple[Any, int]], where: Callable[[int], str],
               key: str, problems: list[Problem]) -> Condition | None:
    start = len(problems)
    values: dict[str, Any] = {}
    signal, line = items.get("signal", (None, 0))
    if signal not in SIGNALS:
        problems.append(Problem(where(line), f"{key}.signal",
                                f"expected one of {', '.join(SIGNALS)}, got {signal!r}"))
    values["signal"] = signal
    aggregate, line = items.get("aggregate", ("last", 0))
    if not isinstance(aggregate, str) or not _AGGREGATE.match(aggregate):
        problems.append(Problem(where(line), f"{key}.aggregate",
                                f"expected last, mean, min, max, increase or pNN, got {aggregate!r}"))
    values["aggregate"] = aggregate
    values.update(_typed_fields(items, (("window", "window", parse_duration), ("baseline", "baseline", parse_duration)),
                                where, key, problems))
    comparisons = [n for n in ("below", "above", "below_baseline", "above_baseline") if n in items]
    if len(comparisons) != 1:
        line = min((items[n][1] for n in comparisons), default=min((v[1] for v in items.values()), default=0))
        problems.append(Problem(where(line), key, "needs exactly one of below, above, below_baseline, above_baseline"))
    for name in comparisons:
        raw, line = items[name]
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            problems.append(Problem(where(line), f"{key}.{name}", f"expected a number, got {raw!r}"))
        else:
            values[name] = float(raw)
    if values.get("aggregate") != "last" and not values.get("window"):
        problems.append(Problem(where(items.get("aggregate", (None, 0))[1]), f"{key}.window",
                                f"aggregate {values.get('aggregate')} needs a window"))
    return Condition(**values) if len(problems) == start else None


def parse_rules(loader: yaml.SafeLoader, node: yaml.Node, path: str, problems: list[Problem]) -> list[Rule]:
    """Rules from the ``rules:`` YAML node; every problem is appended with its file and line."""

    def where(line: int) -> str:
        return f"{path}:{line}" if line else path

    if not isinstance(node, yaml.SequenceNode):
        problems.append(Problem(where(node.start_mark.line + 1), "rules", "expected a list of rules"))
        return []
    rules, names = [], set()
    for index, item in enumerate(node.value):
        key = f"rules[{index}]"
        if not isinstance(item, yaml.MappingNode):
            problems.append(Problem(where(item.start_mark.line + 1), key, "expected a mapping"))
            continue
        items = _node_items(loader, item)
        start = len(problems)
        for unknown in sorted(set(items) - _RULE_KEYS - _CONDITION_KEYS):
            problems.append(Problem(where(items[unknown][1]), f"{key}.{unknown}", "unknown key"))
        name, line = items.get("name", (None, item.start_mark.line + 1))
        if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", name):
            problems.append(Problem(where(line), f"{key}.name", f"expected a snake_case name, got {name!r}"))
        elif name in names:
            problems.append(Problem(where(line), f"{key}.name", f"duplicate rule name {name!r}"))
        names.add(name)
        conditions = [_condition(loader, {k: v for k, v in items.items() if k in _CONDITION_KEYS}, where, key,
                                 problems)]
        extra, line = items.get("and", ([], 0))
        if not isinstance(extra, list) or not all(isinstance(e, dict) for e in extra):
            problems.append(Problem(where(line), f"{key}.and", "expected a list of conditions"))
            extra = []
        for j, cond in enumerate(extra):
            unknown = set(cond) - _CONDITION_KEYS
            if unknown:
                problems.append(Problem(where(line), f"{key}.and[{j}]", f"unknown key(s) {', '.join(sorted(unknown))}"))
            conditions.append(_condition(loader, {k: (v, line) for k, v in cond.items()}, where, f"{key}.and[{j}]",
                                         problems))
        options = _typed_fields(items, _RULE_FIELDS, where, key, problems)
        description = items.get("description", ("", 0))[0]
        if len(problems) == start:
            rules.append(Rule(name=name, description=str(description or ""),
                              conditions=tuple(c for c in conditions if c), **options))
    return rules


def load_rules_file(path: Path, problems: list[Problem]) -> list[Rule]:
    loader = yaml.SafeLoader(path.read_text())
    try:
        root = loader.get_single_node()
        node = next((v for k, v in root.value if k.value == "rules"), None) if root else None
        return parse_rules(loader, node, str(path), problems) if node is not None else []
    finally:
        loader.dispose()


# ---- evaluation ----


def aggregate(values: list[float], how: str) -> float:
    if how == "last":
        return values[-1]
    if how == "mean":
        return statistics.fmean(values)
    if how == "min":
        return min(values)
    if how == "max":
        return max(values)
    if how == "increase":
        return values[-1] - values[0]
    q = int(how[1:])
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def holds(condition: Condition, history: deque[tuple[float, float]], now: float) -> tuple[bool, float | None]:
    """Whether the condition holds on a series' history at ``now``, and the value it compared."""
    if not history:
        return False, None
    recent = [v for t, v in history if t >= now - condition.window] or [history[-1][1]]
    value = aggregate(recent, condition.aggregate)
    if condition.below is not None:
        return value < condition.below, value
    if condition.above is not None:
        return value > condition.above, value
    start = now - condition.window
    base = [v for t, v in history if start - condition.baseline <= t < start]
    if len(base) < 3:  # no baseline yet: never fire on a job's first minutes
        return False, value
    median = statistics.median(base)
    if condition.below_baseline is not None:
        return value < condition.below_baseline * median, value
    return value > (condition.above_baseline or 0.0) * median, value


@dataclass
class RuleState:
    pending_since: float | None = None
    active: bool = False
    value: float | None = None


@dataclass
class Engine(Collector):
    """Keeps signal histories, evaluates rules, exports their state, and calls ``on_fire``."""

    rules: list[Rule]
    on_fire: Callable[[Rule, dict[str, str], float | None], None]
    training_active: Callable[[dict[str, str]], bool]
    name: str = "rules"
    history: dict[tuple[str, Labels], deque[tuple[float, float]]] = field(default_factory=dict)
    states: dict[tuple[str, Labels], RuleState] = field(default_factory=dict)
    firings: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set_rules(self, rules: list[Rule]) -> None:
        with self._lock:
            self.rules = rules
            names = {r.name for r in rules}
            self.states = {k: s for k, s in self.states.items() if k[0] in names}

    def _keep_seconds(self) -> float:
        return max((c.window + (c.baseline if c.below_baseline or c.above_baseline else 0) + 5
                    for r in self.rules for c in r.conditions), default=60.0)

    def observe(self, source: str, timestamp: float, signals: dict[str, list[tuple[dict[str, str], float]]]) -> None:
        """Record one sample of the signals a collector produces, then evaluate the rules that use them."""
        with self._lock:
            keep = self._keep_seconds()
            seen: set[tuple[str, Labels]] = set()
            for signal, series in signals.items():
                for labels, value in series:
                    key = (signal, tuple(sorted(labels.items())))
                    seen.add(key)
                    history = self.history.setdefault(key, deque())
                    history.append((timestamp, value))
                    while history and history[0][0] < timestamp - keep:
                        history.popleft()
            for key in [k for k in self.history if SIGNALS[k[0]][0] == source and k not in seen]:
                del self.history[key]  # the GPU, job or interface is gone
            fired = self._evaluate(source, timestamp)
        for rule, labels, value in fired:  # outside the lock: starting a capture takes time
            self.on_fire(rule, labels, value)

    def _series(self, condition: Condition, labels: dict[str, str]) -> list[tuple[Labels, deque]]:
        """The series of ``condition.signal`` that match the primary series' labels."""
        wanted = SIGNALS[condition.signal][1]
        shared = {k: v for k, v in labels.items() if k in wanted}
        return [(key[1], h) for key, h in self.history.items()
                if key[0] == condition.signal and all(dict(key[1]).get(k) == v for k, v in shared.items())]

    def _evaluate(self, source: str, now: float) -> list[tuple[Rule, dict[str, str], float | None]]:
        fired = []
        for rule in self.rules:
            if not any(SIGNALS[c.signal][0] == source for c in rule.conditions):
                continue
            primary = rule.conditions[0]
            live: set[Labels] = set()
            for labels_key, history in self._series(primary, {}):
                live.add(labels_key)
                labels = dict(labels_key)
                ok, value = holds(primary, history, now)
                for extra in rule.conditions[1:]:
                    ok = ok and any(holds(extra, h, now)[0] for _, h in self._series(extra, labels))
                if ok and rule.while_training:
                    ok = self.training_active(labels)
                state = self.states.setdefault((rule.name, labels_key), RuleState())
                state.value = value
                if not ok:
                    if state.active:
                        log.info("rule %s resolved for %s (value %s)", rule.name, _show(labels), _num(value))
                        self.version += 1
                    state.pending_since, state.active = None, False
                    continue
                if state.pending_since is None:
                    state.pending_since = now
                    log.info("rule %s pending for %s (value %s, fires after %gs)", rule.name, _show(labels),
                             _num(value), rule.for_seconds)
                if not state.active and now - state.pending_since >= rule.for_seconds - FOR_SLACK_SECONDS:
                    state.active = True
                    self.firings[rule.name] = self.firings.get(rule.name, 0) + 1
                    self.version += 1
                    log.warning("rule %s firing for %s: %s (value %s)", rule.name, _show(labels),
                                rule.description, _num(value))
                    fired.append((rule, labels, value))
            for key in [k for k in self.states if k[0] == rule.name and k[1] not in live]:
                del self.states[key]
        return fired

    def sample(self) -> bool:
        return True

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            states = sorted(self.states.items())
            firings = dict(self.firings)
            names = [r.name for r in self.rules]
        yield gauge("rule_active", "Whether the rule is firing (1) or not (0) for the GPU, job or device.",
                    ["rule", *STATE_LABELS],
                    (([name, *(dict(labels).get(k, "") for k in STATE_LABELS)], float(s.active))
                     for (name, labels), s in states))
        yield counter("rule_firings", "Total times the rule started firing.", ["rule"],
                      (([name], firings.get(name, 0)) for name in names))


def _show(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "host"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"
