"""The agent's resident memory (issue 24, target ≤ 35 MiB with 20 jobs): what it uses only at a capture or on
a bad config is imported there, not at start-up; what replaced ``statistics`` gives what it gave."""

from __future__ import annotations

import random
import statistics
import subprocess
import sys

from tfprofd.daemon.rules import mean, median

RARE = ("statistics", "fractions", "decimal", "difflib", "tfprofd.daemon.analysis.compare",
        "tfprofd.daemon.analysis.report", "tfprofd.daemon.analysis.onset")


def test_the_agent_starts_without_what_it_uses_only_at_a_capture():
    code = ("import sys; import tfprofd.daemon.agent, tfprofd.daemon.cli; "
            f"print(' '.join(m for m in {RARE!r} if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []
    from tfprofd.daemon.analysis import compare, report, with_comparison  # still there on first use

    assert callable(compare) and callable(report) and callable(with_comparison)


def test_rules_mean_and_median_are_statistics_own():
    rng = random.Random(24)
    for n in [1, 2, 3, 4, 5, 10, 11, *range(1, 200, 7)]:
        for values in ([rng.uniform(-1e6, 1e6) for _ in range(n)], [float(rng.randint(0, 9)) for _ in range(n)],
                       [rng.choice([1e-300, 1e300, -1e300, 0.1, 3.0]) for _ in range(n)]):
            assert mean(values) == statistics.fmean(values)
            assert median(values) == statistics.median(values)
