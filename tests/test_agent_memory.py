"""The agent's resident memory (issue 24, target ≤ 35 MiB with 20 jobs): what it uses only at a capture or on
a bad config is imported there, not at start-up; what replaced ``statistics`` gives what it gave."""

from __future__ import annotations

import random
import statistics
import subprocess
import sys

from tfprofd.daemon.rules import History, mean

RARE = ("statistics", "fractions", "decimal", "difflib", "tfprofd.daemon.analysis.onset")
UNUSED = ("asyncio",)  # 1.5 MiB: the HTTP servers run on a selector loop of their own (daemon/httpserver.py)


def test_the_agent_starts_without_what_it_uses_only_at_a_capture():
    code = ("import sys; import tfprofd.daemon.agent, tfprofd.daemon.cli; "
            f"print(' '.join(m for m in {RARE + UNUSED!r} if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []


def test_rules_mean_and_median_are_statistics_own():
    rng = random.Random(24)
    for n in [1, 2, 3, 4, 5, 10, 11, *range(1, 200, 7)]:
        for values in ([rng.uniform(-1e6, 1e6) for _ in range(n)], [float(rng.randint(0, 9)) for _ in range(n)],
                       [rng.choice([1e-300, 1e300, -1e300, 0.1, 3.0]) for _ in range(n)]):
            assert mean(values) == statistics.fmean(values)
            history = History(enumerate(values))
            assert history.median_between(0, n, "all") == statistics.median(values)


def test_a_rule_series_history_keeps_and_finds_what_a_scan_of_every_sample_found():
    """Rule histories are kept in arrays (a value's 8 bytes, the times on an axis; a deque of tuples took ~90 bytes a
    sample, 110 MB with 1,000 jobs over the 10 min baseline) and windows found by bisection: the same samples as a
    list scan, also for a window found before a drop and asked for again after it."""
    from tfprofd.daemon.rules import History

    rng = random.Random(2424)
    history, plain = History(), []
    now = 0.0
    for _ in range(3000):
        now += rng.choice([0.0, 0.5, 1.0, 1.0, 7.0])  # equal times too (two samples in one instant)
        value = rng.uniform(-5, 5)
        history.append(now, value)
        plain.append((now, value))
        keep = rng.choice([30.0, 200.0, 625.0])
        probe = now - 150.0
        history.between(probe)  # found before the drop: found again after it, without what was dropped
        history.drop_before(now - keep)
        plain = [(t, v) for t, v in plain if t >= now - keep]
        assert history.between(probe).tolist() == [v for t, v in plain if t >= probe]
        assert list(history) == plain and len(history) == len(plain) and history.last() == plain[-1][1]
        start, end = now - rng.uniform(0, 300), now - rng.uniform(0, 30)
        assert history.between(start, end).tolist() == [v for t, v in plain if start <= t < end]
        assert history.between(end).tolist() == [v for t, v in plain if t >= end]


def test_a_collector_part_keeps_its_rendering_but_none_of_the_families_it_rendered():
    """A collector makes new families at every collect: the exposition keeps what it wrote, not the families
    (keeping them held every sample of the last rendering, ~230 KB with 8 GPUs, twice that while the next
    one ran). Each scrape still gets the collector's current values, as prometheus_client writes them."""
    import gc
    import weakref

    from prometheus_client.core import GaugeMetricFamily

    from tfprofd.daemon.exposition import OPENMETRICS, TEXT, Exposition, render_library

    made: list[weakref.ref] = []
    value = [40.0]

    def collect() -> list[GaugeMetricFamily]:
        family = GaugeMetricFamily("tfprofd_gpu_temperature_celsius", "GPU temperature.", labels=["gpu"])
        for gpu in range(8):
            family.add_metric([str(gpu)], value[0] + gpu)
        made.append(weakref.ref(family))
        return [family]

    exposition = Exposition(clock=lambda: 0.0)
    for fmt in (TEXT, OPENMETRICS, TEXT):
        value[0] += 1
        body = exposition.part("nvml", fmt, collect, max_age=-1.0).bytes  # rendered afresh each time
        assert body == render_library(collect(), fmt)
    gc.collect()
    assert len(made) == 6 and [ref() for ref in made] == [None] * 6
