"""The seed's case studies reproduced on CPU: tfprofd must name each bottleneck correctly."""

from __future__ import annotations

import pytest

from helpers import AgentProcess
from scenarios import SCENARIOS, run

pytestmark = pytest.mark.tf


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scenarios")
    config = tmp / "tfprofd.yaml"
    config.write_text("rules: []\n")  # only the captures the test asks for
    a = AgentProcess(tmp, args=["--config", str(config), "--captures.max-per-hour", "100"]).start()
    yield a
    a.stop()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario_is_named_correctly(agent, scenario):
    result = run(agent, scenario, warmup=3.0)
    assert result["status"] == "done", result
    assert result["bottleneck"] == scenario.expected, result
