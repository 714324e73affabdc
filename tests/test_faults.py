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
    wait_for(lambda: metric_value(agent.scrape(), "tfprofd_disk_read_bytes_total", device="sda") is None, 5,
             message="disk collector to be disabled")
    assert metric_value(agent.scrape(), "tfprofd_collector_success", collector="disk") is None

    config.write_text("collectors:\n  disk:\n    enabled: sometimes\n")
    agent.signal(signal.SIGHUP)
    wait_for(lambda: "config reload rejected" in agent.log(), 5, message="reload to be rejected")
    assert f"{config}:3: collectors.disk.enabled: expected true or false" in agent.log()
    assert agent.proc.poll() is None
    assert metric_value(agent.scrape(), "tfprofd_disk_read_bytes_total", device="sda") is None
