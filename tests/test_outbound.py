"""The agent's own requests (to other agents and to Prometheus) against ends that misbehave: a redirect never
takes the shared token anywhere, a trickled answer ends at the deadline, and what is not HTTP or not strict
JSON is a named failure of that end, never an exception that escapes (a 500, a whole job record lost)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ipaddress
import json
import re
import socket
from types import SimpleNamespace

import pytest
from hostile_http import NESTED, HostileServer, json_body, not_http, redirect_to, trickle

from tfprofd.daemon import outbound
from tfprofd.daemon.cluster import PeerFinder
from tfprofd.daemon.config import ClusterSettings
from tfprofd.daemon.errors import DiscoveryFailed, ForwardFailed
from tfprofd.daemon.forwarding import AlertForwarder
from tfprofd.daemon.jobcapture import PeerClient, PeerError

TOKEN = "shared-cluster-token"
LOOPBACK = [ipaddress.ip_network("127.0.0.0/8")]


@pytest.fixture
def servers():
    started: list[HostileServer] = []

    def start(answer) -> HostileServer:
        started.append(HostileServer(answer))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def _client() -> PeerClient:
    return PeerClient(lambda: TOKEN, lambda: "127.0.0.1:1")


def _forwarder() -> AlertForwarder:
    return AlertForwarder(lambda: SimpleNamespace(forward_timeout=5.0), lambda: 1, lambda: TOKEN, lambda: "127.0.0.1:1")


def _finder(url: str, timeout: float = 5.0) -> PeerFinder:
    return PeerFinder(ClusterSettings(prometheus_url=url, timeout=timeout), LOOPBACK, 9848)


def test_a_redirect_is_never_followed_so_the_token_reaches_no_other_host(servers):
    elsewhere = servers(json_body(200, b'{"agent": "thief"}'))
    redirecting = servers(redirect_to(elsewhere.address))
    with pytest.raises(PeerError, match=r"answered 302, a redirect to .* which is not followed"):
        _client().call(redirecting.address, "GET", "/peer")
    answer = _forwarder().forward(redirecting.address, {"version": "4"}, [{"labels": {}}])
    assert answer == {"to": redirecting.address, "status": 302}  # not forwarded on, not retried
    with pytest.raises(DiscoveryFailed, match="answered 302, a redirect"):
        _finder(f"http://{redirecting.address}").find("ring")
    assert [auth for _, _, auth in redirecting.seen] == [f"Bearer {TOKEN}", f"Bearer {TOKEN}", ""]
    assert elsewhere.seen == []


def test_an_answer_trickled_a_byte_at_a_time_ends_at_the_deadline(servers):
    """Each byte comes well within any per-read timeout; the whole answer would take 5,000 s."""
    slow = servers(trickle(0.5))
    calls = {
        "peer": lambda: _client().call(slow.address, "GET", "/captures/x", timeout=1.0),
        "forward": lambda: _forwarder().forward(slow.address, {"version": "4"}, []),
        "prometheus": lambda: _finder(f"http://{slow.address}", timeout=1.0).find("ring"),
    }
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        _, pending = concurrent.futures.wait(futures.values(), timeout=60)
        assert not pending, [name for name, f in futures.items() if f in pending]
    for future in futures.values():
        with pytest.raises((PeerError, ForwardFailed, DiscoveryFailed), match="no answer within"):
            future.result()


@pytest.mark.parametrize("answer", [not_http(), json_body(200, NESTED), json_body(200, b'{"agent": NaN}')],
                         ids=["ssh banner", "nested 100,000 deep", "NaN"])
def test_what_is_not_a_tfprofd_answer_is_a_named_failure_of_that_end(servers, answer):
    end = servers(answer)
    with pytest.raises(PeerError, match=r"not an HTTP answer|not a tfprofd answer"):
        _client().call(end.address, "GET", "/peer")
    with pytest.raises(DiscoveryFailed, match=re.escape(f"Prometheus at http://{end.address}")):
        _finder(f"http://{end.address}").find("ring")
    try:
        forwarded = _forwarder().forward(end.address, {"version": "4"}, [])
    except ForwardFailed as exc:  # not HTTP: the receiving agent is not there; Alertmanager sends again
        assert "not an HTTP answer" in exc.reason
    else:  # an answer that is not JSON as the agents write it is not passed on
        assert forwarded == {"to": end.address, "status": 200}


def test_strict_json_refuses_what_strict_parsers_refuse():
    assert outbound.strict_json(b'{"a": [1.5, -2]}') == {"a": [1.5, -2]}
    for text in (b"NaN", b'{"a": Infinity}', b"[-Infinity]", NESTED, b"\xff"):
        with pytest.raises(ValueError):
            outbound.strict_json(text)


def test_an_answer_is_read_up_to_its_bound_and_said_in_a_bounded_line(servers):
    huge = servers(json_body(409, json.dumps({"error": "x" * 4_000_000}).encode()))
    status, body, _ = outbound.request(f"http://{huge.address}/", timeout=30, max_bytes=1000)
    assert status == 409 and len(body) == 1001
    line = outbound.said({"error": "x" * 4_000_000})
    assert len(line) < 400 and line.endswith("(4000000 characters)")



def test_a_name_whose_first_address_drops_connections_reaches_the_next(servers, monkeypatch):
    """A dual-stack name behind a firewall that drops one family: each address gets the timeout to connect
    (as urllib gave it), and the deadline counts the answer from the connection that was made."""
    live = servers(json_body(200, b'{"agent": "a"}'))
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(0)
    filling = []
    for _ in range(4):  # a full backlog: a further connection's SYN is dropped, its connect waits
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(blackhole.getsockname())
        filling.append(s)
    addresses = [blackhole.getsockname(), ("127.0.0.1", int(live.address.rpartition(":")[2]))]
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *args, **kw: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", a) for a in addresses] if host == "dual.test"
        else real(host, *args, **kw))
    try:
        answer = outbound.request("http://dual.test:1/api/v1/peer", timeout=1.0, max_bytes=1000)
        assert (answer.status, answer.body) == (200, b'{"agent": "a"}')
    finally:
        for s in (*filling, blackhole):
            s.close()



@pytest.mark.parametrize("url", ["http://a b:9090/api/v1/query", "http://[fe80::abcd]/api/v1/query"])
def test_a_url_that_cannot_be_asked_is_a_named_failure(url):
    """http.client's InvalidURL escaped (a host with a space), and an IPv6 address without a port was asked at
    host ':' (its last part read as the port)."""
    with pytest.raises(outbound.OutboundError):
        outbound.request(url, timeout=1.0, max_bytes=100)
    with pytest.raises(DiscoveryFailed, match="Prometheus at"):
        _finder(url.rsplit("/api/v1/query", 1)[0], timeout=1.0).find("ring")
