"""Alerts reach the right node: an agent forwards an alert for another host to that host's agent, which
captures it once; forwarding never loops and never leaves the configured networks."""

from __future__ import annotations

import json
import socket

from tfprofd.exporter.hook import Reporter

from helpers import AgentProcess, free_port, http, reports_socket, wait_for

TOKEN = "shared-token-of-every-agent"


def _alert(instance: str, fingerprint: str = "f1") -> dict:
    return {"version": "4", "status": "firing", "receiver": "tfprofd", "alerts": [{
        "status": "firing", "labels": {"alertname": "TfprofdGpuUnderutilized", "instance": instance,
                                       "training_job": "bert"},
        "annotations": {}, "startsAt": "2026-11-21T10:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
        "fingerprint": fingerprint}]}


def _agent(tmp, name: str, host: str, forward_port: int, api_port: int | None = None) -> AgentProcess:
    (tmp / name).mkdir()
    agent = AgentProcess(tmp / name, env={"TFPROFD_API_TOKEN": TOKEN})
    if api_port is not None:
        agent.api_port = api_port
    agent.args += ["--api.listen", f"{host}:{agent.api_port}", "--alerts.host-value", host,
                   "--alerts.forward-networks", "127.0.0.0/8", "--alerts.forward-port", str(forward_port)]
    return agent


def _post(host: str, port: int, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://{host}:{port}/api/v1/alerts", data=json.dumps(body).encode(),
                                     method="POST", headers={"Authorization": f"Bearer {TOKEN}", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _captures(host: str, port: int) -> list[dict]:
    status, answer = http("GET", f"http://{host}:{port}/api/v1/captures", token=TOKEN)
    assert status == 200, answer
    return answer["captures"]


def test_an_alert_posted_to_one_agent_is_captured_once_by_the_agent_of_its_node(tmp_path):
    b_port = free_port()
    a = _agent(tmp_path, "a", "127.0.0.1", forward_port=b_port)
    b = _agent(tmp_path, "b", "127.0.0.2", forward_port=b_port, api_port=b_port)
    a.start()
    b.start()
    try:
        # A job trains on node B (its profiler port closes once it reported: the capture starts and fails, recorded).
        report = Reporter(job="bert", worker="0", profiler=False, addr=f"127.0.0.1:{b.hook_port}").report()
        with reports_socket() as s, socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            report.update(pid=4242, process_start=1.0, seq=1, time=1.0, phase="train",
                          profiler=f"127.0.0.1:{server.getsockname()[1]}")
            s.sendto(json.dumps(report).encode(), ("127.0.0.1", b.hook_port))
            wait_for(lambda: "training_job=\"bert\"" in b.scrape(), 20, message="the job to report to B")

        # Alertmanager posts to the Service, which picked A; A hands the alert to B.
        status, answer = _post("127.0.0.1", a.api_port, _alert("127.0.0.2:9847"))
        assert status == 200, answer
        [forwarded] = answer["forwarded"]
        assert forwarded["to"] == f"127.0.0.2:{b_port}" and len(forwarded["answer"]["captures"]) == 1, answer
        # Alertmanager's repeat goes to A again (or straight to B): B remembers it, nobody captures twice.
        status, answer = _post("127.0.0.1", a.api_port, _alert("127.0.0.2:9847"))
        assert answer["forwarded"][0]["answer"]["ignored"] == [
            {"alert": "TfprofdGpuUnderutilized", "why": "already handled"}], answer
        status, answer = _post("127.0.0.2", b_port, _alert("127.0.0.2:9847"))
        assert status == 200 and answer["ignored"][0]["why"] == "already handled", answer
        assert [c["trigger"] for c in _captures("127.0.0.2", b_port)] == ["alert"]
        assert _captures("127.0.0.1", a.api_port) == []
        assert "forwarded alerts TfprofdGpuUnderutilized to the agent at 127.0.0.2" in a.log()

        # A forwarded alert is never forwarded again, even when the receiver thinks it is for someone else.
        status, answer = _post("127.0.0.2", b_port, _alert("127.0.0.1:9847", "f2"),
                               headers={"X-Tfprofd-Forwarded-By": "127.0.0.9"})
        assert status == 200 and answer["forwarded"] == [], answer
        assert "never forwarded twice" in answer["ignored"][0]["why"]

        # An agent that cannot be reached: 503, so Alertmanager sends again later.
        status, answer = _post("127.0.0.1", a.api_port, _alert("127.0.0.3:9847", "f3"))
        assert status == 503 and "unreachable" in answer["retry"][0]["why"], answer

        # Outside alerts.forward_networks (or a DNS name): ignored, the token never leaves.
        for instance in ("10.1.2.3:9847", "evil.example.com:9847"):
            status, answer = _post("127.0.0.1", a.api_port, _alert(instance, "f4"))
            assert status == 200 and answer["forwarded"] == [], answer
            assert answer["ignored"] == [{"alert": "TfprofdGpuUnderutilized", "why": "another host"}]
    finally:
        a.stop()
        b.stop()
