"""Job-wide capture against lightweight peers (tests/fake_agent.py speaks the peer API): one instant for
every peer, one job record with every worker and the straggler, and the faults: a peer down, a peer with
another token, a peer that answers late, a job that ends mid-capture, a forged job-wide request."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.request

import pytest
from fake_agent import FakeAgent, FakeWorker
from hostile_http import NESTED, HostileServer, json_body, not_http, redirect_to, send

from tfprofd.daemon.jobcapture import LOCAL, JobRecord, conclude, worker_results

from helpers import AgentProcess, Server, free_port, http, wait_for

pytestmark = pytest.mark.servers

TOKEN = "shared-cluster-token"


def fake(workers: list[FakeWorker], **kw) -> FakeAgent:
    return FakeAgent("127.0.0.1", free_port(), kw.pop("token", TOKEN), workers, **kw).start()


@pytest.fixture
def coordinator(tmp_path):
    """A real agent with no worker of its own and the static peer list given by the test."""
    agents: list[AgentProcess] = []
    fakes: list[FakeAgent] = []

    def start(peers: list[FakeAgent], more: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> AgentProcess:
        fakes.extend(peers)
        args = ["--captures.baseline", "false", "--cluster.timeout", "10s", *extra]  # pings on a busy test machine
        if peers:
            args += ["--cluster.peers", ",".join([*(f"{p.host}:{p.port}" for p in peers), *more])]
        agent = AgentProcess(tmp_path, args=args, env={"TFPROFD_API_TOKEN": TOKEN}).start()
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        agent.stop()
    for peer in fakes:
        peer.stop()


def job_record(agent: AgentProcess, record_id: str) -> dict:
    def final():
        status, record = http("GET", f"{agent.api}/captures/{record_id}", token=TOKEN)
        assert status == 200, record
        return record if record["status"] != "running" else None

    return wait_for(final, 60, 0.2, message=f"job record {record_id}")


def partial_failures(agent: AgentProcess, traced: list[str]) -> dict[str, str]:
    """Ask ``agent`` for a job-wide capture of "ring"; the record must end partial with ``traced`` workers: its
    failed peers, with why."""
    status, answer = http("POST", f"{agent.api}/captures", {"job": "ring", "scope": "job"}, token=TOKEN)
    assert status == 202, answer
    record = job_record(agent, answer["id"])
    assert record["status"] == "partial", record
    assert [w["worker"] for w in record["workers"]] == traced
    why = {f["peer"]: f["why"] for f in record["failed"]}
    assert all(name in record["detail"] for name in why)
    return why


def test_one_request_one_instant_one_record_with_every_worker_and_the_straggler(coordinator):
    peers = [fake([FakeWorker("worker-0", 10.0)]), fake([FakeWorker("worker-1", 10.4)]),
             fake([FakeWorker("worker-2", 16.0, input_wait_ms=7.0)])]
    agent = coordinator(peers)
    status, answer = http("POST", f"{agent.api}/captures", {"job": "ring", "scope": "job"}, token=TOKEN)
    assert status == 202, answer
    record = job_record(agent, answer["id"])
    assert record["status"] == "done", record
    assert [w["worker"] for w in record["workers"]] == ["worker-0", "worker-1", "worker-2"]
    # Every peer was asked for the same instant, and before it came.
    instants = {start for p in peers for _, start in p.asked}
    assert instants == {record["start_at_ns"]}
    assert all(when < record["start_at_ns"] / 1e9 for p in peers for when, _ in p.asked)
    assert record["window_skew_ms"] == 0.0
    straggler = record["straggler"]
    assert (straggler["worker"], straggler["part"]) == ("worker-2", "input_wait")
    assert straggler["delta_ms"] == pytest.approx(6.0)
    assert record["failed"] == [] and len(record["captures"]) == 3
    # The straggler against the median of the others (worker-0, by step time), part by part, in the record.
    compared = record["comparison"]
    assert (compared["worker"], compared["reference"], compared["named_by"]) == ("worker-2", "worker-0", "trace")
    parts = {p["part"]: p["delta_ms"] for p in compared["comparison"]["parts"]}
    assert parts["input_wait"] == pytest.approx(6.0) and compared["comparison"]["step_ms"] == [10.0, 16.0, 6.0]
    assert compared["summary"] in record["detail"]


def test_faults_are_named_in_a_partial_record(coordinator):
    good = fake([FakeWorker("worker-0")])
    other_token = fake([FakeWorker("worker-1")], token="another-token")
    late = fake([FakeWorker("worker-2")], answer_delay=20.0)
    ended = fake([FakeWorker("worker-3")], outcome="died")
    down_port = free_port()
    agent = coordinator([good, other_token, late, ended], (f"127.0.0.1:{down_port}",))
    why = partial_failures(agent, ["worker-0"])
    assert set(why) == {f"127.0.0.1:{p}" for p in (other_token.port, late.port, ended.port, down_port)}
    assert "unreachable" in why[f"127.0.0.1:{down_port}"]
    assert "refused the shared token (401)" in why[f"127.0.0.1:{other_token.port}"]
    assert "not asked in time" in why[f"127.0.0.1:{late.port}"]
    assert "died during the capture" in why[f"127.0.0.1:{ended.port}"]
    assert other_token.asked == []  # named before any capture was asked of it


def test_a_forged_or_forwarded_job_wide_request_reaches_nobody(coordinator):
    peer = fake([FakeWorker("worker-0")])
    agent = coordinator([peer])
    with socket.socket() as outside:  # an address the request would like the agent to call
        outside.bind(("127.0.0.9", 0))
        outside.listen(1)
        outside.settimeout(0.5)
        target = f"127.0.0.9:{outside.getsockname()[1]}"
        for body, headers in (({"job": "ring", "scope": "job", "peers": [target]}, {}),
                              ({"job": "ring", "scope": "job"}, {"X-Tfprofd-Forwarded-By": "gpu-7"}),
                              ({"job": "ring", "scope": "job", "start_at_ns": 1}, {}),
                              ({"scope": "job"}, {}), ({"job": "ring", "scope": "world"}, {}),
                              ({"job": "ring", "trigger": "rule"}, {})):
            status, answer = http("POST", f"{agent.api}/captures", body, token=TOKEN, headers=headers)
            assert status == 400, (body, answer)
        assert peer.connections == 0
        # The same request, unforged: the agent asks its configured peer, still nobody else.
        status, answer = http("POST", f"{agent.api}/captures", {"job": "ring", "scope": "job"}, token=TOKEN)
        assert status == 202, answer
        assert job_record(agent, answer["id"])["status"] == "done"
        assert peer.connections > 0
        with pytest.raises(TimeoutError):
            outside.accept()
    status, answer = http("POST", f"{agent.api}/captures", {"job": "ring", "start_at_ns": 10**18}, token=TOKEN)
    assert status == 400 and "start_at_ns" in answer["error"], answer  # a peer's instant is at most a minute ahead


def test_a_job_wide_capture_needs_a_cluster(coordinator):
    agent = coordinator([])
    status, answer = http("POST", f"{agent.api}/captures", {"job": "ring", "scope": "job"}, token=TOKEN)
    assert status == 400 and "cluster.prometheus_url or cluster.peers" in answer["error"], answer


def test_a_job_level_alert_captures_the_whole_job_once(coordinator):
    peers = [fake([FakeWorker("worker-0")]), fake([FakeWorker("worker-1")])]
    agent = coordinator(peers)
    alert = {"status": "firing", "labels": {"alertname": "TfprofdStraggler", "training_job": "ring"},
             "fingerprint": "abc", "startsAt": "2026-11-24T18:00:00Z"}
    payload = {"version": "4", "status": "firing", "alerts": [alert]}
    status, outcome = http("POST", f"{agent.api}/alerts", payload, token=TOKEN)
    assert status == 200 and len(outcome["captures"]) == 1, outcome
    record = job_record(agent, outcome["captures"][0])
    assert (record["trigger"], record["status"]) == ("alert", "done"), record
    assert [w["worker"] for w in record["workers"]] == ["worker-0", "worker-1"]
    assert [p.triggers for p in peers] == [["alert"], ["alert"]]  # the peers' holds on automatic captures apply
    status, again = http("POST", f"{agent.api}/alerts", payload, token=TOKEN)
    assert again["captures"] == [] and again["ignored"][0]["why"] == "already handled", again
    agent.stop()  # the job record outlives the agent
    agent.start()
    assert http("GET", f"{agent.api}/captures/{record['id']}", token=TOKEN) == (200, record)


def test_tfprofd_capture_all_hosts_waits_for_the_job_record(coordinator):
    peers = [fake([FakeWorker("worker-0", 10.0)]), fake([FakeWorker("worker-1", 30.0, input_wait_ms=21.0)])]
    agent = coordinator(peers)
    run = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "capture", "--api", f"http://127.0.0.1:{agent.api_port}",
                          "--job", "ring", "--all-hosts", "--wait"], env={**os.environ, "TFPROFD_API_TOKEN": TOKEN},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "job-wide capture" in run.stdout and "job ring: done: 2 worker(s)" in run.stdout, run.stdout
    assert "straggler: worker worker-1" in run.stdout and "in input_wait" in run.stdout, run.stdout
    assert "compared: worker worker-1" in run.stdout and "median worker worker-0" in run.stdout, run.stdout
    run = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "capture", "--api", f"http://127.0.0.1:{agent.api_port}",
                          "--all-hosts"], env={**os.environ, "TFPROFD_API_TOKEN": TOKEN}, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "--all-hosts needs --job" in run.stderr


def test_a_bad_job_record_on_disk_is_set_aside_and_the_agent_starts(tmp_path):
    jobs = tmp_path / "state" / "jobs"
    jobs.mkdir(parents=True, mode=0o700)
    (jobs / "20261124T180000Z-abcdef.json").write_text('{"id": "../../etc", "scope": "job"}')
    agent = AgentProcess(tmp_path, env={"TFPROFD_API_TOKEN": TOKEN}).start()
    try:
        assert http("GET", f"{agent.api}/captures/20261124T180000Z-abcdef", token=TOKEN)[0] == 404
        assert [p.name.split(".bad-")[0] for p in jobs.iterdir()] == ["20261124T180000Z-abcdef.json"]
        assert "not a valid job record" in agent.log()
    finally:
        agent.stop()


def test_a_job_no_agent_has_is_refused_at_once(tmp_path):
    agent = AgentProcess(tmp_path, env={"TFPROFD_API_TOKEN": TOKEN},
                         args=["--cluster.prometheus-url", f"http://127.0.0.1:{free_port()}"]).start()
    try:  # Prometheus down: 502 with its address; the alert asks Alertmanager to send it again
        status, answer = http("POST", f"{agent.api}/captures", {"job": "ring", "scope": "job"}, token=TOKEN)
        assert status == 502 and "unreachable" in answer["error"], answer
        alert = {"status": "firing", "labels": {"alertname": "JobSlow", "training_job": "ring"}, "fingerprint": "f"}
        status, outcome = http("POST", f"{agent.api}/alerts", {"version": "4", "alerts": [alert]}, token=TOKEN)
        assert status == 503 and "unreachable" in outcome["retry"][0]["why"], outcome
    finally:
        agent.stop()


def test_the_straggler_alert_on_its_node_compares_the_named_worker_with_the_median_one(coordinator):
    """A synchronous job: every worker waits for the slowest at each all-reduce, so step times are equal and the
    traces alone name no straggler. The alert (the GPU signal) names worker-2; the agent of its node captures the
    whole job and says what differs between worker-2 and the median worker, part by part and op by op."""
    healthy = (("input", "Iterator::Map", 0.5), ("device", "MatMul", 9.0))
    slowed = (("input", "Iterator::Map", 40.2), ("device", "MatMul", 9.0))
    peers = [fake([FakeWorker("worker-0", 51.2, 1.0, 40.0, healthy)]),
             fake([FakeWorker("worker-1", 51.2, 1.0, 40.0, healthy)]),
             fake([FakeWorker("worker-2", 51.3, 41.0, 0.3, slowed)])]
    agent = coordinator(peers, extra=("--alerts.host-value", "127.0.0.1"))
    alert = {"status": "firing", "fingerprint": "5f2", "startsAt": "2026-11-24T18:00:00Z",
             "labels": {"alertname": "TfprofdStraggler", "severity": "warning", "job": "tfprofd",
                        "instance": "127.0.0.1:9847", "training_job": "ring", "worker": "worker-2"}}
    payload = {"version": "4", "status": "firing", "alerts": [alert]}
    status, outcome = http("POST", f"{agent.api}/alerts", payload, token=TOKEN)
    assert status == 200 and len(outcome["captures"]) == 1, outcome
    record = job_record(agent, outcome["captures"][0])
    assert (record["trigger"], record["status"], record["suspect"]) == ("alert", "done", "worker-2"), record
    assert [w["worker"] for w in record["workers"]] == ["worker-0", "worker-1", "worker-2"]
    assert [p.triggers for p in peers] == [["alert"]] * 3
    assert record["straggler"] is None  # 51.3 against 51.2 ms: no step-time straggler
    compared = record["comparison"]
    assert (compared["worker"], compared["reference"], compared["named_by"]) == ("worker-2", "worker-0", "alert")
    parts = {p["part"]: p["delta_ms"] for p in compared["comparison"]["parts"]}
    assert parts["input_wait"] == pytest.approx(40.0) and parts["device_collectives"] == pytest.approx(-39.7)
    [op] = compared["comparison"]["ops"]  # the ops that grew
    assert (op["name"], op["kind"]) == ("Iterator::Map", "input") and op["delta_ms"] == pytest.approx(39.7)
    assert "worker worker-2" in compared["summary"] and "median worker worker-0" in compared["summary"]
    assert "+40.0 ms waiting for input" in record["detail"], record["detail"]
    status, again = http("POST", f"{agent.api}/alerts", payload, token=TOKEN)
    assert again["captures"] == [] and again["ignored"][0]["why"] == "already handled", again
    agent.stop()  # the comparison is kept with the record
    agent.start()
    assert http("GET", f"{agent.api}/captures/{record['id']}", token=TOKEN) == (200, record)
    # An alert naming a worker the job does not have: the job is still captured, and the record says so.
    alert = {**alert, "fingerprint": "5f3", "labels": {**alert["labels"], "worker": "worker-9\n<script>"}}
    status, outcome = http("POST", f"{agent.api}/alerts", {**payload, "alerts": [alert]}, token=TOKEN)
    assert status == 200 and len(outcome["captures"]) == 1, outcome
    other = job_record(agent, outcome["captures"][0])
    assert other["comparison"] is None and other["suspect"] == "worker-9\n<script>", other
    assert "the alert's straggler, worker 'worker-9\\n<script>', was not traced" in other["detail"], other["detail"]


def test_the_capture_list_holds_job_records_marked_as_such(coordinator):
    agent = coordinator([fake([FakeWorker("worker-0")]), fake([FakeWorker("worker-1")])])
    status, answer = http("POST", f"{agent.api}/captures", {"job": "ring", "scope": "job"}, token=TOKEN)
    assert status == 202, answer
    record = job_record(agent, answer["id"])
    status, listed = http("GET", f"{agent.api}/captures", token=TOKEN)
    assert status == 200 and listed["captures"] == [record], listed
    assert listed["captures"][0]["scope"] == "job"


def test_a_job_level_alert_through_a_real_alertmanager_makes_one_job_record(coordinator, tmp_path):
    """Debian's Alertmanager groups a job-level alert (aggregated over hosts: no instance) and posts it, again and
    again while it fires, to an agent's webhook: one job-wide capture of every worker, once."""
    if not shutil.which("prometheus-alertmanager"):
        pytest.fail("prometheus-alertmanager not found: run `make test`, which installs Debian's packages")
    peers = [fake([FakeWorker("worker-0", 10.0)]), fake([FakeWorker("worker-1", 30.0, input_wait_ms=21.0)])]
    agent = coordinator(peers)
    (tmp_path / "am-token").write_text(TOKEN)
    am_port = free_port()
    (tmp_path / "alertmanager.yml").write_text(f"""
route:
  receiver: tfprofd
  group_by: [alertname, training_job]
  group_wait: 1s
  group_interval: 2s
  repeat_interval: 2s
receivers:
  - name: tfprofd
    webhook_configs:
      - url: http://127.0.0.1:{agent.api_port}/api/v1/alerts
        send_resolved: false
        http_config:
          authorization:
            credentials_file: {tmp_path / "am-token"}
""")
    am = Server(["prometheus-alertmanager", f"--config.file={tmp_path / 'alertmanager.yml'}",
                 f"--storage.path={tmp_path / 'am'}", f"--web.listen-address=127.0.0.1:{am_port}",
                 "--cluster.listen-address="], f"http://127.0.0.1:{am_port}/-/ready", tmp_path / "alertmanager.log")
    try:
        now = datetime.datetime.now(datetime.timezone.utc)
        alert = [{"labels": {"alertname": "JobStepSlow", "training_job": "ring", "severity": "warning"},
                  "startsAt": now.isoformat(), "endsAt": (now + datetime.timedelta(hours=1)).isoformat()}]
        status, answer = http("POST", f"http://127.0.0.1:{am_port}/api/v2/alerts", alert)
        assert status == 200, answer

        def sent() -> float:
            text = http("GET", f"http://127.0.0.1:{am_port}/metrics")[1]
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith('alertmanager_notifications_total{integration="webhook"'))

        wait_for(lambda: sent() >= 3, 60, 0.5, message="three notifications from Alertmanager")
        listed = http("GET", f"{agent.api}/captures", token=TOKEN)[1]["captures"]
        assert [(r["scope"], r["trigger"], r["job"]) for r in listed] == [("job", "alert", "ring")], listed
        record = job_record(agent, listed[0]["id"])
        assert record["status"] == "done", record
        assert [w["worker"] for w in record["workers"]] == ["worker-0", "worker-1"]
        assert record["straggler"]["worker"] == "worker-1" and record["straggler"]["part"] == "input_wait"
        assert [p.triggers for p in peers] == [["alert"], ["alert"]]  # one capture each, for all the notifications
    finally:
        am.stop()


def test_the_alerts_straggler_is_this_hosts_worker_when_other_hosts_use_the_same_name():
    """Workers named by the default ("0") or the same TF_CONFIG on each host: the straggler alert came to the
    straggler's node, so its worker "0" is the one compared, not the first "0" in the record."""
    healthy = (("input", "Iterator::Map", 0.5), ("device", "MatMul", 9.0))
    slowed = (("input", "Iterator::Map", 40.2), ("device", "MatMul", 9.0))
    hosts = {"10.0.0.1:9848": FakeWorker("0", 51.2, 1.0, 40.0, healthy),
             "10.0.0.2:9848": FakeWorker("0", 51.2, 1.0, 40.0, healthy),
             LOCAL: FakeWorker("0", 51.3, 41.0, 0.3, slowed)}
    record = JobRecord(id="j1", job="ring", trigger="alert", requested_at=0.0, suspect="0")
    analyses = {}
    for peer, worker in hosts.items():
        [(result, analysis)] = worker_results(peer, FakeAgent(peer, 1, TOKEN, [worker]).record("ring", 10**18))
        record.workers.append(result)
        analyses[(peer, "0")] = analysis
    conclude(record, analyses)
    compared = record.comparison
    assert (compared.worker, compared.peer, compared.reference, compared.named_by) == ("0", LOCAL, "0", "alert")
    assert compared.reference_peer != LOCAL
    assert "+40.0 ms waiting for input" in record.detail, record.detail


def _pinged_then(after):
    """Answers the ping as an agent does (with an agent id of its own), every other request with ``after``."""
    def answer(handler):
        if handler.path == "/api/v1/peer":
            send(handler, 200, json.dumps({"agent": f"hostile-{handler.server.server_address[1]}"}).encode())
        else:
            after(handler)
    return answer


def _strict(text: str):
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the agent's JSON"))


def test_peers_that_are_not_agents_fail_alone_and_the_token_goes_nowhere_else(coordinator):
    """Each of these ended the whole record (a not-HTTP port, a nested answer), sent the shared token to where a
    redirect pointed, or copied megabytes into the record; now each is one named failure beside the good peer."""
    recorder = HostileServer(json_body(200, b'{"agent": "thief"}'))
    hostile = {
        "redirect": HostileServer(redirect_to(recorder.address)),
        "ssh": HostileServer(not_http()),
        "nested": HostileServer(json_body(200, NESTED)),
        "nan": HostileServer(json_body(200, b'{"agent": NaN}')),
        "huge": HostileServer(_pinged_then(json_body(409, json.dumps({"error": "x" * 4_000_000}).encode()))),
    }
    try:
        good = fake([FakeWorker("worker-0")])
        agent = coordinator([good], tuple(s.address for s in hostile.values()))
        why = partial_failures(agent, ["worker-0"])
        assert set(why) == {s.address for s in hostile.values()}, why
        redirected = why[hostile["redirect"].address]
        assert "a redirect to" in redirected and "not followed" in redirected
        assert "not an HTTP answer" in why[hostile["ssh"].address]
        assert "not a tfprofd answer" in why[hostile["nested"].address]
        assert "not a tfprofd answer" in why[hostile["nan"].address]
        assert "refused the capture (409)" in why[hostile["huge"].address]
        assert all(len(w) < 600 for w in why.values()), [len(w) for w in why.values()]
        assert recorder.seen == []  # the redirect's target never saw the token, nor anything else
        listed = urllib.request.urlopen(urllib.request.Request(
            f"{agent.api}/captures", headers={"Authorization": f"Bearer {TOKEN}"}), timeout=10).read()
        assert len(listed) < 100_000 and _strict(listed.decode())
    finally:
        for server in (recorder, *hostile.values()):
            server.stop()


def test_the_same_peer_list_on_every_agent_asks_each_agent_once_and_names_no_false_failure(tmp_path):
    """README's static list, given to every agent: it names the coordinator itself and agents with no worker of
    the job, and one agent may be listed under two names. Each agent with workers is asked once; the others are
    not failures."""
    with_worker, without = fake([FakeWorker("worker-0")]), fake([])
    agent = AgentProcess(tmp_path, env={"TFPROFD_API_TOKEN": TOKEN})
    peers = [f"127.0.0.1:{with_worker.port}", f"localhost:{with_worker.port}", f"127.0.0.1:{without.port}",
             f"127.0.0.1:{agent.api_port}"]
    agent.args += ["--captures.baseline", "false", "--cluster.timeout", "10s", "--cluster.peers", ",".join(peers)]
    agent.start()
    try:
        status, answer = http("POST", f"{agent.api}/captures", {"job": "ring", "scope": "job"}, token=TOKEN)
        assert status == 202, answer
        record = job_record(agent, answer["id"])
        assert (record["status"], record["failed"]) == ("done", []), record
        assert [w["worker"] for w in record["workers"]] == ["worker-0"]
        assert len(with_worker.asked) == 1 and record["peers"] == [f"127.0.0.1:{with_worker.port}"]
    finally:
        agent.stop()
        with_worker.stop()
        without.stop()


def test_a_job_wide_capture_of_a_job_already_being_captured_is_refused(coordinator):
    slow = fake([FakeWorker("worker-0")], answer_delay=30.0)  # holds the first capture until its start instant
    agent = coordinator([slow])
    status, first = http("POST", f"{agent.api}/captures", {"job": "ring", "scope": "job"}, token=TOKEN)
    assert status == 202, first
    status, second = http("POST", f"{agent.api}/captures", {"job": "ring", "scope": "job"}, token=TOKEN)
    assert (status, second["code"]) == (409, "capture_busy") and first["id"] in second["error"], second
    job_record(agent, first["id"])
    status, third = http("POST", f"{agent.api}/captures", {"job": "ring", "scope": "job"}, token=TOKEN)
    assert status == 202, third
