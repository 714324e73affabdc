"""Job-wide capture end to end: three real agents on their own loopback addresses (127.0.0.2-4, one control
API port shared as on real nodes), a real Prometheus scraping them, and a TensorFlow job with one worker per
agent, one of them slowed by a sleep in its input. One request to any agent gives one record with every
worker, one window, and the slowed worker named with the part that grew."""

from __future__ import annotations

import json

import pytest

from helpers import AgentProcess, free_port, http, metric_value, start_prometheus, start_training, wait_for

pytestmark = [pytest.mark.tf, pytest.mark.servers]

TOKEN = "cluster-token"
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


@pytest.fixture
def cluster(tmp_path):
    """(agents by host, their control API port); Prometheus scrapes them, job ring has a worker on each."""
    api_port = free_port()
    agents = {host: AgentProcess(tmp_path / host) for host in HOSTS if not (tmp_path / host).mkdir()}
    workers, prometheus = [], None
    try:
        prometheus, prom_port = start_prometheus(tmp_path, [f"{h}:{a.port}" for h, a in agents.items()])
        for host, agent in agents.items():
            agent.env["TFPROFD_API_TOKEN"] = TOKEN
            agent.args += ["--listen", f"{host}:{agent.port}", "--api.listen", f"{host}:{api_port}",
                           "--captures.baseline", "false", "--alerts.forward-networks", "127.0.0.0/8",
                           "--alerts.host-value", host,
                           "--cluster.prometheus-url", f"http://127.0.0.1:{prom_port}"]
            agent.start(wait=False)
        for host, agent in agents.items():
            wait_for(lambda a=agent, h=host: _serves(a, h), 30, message=f"the agent on {host}")
        # One worker per agent; worker-1's input reads 10x slower.
        for i, host in enumerate(HOSTS):
            workers.append(start_training(agents[host].hook_port, "--job", "ring", "--worker", f"worker-{i}",
                                          "--seconds", "300", "--map-delay", "0.002" if i == 1 else "0.0002"))
        yield agents, api_port
    finally:
        for w in workers:
            w.kill()
            w.wait()
        if prometheus:
            prometheus.stop()
        for agent in agents.values():
            if agent.proc:
                agent.stop()


def _serves(agent: AgentProcess, host: str) -> bool:
    assert agent.proc.poll() is None, agent.log()
    try:
        return http("GET", f"http://{host}:{agent.port}/healthz", timeout=1)[0] in (200, 503)
    except OSError:
        return False


def _training(agents: dict[str, AgentProcess]) -> bool:
    return all(metric_value(http("GET", f"http://{h}:{a.port}/metrics")[1], "tfprofd_training_samples_per_second",
                            training_job="ring") for h, a in agents.items())


def test_one_request_to_any_agent_captures_every_worker_in_one_window_and_names_the_straggler(cluster):
    agents, api_port = cluster
    wait_for(lambda: _training(agents), 240, 1, message="the three workers to train")
    coordinator = HOSTS[2]  # any agent: here one without the straggler
    status, answer = http("POST", f"http://{coordinator}:{api_port}/api/v1/captures",
                          {"job": "ring", "scope": "job", "duration_ms": 2000}, token=TOKEN)
    assert status == 202, answer
    record = _final(agents, coordinator, api_port, answer["id"])
    print(json.dumps(record, indent=1))  # costs in README: requested_at -> start_at_ns -> finished_at
    _every_worker_and_the_straggler(record, api_port)

    # The same from the straggler alert, sent to another agent: it goes on to the straggler's node, whose agent
    # captures the whole job and compares the straggler with the median worker, over the same window.
    straggler_host = HOSTS[1]
    # Every agent has its next capture worker started again (the first capture used it): else, on a busy machine,
    # one starts cold after the instant and the windows are tens of ms apart (named in the record's `late`).
    wait_for(lambda: all(metric_value(http("GET", f"http://{h}:{a.port}/metrics")[1], "tfprofd_capture_worker_ready")
                         == 1 for h, a in agents.items()), 120, 0.5, message="every agent's capture worker")
    alert = {"status": "firing", "fingerprint": "tf1", "startsAt": "2026-11-24T18:00:00Z",
             "labels": {"alertname": "TfprofdStraggler", "job": "tfprofd", "training_job": "ring", "worker": "worker-1",
                        "instance": f"{straggler_host}:{agents[straggler_host].port}", "severity": "warning"}}
    status, outcome = http("POST", f"http://{HOSTS[0]}:{api_port}/api/v1/alerts",
                           {"version": "4", "status": "firing", "alerts": [alert]}, token=TOKEN)
    assert status == 200 and outcome["forwarded"][0]["to"] == f"{straggler_host}:{api_port}", outcome
    [record_id] = outcome["forwarded"][0]["answer"]["captures"]
    record = _final(agents, straggler_host, api_port, record_id)
    print(json.dumps(record, indent=1))
    assert (record["trigger"], record["suspect"]) == ("alert", "worker-1")
    _every_worker_and_the_straggler(record, api_port, local=straggler_host)
    compared = record["comparison"]
    assert (compared["worker"], compared["named_by"]) == ("worker-1", "alert") and compared["reference"] != "worker-1"
    before, after, _ = compared["comparison"]["step_ms"]
    assert after > 2 * before and compared["comparison"]["parts"][0]["part"] == "input_wait", compared  # 10x slower


def _final(agents: dict[str, AgentProcess], host: str, api_port: int, record_id: str) -> dict:
    def final():
        status, record = http("GET", f"http://{host}:{api_port}/api/v1/captures/{record_id}", token=TOKEN)
        assert status == 200, record
        return record if record["status"] != "running" else None

    record = wait_for(final, 400, 1, message="the job record")
    assert record["status"] == "done", (record["failed"], record["detail"], [a.log()[-2000:] for a in agents.values()])
    return record


def _every_worker_and_the_straggler(record: dict, api_port: int, local: str = HOSTS[2]) -> None:
    assert [w["worker"] for w in record["workers"]] == ["worker-0", "worker-1", "worker-2"], record
    assert {w["peer"] for w in record["workers"]} == {*(f"{h}:{api_port}" for h in HOSTS if h != local), "local"}
    assert all(w["steps"] > 0 for w in record["workers"]), record["workers"]
    assert record["window_skew_ms"] < 50, record["window_skew_ms"]
    straggler = record["straggler"]
    assert straggler and straggler["worker"] == "worker-1", record
    assert straggler["part"] in ("input_wait", "between_steps_input"), straggler
