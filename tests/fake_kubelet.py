"""A kubelet PodResources endpoint for tests: a real gRPC server speaking the real ``v1`` proto on a unix
socket, as the kubelet serves it (simulated at its real boundary, like the fake NVML)."""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path

import grpc

from tfprofd.exporter.protos import podresources_pb2 as pb

# pod -> (namespace, {container: {resource: [device ids]}})
Pods = dict[str, tuple[str, dict[str, dict[str, list[str]]]]]
# (pod, container) -> the devices DRA allocated it: (claim, driver, pool, device, [CDI device names]) each
Claims = dict[tuple[str, str], list[tuple[str, str, str, str, list[str]]]]


class FakeKubelet:
    def __init__(self, socket_path: Path, pods: Pods | None = None, claims: Claims | None = None):
        self.socket_path = socket_path
        self.pods: Pods = pods or {}
        self.claims: Claims = claims or {}
        self.delay = 0.0  # seconds each List takes (a slow kubelet)
        self.calls = 0
        self._release = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.unary_unary_rpc_method_handler(
            self._list, request_deserializer=pb.ListPodResourcesRequest.FromString,
            response_serializer=pb.ListPodResourcesResponse.SerializeToString)
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("v1.PodResourcesLister", {"List": handler})])
        self.server.add_insecure_port(f"unix://{socket_path}")

    def _list(self, request: pb.ListPodResourcesRequest, context: grpc.ServicerContext) -> pb.ListPodResourcesResponse:
        self.calls += 1
        if self.delay:
            self._release.wait(self.delay)
        response = pb.ListPodResourcesResponse()
        for pod, (namespace, containers) in self.pods.items():
            p = response.pod_resources.add(name=pod, namespace=namespace)
            for container, resources in containers.items():
                c = p.containers.add(name=container, cpu_ids=[2, 3])
                for resource, ids in resources.items():
                    c.devices.add(resource_name=resource, device_ids=ids)
                for claim, driver, pool, device, cdi in self.claims.get((pod, container), []):
                    c.dynamic_resources.add(claim_name=claim, claim_namespace=namespace).claim_resources.add(
                        driver_name=driver, pool_name=pool, device_name=device,
                        cdi_devices=[pb.CDIDevice(name=name) for name in cdi])
        return response

    def __enter__(self) -> FakeKubelet:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self.server.stop(grace=None)
