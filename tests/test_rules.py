"""Rule parsing (errors with file and line) and evaluation semantics, on a scripted clock."""

from __future__ import annotations

import textwrap

import pytest

from tfprofd.daemon import config
from tfprofd.daemon.rules import CLEARED, FIRING, PENDING, RESOLVED, Condition, Engine, History, Rule, aggregate, holds
from tfprofd.exporter.registry import signal_catalog


def load(tmp_path, text: str):
    path = tmp_path / "rules.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path), config.load(str(path), env={})


def test_shipped_rules_load_and_a_rules_list_replaces_them(tmp_path):
    assert {r.name for r in config.load(None, env={}).rules} >= {
        "low_gpu_utilization", "throughput_drop", "cpu_bottleneck", "io_bottleneck", "gpu_memory_growth",
        "host_memory_growth", "step_time_outlier", "slow_initialization", "network_receive_saturated"}
    _, cfg = load(tmp_path, "rules: []\n")
    assert cfg.rules == ()


def test_rule_errors_name_file_line_and_key(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(textwrap.dedent("""\
        rules:
          - name: ok_rule
            signal: gpu_utilization
            below: 0.5
          - name: Bad Name
            signal: gpu_temperature
            below: 0.5
            above: 0.9
            for: soon
            colour: red
          - name: ok_rule
            signal: cpu_utilization
            aggregate: p95
            above: 0.9
    """))
    with pytest.raises(config.ConfigError) as info:
        config.load(str(path), env={})
    found = [str(p) for p in info.value.problems]
    assert f"{path}:5: rules[1].name: expected a snake_case name, got 'Bad Name'" in found
    assert any(p.startswith(f"{path}:6: rules[1].signal: expected one of gpu_utilization") for p in found)
    assert any(p.startswith(f"{path}:7: rules[1]: needs exactly one of below, above") for p in found)
    assert f"{path}:9: rules[1].for: expected a duration like 1s, 500ms or 5m, got 'soon'" in found
    assert f"{path}:10: rules[1].colour: unknown key" in found
    assert f"{path}:11: rules[2].name: duplicate rule name 'ok_rule'" in found
    assert f"{path}:13: rules[2].window: aggregate p95 needs a window" in found


def test_an_aggregate_with_a_trailing_newline_is_refused_naming_file_line_and_key(tmp_path):
    """``$`` matches before a final newline: "p50\\n" passed the check, and the rules found no such aggregate at
    every sample after (a KeyError where the source's rules stopped)."""
    path = tmp_path / "rules.yaml"
    path.write_text('rules:\n  - name: spread\n    signal: gpu_utilization\n    aggregate: "p50\\n"\n'
                    '    window: 1m\n    above: 0.5\n')
    with pytest.raises(config.ConfigError) as info:
        config.load(str(path), env={})
    assert [str(p) for p in info.value.problems] == [
        f"{path}:4: rules[0].aggregate: expected last, mean, min, max, increase or pNN, got 'p50\\n'"]


@pytest.mark.parametrize(("how", "expected"), [("last", 5), ("mean", 3), ("min", 1), ("max", 5), ("increase", 4),
                                               ("p50", 3), ("p95", 5), ("p5", 1)])
def test_aggregates(how, expected):
    assert aggregate([1, 2, 3, 4, 5], how) == expected


def test_baseline_drop_needs_history_and_compares_to_the_median():
    condition = Condition("samples_per_second", aggregate="mean", window=10, below_baseline=0.7, baseline=60)
    history = History((t, 100.0) for t in range(0, 60))
    assert holds(condition, history, 59) == (False, 100.0)
    for t in range(60, 71):
        history.append(t, 60.0)
    assert holds(condition, history, 70) == (True, 60.0)
    assert holds(condition, History([(0, 1.0)]), 0)[0] is False  # no baseline yet


class Scripted:
    """An engine with one rule, fed by hand; ``fired`` collects the firings."""

    def __init__(self, rule: Rule, training: bool = True):
        self.engine = Engine([rule], signal_catalog())
        self.training = training
        self.transitions: list = []

    def observe(self, source: str, t: float, signals: dict) -> list:
        out = self.engine.observe(source, t, signals, lambda labels: self.training)
        self.transitions += out
        return out

    @property
    def fired(self) -> list:
        return [(t.rule.name, t.labels, t.value) for t in self.transitions if t.kind == FIRING]

    def active(self) -> dict[tuple, float]:
        [family, _] = self.engine.collect()
        return {tuple(sorted((k, v) for k, v in s.labels.items() if v)): s.value for s in family.samples}


def test_for_duration_counts_from_the_first_sample_that_crossed():
    rule = Rule("low", "", (Condition("gpu_utilization", below=0.5),), for_seconds=30)
    e = Scripted(rule)
    for t in range(0, 10):
        e.observe("nvml", t, {"gpu_utilization": [({"gpu": "0"}, 0.95)]})
    for t in range(10, 40):  # dropped at t=10: not yet firing at t=39
        e.observe("nvml", t, {"gpu_utilization": [({"gpu": "0"}, 0.3)]})
    assert e.fired == []
    assert [t.kind for t in e.transitions] == [PENDING]
    e.observe("nvml", 40, {"gpu_utilization": [({"gpu": "0"}, 0.3)]})
    assert e.fired == [("low", {"gpu": "0"}, 0.3)]
    e.observe("nvml", 41, {"gpu_utilization": [({"gpu": "0"}, 0.3)]})
    assert len(e.fired) == 1  # fires once per episode
    e.observe("nvml", 42, {"gpu_utilization": [({"gpu": "0"}, 0.9)]})
    assert e.transitions[-1].kind == RESOLVED and e.transitions[-1].why == "condition cleared"
    assert e.active()[(("gpu", "0"), ("rule", "low"))] == 0


def test_a_series_shows_at_once_and_goes_when_its_gpu_goes_resolving_the_alert():
    rule = Rule("low", "", (Condition("gpu_utilization", below=0.5),), for_seconds=0)
    e = Scripted(rule)
    e.observe("nvml", 0, {"gpu_utilization": [({"gpu": "0"}, 0.95), ({"gpu": "1"}, 0.95)]})
    assert e.active() == {(("gpu", "0"), ("rule", "low")): 0, (("gpu", "1"), ("rule", "low")): 0}
    e.observe("nvml", 1, {"gpu_utilization": [({"gpu": "0"}, 0.95), ({"gpu": "1"}, 0.1)]})
    assert e.active()[(("gpu", "1"), ("rule", "low"))] == 1
    e.observe("nvml", 2, {"gpu_utilization": [({"gpu": "0"}, 0.95)]})  # GPU 1 fell off the bus
    assert e.active() == {(("gpu", "0"), ("rule", "low")): 0}
    last = e.transitions[-1]
    assert (last.kind, last.labels, last.why) == (RESOLVED, {"gpu": "1"}, "series gone")


def test_a_job_that_stops_training_resolves_its_rule():
    rule = Rule("drop", "", (Condition("samples_per_second", below=50),), for_seconds=0)
    e = Scripted(rule)
    labels = {"training_job": "a", "worker": "0"}
    e.observe("training", 0, {"samples_per_second": [(labels, 10.0)]})
    assert e.fired
    e.training = False
    e.observe("training", 1, {"samples_per_second": [(labels, 10.0)]})
    assert e.transitions[-1].kind == RESOLVED


def test_removing_a_firing_rule_resolves_it():
    rule = Rule("low", "", (Condition("gpu_utilization", below=0.5),))
    e = Scripted(rule)
    e.observe("nvml", 0, {"gpu_utilization": [({"gpu": "0"}, 0.1)]})
    assert e.fired
    [resolved] = e.engine.set_rules([])
    assert resolved.kind == RESOLVED and resolved.why == "rule removed or changed"
    assert e.active() == {}


def test_rules_are_gated_on_an_active_training_job():
    rule = Rule("low", "", (Condition("gpu_utilization", below=0.5),), for_seconds=0)
    e = Scripted(rule, training=False)
    e.observe("nvml", 0, {"gpu_utilization": [({"gpu": "0"}, 0.0)]})
    assert e.fired == []


def test_and_conditions_join_a_host_signal():
    rule = Rule("cpu_bound", "", (Condition("gpu_utilization", below=0.5),
                                  Condition("cpu_utilization", aggregate="mean", window=5, above=0.9)))
    e = Scripted(rule)
    e.observe("cpu", 0, {"cpu_utilization": [({}, 0.5)]})
    e.observe("nvml", 0, {"gpu_utilization": [({"gpu": "0"}, 0.2)]})
    assert e.fired == []
    e.observe("cpu", 1, {"cpu_utilization": [({}, 0.99)]})
    e.observe("cpu", 2, {"cpu_utilization": [({}, 0.99)]})
    e.observe("cpu", 3, {"cpu_utilization": [({}, 0.99)]})
    e.observe("nvml", 6, {"gpu_utilization": [({"gpu": "0"}, 0.2)]})
    assert [f[0] for f in e.fired] == ["cpu_bound"]


def test_fluctuation_rule_fires_on_high_p95_with_low_p5():
    rule = Rule("fluct", "", (Condition("gpu_utilization", "p95", 60, above=0.7),
                              Condition("gpu_utilization", "p5", 60, below=0.1)))
    e = Scripted(rule)
    for t in range(60):
        e.observe("nvml", t, {"gpu_utilization": [({"gpu": "0"}, 0.99 if t % 3 else 0.0)]})
    assert e.fired and e.fired[0][0] == "fluct"
    steady = Scripted(rule)
    for t in range(60):
        steady.observe("nvml", t, {"gpu_utilization": [({"gpu": "0"}, 0.9)]})
    assert steady.fired == []


def test_times_are_the_sample_clock_not_the_wall_clock():
    """The engine only sees the monotonic sample times it is given: a wall-clock step cannot shorten `for`."""
    rule = Rule("low", "", (Condition("gpu_utilization", below=0.5),), for_seconds=30)
    e = Scripted(rule)
    base = 1_000_000.0  # monotonic seconds since boot, unrelated to Unix time
    for t in range(0, 29):
        e.observe("nvml", base + t, {"gpu_utilization": [({"gpu": "0"}, 0.1)]})
    assert e.fired == []
    e.observe("nvml", base + 30, {"gpu_utilization": [({"gpu": "0"}, 0.1)]})
    assert e.fired


def test_firing_jobs_follow_each_job_through_firing_resolving_going_and_rule_removal():
    # firing_jobs decides which jobs are steady enough for their baseline capture, once a sample
    rule = Rule("drop", "", (Condition("samples_per_second", below=50),), for_seconds=0)
    e = Scripted(rule)

    def rate(t: float, **values: float) -> None:
        e.observe("training", t, {"samples_per_second": [({"training_job": job, "worker": "0"}, v)
                                                         for job, v in values.items()]})

    rate(0, a=10.0, b=100.0)
    assert "a" in e.engine.firing_jobs() and "b" not in e.engine.firing_jobs()
    rate(1, a=100.0, b=10.0)  # a cleared, b fires
    assert "a" not in e.engine.firing_jobs() and "b" in e.engine.firing_jobs()
    rate(2, a=10.0)  # b's series is gone: resolved
    assert "a" in e.engine.firing_jobs() and "b" not in e.engine.firing_jobs()
    e.engine.set_rules([])
    assert "a" not in e.engine.firing_jobs()


def test_a_baseline_median_kept_sorted_as_its_window_slides_is_the_median_of_the_window():
    """A rule's 10-minute baseline is kept sorted while it slides (sorting it afresh every sample for 1,000
    jobs cost ~9% of a core): through equal values, equal times, gaps, compaction of old samples, windows
    that jump back or past their last position, and several windows on one series, the median is always
    statistics.median of the samples in the window."""
    import random
    import statistics

    rng = random.Random(2411)
    history = History()
    now, checked = 0.0, 0
    for step in range(4000):
        now += rng.choice([0.0, 1.0, 1.0, 1.0, 2.0, 45.0 if step % 500 == 0 else 1.0])
        history.append(now, rng.choice([rng.uniform(0, 10), 5.0, float(rng.randint(0, 3)), -0.0, 0.0]))
        history.drop_before(now - rng.choice([700.0, 700.0, 700.0, 90.0]))
        for key, window, baseline in (("a", 20.0, 600.0), ("b", 0.0, 60.0), ("c", rng.uniform(0, 700), 30.0)):
            start = now - window
            values = history.between(start - baseline, start)
            got = history.median_between(start - baseline, start, key, 3)
            assert got == (statistics.median(values) if len(values) >= 3 else None), (step, key)
            checked += len(values) >= 3
    assert checked > 8000


def test_baseline_windows_kept_sorted_do_not_outlive_the_rules_that_used_them():
    """Each rule's baseline window is kept sorted per series (up to 600 values, 4.8 kB): rules edited again
    and again with other windows must not leave their old windows behind."""
    from tfprofd.exporter.registry import signal_catalog

    engine = Engine([], signal_catalog())
    labels = {"training_job": "j", "worker": "0"}
    for edit in range(5):
        engine.set_rules([Rule("drop", "", (Condition("samples_per_second", aggregate="mean", window=float(edit),
                                                      below_baseline=0.5, baseline=60.0),))])
        for t in range(100 * edit, 100 * edit + 100):
            engine.observe("training", float(t), {"samples_per_second": [(labels, 100.0 + t % 7)]}, lambda _: True)
        (history,) = engine._series["samples_per_second"].values()
        assert list(history._sorted) == [(float(edit), 60.0)]


def test_a_baseline_comparison_decided_by_the_medians_bounds_is_the_comparison_with_the_median(monkeypatch):
    """A baseline rule compares with the median only where the bounds from the window as last kept sorted
    cannot decide (issue 24): through steady stretches, drops, spikes, gaps and long stale runs, below and
    above, with ratios 0 to 3, every result is the comparison with statistics.median of the window."""
    import random
    import statistics

    exact = []
    median_between = History.median_between
    monkeypatch.setattr(History, "median_between", lambda self, *a: exact.append(1) or median_between(self, *a))
    rng = random.Random(24)
    conditions = [Condition("samples_per_second", aggregate=how, window=window, baseline=baseline, **{side: ratio})
                  for how, window, baseline in (("mean", 20.0, 600.0), ("last", 0.0, 60.0), ("max", 5.0, 30.0))
                  for side in ("below_baseline", "above_baseline") for ratio in (0.0, 0.7, 1.0, 3.0)]
    histories = [History() for _ in conditions]  # one each: a window sorted for one is not stale for another
    now, level, checked = 0.0, 100.0, 0
    for step in range(3000):
        now += 30.0 if step % 700 == 699 else 1.0
        if step % 250 == 0:
            level = rng.choice([100.0, 50.0, 200.0, 0.0])
        value = rng.choice([level + rng.uniform(-5, 5), level, 1000.0 if step % 97 == 0 else level])
        for history in histories:
            history.append(now, value)
            history.drop_before(now - 625)
        for condition, history in zip(conditions, histories, strict=True):
            recent = history.between(now - condition.window) or [history.last()]
            value = aggregate(recent, condition.aggregate)
            start = now - condition.window
            window = history.between(start - condition.baseline, start)
            if len(window) < 3:
                assert holds(condition, history, now) == (False, value)
                continue
            middle = statistics.median(window)
            want = (value < condition.below_baseline * middle if condition.below_baseline is not None
                    else value > condition.above_baseline * middle)
            assert holds(condition, history, now) == (want, value), (step, condition)
            checked += 1
    assert checked > 60000
    assert 0 < len(exact) < checked / 2  # most comparisons are decided by the bounds alone (not with ratio 0)


def test_a_series_key_kept_for_a_labels_dict_handed_again_never_goes_to_another_dict():
    """The engine keeps the key of a labels dict that a collector hands again (a job's, every second): a dict
    handed once and dropped must not lend its key to a new dict that the allocator puts at its address."""
    engine = Engine([Rule("low", "", (Condition("gpu_utilization", below=0.5),), for_seconds=0)], signal_catalog())
    kept = {"gpu": "k"}
    for t in range(200):
        # a dict dropped after the sample: the next sample's is likely made where it was
        engine.observe("nvml", float(t), {"gpu_utilization": [(kept, 0.9), ({"gpu": str(t % 3)}, 0.1 * (t % 3))]},
                       lambda _: True)
        assert {k: [v for _, v in engine.history("gpu_utilization", {"gpu": k})][-1]
                for k in ("k", str(t % 3))} == {"k": 0.9, str(t % 3): 0.1 * (t % 3)}
        assert sorted(dict(key)["gpu"] for key in engine._series["gpu_utilization"]) == sorted({"k", str(t % 3)})


def test_removing_a_pending_rule_clears_it():
    """A reload that removes or changes a pending rule says it cleared: a capture taken on pending is discarded and
    nothing is kept for it (it used to stay pending in the captures' books)."""
    rule = Rule("low", "", (Condition("gpu_utilization", below=0.5),), for_seconds=60)
    e = Scripted(rule)
    e.observe("nvml", 0, {"gpu_utilization": [({"gpu": "0"}, 0.1)]})
    assert [t.kind for t in e.transitions] == [PENDING]
    [cleared] = e.engine.set_rules([])
    assert (cleared.kind, cleared.why, cleared.labels) == (CLEARED, "rule removed or changed", {"gpu": "0"})


def test_series_on_their_signals_shared_times_fire_as_histories_of_their_own_would():
    """The series of a signal share its sample times (issue 24: one axis searched once a sample, not 1,000 arrays
    of times): with series that come, go, come back, skip a sample with a NaN, are handed twice in one sample,
    and times that repeat or jump, each series' history, and whether each rule holds on it, are what a history
    of its own with the same samples gives."""
    import random

    rng = random.Random(2424)
    rules = [Rule(f"r{i}", "", (condition,), for_seconds=0, while_training=False) for i, condition in enumerate([
        Condition("samples_per_second", aggregate="mean", window=20.0, below_baseline=0.8, baseline=120.0),
        Condition("samples_per_second", aggregate="p50", window=7.0, above_baseline=1.1, baseline=40.0),
        Condition("samples_per_second", aggregate="min", window=3.0, below=2.0)])]
    engine = Engine(rules, signal_catalog())
    keep = 120.0 + 20.0 + 5  # what the engine keeps: the longest window and baseline, and 5 s
    labels = {job: {"training_job": job, "worker": "0"} for job in "abcdefgh"}
    own: dict[str, list[tuple[float, float]]] = {}
    now, checked = 0.0, 0
    for step in range(1500):
        now += rng.choice([0.0, 1.0, 1.0, 1.0, 2.0, 200.0 if step % 400 == 399 else 1.0])
        sent = []
        for job in rng.sample(sorted(labels), rng.randint(0, 8)):
            value = rng.choice([float("nan"), 0.5, *(rng.uniform(1, 10) for _ in range(8))])
            sent.append((labels[job], value))
            if rng.random() < 0.05:  # the same series twice in one sample: its first number counts
                sent.append((labels[job], rng.uniform(1, 10)))
        firsts = {}
        for job_labels, value in sent:
            if value == value:
                firsts.setdefault(job_labels["training_job"], value)
        for job in labels:  # a series missing from a sample (or only NaN in it) is gone: it starts again
            value = firsts.get(job)
            if value is None:
                own.pop(job, None)
            else:
                own[job] = [(t, v) for t, v in own.get(job, []) if t >= now - keep] + [(now, value)]
        engine.observe("training", now, {"samples_per_second": sent}, lambda _: True)
        [active, _] = engine.collect()
        firing = {(s.labels["rule"], s.labels["training_job"]): s.value for s in active.samples}
        for job, samples in own.items():
            assert engine.history("samples_per_second", {"training_job": job}) == sorted(samples), (step, job)
            for rule in rules:
                expected = holds(rule.conditions[0], History(samples), now)[0]
                assert firing[(rule.name, job)] == float(expected), (step, job, rule.name)
                checked += expected
        assert {job for _, job in firing} == set(own)
    assert checked > 300


def test_a_series_that_missed_a_time_of_its_signal_starts_again_rather_than_pair_values_with_wrong_times():
    """A sample that raised halfway (a collector's bug: a None value) left some series without a value at a time
    their signal's axis took: their next values must not go with the times before them. The series starts again
    from its next value: no rule fires on values paired with the wrong times, and its history reads."""
    rule = Rule("m", "", (Condition("gpu_utilization", aggregate="mean", window=1.5, below=0.5),), for_seconds=0,
                while_training=False)
    engine = Engine([rule], signal_catalog())
    a, b = {"gpu": "0"}, {"gpu": "1"}
    engine.observe("nvml", 0.0, {"gpu_utilization": [(a, 0.9), (b, 0.9)]}, lambda _: True)
    with pytest.raises(TypeError):
        engine.observe("nvml", 1.0, {"gpu_utilization": [(a, 0.9), (b, None)]}, lambda _: True)
    assert engine.observe("nvml", 2.0, {"gpu_utilization": [(a, 0.9), (b, 0.9)]}, lambda _: True) == []
    assert engine.observe("nvml", 3.0, {"gpu_utilization": [(a, 0.9), (b, 0.1)]}, lambda _: True) == []  # 0.5
    assert engine.history("gpu_utilization", {"gpu": "1"}) == [(2.0, 0.9), (3.0, 0.1)]
    assert engine.history("gpu_utilization", {"gpu": "0"}) == [(0.0, 0.9), (1.0, 0.9), (2.0, 0.9), (3.0, 0.9)]


def test_a_stalled_signal_asked_by_the_rules_of_another_does_not_grow_the_engine():
    """A collector that hangs in a library call publishes nothing, and its series stay; the rules that join its
    signal to another's (cpu_bottleneck: GPU utilization and CPU) still ask where their windows start, with
    another time at each sample of the other signal. What the engine keeps for that stays bounded."""
    from tfprofd.daemon.config import load_rules_file
    from tfprofd.daemon.rules import DEFAULT_RULES, FOUND_KEPT

    engine = Engine(list(load_rules_file(DEFAULT_RULES, [])), signal_catalog())
    engine.observe("nvml", 0.0, {"gpu_utilization": [({"gpu": "0"}, 0.1)]}, lambda _: True)  # then NVML hangs
    for t in range(1, 2000):
        engine.observe("cpu", float(t), {"cpu_utilization": [({}, 0.95)], "cpu_iowait": [({}, 0.0)]}, lambda _: True)
    assert len(engine._axes["gpu_utilization"]._found) <= FOUND_KEPT
