"""The onset of a drop, end to end: a Keras job whose input slows for 20 s and recovers, the real agent with
the shipped rules, TensorFlow's real profiler server (continuous profiling, TF 2.21)."""

from __future__ import annotations

import pytest

from helpers import AgentProcess, job_reporting, start_training, wait_for
from scenarios import BASE

pytestmark = pytest.mark.tf

SLOW_AFTER, SLOW_FOR = 30.0, 20.0  # early: on a loaded host, CPU steps vary enough to trip the shipped rules


def test_a_transient_input_slowdown_is_traced_from_its_onset_and_named(tmp_path):
    # device tracer off: continuous profiling is armed on a GPU developer's machine too (README, Captures)
    agent = AgentProcess(tmp_path, args=["--captures.baseline", "false", "--captures.snapshot-keep", "4",
                                         "--captures.snapshot-interval", "2s",
                                         "--captures.device-tracer-level", "0"]).start()
    log = tmp_path / "slow.log"
    healthy = [a for a in BASE if a not in ("--map-delay", "0.0002")]
    job = start_training(agent.hook_port, "--job", "onset", "--seconds", str(SLOW_AFTER + SLOW_FOR + 40), *healthy,
                         "--map-delay", "0.01", "--slow-after", str(SLOW_AFTER), "--slow-for", str(SLOW_FOR),
                         "--slow-log", str(log))
    try:
        wait_for(lambda: job_reporting(agent, "onset"), 120, message="the job to report")

        def kept():
            status, answer = agent.call("GET", "/captures")
            assert status == 200, answer
            records = answer["captures"]
            slow = float(log.read_text().split()[1]) if log.exists() else None
            done = [r for r in records if r["trigger"] == "rule" and r["status"] not in ("running", "analyzing")
                    and r["status"] != "discarded" and slow is not None and r["requested_at"] > slow - 1]
            return done[-1] if done else None

        record = wait_for(kept, SLOW_AFTER + SLOW_FOR + 240, interval=1.0, message="a rule's capture to be analysed")
        wait_for(lambda: "recovered" in log.read_text(), SLOW_FOR + 60, interval=0.5, message="the job to recover")
    finally:
        job.kill()
        job.wait()
        agent.stop()
    times = dict(line.split() for line in log.read_text().splitlines())
    slow, recovered = float(times["slow"]), float(times["recovered"])
    assert record["status"] == "done", record
    assert record["context"]["mode"] == "snapshots"
    a = record["analysis"]
    assert a["steps"] > 0 and a["bottleneck"] == "input", a["summary"]
    onset = a["onset"]
    begins = onset["trace_begins_at"]
    assert slow - 5 < begins < recovered, (slow, begins, recovered)  # the trace holds slow steps
    assert begins - record["requested_at"] < 2.0  # armed when the rule went pending
    after = onset["first_slow_step_after_drop_s"]
    assert after is not None and 0 <= after < recovered - slow
    print(f"\nrule {record['rule']}: pending {record['requested_at'] - slow:.1f} s after the drop; trace begins "
          f"{begins - slow:.1f} s after it; reported {after:.1f} s; holds drop: {onset['holds_drop']}; "
          f"{a['summary']}")
