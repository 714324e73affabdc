"""Golden-file end-to-end test: the real agent, two simulated GPUs and fixture procfs, scraped over HTTP.

Regenerate the expected output after an intended change with ``UPDATE_GOLDEN=1 make test`` (or
``UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_e2e_metrics.py``) and review the diff.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from helpers import TESTS, GpuState, gpu, hopper, metric_value, mig_hopper, volta, wait_for

GOLDEN = TESTS / "golden" / "metrics.prom"
# Series whose values depend on the run: timings, versions, the test's own process ids.
NONDETERMINISTIC = re.compile(
    r"^(# (HELP|TYPE) )?tfprofd_(collector_duration_seconds|collector_last_sample_timestamp_seconds|build_info)\b")


def deterministic(text: str) -> str:
    return "".join(line + "\n" for line in text.splitlines() if not NONDETERMINISTIC.match(line))


def promtool() -> str:
    path = shutil.which("promtool")
    if not path:
        pytest.fail("promtool not found: run `make test`, which installs Debian's prometheus package")
    return path


def test_scrape_matches_golden_file_and_passes_promtool(agents, tmp_path, fakenvml):
    """Every series the agent can export: a plain GPU, a Hopper with GPM and NVLink, one in MIG mode, a V100."""
    state = GpuState(tmp_path / "nvml.json", [gpu(0), hopper(1), mig_hopper(2), volta(3)])
    agent = agents(env=state.env())

    def complete():
        text = agent.scrape()
        return (metric_value(text, "tfprofd_rule_active", rule="network_receive_saturated", device="eth0") is not None
                and metric_value(text, "tfprofd_mig_sm_activity_ratio", gpu="2", gpu_instance_id="2") is not None
                and metric_value(text, "tfprofd_capture_worker_ready") == 1)

    wait_for(complete, 30, message="two samples of every collector and the capture worker waiting")
    text = agent.scrape()
    got = deterministic(text)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text(), "scrape differs from tests/golden/metrics.prom (UPDATE_GOLDEN=1 to accept)"
    lint = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert lint.stdout.strip() == "" and lint.stderr.strip() == "", lint.stdout + lint.stderr


def test_gpu_readings_follow_the_simulated_gpu(agents, gpus):
    agent = agents(env=gpus.env())
    gpus.update_gpu(0, utilization_gpu=30)
    wait_for(lambda: metric_value(agent.scrape(), "tfprofd_gpu_utilization_ratio", gpu="0") == 0.3, 5,
             message="utilization to drop to 0.3")
    assert metric_value(agent.scrape(), "tfprofd_gpu_utilization_ratio", gpu="1") == 0.95


def test_xid_events_are_counted_once_each(agents, gpus):
    agent = agents(env=gpus.env())
    gpus.update_gpu(1, xid_events=[79, 79, 48])
    uuid = gpus.state["gpus"][1]["uuid"]

    def counted() -> tuple[float | None, float | None]:
        body = agent.scrape()
        return tuple(metric_value(body, "tfprofd_gpu_xid_errors_total", gpu="1", uuid=uuid, xid=xid)
                     for xid in ("79", "48"))

    wait_for(lambda: counted() == (2, 1), 30, message="two XID 79 errors and one XID 48")  # one at a time, in order
    assert counted() == (2, 1)
    assert "XID 79 on GPU 1" in agent.log()
