"""GPU → pod attribution from the kubelet's PodResources API, against a real gRPC server on a unix socket."""

from __future__ import annotations

import os
import re
import signal
from typing import Any

from fake_kubelet import FakeKubelet

from tfprofd.exporter.hook import Reporter
from tfprofd.exporter.kubernetes import KubernetesSettings, PodDevice, parse_pod_resources
from tfprofd.exporter.protos import podresources_pb2 as pb

from helpers import GpuState, gpu, http, metric_value, wait_for

GPU0, GPU1 = gpu(0)["uuid"], gpu(1)["uuid"]
MIG = "MIG-4f3a7a2e-5bd2-5c4e-8a38-1f2b2d8a0c11"


def scrape_with_bert_training(agents, socket_path, state: GpuState) -> tuple[str, Any]:
    """An agent asking the kubelet at ``socket_path``, with this process training job "bert" on GPU 0 (real
    /proc: our pid): its scrape once the job's pod is known, and the agent."""
    agent = agents(args=kubernetes_args(socket_path), env=state.env(), fixtures=False)
    state.update_gpu(0, processes=[{"pid": os.getpid(), "used_memory_bytes": 2**30}])
    reporter = Reporter(job="bert", worker="0", profiler=False, addr=f"unix:{agent.hook_socket}")
    try:
        with reporter.step(batch_size=8):
            pass
        reporter.flush()

        def labelled():
            text = agent.scrape()
            return text if metric_value(text, "tfprofd_training_pod_info", training_job="bert") == 1 else None

        return wait_for(labelled, 30, message="the training job's pod"), agent
    finally:
        reporter.close()


def test_parse_keeps_gpu_and_mig_devices_only():
    response = pb.ListPodResourcesResponse()
    train = response.pod_resources.add(name="bert-0", namespace="ml")
    c = train.containers.add(name="trainer")
    c.devices.add(resource_name="nvidia.com/gpu", device_ids=[GPU1, GPU0])
    c.devices.add(resource_name="example.com/fpga", device_ids=["fpga0"])
    c.devices.add(resource_name="nvidia.com/mig-1g.10gb", device_ids=[MIG])
    response.pod_resources.add(name="web", namespace="default").containers.add(name="nginx")
    devices = parse_pod_resources(response, KubernetesSettings())
    assert devices == (
        PodDevice(GPU0, "nvidia.com/gpu", "ml", "bert-0", "trainer"),
        PodDevice(GPU1, "nvidia.com/gpu", "ml", "bert-0", "trainer"),
        PodDevice(MIG, "nvidia.com/mig-1g.10gb", "ml", "bert-0", "trainer"),
    )


CLAIM = "0f6e4b1c-2d3a-4e5f-8a9b-0c1d2e3f4a5b"  # a ResourceClaim's UID, in the NVIDIA DRA driver's CDI names


def test_parse_reads_the_gpus_dra_allocated_in_every_naming_the_drivers_use():
    response = pb.ListPodResourcesResponse()
    c = response.pod_resources.add(name="bert-0", namespace="ml").containers.add(name="trainer")

    def dra(driver: str, device: str, *cdi: str) -> None:
        c.dynamic_resources.add(claim_name="gpus", claim_namespace="ml").claim_resources.add(
            driver_name=driver, pool_name="node-1", device_name=device, cdi_devices=[pb.CDIDevice(name=n) for n in cdi])

    # The NVIDIA DRA driver: devices named by the GPU's minor number, CDI names of its own.
    dra("gpu.nvidia.com", "gpu-3", f"k8s.gpu.nvidia.com/claim={CLAIM}-gpu-3")
    dra("gpu.nvidia.com", "gpu-2-mig-1g10gb-19-0", f"k8s.gpu.nvidia.com/claim={CLAIM}-gpu-2-mig-1g10gb-19-0")
    dra("", "", f"k8s.gpu.nvidia.com/claim={CLAIM}-gpu-7")  # a kubelet that sends no driver or device name
    dra("", "", "k8s.gpu.nvidia.com/device=gpu-6")  # the driver's older per-device CDI name
    # Drivers handing out nvidia-ctk's CDI devices: by UUID, MIG UUID, index, MIG index, type-index.
    dra("gpu.example.com", "dev-a", f"nvidia.com/gpu={GPU0}")
    dra("gpu.example.com", "dev-b", f"nvidia.com/gpu={MIG}")
    dra("gpu.example.com", "dev-c", "nvidia.com/gpu=1", "nvidia.com/gpu=mig4:2")
    dra("gpu.example.com", "dev-d", "nvidia.com/gpu=gpu5")
    dra("gpu.example.com", "dev-e", "nvidia.com/gpu=all")  # no single GPU: reported, not attributed
    dra("net.example.com", "eth1", "example.com/net=eth1")  # not a GPU
    dra("gpu.example.com", "gpu-9", "vendor.example.com/accel=gpu-9")  # gpu-<n> from a driver not named
    unknown: set[str] = set()
    devices = parse_pod_resources(response, KubernetesSettings(), unknown)
    pod = ("ml", "bert-0", "trainer")
    assert devices == (
        PodDevice("1", "gpu.example.com", *pod),
        PodDevice("4", "gpu.example.com", *pod, mig=True),
        PodDevice("5", "gpu.example.com", *pod),
        PodDevice(GPU0, "gpu.example.com", *pod),
        PodDevice(MIG, "gpu.example.com", *pod, mig=True),
        PodDevice("gpu-2-mig-1g10gb-19-0", "gpu.nvidia.com", *pod, minor=2, mig=True),
        PodDevice("gpu-3", "gpu.nvidia.com", *pod, minor=3),
        PodDevice("gpu-6", "gpu.nvidia.com", *pod, minor=6),
        PodDevice("gpu-7", "gpu.nvidia.com", *pod, minor=7),
    )
    assert unknown == {"nvidia.com/gpu=all"}
    # dra_drivers names which drivers' gpu-<n> devices are GPUs.
    assert [d.device_id for d in parse_pod_resources(response, KubernetesSettings(dra_drivers=re.compile("^$")))
            if d.minor is not None] == []


def kubernetes_args(socket_path, timeout: str = "1s") -> list[str]:
    return ["--collectors.kubernetes.enabled", "true", "--collectors.kubernetes.socket", str(socket_path),
            "--collectors.kubernetes.timeout", timeout]


def test_gpus_and_training_jobs_are_labelled_with_their_pods(agents, tmp_path, fakenvml):
    state = GpuState(tmp_path / "nvml.json", [gpu(0), gpu(1)])
    socket_path = tmp_path / "kubelet.sock"
    pods = {"bert-0": ("ml", {"trainer": {"nvidia.com/gpu": [GPU0]}}),
            "notebook": ("research", {"jupyter": {"nvidia.com/gpu": [GPU1], "cpu": ["0"]}}),
            "small": ("research", {"infer": {"nvidia.com/mig-1g.10gb": [MIG]}})}
    with FakeKubelet(socket_path, pods):
        text, _ = scrape_with_bert_training(agents, socket_path, state)
    assert metric_value(text, "tfprofd_collector_success", collector="kubernetes") == 1
    assert metric_value(text, "tfprofd_gpu_pod_info", gpu="0", uuid=GPU0, namespace="ml", pod="bert-0",
                        container="trainer") == 1
    assert metric_value(text, "tfprofd_gpu_pod_info", gpu="1", uuid=GPU1, namespace="research", pod="notebook",
                        container="jupyter") == 1
    # A MIG device the NVML snapshot does not list keeps its UUID; its GPU index is unknown.
    assert metric_value(text, "tfprofd_gpu_pod_info", gpu="", uuid=MIG, pod="small") == 1
    assert metric_value(text, "tfprofd_training_pod_info", training_job="bert", worker="0", namespace="ml",
                        pod="bert-0", container="trainer") == 1
    assert metric_value(text, "tfprofd_kubernetes_pod_devices", resource="nvidia.com/gpu") == 2
    assert metric_value(text, "tfprofd_kubernetes_pod_devices", resource="nvidia.com/mig-1g.10gb") == 1
    assert "cpu" not in {m for m in re.findall(r'resource="([^"]+)"', text)}


def test_gpus_that_dra_allocated_label_their_pods_and_jobs(agents, tmp_path, fakenvml):
    # The minor numbers (/dev/nvidiaN) are not the NVML indexes here: GPU 0 is nvidia1 and GPU 1 nvidia0.
    state = GpuState(tmp_path / "nvml.json", [gpu(0, minor_number=1), gpu(1, minor_number=0)])
    socket_path = tmp_path / "kubelet.sock"
    pods = {"bert-0": ("ml", {"trainer": {}}), "notebook": ("research", {"jupyter": {}}),
            "small": ("research", {"infer": {}}), "shell": ("research", {"sh": {}})}
    claims = {("bert-0", "trainer"): [("bert-0-gpu", "gpu.nvidia.com", "node-1", "gpu-1",
                                       [f"k8s.gpu.nvidia.com/claim={CLAIM}-gpu-1"])],
              ("notebook", "jupyter"): [("nb-gpu", "gpu.example.com", "node-1", "dev-a", [f"nvidia.com/gpu={GPU1}"])],
              ("small", "infer"): [("small-mig", "gpu.nvidia.com", "node-1", "gpu-0-mig-1g10gb-19-0",
                                    [f"k8s.gpu.nvidia.com/claim={CLAIM}-gpu-0-mig-1g10gb-19-0"])],
              ("shell", "sh"): [("all-gpus", "gpu.example.com", "node-1", "dev-all", ["nvidia.com/gpu=all"])]}
    with FakeKubelet(socket_path, pods, claims):
        text, agent = scrape_with_bert_training(agents, socket_path, state)
    # gpu-1 is minor 1: NVML's GPU 0, where the job trains.
    assert metric_value(text, "tfprofd_gpu_pod_info", gpu="0", uuid=GPU0, namespace="ml", pod="bert-0",
                        container="trainer") == 1
    assert metric_value(text, "tfprofd_training_pod_info", training_job="bert", worker="0", namespace="ml",
                        pod="bert-0", container="trainer") == 1
    assert metric_value(text, "tfprofd_gpu_pod_info", gpu="1", uuid=GPU1, namespace="research", pod="notebook",
                        container="jupyter") == 1
    # A MIG device of minor 0 (GPU 1): its GPU's index, not the GPU's UUID (the pod holds a part of it).
    assert metric_value(text, "tfprofd_gpu_pod_info", gpu="1", uuid="", namespace="research", pod="small",
                        container="infer") == 1
    assert metric_value(text, "tfprofd_kubernetes_pod_devices", resource="gpu.nvidia.com") == 2
    assert metric_value(text, "tfprofd_kubernetes_pod_devices", resource="gpu.example.com") == 1
    assert 'pod="shell"' not in text
    assert "CDI device nvidia.com/gpu=all names no single GPU" in agent.log()


def test_a_missing_or_slow_kubelet_fails_its_collector_alone(agents, tmp_path, fakenvml):
    state = GpuState(tmp_path / "nvml.json", [gpu(0)])
    socket_path = tmp_path / "kubelet.sock"
    agent = agents(args=kubernetes_args(socket_path, timeout="300ms"), env=state.env())

    def kubernetes_success(value: float):
        text = agent.scrape()
        return text if metric_value(text, "tfprofd_collector_success", collector="kubernetes") == value else None

    text = wait_for(lambda: kubernetes_success(0), 20, message="the kubelet's absence to show")
    assert metric_value(text, "tfprofd_gpu_utilization_ratio", gpu="0") == 0.95
    assert metric_value(text, "tfprofd_collector_success", collector="nvml") == 1
    assert "tfprofd_gpu_pod_info" not in text
    assert "collector kubernetes failed" in agent.log() and str(socket_path) in agent.log()

    with FakeKubelet(socket_path, {"bert-0": ("ml", {"trainer": {"nvidia.com/gpu": [GPU0]}})}) as kubelet:
        text = wait_for(lambda: kubernetes_success(1), 20, message="the kubelet to be found once it listens")
        assert metric_value(text, "tfprofd_gpu_pod_info", gpu="0", pod="bert-0") == 1

        kubelet.delay = 30  # slower than the 300 ms timeout: the sample fails, pods are no longer claimed
        text = wait_for(lambda: kubernetes_success(0), 20, message="a slow kubelet to fail the collector")
        assert "tfprofd_gpu_pod_info{" not in text
        assert metric_value(text, "tfprofd_gpu_utilization_ratio", gpu="0") == 0.95
        status, _ = http("GET", agent.url + "/metrics", timeout=2)  # a scrape never waits on the kubelet
        assert status == 200


def test_disabling_the_collector_on_reload_forgets_its_pods(agents, tmp_path, fakenvml):
    state = GpuState(tmp_path / "nvml.json", [gpu(0)])
    socket_path = tmp_path / "kubelet.sock"
    config = tmp_path / "tfprofd.yaml"
    enabled = f"collectors:\n  kubernetes:\n    enabled: true\n    socket: {socket_path}\n"
    config.write_text(enabled)
    with FakeKubelet(socket_path, {"bert-0": ("ml", {"trainer": {"nvidia.com/gpu": [GPU0]}})}):
        agent = agents(args=["--config", str(config)], env=state.env())
        wait_for(lambda: "tfprofd_gpu_pod_info{" in agent.scrape(), 20, message="the pod to show")
        config.write_text(enabled.replace("enabled: true", "enabled: false"))
        agent.signal(signal.SIGHUP)
        wait_for(lambda: "collector kubernetes disabled" in agent.log(), 10, message="the reload")
        # the kubelet still answers: only the registry's memory could keep the pod
        text = agent.scrape()
    assert "tfprofd_gpu_pod_info{" not in text
    assert metric_value(text, "tfprofd_collector_success", collector="kubernetes") is None
    assert metric_value(text, "tfprofd_gpu_utilization_ratio", gpu="0") == 0.95
