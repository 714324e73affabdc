"""Kubernetes collector: which pod holds which GPU, from the kubelet's PodResources API.

The kubelet serves ``v1.PodResourcesLister`` over gRPC on a unix socket
(``/var/lib/kubelet/pod-resources/kubelet.sock``; mount the directory, not the socket, so a kubelet
restart that recreates the socket is seen). ``List`` returns every pod's containers and the devices the
device plugins gave them: ``nvidia.com/gpu`` with GPU UUIDs, ``nvidia.com/mig-<profile>`` with ``MIG-``
UUIDs; and the devices Dynamic Resource Allocation gave them (``dynamic_resources``, stable in Kubernetes
1.35): each claim's devices by driver, pool and device name, with their CDI device names. A DRA GPU is
read from a CDI name of kind ``nvidia.com/gpu`` (nvidia-ctk's names: ``GPU-``/``MIG-`` UUIDs, indexes
``0``, ``0:1``, ``gpu0``, ``mig0:1``), else, for the NVIDIA DRA driver (``gpu.nvidia.com``), from its
device name ``gpu-<minor>`` or ``gpu-<minor>-mig-...`` (or its CDI names ``k8s.gpu.nvidia.com/device=gpu-<minor>``
and ``k8s.gpu.nvidia.com/claim=<claim uid>-gpu-<minor>``), which the job registry maps to NVML's GPU
by its minor number. The collector keeps the GPU devices as a ``PodDevices`` fact; the job registry joins it with
NVML's GPUs (``tfprofd_gpu_pod_info``) and the training jobs on them. A kubelet that is unreachable or
slower than ``timeout`` fails this collector alone; every other metric stays.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from .base import Collector, Environment, gauge
from .options import option, parse_bool, parse_duration, parse_regex, parse_str

log = logging.getLogger(__name__)

LIST_METHOD = "/v1.PodResourcesLister/List"
MAX_RESPONSE_BYTES = 16 * 1024 * 1024  # kubelet's own limit for this API


@dataclass(frozen=True)
class PodDevice:
    """One device a container holds: ``device_id`` as the device plugin or the DRA CDI name gives it (a GPU
    or MIG UUID, or a GPU index, also for a MIG device named by index), or, with ``minor``, the DRA device
    name of a GPU or MIG device named by its GPU's minor number. ``mig``: a MIG device (part of the GPU)."""

    device_id: str
    resource: str
    namespace: str
    pod: str
    container: str
    minor: int | None = None
    mig: bool = False


@dataclass(frozen=True)
class PodDevices:
    devices: tuple[PodDevice, ...]


@dataclass(frozen=True)
class KubernetesSettings:
    enabled: bool = option(False, parse_bool, "Label GPUs with the pods that hold them, from the kubelet's "
                           "PodResources API.")
    socket: str = option("/var/lib/kubelet/pod-resources/kubelet.sock", parse_str,
                         "The kubelet's PodResources socket.")
    timeout: float = option(2.0, parse_duration, "How long one List call may take before the sample fails.",
                            minimum=0.05, maximum=60)
    resources: re.Pattern[str] = option(re.compile(r"^nvidia\.com/(gpu|mig-.+)$"), parse_regex,
                                        "Resource names that are GPUs (device plugin and MIG resources).")
    dra_drivers: re.Pattern[str] = option(re.compile(r"^gpu\.nvidia\.com$"), parse_regex,
                                          "DRA drivers that name GPUs gpu-<minor> (the NVIDIA DRA driver); a "
                                          "CDI device of kind nvidia.com/gpu is a GPU whatever its driver.")


CDI_GPU_KIND = "nvidia.com/gpu"
CDI_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Fa-f-]+$")
CDI_INDEX = re.compile(r"^(?:gpu)?(\d+)$|^(?:mig)?(\d+):\d+$")  # 0, gpu0; a MIG device: 0:1, mig0:1
DRA_DEVICE = re.compile(r"^gpu-(\d+)(-mig-.+)?$")  # the NVIDIA DRA driver's gpu-<minor>[-mig-...]
DRA_CDI = re.compile(r"^k8s\.(?P<driver>[^/]+)/(?:device=|claim=[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}-)"
                     r"(?P<device>gpu-\d+(?:-mig-.+)?)$")


def parse_pod_resources(response: Any, settings: KubernetesSettings,
                        unknown: set[str] | None = None) -> tuple[PodDevice, ...]:
    """The GPU devices of a ``ListPodResourcesResponse``, sorted and without duplicates. The CDI names of
    kind nvidia.com/gpu that name no single GPU (``all``, or unknown forms) are added to ``unknown``."""
    found = {
        PodDevice(device_id, devices.resource_name, pod.namespace, pod.name, container.name)
        for pod in response.pod_resources
        for container in pod.containers
        for devices in container.devices
        if settings.resources.match(devices.resource_name)
        for device_id in devices.device_ids
    }
    for pod in response.pod_resources:
        for container in pod.containers:
            for claim in container.dynamic_resources:
                for resource in claim.claim_resources:
                    for device_id, driver, minor, mig in _dra_gpus(resource, settings.dra_drivers, unknown):
                        found.add(PodDevice(device_id, driver, pod.namespace, pod.name, container.name, minor, mig))
    return tuple(sorted(found, key=lambda d: (d.device_id, d.namespace, d.pod, d.container, d.resource)))


def _dra_gpus(resource: Any, drivers: re.Pattern[str],
              unknown: set[str] | None) -> list[tuple[str, str, int | None, bool]]:
    """(device id, driver, minor, mig) of each GPU one DRA device is: from its nvidia.com/gpu CDI names, else
    from the NVIDIA DRA driver's device name (or, from a kubelet that does not send it, its CDI name)."""
    names = [cdi.name for cdi in resource.cdi_devices]
    gpus = []
    for name in names:
        kind, _, device = name.partition("=")
        if kind != CDI_GPU_KIND:
            continue
        driver = resource.driver_name or CDI_GPU_KIND
        if CDI_UUID.match(device):
            gpus.append((device, driver, None, device.startswith("MIG-")))
        elif index := CDI_INDEX.match(device):
            gpus.append((index[1] or index[2], driver, None, index[2] is not None))
        elif unknown is not None:
            unknown.add(name)
    if gpus:
        return gpus
    candidates = [(resource.driver_name, resource.device_name)] + [
        (m["driver"], m["device"]) for m in map(DRA_CDI.match, names) if m]
    for driver, device in candidates:
        if driver and drivers.match(driver) and (named := DRA_DEVICE.match(device)):
            return [(device, driver, int(named[1]), named[2] is not None)]
    return []


class KubernetesCollector(Collector):
    name = "kubernetes"
    section = "collectors.kubernetes"
    Settings = KubernetesSettings

    def __init__(self, settings: KubernetesSettings, env: Environment):
        super().__init__(settings, env)
        self._channel: Any = None
        self._channel_socket = ""
        self._list: Any = None
        self._request: Any = None
        self._devices: tuple[PodDevice, ...] | None = None
        self._unknown: set[str] = set()  # CDI names already logged

    def _lister(self) -> Any:
        """The List call on a channel to the configured socket (grpc is imported only when enabled)."""
        socket = self.settings.socket
        if self._channel is None or self._channel_socket != socket:
            import grpc

            from .protos import podresources_pb2 as pb

            self.close()
            self._channel = grpc.insecure_channel(
                f"unix://{socket}", options=[("grpc.max_receive_message_length", MAX_RESPONSE_BYTES)])
            self._channel_socket = socket
            self._list = self._channel.unary_unary(
                LIST_METHOD, request_serializer=pb.ListPodResourcesRequest.SerializeToString,
                response_deserializer=pb.ListPodResourcesResponse.FromString)
            self._request = pb.ListPodResourcesRequest()
        return self._list

    def sample(self) -> bool:
        import grpc

        try:
            response = self._lister()(self._request, timeout=self.settings.timeout)
        except grpc.RpcError as exc:
            code = exc.code().name if exc.code() else "UNKNOWN"
            raise OSError(f"kubelet PodResources List on {self.settings.socket}: {code}: {exc.details()}") from None
        unknown: set[str] = set()
        self._devices = parse_pod_resources(response, self.settings, unknown)
        for name in sorted(unknown - self._unknown):
            log.warning("kubelet PodResources: CDI device %s names no single GPU; its container's GPUs are not "
                        "attributed to its pod", name)
        self._unknown |= unknown
        return True

    def clear(self) -> None:
        self._devices = None

    def facts(self) -> tuple[PodDevices, ...]:
        return () if self._devices is None else (PodDevices(self._devices),)

    def collect(self) -> Iterator[Metric]:
        if self._devices is None:
            return
        per_resource = Counter(d.resource for d in self._devices)
        yield gauge("kubernetes_pod_devices", "GPU devices the kubelet has assigned to containers, by resource.",
                    ["resource"], (((resource,), n) for resource, n in sorted(per_resource.items())))

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
