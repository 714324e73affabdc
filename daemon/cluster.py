"""Where a training job's workers are: the agents that have a worker of it, for a job-wide capture.

From Prometheus (``cluster.prometheus_url``): the agents' own ``tfprofd_training_up`` series of the job
(1: it reported lately) name each agent by its ``instance`` (``host:metrics port``) and its workers; the
agent's control API is at that host and ``api_port``. Only hosts that are IP addresses inside
``alerts.forward_networks`` become peers (what Prometheus says cannot send the agent anywhere else); the
others are returned as refused, with the reason. The static list (``cluster.peers``, control API
``host:port``s, trusted as named) is for hosts without Prometheus: every peer there is returned, its
workers unknown until it is asked. Both may be set: the union, each address once.
"""

from __future__ import annotations

import ipaddress
import json
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import outbound
from .config import ClusterSettings
from .errors import DiscoveryFailed, InvalidRequest

MAX_ANSWER_BYTES = 8 * 1024 * 1024
MAX_JOB_NAME = 256
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Peer:
    """An agent with (or, from the static list, maybe with) workers of the job."""

    address: str  # its control API, host:port ([v6]:port)
    instance: str  # its Prometheus instance label; "" for a static peer
    workers: tuple[str, ...]  # the job's workers Prometheus saw there; () for a static peer


@dataclass(frozen=True)
class Refused:
    instance: str
    why: str


@dataclass(frozen=True)
class JobPeers:
    job: str
    peers: tuple[Peer, ...]
    refused: tuple[Refused, ...]


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_instance(instance: str) -> tuple[str, str]:
    """(host, port) of ``host:port`` or ``[v6]:port``."""
    if instance.startswith("["):
        host, _, port = instance[1:].partition("]:")
        return host, port
    host, _, port = instance.rpartition(":")
    return host, port


class PeerFinder:
    def __init__(self, settings: ClusterSettings, networks: Sequence[Network], api_port: int):
        self.settings = settings
        self.networks = tuple(networks)
        self.api_port = api_port

    def find(self, job: str) -> JobPeers:
        """The agents with a worker of ``job``. Raises InvalidRequest for a job name that cannot be one,
        DiscoveryFailed when Prometheus is set but does not answer usefully."""
        if not job or len(job) > MAX_JOB_NAME or not job.isprintable():
            raise InvalidRequest(f"a job name is 1-{MAX_JOB_NAME} printable characters")
        peers: dict[str, Peer] = {}
        refused: list[Refused] = []
        if self.settings.prometheus_url:
            for instance, workers in sorted(self._query(job).items()):
                peer = self._peer(instance, workers)
                if isinstance(peer, Refused):
                    refused.append(peer)
                else:
                    peers.setdefault(peer.address, peer)
        for host, port in self.settings.peers:
            address = _address(host, port)
            peers.setdefault(address, Peer(address, "", ()))
        return JobPeers(job, tuple(peers.values()), tuple(refused))

    def _peer(self, instance: str, workers: tuple[str, ...]) -> Peer | Refused:
        host, _ = _split_instance(instance)
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return Refused(instance, "its instance label is not an IP address (and Prometheus's labels choose no "
                                     "address outside alerts.forward_networks)")
        if not any(ip in network for network in self.networks):
            return Refused(instance, f"{ip} is outside alerts.forward_networks")
        return Peer(_address(str(ip), self.api_port), instance, workers)

    def _query(self, job: str) -> dict[str, tuple[str, ...]]:
        """instance -> the job's workers up there, from Prometheus's instant query."""
        promql = f"max by (instance, worker) (tfprofd_training_up{{training_job={json.dumps(job)}}} == 1)"
        url = f"{self.settings.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        where = f"Prometheus at {self.settings.prometheus_url}"
        try:  # as the agents are asked (outbound): no proxy, no redirect, one deadline for the whole answer
            status, body, location = outbound.request(url, timeout=self.settings.timeout, max_bytes=MAX_ANSWER_BYTES)
        except outbound.OutboundError as exc:
            raise DiscoveryFailed(f"{where}: {exc}") from None
        if 300 <= status < 400:
            raise DiscoveryFailed(f"{where} answered {status}, a redirect to {str(location)[:200]!r}: set "
                                  "cluster.prometheus_url to where Prometheus answers")
        if status != 200:
            raise DiscoveryFailed(f"{where} answered {status}: {body[:500].decode(errors='replace')}")
        if len(body) > MAX_ANSWER_BYTES:
            raise DiscoveryFailed(f"{where} sent more than {MAX_ANSWER_BYTES} bytes for one job")
        try:
            answer: Any = outbound.strict_json(body)
            result = answer["data"]["result"] if answer.get("status") == "success" else None
            if not isinstance(result, list):
                raise ValueError(answer.get("error", "no result"))
            found: dict[str, set[str]] = {}
            for series in result:
                labels = series["metric"]
                found.setdefault(str(labels["instance"]), set()).add(str(labels.get("worker", "")))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DiscoveryFailed(f"{where} sent an answer that is not a query result: {exc}") from None
        return {instance: tuple(sorted(workers)) for instance, workers in found.items()}
