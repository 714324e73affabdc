"""The GPU collector against the simulated NVML (tests/fakenvml, loaded by the real pynvml): health, driver
reloads, failing fields, MIG instances, GPM and the sm_activity rule."""

from __future__ import annotations

import os
import subprocess
import sys

from fake_kubelet import FakeKubelet

from tfprofd.exporter.hook import Reporter

from helpers import GpuState, gpu, hopper, metric_value, mig_hopper, wait_for

GPU0, GPU1 = gpu(0)["uuid"], gpu(1)["uuid"]


def scraped(agent, name: str, value: float | None, **labels: str):
    """A predicate: the agent's scrape once ``name{labels}`` reads ``value``."""
    def check():
        text = agent.scrape()
        return text if metric_value(text, name, **labels) == value else None
    return check


def test_a_gpu_that_falls_off_the_bus_keeps_gpu_up_at_0(agents, tmp_path, fakenvml):
    state = GpuState(tmp_path / "nvml.json", [gpu(0), gpu(1)])
    agent = agents(env=state.env())
    wait_for(scraped(agent, "tfprofd_gpu_up", 1, gpu="1", uuid=GPU1), 10, message="GPU 1 up")
    state.update_gpu(1, error="gpu_is_lost")
    text = wait_for(scraped(agent, "tfprofd_gpu_up", 0, gpu="1", uuid=GPU1), 10, message="GPU 1 down")
    # the GPU's other series go; its up series stays, with the UUID it last answered with
    assert metric_value(text, "tfprofd_gpu_temperature_celsius", gpu="1") is None
    assert metric_value(text, "tfprofd_gpu_up", gpu="0", uuid=GPU0) == 1
    assert metric_value(text, "tfprofd_gpu_temperature_celsius", gpu="0") == 61
    wait_for(scraped(agent, "tfprofd_collector_success", 0, collector="nvml"), 10, message="nvml success 0")
    assert f"GPU 1 ({GPU1}) does not answer: NVML error: GPU is lost" in agent.log()
    state.update_gpu(1, error=None)
    wait_for(scraped(agent, "tfprofd_gpu_temperature_celsius", 62, gpu="1"), 10, message="GPU 1 back")
    assert "GPU 1 answers again" in agent.log()


def test_a_driver_reload_initializes_nvml_again(agents, tmp_path, fakenvml):
    """After a driver reload every handle is stale (NVML answers UNINITIALIZED) until nvmlInit runs again;
    before, the agent never re-initialized and exported nothing until restarted."""
    state = GpuState(tmp_path / "nvml.json", [gpu(0)])
    agent = agents(env=state.env())
    wait_for(scraped(agent, "tfprofd_gpu_temperature_celsius", 61, gpu="0"), 10, message="GPU 0")
    state.state["generation"] = 1  # the driver was reloaded
    state.update_gpu(0, temperature_celsius=70)
    text = wait_for(scraped(agent, "tfprofd_gpu_temperature_celsius", 70, gpu="0"), 10,
                    message="readings after the reload")
    assert "NVML re-initialized" in agent.log()
    assert metric_value(text, "tfprofd_gpu_up", gpu="0", uuid=GPU0) == 1
    wait_for(scraped(agent, "tfprofd_collector_success", 1, collector="nvml"), 10, message="success again")


def test_a_field_that_fails_drops_that_field_not_the_gpu(agents, tmp_path, fakenvml):
    """NO_PERMISSION on the process list (a container without it) used to take the whole GPU away."""
    state = GpuState(tmp_path / "nvml.json", [gpu(0, errors={"processes": "no_permission", "power": "unknown"})])
    agent = agents(env=state.env())
    text = wait_for(scraped(agent, "tfprofd_gpu_up", 1, gpu="0"), 10, message="GPU 0 up")
    assert metric_value(text, "tfprofd_gpu_utilization_ratio", gpu="0") == 0.95
    assert metric_value(text, "tfprofd_gpu_power_watts", gpu="0") is None
    assert metric_value(text, "tfprofd_collector_success", collector="nvml") == 1
    assert metric_value(text, "tfprofd_nvml_errors_total", call="processes", error="NO_PERMISSION") >= 1
    assert metric_value(text, "tfprofd_nvml_errors_total", call="power", error="UNKNOWN") >= 1
    log = agent.log()
    assert log.count("GPU 0: processes failed (Insufficient Permissions)") == 1  # once, not every sample


def test_gpm_ratios_need_two_samples_and_a_gpu_that_has_gpm(agents, tmp_path, fakenvml):
    state = GpuState(tmp_path / "nvml.json", [gpu(0), hopper(1)])
    agent = agents(env=state.env())
    text = wait_for(scraped(agent, "tfprofd_gpu_sm_activity_ratio", 0.125, gpu="1"), 10, message="GPM ratios")
    assert metric_value(text, "tfprofd_gpu_sm_occupancy_ratio", gpu="1") == 0.08
    assert metric_value(text, "tfprofd_gpu_tensor_activity_ratio", gpu="1") == 0.03
    assert metric_value(text, "tfprofd_gpu_dram_bandwidth_utilization_ratio", gpu="1") == 0.2
    assert metric_value(text, "tfprofd_gpu_sm_activity_ratio", gpu="0") is None  # no GPM: no series
    state.update_gpu(1, gpm={"sm_activity": 80})
    text = wait_for(scraped(agent, "tfprofd_gpu_sm_activity_ratio", 0.8, gpu="1"), 10, message="a new reading")
    assert metric_value(text, "tfprofd_gpu_sm_occupancy_ratio", gpu="1") is None  # no longer reported


def test_mig_instances_their_processes_pods_and_the_sm_activity_rule(agents, tmp_path, fakenvml):
    """On a GPU in MIG mode NVML has no utilization, so gpu_utilization rules never fire there; GPM per GPU
    instance gives sm_activity, and the rule fires for the instance the job trains in."""
    me = os.getpid()
    mig = mig_hopper(0, processes=[{"pid": me, "used_memory_bytes": 2**30, "gpu_instance_id": 2,
                                    "compute_instance_id": 0}])
    mig_uuid = mig["mig"]["instances"][1]["uuid"]
    state = GpuState(tmp_path / "nvml.json", [mig])
    config = tmp_path / "tfprofd.yaml"
    config.write_text("rules:\n  - name: low_sm_activity\n    signal: sm_activity\n    below: 0.2\n"
                      "    for: 1s\n    capture: false\n")
    socket_path = tmp_path / "kubelet.sock"
    with FakeKubelet(socket_path, {"small": ("ml", {"trainer": {"nvidia.com/mig-1g.10gb": [mig_uuid]}})}):
        agent = agents(args=["--config", str(config), "--collectors.kubernetes.enabled", "true",
                             "--collectors.kubernetes.socket", str(socket_path)], env=state.env(), fixtures=False)
        reporter = Reporter(job="bert", worker="0", profiler=False, addr=f"unix:{agent.hook_socket}")
        try:
            with reporter.step(batch_size=8):
                pass
            reporter.flush()
            text = wait_for(scraped(agent, "tfprofd_rule_active", 1, rule="low_sm_activity", gpu="0",
                                    gpu_instance_id="2"), 20, message="the rule to fire for instance 2")
        finally:
            reporter.close()
    assert metric_value(text, "tfprofd_rule_active", rule="low_sm_activity", gpu="0", gpu_instance_id="1") == 0
    assert metric_value(text, "tfprofd_gpu_utilization_ratio", gpu="0") is None  # MIG mode: NOT_SUPPORTED
    assert metric_value(text, "tfprofd_gpu_mig_mode", gpu="0") == 1
    assert metric_value(text, "tfprofd_mig_info", gpu="0", gpu_instance_id="2", compute_instance_id="0",
                        mig_uuid=mig_uuid, profile="1c.3g.40gb") == 1
    assert metric_value(text, "tfprofd_mig_processes", gpu="0", gpu_instance_id="2") == 1
    assert metric_value(text, "tfprofd_mig_processes", gpu="0", gpu_instance_id="1") == 0
    assert metric_value(text, "tfprofd_mig_memory_used_bytes", gpu="0", gpu_instance_id="2") == 2 * 2**30
    assert metric_value(text, "tfprofd_mig_sm_activity_ratio", gpu="0", gpu_instance_id="2") == 0.05
    # the kubelet names the MIG device; NVML says which GPU it is on
    assert metric_value(text, "tfprofd_gpu_pod_info", gpu="0", uuid=mig_uuid, pod="small") == 1


XID_REGISTRATION = """
import os, sys
import pynvml
from tfprofd.exporter.nvml import XidWatcher

class Collector:
    nvml = pynvml

pynvml.nvmlInit()
watcher = XidWatcher(Collector())
os.remove(sys.argv[1])  # the driver goes away: no GPUs to count, after the event set was made
for _ in range(5):
    try:
        watcher._register()
    except pynvml.NVMLError:
        pass
    else:
        sys.exit("registered with no driver")
links = []
for fd in os.listdir("/proc/self/fd"):
    try:
        links.append(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        pass  # the listing's own descriptor
print(links.count("anon_inode:inotify"))
"""


def test_a_failed_xid_registration_frees_its_event_set(tmp_path, fakenvml):
    """The XID watcher makes an event set, then registers each GPU; when counting the GPUs fails (the driver
    going away) the set is freed, not leaked by each retry (an event set holds a kernel watch, as the driver's
    holds its resources)."""
    state = GpuState(tmp_path / "nvml.json", [gpu(0)])
    done = subprocess.run([sys.executable, "-c", XID_REGISTRATION, str(state.path)], env={**os.environ, **state.env()},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"
