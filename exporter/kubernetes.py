"""Kubernetes collector: which pod holds which GPU, from the kubelet's PodResources API.

The kubelet serves ``v1.PodResourcesLister`` over gRPC on a unix socket
(``/var/lib/kubelet/pod-resources/kubelet.sock``; mount the directory, not the socket, so a kubelet
restart that recreates the socket is seen). ``List`` returns every pod's containers and the devices the
device plugins gave them: ``nvidia.com/gpu`` with GPU UUIDs, ``nvidia.com/mig-<profile>`` with ``MIG-``
UUIDs. The collector keeps the GPU devices as a ``PodDevices`` fact; the job registry joins it with
NVML's GPUs (``tfprofd_gpu_pod_info``) and the training jobs on them. A kubelet that is unreachable or
slower than ``timeout`` fails this collector alone; every other metric stays.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from .base import Collector, Environment, gauge
from .options import option, parse_bool, parse_duration, parse_regex, parse_str

LIST_METHOD = "/v1.PodResourcesLister/List"
MAX_RESPONSE_BYTES = 16 * 1024 * 1024  # kubelet's own limit for this API


@dataclass(frozen=True)
class PodDevice:
    """One device a container holds: ``device_id`` as the device plugin names it (a GPU or MIG UUID, or an
    index when the plugin runs with ``DEVICE_ID_STRATEGY=index``)."""

    device_id: str
    resource: str
    namespace: str
    pod: str
    container: str


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


def parse_pod_resources(response: Any, resources: re.Pattern[str]) -> tuple[PodDevice, ...]:
    """The GPU devices of a ``ListPodResourcesResponse``, sorted and without duplicates."""
    found = {
        PodDevice(device_id, devices.resource_name, pod.namespace, pod.name, container.name)
        for pod in response.pod_resources
        for container in pod.containers
        for devices in container.devices
        if resources.match(devices.resource_name)
        for device_id in devices.device_ids
    }
    return tuple(sorted(found, key=lambda d: (d.device_id, d.namespace, d.pod, d.container)))


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
        self._devices = parse_pod_resources(response, self.settings.resources)
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
