"""Faults: no driver, a failing GPU, a GPU that vanishes, signals. The scrape always succeeds."""

from __future__ import annotations

import signal

from helpers import GpuState, gpu, metric_value, wait_for


def test_no_nvml_library_exports_everything_else(agents, tmp_path):
    (tmp_path / "empty").mkdir()
    agent = agents(env={"LD_LIBRARY_PATH": str(tmp_path / "empty")})
    text = agent.scrape()
    assert metric_value(text, "tfprofd_collector_success", collector="nvml") == 0
    assert metric_value(text, "tfprofd_gpus") == 0
    for collector in ("cpu", "memory", "disk", "network"):
        assert metric_value(text, "tfprofd_collector_success", collector=collector) == 1
    assert metric_value(text, "tfprofd_memory_total_bytes") == 65773892 * 1024
    seen: set[float] = set()

    def three_more_nvml_samples() -> bool:
        seen.add(metric_value(agent.scrape(), "tfprofd_collector_last_sample_timestamp_seconds", collector="nvml"))
        return len(seen) > 3

    wait_for(three_more_nvml_samples, 30, message="three more NVML samples")
    assert agent.log().count("no GPU metrics: NVML unavailable") == 1  # said once, not every sample


def test_one_failing_gpu_leaves_the_other_exported(agents, tmp_path, fakenvml):
    state = GpuState(tmp_path / "nvml.json", [gpu(0), gpu(1, error="unknown")])
    agent = agents(env=state.env())
    text = agent.scrape()
    assert metric_value(text, "tfprofd_collector_success", collector="nvml") == 0
    assert metric_value(text, "tfprofd_gpus") == 2
    assert metric_value(text, "tfprofd_gpu_utilization_ratio", gpu="0") == 0.95
    assert metric_value(text, "tfprofd_gpu_utilization_ratio", gpu="1") is None
    assert metric_value(text, "tfprofd_gpu_up", gpu="0") == 1
    assert metric_value(text, "tfprofd_gpu_up", gpu="1") == 0  # uuid "": it never answered
    assert "GPU 1 (uuid unknown) does not answer: NVML error: Unknown Error" in agent.log()


def test_unsupported_fields_are_omitted_without_failing(agents, tmp_path, fakenvml):
    state = GpuState(tmp_path / "nvml.json", [gpu(0, unsupported=["ecc", "pcie", "energy"])])
    agent = agents(env=state.env())
    text = agent.scrape()
    assert metric_value(text, "tfprofd_collector_success", collector="nvml") == 1
    assert metric_value(text, "tfprofd_gpu_ecc_errors_total", gpu="0", type="corrected") is None
    assert metric_value(text, "tfprofd_gpu_energy_joules_total", gpu="0") is None
    assert metric_value(text, "tfprofd_gpu_power_watts", gpu="0") == 350.125


def test_state_file_removed_mid_run_then_restored(agents, gpus):
    """The driver goes away and comes back: NVML is initialized again (retried every retry_interval)."""
    agent = agents(env=gpus.env(), args=["--collectors.nvml.retry-interval", "1s"])
    assert metric_value(agent.scrape(), "tfprofd_collector_success", collector="nvml") == 1
    gpus.path.unlink()
    wait_for(lambda: metric_value(agent.scrape(), "tfprofd_collector_success", collector="nvml") == 0, 5,
             message="nvml success to read 0")
    text = agent.scrape()
    assert metric_value(text, "tfprofd_gpu_utilization_ratio", gpu="0") is None
    assert metric_value(text, "tfprofd_collector_success", collector="cpu") == 1
    gpus.write()
    wait_for(lambda: metric_value(agent.scrape(), "tfprofd_gpu_utilization_ratio", gpu="0") == 0.95, 5,
             message="GPUs to come back")
    assert agent.proc.poll() is None


def test_sighup_reloads_config_and_rejects_a_bad_one(agents, gpus, tmp_path):
    config = tmp_path / "tfprofd.yaml"
    config.write_text("collectors:\n  disk:\n    enabled: true\n")
    agent = agents(args=["--config", str(config)], env=gpus.env())
    assert metric_value(agent.scrape(), "tfprofd_disk_read_bytes_total", device="sda") is not None

    config.write_text("collectors:\n  disk:\n    enabled: false\n")
    agent.signal(signal.SIGHUP)

    def disk_gone() -> bool:  # its series and its collector_success (served until the agent's part is forgotten)
        text = agent.scrape()
        return (metric_value(text, "tfprofd_disk_read_bytes_total", device="sda") is None
                and metric_value(text, "tfprofd_collector_success", collector="disk") is None)

    wait_for(disk_gone, 5, message="disk collector to be disabled")
    assert disk_gone()

    config.write_text("collectors:\n  disk:\n    enabled: sometimes\n")
    agent.signal(signal.SIGHUP)
    wait_for(lambda: "config reload rejected" in agent.log(), 5, message="reload to be rejected")
    assert f"{config}:3: collectors.disk.enabled: expected true or false" in agent.log()
    assert agent.proc.poll() is None
    assert metric_value(agent.scrape(), "tfprofd_disk_read_bytes_total", device="sda") is None


def test_costly_gpu_readings_are_read_every_slow_interval(agents, tmp_path, fakenvml):
    """Total energy (3-4 ms of CPU per GPU on an H100) and MIG mode are re-read every slow_interval, not every
    sample: between reads the energy counter keeps its last value."""
    state = GpuState(tmp_path / "nvml.json", [gpu(0, utilization_gpu=90, energy_millijoules=5_000_000)])
    slow = agents(env=state.env(), args=["--collectors.nvml.slow-interval", "1h"])
    wait_for(lambda: metric_value(slow.scrape(), "tfprofd_gpu_energy_joules_total", gpu="0") == 5000.0, 30,
             message="the first sample")
    state.update_gpu(0, utilization_gpu=20, energy_millijoules=7_000_000)
    wait_for(lambda: metric_value(slow.scrape(), "tfprofd_gpu_utilization_ratio", gpu="0") == 0.2, 30,
             message="the next sample")
    assert metric_value(slow.scrape(), "tfprofd_gpu_energy_joules_total", gpu="0") == 5000.0
    quick = agents(env=state.env(), args=["--collectors.nvml.slow-interval", "1s"])
    state.update_gpu(0, energy_millijoules=9_000_000)
    wait_for(lambda: metric_value(quick.scrape(), "tfprofd_gpu_energy_joules_total", gpu="0") == 9000.0, 30,
             message="energy re-read after slow_interval")
