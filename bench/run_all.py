"""Runs every benchmark in one go (`make bench`); each prints its own side-by-side figures and targets.

``--quick`` runs each with tiny sizes and durations (tests/test_bench_quick.py, in CI): the figures mean
nothing then, but a bench that no longer runs fails there.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHES = ("scrape.py", "hook_overhead.py", "capture_latency.py", "scenarios.py", "hostile.py", "analysis_cost.py",
           "job_capture.py", "continuous_profiling.py", "render_jobs.py",
           "noise.py", "versus.py")

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    failed = []
    for bench in BENCHES:
        print(f"==== {bench}", flush=True)
        if subprocess.run([sys.executable, str(here / bench), *sys.argv[1:]], cwd=here).returncode != 0:
            failed.append(bench)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    sys.exit(1 if failed else 0)
