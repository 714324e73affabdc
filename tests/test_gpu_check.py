"""``make gpu-check``'s run step (bench/gpu_check.py run): it passes only where NVML answers with a GPU.

The test machine has no GPU: without tests/fakenvml on LD_LIBRARY_PATH the real pynvml finds no
libnvidia-ml.so.1, as on a host without the driver; with it, the simulated library stands in."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import prometheus_client
import psutil
import pynvml
import pytest
import yaml

from helpers import GpuState, gpu

ROOT = Path(__file__).resolve().parent.parent


def _site(tmp_path: Path) -> Path:
    """What ``gpu_check.py build`` installs, linked from this environment: the agent and its four packages."""
    site = tmp_path / "site"
    (site / "tfprofd").mkdir(parents=True)
    for name in ("daemon", "exporter"):
        (site / "tfprofd" / name).symlink_to(ROOT / name)
    for module in (prometheus_client, psutil, yaml):
        (site / module.__name__).symlink_to(Path(module.__file__).parent)
    (site / "pynvml.py").symlink_to(pynvml.__file__)
    return site


def _gpu_check(tmp_path: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "OUT", "FAKE_NVML_STATE")}
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "run", "--seconds", "2",
                           "--site", str(_site(tmp_path)), *extra], env={**environment, **env}, capture_output=True,
                          text=True, timeout=240)


def test_without_nvml_gpu_check_fails_and_says_why(tmp_path):
    result = _gpu_check(tmp_path, {})
    assert result.returncode == 1, result
    assert "gpu-check FAILED: NVML is unavailable on this host" in result.stderr, result.stderr
    assert "libnvidia-ml.so.1" in result.stderr and "machine with an NVIDIA GPU" in result.stderr


def test_with_nvml_but_no_gpu_gpu_check_fails(tmp_path, fakenvml):
    state = GpuState(tmp_path / "nvml.json", [])
    result = _gpu_check(tmp_path, state.env())
    assert result.returncode == 1, result
    assert "gpu-check FAILED: NVML loaded but reports no GPU" in result.stderr, result.stderr


def test_with_a_gpu_gpu_check_passes_and_names_it(tmp_path, fakenvml):
    state = GpuState(tmp_path / "nvml.json", [gpu(0)])
    result = _gpu_check(tmp_path, state.env())
    assert result.returncode == 0, result
    assert "GPU 0: NVIDIA H100 80GB HBM3" in result.stdout and "FAILED" not in result.stderr, result


PODS_SKIP = "network namespaces need root and ip(8)"


@pytest.mark.parametrize(("over", "flag"), [("UDP", None), ("the Unix socket", "--unix"),
                                            ("UDP from a network namespace of their own (pods)", "--pods")])
def test_with_jobs_gpu_check_says_what_they_cost_the_agent(tmp_path, fakenvml, over, flag):
    if flag == "--pods" and (os.geteuid() != 0 or not shutil.which("ip")):
        pytest.skip(PODS_SKIP)
    state = GpuState(tmp_path / "nvml.json", [gpu(0)])
    result = _gpu_check(tmp_path, state.env(), "--workload", "0", "--jobs", "3", *([flag] if flag else []))
    assert result.returncode == 0, result
    assert f"3 jobs reporting at their own phases over {over}" in result.stdout, result.stdout
    assert "unscraped: the agent's CPU" in result.stdout and "scraped every second by this check" in result.stdout
    if flag == "--pods":
        assert "tfprofd-gpu-check-" not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                          text=True).stdout  # the namespace went with the check


def test_pods_where_no_network_namespace_can_be_made_say_why_and_check_nothing(tmp_path, fakenvml):
    """``--pods`` needs ip(8) (the GPU machines lent have none): without it the check says so, starts no agent and
    exits 2."""
    state = GpuState(tmp_path / "nvml.json", [gpu(0)])
    result = _gpu_check(tmp_path, {**state.env(), "PATH": str(tmp_path / "no-tools")}, "--workload", "0",
                        "--jobs", "3", "--pods")
    assert result.returncode == 2 and "--pods: cannot run ip(8)" in result.stderr, result
    assert "jobs reporting" not in result.stdout, result.stdout


@pytest.mark.parametrize(("args", "error"), [(["--jobs", "-3"], "--jobs must be 0 or more, not -3"),
                                             (["--unix"], "give --jobs N too"), (["--pods"], "give --jobs N too"),
                                             (["--jobs", "2", "--unix", "--pods"], "give one")])
def test_gpu_check_refuses_jobs_it_cannot_run(tmp_path, args, error):
    result = _gpu_check(tmp_path, {}, *args)
    assert result.returncode == 2 and error in result.stderr, result


def test_gpu_capture_runs_and_says_what_this_machine_lacks():
    """``bench/gpu_capture.py``, make gpu-check's second half, uses gpu_check's helpers: a helper renamed there broke
    its import, and only the GPU machine found it. Here (no JAX for this Python, and the site built or not) it
    runs and says what it skips."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_capture.py"), "run", "--python", sys.executable],
                            capture_output=True, text=True, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    missing = "is missing: run `python3 bench/gpu_check.py build`"
    assert (result.returncode, missing in result.stderr) == (2, True) or (
        result.returncode == 0 and f"no JAX for {sys.executable} on this machine" in result.stderr), result
