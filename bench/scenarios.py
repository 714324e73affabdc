"""Issue 5: the seed's case studies reproduced on CPU, each captured and analysed by a real agent.

Prints, per scenario: samples/s with the hook, the bottleneck tfprofd names, the input-bound ratio and
whether that matches the cause. Target: every scenario named correctly. ``--quick``: the first scenario only
(CI: the bench runs; one scenario says nothing of the others). Scenario names as arguments pick scenarios.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import common  # noqa: F401  (puts tests/ on the path)
from helpers import AgentProcess
from scenarios import SCENARIOS, run


def main() -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "tfprofd.yaml"
        config.write_text("rules: []\n")
        agent = AgentProcess(Path(tmp), args=["--config", str(config), "--captures.max-per-hour", "100"]).start()
        try:
            only = [a for a in sys.argv[1:] if not a.startswith("--")]
            for scenario in SCENARIOS[:1] if "--quick" in sys.argv else SCENARIOS:
                if only and scenario.name not in only:
                    continue
                results.append(run(agent, scenario))
        finally:
            agent.stop()
    print(f"{'scenario':22} {'samples/s':>10} {'step ms':>8} {'input-bound':>11}  {'named':12} {'expected':12} ok")
    for r in results:
        ibr = "n/a" if r["input_bound_ratio"] is None else f"{r['input_bound_ratio']:.1%}"
        step = "n/a" if r["step_ms"] is None else f"{r['step_ms']:.2f}"
        print(f"{r['scenario']:22} {r['samples_per_second']:10.0f} {step:>8} {ibr:>11}  {r['bottleneck']!s:12} "
              f"{r['expected']:12} {'yes' if r['bottleneck'] == r['expected'] else 'NO'}")
        print(f"    {r['summary']}")
    named = sum(r["bottleneck"] == r["expected"] for r in results)
    print(f"named correctly: {named} of {len(results)}")
    return results


if __name__ == "__main__":
    main()
