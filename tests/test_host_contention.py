"""A CPU hog beside a training job during a capture: the record says host_contention, with the numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import AgentProcess, job_reporting, start_training, wait_capture, wait_for

pytestmark = pytest.mark.tf

RULES = """
rules:
  - name: always_capture
    description: fires as soon as the job trains (the test's trigger)
    signal: samples_per_second
    above: 0
    cooldown: 10m
"""


def test_a_rule_capture_beside_cpu_hogs_names_host_contention_with_the_numbers(tmp_path):
    config = tmp_path / "tfprofd.yaml"
    config.write_text(RULES)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    agent = AgentProcess(tmp_path, args=["--config", str(config), "--captures.baseline", "false",
                                         "--captures.duration", "2s"], fixtures=False).start()
    # no read cost: the job's steps are CPU compute, which the hogs starve
    job = start_training(agent.hook_port, "--job", "starved", "--seconds", "600", "--features", "64", "--width",
                         "1024", "--batch-size", "64", "--samples", "4096")
    try:
        wait_for(lambda: job_reporting(agent, "starved"), 240, message="the Keras job to report")

        def rule_capture():
            captures = agent.call("GET", "/captures")[1]["captures"]
            return captures[0] if captures else None

        record = wait_capture(agent, wait_for(rule_capture, 120, message="the rule's capture")["id"], timeout=300)
        assert record["status"] == "done", record
        host, analysis = record["host"], record["analysis"]
        assert host["job_processes"] >= 1 and host["job_threads"] > 1, host  # the pid reported over UDP matched
        # the hogs are among the three heaviest others, unless a busier machine's own work fills the list
        listed = {o["pid"] for o in host["top_others"]}
        assert listed & {h.pid for h in hogs} or len(listed) == 3, host["top_others"]
        assert analysis["bottleneck"] == "host_contention", analysis["summary"]
        assert analysis["trace_bottleneck"] not in (None, "host_contention")
        found = re.match(r"host_contention: other processes used (\d+\.\d) of (\d+) CPUs.*; the job's threads were "
                         r"ready to run on (\d+\.\d) CPUs but ran on (\d+\.\d), waiting for a CPU (\d+)% of the time",
                         analysis["summary"])
        assert found, analysis["summary"]
        others, cpus, wanted, got, waited = (float(g) for g in found.groups())
        assert cpus == os.cpu_count() and others >= 0.5 and got < wanted and waited >= 25, analysis["summary"]
        assert abs(others - (host["other_cores"] + host["tfprofd_cores"])) < 0.06
        assert "(rule always_capture fired while the host was contended)" in analysis["summary"]
        assert f"the trace alone says {analysis['trace_bottleneck']}" in analysis["summary"]
        assert "rule always_capture's cooldown for job starved is lifted" in agent.log()
    finally:
        for proc in (job, *hogs):
            proc.kill()
            proc.wait()
        agent.stop()
