"""Captures end to end: a real Keras job with the hook, the real agent, the real profiler server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tfprofd.exporter.hook import Reporter

from helpers import (
    AgentProcess,
    GpuState,
    build_fakenvml,
    free_port,
    gpu,
    http,
    job_reporting,
    metric_value,
    start_training,
    wait_capture,
    wait_for,
    wait_traced,
)

pytestmark = pytest.mark.tf

RULES = """
rules:
  - name: low_gpu_utilization
    description: test copy of the shipped rule with a short for
    signal: gpu_utilization
    below: 0.5
    for: 3s
    cooldown: 0s
"""


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """An agent with two simulated GPUs and a Keras job on GPU 1 that trains for the whole module.

    Tests here never stop this agent: a test that restarts an agent starts its own (``lend``)."""
    tmp = tmp_path_factory.mktemp("captures")
    build_fakenvml()
    state = GpuState(tmp / "nvml.json", [gpu(0), gpu(1)])
    config = tmp / "tfprofd.yaml"
    config.write_text(RULES)
    agent = AgentProcess(tmp, args=["--config", str(config), "--captures.max-per-hour", "100",
                                    "--captures.duration", "1s", "--captures.baseline", "false"],
                         env=state.env()).start()
    job = start_training(agent.hook_port, "--job", "resnet", "--seconds", "600", "--map-delay", "0.0002")
    state.update_gpu(1, processes=[{"pid": job.pid, "used_memory_bytes": 2**30}])
    try:
        wait_for(lambda: job_reporting(agent, "resnet"), 120, message="the Keras job to report")
        yield agent, state, job
    finally:
        job.kill()
        job.wait()
        agent.stop()


def profiler_address(agent: AgentProcess, job: str) -> str:
    line = next(ln for ln in agent.scrape().splitlines() if ln.startswith("tfprofd_training_info{")
                and f'training_job="{job}"' in ln)
    return line.split('profiler_address="')[1].split('"')[0]


def lend(rig, tmp_path, job: str = "lent", **kwargs) -> tuple[AgentProcess, Reporter]:
    """An agent of the test's own, told about the rig's Keras job by a reporter of the test's own."""
    agent = AgentProcess(tmp_path, **kwargs).start()
    reporter = Reporter(job=job, profiler=False, addr=f"127.0.0.1:{agent.hook_port}")
    reporter.profiler_address = profiler_address(rig[0], "resnet")
    reporter.phase = "train"
    reporter.start()
    wait_for(lambda: job_reporting(agent, job), 10, message="the lent job to report")
    return agent, reporter


def profiler_free(address: str) -> bool:
    """Whether the profiler server at ``address`` takes a new session (a 1 ms one, over raw gRPC)."""
    import grpc

    from tfprofd.daemon.protos import profiler_pb2

    request = profiler_pb2.ProfileRequest(duration_ms=1, emit_xspace=True, session_id="probe",
                                          opts=profiler_pb2.ProfileOptions(version=1, duration_ms=1))
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 30)]) as channel:
        try:
            channel.unary_unary("/tensorflow.ProfilerService/Profile")(request.SerializeToString(), timeout=30)
            return True
        except grpc.RpcError as exc:
            if "Another profiling session" in str(exc.details()):
                return False
            raise


def post_capture(agent, body=None, raw: bytes | None = None):
    return agent.call("POST", "/captures", raw if raw is not None else body)


def test_curl_capture_runs_to_done_with_a_complete_record(rig):
    agent, _, _ = rig
    status, answer = post_capture(agent, {"job": "resnet", "duration_ms": 1000})
    assert status == 202, answer
    record = wait_capture(agent, answer["id"])
    assert record["status"] == "done", record
    assert record["trigger"] == "manual" and record["job"] == "resnet" and record["mode"] == "agent"
    assert record["targets"][0]["worker"] == "0"
    trace = Path(record["directory"]) / record["files"][0]
    assert trace.name.endswith(".xplane.pb") and trace.stat().st_size > 100_000
    assert record["bytes"] >= trace.stat().st_size
    assert record["started_at"] >= record["requested_at"] and record["finished_at"] > record["started_at"]
    listed = agent.call("GET", "/captures")[1]["captures"]
    assert answer["id"] in [r["id"] for r in listed]
    assert metric_value(agent.scrape(), "tfprofd_captures_total", trigger="manual", status="done") >= 1
    assert Path(record["directory"]).stat().st_mode & 0o777 == 0o750  # the agent wrote it: nobody else writes


def test_post_without_a_body_captures_the_only_job(rig):
    agent, _, _ = rig
    status, answer = agent.call("POST", "/captures")
    assert status == 202 and answer["job"] == "resnet", answer
    assert wait_capture(agent, answer["id"])["status"] in ("done", "analysis_failed")


def test_concurrent_posts_give_one_capture_and_409s(rig):
    agent, _, _ = rig
    results: list[tuple[int, dict]] = []
    threads = [threading.Thread(target=lambda: results.append(post_capture(agent, {"job": "resnet"})))
               for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(s for s, _ in results)
    assert statuses == [202, 409, 409, 409, 409], results
    accepted = next(a for s, a in results if s == 202)
    assert all("already running" in a["error"] for s, a in results if s == 409)
    # The one capture traces the job; its analysis (38-59 s on a busy machine) is not what this test is about.
    record = wait_traced(agent, accepted["id"])
    assert record["status"] in ("analyzing", "done", "analysis_failed") and record["files"], record
    captures = agent.call("GET", "/captures")[1]["captures"]
    assert [c["id"] for c in captures if c["requested_at"] >= record["requested_at"]] == [accepted["id"]]
    wait_capture(agent, accepted["id"])  # its analysis ends here, not under the next test's capture


def test_bad_requests_get_4xx_with_a_json_reason(rig):
    agent, _, _ = rig
    assert post_capture(agent, raw=b"{not json")[0] == 400
    status, answer = post_capture(agent, raw=b"[" * 30_000 + b"]" * 30_000)
    assert status == 400 and "nested too deeply" in answer["error"], answer
    status, answer = post_capture(agent, {"job": "resnet", "duration_ms": "long"})
    assert status == 400 and "duration_ms must be an integer" in answer["error"]
    status, answer = post_capture(agent, {"job": "resnet", "options": {"python_tracer_level": 5}})
    assert status == 400 and "python_tracer_level" in answer["error"]
    status, answer = post_capture(agent, {"job": "no-such-job"})
    assert status == 404 and "no-such-job" in answer["error"]
    status, answer = post_capture(agent, raw=b"{" + b" " * 70000 + b"}")
    assert status == 413
    assert agent.call("GET", "/captures/nope")[0] == 404
    assert agent.call("DELETE", "/captures")[0] == 405
    # Without the token every request is 401, before the path is even looked at.
    for method, path in (("GET", "/captures"), ("GET", "/nothing-here"), ("DELETE", "/captures")):
        status, answer = http(method, agent.api + path)
        assert status == 401 and "bearer token" in answer["error"], (method, path, answer)
    assert http("GET", agent.api + "/captures", token="wrong")[0] == 401
    assert http("GET", agent.url + "/metrics")[0] == 200  # /metrics stays open, read-only


def test_a_job_without_a_listening_profiler_fails_with_no_server(rig):
    agent, _, _ = rig
    reporter = Reporter(job="ghost", profiler=False, addr=f"127.0.0.1:{agent.hook_port}")
    with socket.socket() as server:  # the process's own port when it reports, closed when the capture comes
        server.bind(("127.0.0.1", 0))
        server.listen()
        reporter.profiler_address = f"127.0.0.1:{server.getsockname()[1]}"
        reporter.record(1, 32, 0.01)
        reporter.flush()
        wait_for(lambda: job_reporting(agent, "ghost"), 5, message="ghost job")
    status, answer = post_capture(agent, {"job": "ghost"})
    assert status == 202, answer
    record = wait_capture(agent, answer["id"])
    assert (record["status"], record["reason"]) == ("failed", "no_server"), record
    assert reporter.profiler_address in record["detail"]


def test_gpu_utilization_drop_fires_the_rule_and_captures_the_job_on_that_gpu(rig):
    agent, state, _ = rig
    before = {r["id"] for r in agent.call("GET", "/captures")[1]["captures"]}
    dropped_at = time.time()
    state.update_gpu(1, utilization_gpu=20)
    try:
        def rule_capture():
            captures = agent.call("GET", "/captures")[1]["captures"]
            return next((c for c in captures if c["id"] not in before and c["trigger"] == "rule"), None)

        record = wait_for(rule_capture, 30, message="a rule-triggered capture")
        assert record["rule"] == "low_gpu_utilization" and record["gpu"] == "1" and record["job"] == "resnet"
        assert record["requested_at"] - dropped_at < 3.0  # when the rule went pending, before its `for` passed
        record = wait_capture(agent, record["id"])
        assert record["status"] == "done", record  # kept: the rule fired
        # TensorFlow 2.21 has continuous profiling, but its snapshots kill jobs on a GPU: one capture at pending
        assert record["context"]["mode"] == "capture" and "GPU" in record["context"]["mode_reason"], record
        assert sum((Path(record["directory"]) / f).stat().st_size for f in record["files"]) > 100_000
        text = agent.scrape()
        assert metric_value(text, "tfprofd_rule_active", rule="low_gpu_utilization", gpu="1") == 1
        assert metric_value(text, "tfprofd_rule_active", rule="low_gpu_utilization", gpu="0") == 0
        assert metric_value(text, "tfprofd_rule_firings_total", rule="low_gpu_utilization") >= 1
        assert "rule low_gpu_utilization firing for gpu=1" in agent.log()
    finally:
        state.update_gpu(1, utilization_gpu=95)
    wait_for(lambda: metric_value(agent.scrape(), "tfprofd_rule_active", rule="low_gpu_utilization", gpu="1") == 0,
             10, message="the rule to resolve")


def test_server_mode_has_the_training_process_write_the_trace(rig, tmp_path):
    from tfprofd.daemon import capture_worker

    agent, _, _ = rig
    request = {"mode": "server", "targets": [profiler_address(agent, "resnet")], "duration_ms": 800,
               "logdir": str(tmp_path), "host_tracer_level": 2, "device_tracer_level": 1, "python_tracer_level": 0,
               "delay_ms": 0, "max_trace_bytes": 1 << 28}
    result = capture_worker.capture_server_mode(request, tmp_path)
    assert result["status"] == "done", result
    assert (tmp_path / result["files"][0]).stat().st_size > 100_000
    closed = capture_worker.capture_agent_mode({**request, "targets": [f"127.0.0.1:{free_port()}"]}, tmp_path)
    assert closed["reason"] == "no_server"


def test_a_trace_larger_than_the_limit_fails_too_large(rig, tmp_path):
    from tfprofd.daemon import capture_worker

    agent, _, _ = rig
    request = {"mode": "agent", "targets": [profiler_address(agent, "resnet")], "duration_ms": 500,
               "logdir": str(tmp_path), "host_tracer_level": 2, "device_tracer_level": 1, "python_tracer_level": 0,
               "delay_ms": 0, "max_trace_bytes": 1000}
    result = capture_worker.capture_agent_mode(request, tmp_path)
    assert (result["status"], result["reason"]) == ("failed", "too_large"), result
    assert not list(tmp_path.rglob("*.xplane.pb"))


def test_sigterm_during_a_capture_finishes_its_record_as_agent_stopped(rig, tmp_path):
    agent, reporter = lend(rig, tmp_path)
    try:
        status, answer = post_capture(agent, {"job": "lent", "duration_ms": 8000})
        assert status == 202, answer
        wait_for(lambda: any(p.cmdline()[-1:] == ["tfprofd.daemon.capture_worker"]
                             for p in psutil.Process(agent.proc.pid).children()), 10, message="the capture worker")
        took = agent.stop()
        assert agent.proc.returncode == 0, f"killed after {took:.1f}s"
        record = json.loads((tmp_path / "state" / "records" / f"{answer['id']}.json").read_text())
        assert (record["status"], record["reason"]) == ("failed", "agent_stopped"), record
        agent.start()
        assert agent.call("GET", f"/captures/{answer['id']}")[1]["reason"] == "agent_stopped"
    finally:
        reporter.close()
        agent.stop()


def test_records_survive_an_agent_restart(rig, tmp_path):
    agent, reporter = lend(rig, tmp_path)
    try:
        status, answer = post_capture(agent, {"job": "lent", "duration_ms": 500})
        assert status == 202, answer
        wait_capture(agent, answer["id"])
        before = {r["id"]: r["status"] for r in agent.call("GET", "/captures")[1]["captures"]}
        agent.stop()
        agent.start()
        after = {r["id"]: r["status"] for r in agent.call("GET", "/captures")[1]["captures"]}
        assert after == before
    finally:
        reporter.close()
        agent.stop()


def test_capture_workers_die_with_a_killed_agent(rig, tmp_path):
    agent, reporter = lend(rig, tmp_path)
    try:
        status, answer = post_capture(agent, {"job": "lent", "duration_ms": 20000})
        assert status == 202, answer
        workers = wait_for(lambda: [p for p in psutil.Process(agent.proc.pid).children()
                                    if "tfprofd.daemon.capture_worker" in p.cmdline()], 10, message="the worker")
        os.kill(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait()
        wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers), 10,
                 message="the orphaned worker to die")
    finally:
        reporter.close()
        agent.stop()
        # the job's server may hold the 20 s session a while after its client died: the next test needs it free
        wait_for(lambda: profiler_free(reporter.profiler_address), 60, interval=0.5, message="the profiler free")


def test_capture_command_wraps_the_api(rig):
    agent, _, _ = rig
    token_file = agent.tmp / "state" / "api.token"
    result = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "capture", "--job", "resnet", "--duration", "1s",
                             "--wait", "--api", f"http://127.0.0.1:{agent.api_port}", "--token-file", str(token_file)],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("capture ") and "bottleneck:" in result.stdout, result.stdout
    refused = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "capture", "--job", "nobody", "--token-file",
                              str(token_file), "--api", f"http://127.0.0.1:{agent.api_port}"], capture_output=True,
                             text=True)
    assert refused.returncode == 1 and "capture refused (404)" in refused.stderr


def test_a_steady_job_gets_a_baseline_and_later_captures_say_what_changed(rig, tmp_path):
    agent, reporter = lend(rig, tmp_path, args=["--captures.baseline-after", "10s", "--captures.baseline-duration",
                                                 "500ms"])
    try:
        def baseline():
            return next((c for c in agent.call("GET", "/captures")[1]["captures"] if c["trigger"] == "baseline"), None)

        record = wait_capture(agent, wait_for(baseline, 60, message="the baseline capture")["id"])
        assert record["status"] == "done" and record["duration_ms"] == 500, record
        assert "job lent has trained steadily" in agent.log()
        status, answer = post_capture(agent, {"job": "lent", "duration_ms": 1000})
        assert status == 202, answer
        incident = wait_capture(agent, answer["id"])
        assert incident["status"] == "done", incident
        comparison = incident["analysis"]["comparison"]
        assert comparison["baseline_id"] == record["id"]
        assert incident["analysis"]["summary"].startswith(comparison["summary"])
        assert "step time" in comparison["summary"] and len(comparison["parts"]) == 10
        text = agent.scrape()
        for which in ("latest", "baseline"):
            assert metric_value(text, "tfprofd_capture_step_breakdown_seconds", training_job="lent", capture=which,
                                part="host_compute") > 0
        # Retention keeps the baseline even when it is the oldest capture beyond captures.keep.
        agent.stop()
        agent.args += ["--captures.keep", "1"]
        agent.start()
        kept = {c["trigger"] for c in agent.call("GET", "/captures")[1]["captures"]}
        assert "baseline" in kept
    finally:
        reporter.close()
        agent.stop()


def test_a_capture_opens_in_the_xprof_viewer_for_a_user_who_cannot_write_it(rig, tmp_path):
    """The agent leaves the capture as it was written (no viewer cache: most captures are never opened);
    `tfprofd analyze --viewer-cache` on a copy leaves xprof's cache complete, so a read-only reader sees it."""
    import gzip
    import shutil
    import tempfile
    import urllib.request

    from tfprofd.daemon.statedir import StateDir

    agent, _, _ = rig
    status, answer = post_capture(agent, {"job": "resnet", "duration_ms": 800})
    assert status == 202, answer
    record = wait_capture(agent, answer["id"])
    assert record["status"] == "done", record
    run = next(Path(record["directory"]).glob("plugins/profile/*"))
    assert all(p.name.endswith(".xplane.pb") for p in run.iterdir()), list(run.iterdir())
    directory = Path(record["directory"])
    counted = StateDir(directory.parent.parent).tree_bytes("captures", directory.name)
    assert record["bytes"] == counted == sum(p.stat().st_size for p in run.iterdir())
    readable = Path(tempfile.mkdtemp(prefix="tfprofd-viewer-"))  # pytest's own tmp dirs are private (0700)
    copy = readable / "capture"
    shutil.copytree(record["directory"], copy)
    subprocess.run([sys.executable, "-m", "tfprofd.daemon.analysis", str(copy), "--viewer-cache"], check=True,
                   stdout=subprocess.DEVNULL)
    names = {p.name for p in next(copy.glob("plugins/profile/*")).iterdir()}
    assert {"cache_version.txt", ".cached_tools.json", "ALL_HOSTS.op_stats_v2.pb"} <= names, names
    assert any(n.endswith(".SSTABLE") for n in names), names  # the trace viewer's tables
    subprocess.run(["chmod", "-R", "a+rX,a-w", str(readable)], check=True)
    port, grpc_port = free_port(), free_port()
    xprof = Path(sys.executable).with_name("xprof")
    server = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(xprof), "--logdir",
                               str(copy), "--port", str(port), "--grpc_port", str(grpc_port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def get(path: str):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/profile/{path}", timeout=30) as r:
                body = r.read()
                return json.loads(gzip.decompress(body) if r.headers.get("Content-Encoding") == "gzip" else body)

        def runs():
            try:
                return get("runs")
            except OSError:
                assert server.poll() is None, "the xprof server exited"
                return None

        [run_name] = wait_for(runs, 60, message="the xprof server to list the capture")
        assert "overview_page" in get(f"run_tools?run={run_name}")
        [host] = get(f"hosts?run={run_name}&tag=overview_page")
        overview = get(f"data?run={run_name}&tag=overview_page&host={host['hostname']}")
        assert overview[1]["rows"] and overview[1]["p"]["steptime_ms_average"], "the read-only reader got no steps"
        trace = get(f"data?run={run_name}&tag=trace_viewer@&host={host['hostname']}")
        assert trace["traceEvents"]
        assert sorted(p.name for p in next(copy.glob("plugins/profile/*")).iterdir()) == sorted(names)
    finally:
        server.kill()
        server.wait()
        subprocess.run(["chmod", "-R", "u+w", str(readable)], check=True)
        shutil.rmtree(readable)
