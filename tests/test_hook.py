"""The training hook with real TensorFlow on CPU, reporting to a real agent process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from helpers import GpuState, gpu, metric_value, wait_for

pytestmark = pytest.mark.tf


def train(agent, *args: str, wait: bool = True) -> subprocess.Popen | dict:
    env = {**os.environ, "TFPROFD_ADDR": f"127.0.0.1:{agent.hook_port}", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tfprofd.daemon.demo_job", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def counts(agent, job: str) -> tuple[float | None, float | None]:
    text = agent.scrape()
    return (metric_value(text, "tfprofd_training_steps_total", training_job=job, worker="0"),
            metric_value(text, "tfprofd_training_samples_total", training_job=job, worker="0"))


def test_fit_counts_exact_steps_and_samples_with_steps_per_execution(agents):
    agent = agents()
    # 1000 samples in batches of 32: 31 full batches and one of 8, twice; 7 steps per execution.
    truth = train(agent, "--job", "spe7", "--steps-per-execution", "7", "--samples", "1000", "--epochs", "2")
    assert (truth["steps"], truth["samples"]) == (64, 2000)
    wait_for(lambda: counts(agent, "spe7") == (64, 2000), 5, message=f"exact counts, got {counts(agent, 'spe7')}")
    text = agent.scrape()
    assert metric_value(text, "tfprofd_training_phase", training_job="spe7", phase="idle") == 1
    assert metric_value(text, "tfprofd_training_up", training_job="spe7") == 1
    assert metric_value(text, "tfprofd_training_first_step_seconds", training_job="spe7") > 0
    assert metric_value(text, "tfprofd_hook_reports_rejected_total", reason="invalid_field") == 0
    info = [line for line in text.splitlines() if line.startswith("tfprofd_training_info{")]
    assert len(info) == 1 and f'profiler_address="{truth["profiler"]}"' in info[0]


def test_custom_loop_reports_the_same(agents):
    agent = agents()
    truth = train(agent, "--job", "loop", "--mode", "custom", "--samples", "500", "--epochs", "1")
    assert (truth["steps"], truth["samples"]) == (16, 500)
    wait_for(lambda: counts(agent, "loop") == (16, 500), 5, message=f"exact counts, got {counts(agent, 'loop')}")
    text = agent.scrape()
    assert metric_value(text, "tfprofd_training_step_duration_seconds_count", training_job="loop") == 16


def test_explicit_batch_size_is_exported(agents):
    agent = agents()
    train(agent, "--job", "explicit", "--explicit-batch-size", "--samples", "640", "--epochs", "1")
    wait_for(lambda: counts(agent, "explicit") == (20, 640), 5, message="exact counts")
    assert metric_value(agent.scrape(), "tfprofd_training_batch_size", training_job="explicit") == 32


def test_agent_killed_and_restarted_mid_training(agents):
    agent = agents()
    proc = train(agent, "--job", "survivor", "--seconds", "12", "--map-delay", "0.0005", wait=False)
    wait_for(lambda: (counts(agent, "survivor")[0] or 0) > 0, 60, message="training to report")
    agent.proc.kill()
    agent.proc.wait()
    time.sleep(2)
    agent.start()  # same ports: the hook finds it again
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    truth = json.loads(out.strip().splitlines()[-1])
    wait_for(lambda: counts(agent, "survivor") == (truth["steps"], truth["samples"]), 5,
             message=f"counters to continue to {truth}, got {counts(agent, 'survivor')}")


def test_training_process_is_mapped_to_its_gpu(agents, tmp_path, fakenvml):
    state = GpuState(tmp_path / "nvml.json", [gpu(0), gpu(1)])
    agent = agents(env=state.env())
    proc = train(agent, "--job", "mapped", "--seconds", "20", wait=False)
    try:
        state.update_gpu(1, processes=[{"pid": proc.pid, "used_memory_bytes": 2**30}])
        wait_for(lambda: metric_value(agent.scrape(), "tfprofd_gpu_job_info", gpu="1", training_job="mapped") == 1,
                 60, message="job-to-GPU mapping")
        assert metric_value(agent.scrape(), "tfprofd_gpu_job_info", gpu="0", training_job="mapped") is None
    finally:
        proc.kill()
        proc.wait()


def test_profiler_server_started_by_the_hook_answers_a_capture(agents, tmp_path):
    from xprof.convert import _pywrap_profiler_plugin

    agent = agents()
    proc = train(agent, "--job", "profiled", "--seconds", "25", wait=False)
    try:
        wait_for(lambda: "profiled" in agent.scrape() and metric_value(
            agent.scrape(), "tfprofd_training_steps_total", training_job="profiled"), 60, message="job to report")
        line = next(ln for ln in agent.scrape().splitlines()
                    if ln.startswith("tfprofd_training_info{") and "profiled" in ln)
        address = line.split('profiler_address="')[1].split('"')[0]
        logdir = tmp_path / "profile"
        _pywrap_profiler_plugin.trace(address, str(logdir), "", True, 1000, 3,
                                      {"host_tracer_level": 2, "device_tracer_level": 1, "python_tracer_level": 0,
                                       "delay_ms": 0})
        traces = list(logdir.glob("plugins/profile/*/*.xplane.pb"))
        assert traces and traces[0].stat().st_size > 10_000, traces
    finally:
        proc.kill()
        proc.wait()


def test_hook_module_imports_only_the_standard_library():
    code = ("import sys; import tfprofd.exporter.hook as h; "
            "heavy = {'tensorflow', 'keras', 'numpy', 'prometheus_client', 'psutil', 'yaml'} & set(sys.modules); "
            "print(sorted(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
