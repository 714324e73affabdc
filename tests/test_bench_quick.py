"""Every benchmark in bench/ runs, in its quick mode (tiny sizes and durations, no timing targets), so a
bench cannot rot unnoticed between the runs of `make bench` (bench/capture_latency.py once answered 401
to every call, unnoticed)."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
from run_all import BENCHES  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.servers]
# What each bench prints last when it ran to the end (a bench that only exits 0 proves less).
LAST_WORDS = {"scrape.py": "scrape and CPU against the number of reporting jobs",
              "hook_overhead.py": "one report (the reporter thread's work each second)",
              "capture_latency.py": "ratio tfprofd / TensorFlow's client:",
              "scenarios.py": "named correctly: 1 of 1",
              "hostile.py": "RSS ",
              "analysis_cost.py": " s capture: trace",
              "job_capture.py": "peers  -> instant  -> last asked  -> record",
              "continuous_profiling.py": "stop_ms_median",
              "render_jobs.py": "the collector's work for",
              "noise.py": "captures of the unchanged job not saying the host was contended:",
              "versus.py": "this / base CPU: median"}



def test_every_bench_has_a_quick_check():
    assert set(LAST_WORDS) == set(BENCHES)


@pytest.mark.parametrize("bench", BENCHES)
def test_bench_runs_in_quick_mode(bench, tmp_path):
    plot = tmp_path / "scaling.svg"  # scrape.py also draws README's scaling plot
    extra = [f"--plot={plot}"] if bench == "scrape.py" else []
    result = subprocess.run([sys.executable, str(BENCH / bench), "--quick", *extra], cwd=BENCH,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{bench} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert LAST_WORDS[bench] in result.stdout, result.stdout[-3000:]
    if extra:  # two panels of two lines each, every line through each size measured
        lines = ET.parse(plot).getroot().findall("{http://www.w3.org/2000/svg}polyline")
        assert [len(line.get("points").split()) for line in lines] == [3, 2, 2, 3, 2, 2]
