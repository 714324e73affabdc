from __future__ import annotations

import pytest

from helpers import AgentProcess, GpuState, build_fakenvml, gpu


@pytest.fixture(scope="session")
def fakenvml():
    return build_fakenvml()


@pytest.fixture
def gpus(tmp_path, fakenvml) -> GpuState:
    """Two simulated GPUs."""
    return GpuState(tmp_path / "nvml.json", [gpu(0), gpu(1)])


@pytest.fixture
def agents(tmp_path):
    """Start agents with ``agents(args=..., env=...)``; all are stopped at the end of the test."""
    started: list[AgentProcess] = []

    def start(**kwargs) -> AgentProcess:
        agent = AgentProcess(tmp_path, **kwargs).start()
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.stop()
