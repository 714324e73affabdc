"""Finding the agents with a worker of a job: from a real Prometheus scraping real agents on their own
loopback addresses (127.0.0.2-4), or from the static cluster.peers list; and the cluster options."""

from __future__ import annotations

import ipaddress
import socket
import time

import pytest

from tfprofd.daemon import config
from tfprofd.daemon.cluster import JobPeers, Peer, PeerFinder, Refused
from tfprofd.daemon.config import ClusterSettings
from tfprofd.daemon.errors import DiscoveryFailed, InvalidRequest
from tfprofd.exporter.hook import Reporter

from helpers import AgentProcess, free_port, http, start_prometheus, wait_for

pytestmark = pytest.mark.servers

LOOPBACK = [ipaddress.ip_network("127.0.0.0/8")]


def agent_on(tmp_path, host: str) -> AgentProcess:
    """A real agent whose metrics listener is on ``host`` (its own loopback address, as its own node)."""
    (tmp_path / host).mkdir()
    agent = AgentProcess(tmp_path / host)
    agent.args += ["--listen", f"{host}:{agent.port}"]  # the last --listen wins
    agent.start(wait=False)
    wait_for(lambda: _serves(f"http://{host}:{agent.port}/healthz", agent), 20, message=f"the agent on {host}")
    return agent


def _serves(url: str, agent: AgentProcess) -> bool:
    assert agent.proc.poll() is None, agent.log()
    try:
        return http("GET", url, timeout=1)[0] in (200, 503)
    except OSError:
        return False


@pytest.fixture
def cluster(tmp_path):
    """Three agents (127.0.0.2-4), job ring with worker-0 on .2 and worker-1 on .3, job other on .4, and
    Prometheus scraping them all; yields (prometheus URL, {host: agent})."""
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    agents, reporters, prometheus = {}, [], None
    try:
        for host in hosts:
            agents[host] = agent_on(tmp_path, host)
        for host, job, worker in (("127.0.0.2", "ring", "worker-0"), ("127.0.0.3", "ring", "worker-1"),
                                  ("127.0.0.4", "other", "worker-0")):
            reporter = Reporter(job=job, worker=worker, profiler=False, addr=f"127.0.0.1:{agents[host].hook_port}",
                                interval=0.2)
            reporter.phase = "train"
            reporters.append(reporter.start())
        prometheus, port = start_prometheus(tmp_path, [f"{h}:{a.port}" for h, a in agents.items()])
        yield f"http://127.0.0.1:{port}", agents
    finally:
        for reporter in reporters:
            reporter.close()
        if prometheus:
            prometheus.stop()
        for agent in agents.values():
            agent.stop()


def test_prometheus_names_the_agents_with_a_worker_of_the_job(cluster):
    url, agents = cluster
    finder = PeerFinder(ClusterSettings(prometheus_url=url), LOOPBACK, api_port=9848)
    def both() -> JobPeers | None:
        found = finder.find("ring")
        return found if len(found.peers) == 2 else None

    found = wait_for(both, 30, 0.5, message="both agents of job ring in Prometheus")
    two, three = agents["127.0.0.2"], agents["127.0.0.3"]
    assert found == JobPeers("ring", (Peer("127.0.0.2:9848", f"127.0.0.2:{two.port}", ("worker-0",)),
                                      Peer("127.0.0.3:9848", f"127.0.0.3:{three.port}", ("worker-1",))), ())
    # Only hosts inside alerts.forward_networks become peers; the rest are named with the reason.
    narrow = PeerFinder(ClusterSettings(prometheus_url=url), [ipaddress.ip_network("127.0.0.2/32")], 9848)
    assert narrow.find("ring") == JobPeers(
        "ring", (Peer("127.0.0.2:9848", f"127.0.0.2:{two.port}", ("worker-0",)),),
        (Refused(f"127.0.0.3:{three.port}", "127.0.0.3 is outside alerts.forward_networks"),))
    # Static peers are added as named (workers unknown until asked), each address once.
    both = PeerFinder(ClusterSettings(prometheus_url=url, peers=(("127.0.0.2", 9848), ("gpu-9", 9848))), LOOPBACK,
                      9848)
    assert [p.address for p in both.find("ring").peers] == ["127.0.0.2:9848", "127.0.0.3:9848", "gpu-9:9848"]
    # A job name is a value, never PromQL: a hostile one finds nothing (and no error).
    assert finder.find('ring"} or vector(1) or {x="').peers == ()
    assert finder.find("nobody").peers == ()
    for bad in ("", "x" * 257, "ring\n"):
        with pytest.raises(InvalidRequest):
            finder.find(bad)


def test_the_static_list_needs_no_prometheus():
    finder = PeerFinder(ClusterSettings(peers=(("10.0.0.5", 9848), ("::1", 9848))), [], 9848)
    assert finder.find("ring") == JobPeers("ring", (Peer("10.0.0.5:9848", "", ()), Peer("[::1]:9848", "", ())), ())


def test_a_prometheus_that_is_down_or_silent_fails_with_its_address():
    down = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(DiscoveryFailed, match=f"Prometheus at {down}: unreachable"):
        PeerFinder(ClusterSettings(prometheus_url=down), LOOPBACK, 9848).find("ring")
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(DiscoveryFailed, match=f"Prometheus at {url}: no answer within 0.3s"):
            PeerFinder(ClusterSettings(prometheus_url=url, timeout=0.3), LOOPBACK, 9848).find("ring")
        assert time.monotonic() - started < 10  # bounded by the timeout, not hanging


def test_a_url_that_is_not_prometheus_fails_clearly(cluster):
    _, agents = cluster
    agent = agents["127.0.0.2"]  # answers /api/v1/query with 404
    with pytest.raises(DiscoveryFailed, match="answered 404"):
        PeerFinder(ClusterSettings(prometheus_url=f"http://127.0.0.2:{agent.port}"), LOOPBACK, 9848).find("ring")


def test_cluster_options_by_flag_env_and_yaml_list(tmp_path):
    path = tmp_path / "tfprofd.yaml"
    path.write_text("cluster:\n  prometheus_url: http://prometheus:9090/\n  peers:\n    - gpu-1:9848\n"
                    "    - '[fd00::2]:9848'\n")
    cfg = config.load(str(path), env={})
    assert cfg.cluster.prometheus_url == "http://prometheus:9090"
    assert cfg.cluster.peers == (("gpu-1", 9848), ("fd00::2", 9848))
    assert config.load(None, env={"TFPROFD_CLUSTER_PEERS": "h1:1,h2:2"}).cluster.peers == (("h1", 1), ("h2", 2))
    assert config.load(None, env={}, flags={"cluster.peers": "h1:1, h1:1 ,h2:2"}).cluster.peers == (("h1", 1),
                                                                                                     ("h2", 2))
    assert config.load(None, env={}).cluster == ClusterSettings()
    for key, value, words in (("cluster.peers", "gpu-1", "host:port"), ("cluster.peers", ":9848", "host:port"),
                              ("cluster.peers", "gpu-1:0", "host:port"), ("cluster.peers", "bad host:1", "host name"),
                              ("cluster.prometheus_url", "prometheus:9090", "http://"),
                              ("cluster.prometheus_url", "http://u:p@prometheus:9090", "http://"),
                              ("cluster.prometheus_url", "http://prometheus:99999", "port"),
                              ("cluster.timeout", "0s", "cluster.timeout")):
        with pytest.raises(config.ConfigError, match=words):
            config.load(None, env={}, flags={key: value})
