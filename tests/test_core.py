"""The agent's core as a user and its operators meet it: start and stop, reload, a hung GPU, corrupt state,
the HTTP server under odd clients, jobs that share a name or end, and the Alertmanager retry contract."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from http.client import HTTPConnection

import pytest
from test_config import HOSTILE

from tfprofd.exporter.hook import Reporter

from helpers import AgentProcess, GpuState, gpu, http, metric_value, reports_socket, wait_for


def run_agent(tmp_path, *args: str, timeout: float = 10) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "run", "--state-dir", str(tmp_path / "state"),
                             "--hook.socket", str(tmp_path / "hook.sock"), *args], capture_output=True, text=True,
                            timeout=timeout)
    return result, time.monotonic() - started


# ---- start and stop ----

SYS_TGKILL = {"x86_64": 234, "aarch64": 131}[platform.machine()]


def test_a_busy_port_fails_the_start_at_once_with_one_clear_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result, took = run_agent(tmp_path, "--listen", f"127.0.0.1:{port}", "--api.listen", "127.0.0.1:0")
    assert result.returncode == 1, (result, took)  # at once: run_agent's timeout bounds any retrying
    assert f"tfprofd: cannot start: cannot listen on 127.0.0.1:{port} for metrics" in result.stderr
    assert "Traceback" not in result.stderr
    assert "tfprofd stopped" not in result.stdout + result.stderr  # it never ran
    assert not (tmp_path / "hook.sock").exists()  # what it opened before failing is gone


@pytest.mark.parametrize("problem", ["not a directory", "world-writable"])
def test_an_unusable_state_dir_fails_the_start_with_one_clear_line(tmp_path, problem):
    if problem == "not a directory":
        (tmp_path / "file").write_text("")
        state = tmp_path / "file" / "state"
    else:
        state = tmp_path / "open"
        state.mkdir()
        state.chmod(0o777)
    result = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "run", "--state-dir", str(state), "--listen",
                             "127.0.0.1:0", "--api.listen", "127.0.0.1:0", "--hook.socket", str(tmp_path / "h.sock")],
                            capture_output=True, text=True, timeout=10)
    assert result.returncode == 1 and f"cannot start: state_dir {state}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_an_empty_token_file_fails_the_start_closed(tmp_path):
    token = tmp_path / "token"
    token.write_text("\n")
    token.chmod(0o600)
    result, _ = run_agent(tmp_path, "--listen", "127.0.0.1:0", "--api.listen", "127.0.0.1:0", "--api.token-file",
                          str(token))
    assert result.returncode == 1 and "the API token file" in result.stderr and "is empty" in result.stderr


def test_sigterm_stops_the_agent_every_time(agents, gpus):
    for _ in range(8):
        agent = agents(env=gpus.env())
        took = agent.stop()
        assert agent.proc.returncode == 0, f"killed after {took:.1f}s"
        assert "tfprofd stopped" in agent.log()
        assert not agent.hook_socket.exists(), "the hook socket was left behind"


def signal_thread(pid: int, sig: signal.Signals) -> None:
    """Deliver a signal to one of a process's threads other than its main one (the kernel may pick any)."""
    tid = next(int(t) for t in sorted(os.listdir(f"/proc/{pid}/task"), key=int) if int(t) != pid)
    assert ctypes.CDLL(None, use_errno=True).syscall(SYS_TGKILL, pid, tid, sig) == 0


def test_signals_a_worker_thread_receives_still_reload_and_stop_the_agent(agents, gpus, tmp_path):
    config = tmp_path / "tfprofd.yaml"
    config.write_text("log_level: info\n")
    agent = agents(args=["--config", str(config)], env=gpus.env())
    signal_thread(agent.proc.pid, signal.SIGHUP)
    wait_for(lambda: "config reloaded" in agent.log(), 10, message="SIGHUP to a worker thread to reload")
    signal_thread(agent.proc.pid, signal.SIGTERM)
    took = agent.stop()
    assert agent.proc.returncode == 0, f"SIGTERM to a worker thread was lost; killed after {took:.1f}s"


# ---- reload ----

def test_reload_applies_max_body_and_says_state_dir_needs_a_restart(tmp_path):
    config = tmp_path / "tfprofd.yaml"
    config.write_text(f"api:\n  max_body_bytes: 65536\nstate_dir: {tmp_path / 'state'}\n")
    agent = AgentProcess(tmp_path, args=["--config", str(config)])
    where = agent.args.index("--state-dir")
    del agent.args[where:where + 2]  # the state directory comes from the file alone
    agent.start()
    try:
        body = {"job": "x" * 3000}
        assert agent.call("POST", "/captures", body)[0] == 404  # read, and no such job
        config.write_text(f"api:\n  max_body_bytes: 2048\nstate_dir: {tmp_path / 'elsewhere'}\n")
        agent.signal(signal.SIGHUP)
        wait_for(lambda: "config reloaded" in agent.log(), 10, message="the reload")
        assert "state_dir changed; it takes effect after a restart" in agent.log()
        assert agent.call("POST", "/captures", body)[0] == 413
        assert not (tmp_path / "elsewhere").exists()
    finally:
        agent.stop()


def test_reloading_hostile_files_keeps_the_running_agent(agents, tmp_path):
    config = tmp_path / "tfprofd.yaml"
    config.write_text("interval: 0.2s\n")
    agent = agents(args=["--config", str(config)])
    for name, content in HOSTILE.items():
        config.write_bytes(content)
        before = agent.log().count("config reload rejected")
        agent.signal(signal.SIGHUP)
        wait_for(lambda b=before: agent.log().count("config reload rejected") > b, 10, message=f"{name} rejected")
        assert agent.proc.poll() is None, name
    assert metric_value(agent.scrape(), "tfprofd_collector_success", collector="cpu") == 1
    assert "Traceback" not in agent.log()


# ---- a GPU that hangs inside NVML ----

def test_a_hung_nvml_call_turns_the_collector_failed_and_does_not_hold_up_sigterm(agents, tmp_path, fakenvml):
    state = GpuState(tmp_path / "nvml.json", [gpu(0), gpu(1)])
    agent = agents(env=state.env())
    assert metric_value(agent.scrape(), "tfprofd_gpu_utilization_ratio", gpu="0") == 0.95
    state.update_gpu(1, delay_ms=120_000)
    wait_for(lambda: http("GET", agent.url + "/healthz")[0] == 503, 30, message="health to turn red")
    text = agent.scrape()
    assert metric_value(text, "tfprofd_collector_success", collector="nvml") == 0
    assert metric_value(text, "tfprofd_gpu_utilization_ratio", gpu="0") is None  # no stale values served
    assert metric_value(text, "tfprofd_collector_success", collector="cpu") == 1
    problem = http("GET", agent.url + "/healthz")[1]["collectors"]["nvml"]["problem"]
    assert "in progress" in problem
    took = agent.stop()
    assert agent.proc.returncode == 0, f"SIGTERM with NVML blocked: killed after {took:.1f}s"


# ---- corrupt state files ----

def test_corrupt_records_and_ledger_are_set_aside_and_the_agent_starts(agents, tmp_path):
    records = tmp_path / "state" / "records"
    records.mkdir(parents=True, mode=0o700)
    good = {"id": "20261121T101010Z-abcdef", "trigger": "manual", "job": "old", "targets": [], "requested_at": 1.0,
            "duration_ms": 1000, "mode": "agent", "status": "done", "analysis": {"bottleneck": "input"}}
    (records / f"{good['id']}.json").write_text(json.dumps(good))
    (records / "20261121T101011Z-000000.json").write_text(json.dumps({**good, "id": "20261121T101011Z-000000",
                                                                        "requested_at": "yesterday"}))
    (records / "20261121T101012Z-000000.json").write_text(json.dumps({**good, "id": "../../etc"}))
    (records / "20261121T101013Z-000000.json").write_text("{broken")
    (tmp_path / "state" / "alerts_seen.json").write_text("null")
    agent = agents()
    status, answer = agent.call("GET", "/captures")
    assert status == 200 and [r["id"] for r in answer["captures"]] == [good["id"]]
    assert len(list(records.glob("*.bad-*"))) == 3 and len(list((tmp_path / "state").glob("alerts_seen.json.bad-*")))
    log = agent.log()
    assert "requested_at" in log and "is not a capture id" in log and "alert ledger is not an object" in log
    assert metric_value(agent.scrape(), "tfprofd_captures_running") == 0
    # A job known only from an old record has no capture series.
    assert metric_value(agent.scrape(), "tfprofd_capture_bottleneck_info", training_job="old", kind="input") is None


# ---- the HTTP server ----

def _scrape_on(conn: HTTPConnection) -> float:
    started = time.perf_counter()
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert response.status == 200 and response.read()
    return time.perf_counter() - started


def test_a_kept_alive_connection_scrapes_as_fast_as_new_ones(agents):
    agent = agents()
    kept = HTTPConnection("127.0.0.1", agent.port, timeout=10)
    _scrape_on(kept)
    on_kept, on_new = [], []
    for _ in range(15):
        on_kept.append(_scrape_on(kept))
        fresh = HTTPConnection("127.0.0.1", agent.port, timeout=10)
        on_new.append(_scrape_on(fresh))
        fresh.close()
    kept.close()
    # A response in two writes stalls ~40 ms per scrape on a kept-alive connection (Nagle vs delayed ACK).
    assert statistics.median(on_kept) < 3 * statistics.median(on_new) + 0.005, (on_kept, on_new)


def test_the_listen_backlog_takes_bursts():
    """The metrics socket listens with the system's maximum backlog, not 5."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentProcess(Path(tmp)).start()
        try:
            out = subprocess.run(["ss", "-ltnH", f"sport = :{agent.port}"], capture_output=True, text=True).stdout
            backlog = int(out.split()[2])
            assert backlog >= 128, out
        finally:
            agent.stop()


def test_clients_that_hang_up_log_no_tracebacks(agents):
    agent = agents()
    for i in range(200):
        with socket.create_connection(("127.0.0.1", agent.port)) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" if i % 2 else b"GET /met")
    wait_for(lambda: http("GET", agent.url + "/healthz")[0] == 200, 10, message="the agent to answer")
    assert "Traceback" not in agent.log() and "ERROR" not in agent.log().upper().replace("ERRORS", "")


def test_malformed_and_ambiguous_requests_are_refused(agents):
    agent = agents()
    token = agent.token

    def raw(request: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", agent.api_port), timeout=10) as s:
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)
            return b"".join(iter(lambda: s.recv(65536), b""))

    auth = f"Authorization: bearer {token}\r\n".encode()  # the scheme in any case
    chunked = raw(b"POST /api/v1/captures HTTP/1.1\r\n" + auth + b"Transfer-Encoding: chunked\r\n\r\n"
                  b"5\r\n{}   \r\n0\r\n\r\nGET /api/v1/captures HTTP/1.1\r\n\r\n")
    assert chunked.startswith(b"HTTP/1.1 411 ") and chunked.count(b"HTTP/1.1") == 1
    assert raw(b"POST /api/v1/captures HTTP/1.1\r\n" + auth + b"Content-Length: 1_0\r\n\r\n{}").startswith(
        b"HTTP/1.1 400 ")
    assert raw(b"POST /api/v1/captures HTTP/1.1\r\n" + auth + b"Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}"
               ).startswith(b"HTTP/1.1 400 ")
    assert raw(b"GET /api/v1/captures HTTP/1.1\r\n" + auth + b"X: a\r\n continued\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert raw(b"GET /api/v1/captures HTTP/1.1\r\n" + auth + b"\r\n").startswith(b"HTTP/1.1 200 ")
    # A body cut short by a client that hangs up is never acted on.
    cut = raw(b"POST /api/v1/captures HTTP/1.1\r\n" + auth + b"Content-Length: 100\r\n\r\n{\"job\": \"x\"")
    assert cut == b""
    assert agent.call("GET", "/captures")[1]["captures"] == []


# ---- jobs ----

def _report(agent: AgentProcess, **fields) -> None:
    reporter = Reporter(job=fields.pop("job"), worker="0", profiler=False, addr=f"127.0.0.1:{agent.hook_port}")
    report = reporter.report()
    report.update(fields)
    with reports_socket() as s:
        s.sendto(json.dumps(report).encode(), ("127.0.0.1", agent.hook_port))


def test_two_processes_of_one_job_add_up_instead_of_clobbering(agents):
    agent = agents()
    # Two users' train.py report alternately (default worker "0", job = script name).
    for seq in range(1, 6):
        for pid, start in ((1001, 100.0), (2002, 200.0)):
            _report(agent, job="train", pid=pid, process_start=start, seq=seq, time=1000.0 + seq, phase="train",
                    steps=seq * 10, samples=seq * 10 * 32)
    def counts():
        text = agent.scrape()
        return (metric_value(text, "tfprofd_training_samples_total", training_job="train"),
                metric_value(text, "tfprofd_training_processes", training_job="train"))

    wait_for(lambda: counts() == (2 * 50 * 32, 2), 10, message=f"summed counters, got {counts()}")
    text = agent.scrape()
    assert metric_value(text, "tfprofd_training_samples_per_second", training_job="train") == 2 * 320
    assert "restarted" not in agent.log()


def test_a_job_in_the_metrics_can_be_captured_at_once_even_with_a_long_interval(agents):
    agent = agents(args=["--interval", "60s"])  # no scheduled sample during the test
    for n in range(10):
        _report(agent, job=f"new{n}", pid=3000 + n, phase="train")
        wait_for(lambda n=n: metric_value(agent.scrape(), "tfprofd_training_up", training_job=f"new{n}") == 1, 10,
                 message=f"job new{n} in /metrics")
        status, answer = agent.call("POST", "/captures", {"job": f"new{n}"})
        assert status == 404 and "no profiler server" in answer["error"], answer  # known, not "no training job"


def test_a_killed_job_stops_counting_as_training_at_once(agents, tmp_path):
    agent = agents(fixtures=False)
    code = textwrap.dedent(f"""
        import time
        from tfprofd.exporter.hook import Reporter
        r = Reporter(job="victim", profiler=False, addr="unix:{agent.hook_socket}", interval=0.2).start()
        while True:
            with r.step(batch_size=8):
                time.sleep(0.01)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait_for(lambda: metric_value(agent.scrape(), "tfprofd_training_samples_per_second", training_job="victim"),
                 30, message="the job to report a rate")
        proc.kill()
        proc.wait()
        wait_for(lambda: metric_value(agent.scrape(), "tfprofd_training_processes", training_job="victim") == 0, 10,
                 message="the dead process to be retired")
        text = agent.scrape()
        assert metric_value(text, "tfprofd_training_samples_per_second", training_job="victim") is None
        assert metric_value(text, "tfprofd_training_samples_total", training_job="victim") > 0  # counts are kept
    finally:
        proc.kill()


def test_a_custom_loop_that_ends_is_idle_and_fires_no_throughput_drop(agents, tmp_path):
    config = tmp_path / "rules.yaml"
    # for: 1s, not 0s: a report holding no finished step (the main thread stalled on a busy machine) reads 0
    # samples/s for a moment while training; what must not fire is the 0 of a job that ended
    config.write_text("rules:\n  - name: drop\n    signal: samples_per_second\n    below: 1\n    for: 1s\n")
    agent = agents(args=["--config", str(config)], fixtures=False)
    code = textwrap.dedent(f"""
        import sys, time
        from tfprofd.exporter.hook import Reporter
        with Reporter.shared(job="loop", profiler=False, addr="unix:{agent.hook_socket}", interval=0.2) as r:
            for _ in range(100):
                with r.step(batch_size=8):
                    time.sleep(0.01)
        print("done", flush=True)
        time.sleep(60)  # the process lives on after training, as a script that evaluates or saves would
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "done"
        wait_for(lambda: metric_value(agent.scrape(), "tfprofd_training_phase", training_job="loop", phase="idle")
                 == 1, 10, message="the job to read idle")
        text = agent.scrape()
        assert metric_value(text, "tfprofd_training_samples_total", training_job="loop") == 800
        assert metric_value(text, "tfprofd_rule_firings_total", rule="drop") == 0
        assert metric_value(text, "tfprofd_training_samples_per_second", training_job="loop") is None
    finally:
        proc.kill()


# ---- Alertmanager's retry contract ----

def _alert(fingerprint: str = "f1", **labels) -> dict:
    return {"version": "4", "status": "firing", "alerts": [{
        "status": "firing", "labels": {"alertname": "TfprofdGpuUnderutilized", "instance": "127.0.0.1:9847", **labels},
        "annotations": {}, "startsAt": "2026-11-21T10:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
        "fingerprint": fingerprint}]}


def test_an_alert_is_handled_only_once_a_capture_started_and_5xx_asks_for_a_retry(agents):
    agent = agents(args=["--alerts.host-value", "127.0.0.1"])
    status, answer = agent.call("POST", "/alerts", _alert(training_job="late"))
    assert status == 503 and answer["retry"][0]["why"].startswith("no training job 'late'"), answer
    with socket.socket() as server:  # the job's own port when it reports; closed when captures come
        server.bind(("127.0.0.1", 0))
        server.listen()
        _report(agent, job="late", pid=4242, process_start=1.0, seq=1, time=1.0, phase="train",
                profiler=f"127.0.0.1:{server.getsockname()[1]}")
        wait_for(lambda: metric_value(agent.scrape(), "tfprofd_training_up", training_job="late") == 1, 10,
                 message="job late")

    def retry():  # Alertmanager sends again until it gets a 2xx
        status, answer = agent.call("POST", "/alerts", _alert(training_job="late"))
        assert status in (200, 503), answer
        return (status, answer) if status == 200 else None

    status, answer = wait_for(retry, 10, message="a retry to capture")
    assert len(answer["captures"]) == 1, answer
    status, answer = agent.call("POST", "/alerts", _alert(training_job="late"))  # its next repeat
    assert status == 200 and answer["ignored"] == [{"alert": "TfprofdGpuUnderutilized", "why": "already handled"}]
    # Two alerts without fingerprints but different labels are two alerts, not one.
    first = _alert("", training_job="late", gpu="0")
    second = _alert("", training_job="late", gpu="1")
    wait_for(lambda: agent.call("GET", "/captures")[1]["captures"][0]["status"] not in ("running", "analyzing"), 30,
             message="the first capture to end")
    assert agent.call("POST", "/alerts", first)[1]["captures"]
    wait_for(lambda: agent.call("GET", "/captures")[1]["captures"][0]["status"] not in ("running", "analyzing"), 30,
             message="the second capture to end")
    assert agent.call("POST", "/alerts", second)[1]["captures"]
