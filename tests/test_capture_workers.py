"""The capture worker that waits, pre-started: used by the next capture, replaced when it exits, still isolated.

The training job's profiler here is a TCP listener that never answers (a stuck profiler server): no
TensorFlow needed, and every capture ends at the agent's timeout with its worker killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Iterator

import psutil
import pytest
from fake_profiler import FakeProfiler

from tfprofd.exporter.hook import Reporter

from helpers import AgentProcess, http, job_reporting, metric_value, wait_for

WORKER = "tfprofd.daemon.capture_worker"


@contextlib.contextmanager
def job_agent(tmp_path, job: str, profiler: str, args: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> Iterator[AgentProcess]:
    """An agent with a 5 s capture timeout (the least allowed) and a job ``job`` whose profiler is at ``profiler``."""
    agent = AgentProcess(tmp_path, args=["--captures.timeout", "5s", "--captures.duration", "500ms",
                                         "--captures.baseline", "false", "--captures.analyze", "false", *args],
                         env=env).start()
    reporter = Reporter(job=job, profiler=False, addr=f"127.0.0.1:{agent.hook_port}")
    reporter.profiler_address = profiler
    reporter.phase = "train"
    reporter.start()
    try:
        wait_for(lambda: job_reporting(agent, job), 20, message="the job to report")
        yield agent
    finally:
        reporter.close()
        agent.stop()


@contextlib.contextmanager
def stuck_profiler() -> Iterator[str]:
    """The address of a profiler server that accepts connections and never answers."""
    with socket.socket() as stuck:
        stuck.bind(("127.0.0.1", 0))
        stuck.listen(16)
        yield f"127.0.0.1:{stuck.getsockname()[1]}"


@pytest.fixture
def rig(tmp_path):
    """An agent whose job's profiler accepts and never answers: every capture ends at the timeout."""
    with stuck_profiler() as profiler, job_agent(tmp_path, "stuck", profiler) as agent:
        yield agent


def workers(agent: AgentProcess) -> list[psutil.Process]:
    """The agent's capture worker processes that are alive."""
    found = []
    for child in psutil.Process(agent.proc.pid).children():
        try:
            if WORKER in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def spare(agent: AgentProcess) -> psutil.Process:
    """The one worker waiting for a capture (none is running), once it says it is ready."""
    waiting = wait_for(lambda: (found := workers(agent)) and len(found) == 1 and found[0], 30,
                       message="a capture worker waiting before any capture")
    wait_for(lambda: (h := capture_health(agent))["ready"] and h["pid"] == waiting.pid, 30,
             message="the waiting worker to be ready")
    return waiting


def capture_health(agent: AgentProcess) -> dict:
    status, body = http("GET", agent.url + "/healthz")
    assert status == 200, body
    return body["workers"]["capture"]


def test_a_capture_runs_in_the_worker_started_before_it_and_a_stuck_one_is_killed_at_the_timeout(rig):
    agent = rig
    waiting = spare(agent)
    status, answer = agent.call("POST", "/captures", {"job": "stuck"})
    assert status == 202, answer
    record = wait_for(lambda: (r := agent.call("GET", f"/captures/{answer['id']}")[1])["status"] != "running" and r,
                      30, message="the stuck capture to end")
    assert (record["status"], record["reason"]) == ("failed", "timeout"), record
    assert "the worker was killed" in record["detail"]
    assert f"capture {answer['id']}: worker pid {waiting.pid} (pre-started)" in agent.log()
    wait_for(lambda: not waiting.is_running() or waiting.status() == psutil.STATUS_ZOMBIE, 10,
             message="the stuck worker to be gone")
    replacement = spare(agent)
    assert replacement.pid != waiting.pid
    text = agent.scrape()
    assert metric_value(text, "tfprofd_capture_workers_used_total", start="prestarted") == 1
    assert metric_value(text, "tfprofd_capture_workers_used_total", start="cold") == 0
    assert metric_value(text, "tfprofd_capture_worker_ready") == 1


def test_a_waiting_worker_that_is_killed_is_replaced_and_health_says_so(rig):
    agent = rig
    waiting = spare(agent)
    os.kill(waiting.pid, signal.SIGKILL)
    replacement = wait_for(lambda: (found := workers(agent)) and found[0].pid != waiting.pid and found[0], 30,
                           message="a new waiting worker")
    health = wait_for(lambda: (h := capture_health(agent))["pid"] == replacement.pid and h["ready"] and h, 30,
                      message="/healthz to show the new worker ready")
    assert health["idle_exits"] == 1
    assert f"worker (pid {waiting.pid}) exited while idle with signal SIGKILL" in health["last_exit"], health
    assert metric_value(agent.scrape(), "tfprofd_capture_worker_idle_exits_total") == 1
    assert f"pid {waiting.pid}) exited while idle" in agent.log()
    status, answer = agent.call("POST", "/captures", {"job": "stuck"})  # the replacement takes the capture
    assert status == 202, answer
    wait_for(lambda: f"capture {answer['id']}: worker pid {replacement.pid} (pre-started)" in agent.log(), 30,
             message="the capture to end in the replacement")


def test_sigterm_leaves_no_capture_worker_behind(rig):
    agent = rig
    waiting = spare(agent)
    status, answer = agent.call("POST", "/captures", {"job": "stuck", "duration_ms": 20000})
    assert status == 202, answer
    both = wait_for(lambda: (found := workers(agent)) and len(found) == 2 and found, 30,
                    message="the capture's worker and the next one waiting")
    assert waiting.pid in {p.pid for p in both}
    agent.stop()
    assert agent.proc.returncode == 0
    wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in both), 10,
             message="every capture worker to be gone")


def test_the_start_lead_is_none_for_one_target_and_follows_the_slowest_connection_for_several():
    from tfprofd.daemon.capture_worker import MAX_LEAD_S, MIN_LEAD_S, start_lead

    assert start_lead([None]) == 0.0  # one process: nothing to line up, it starts at once
    assert start_lead([0.0005, 0.001]) == MIN_LEAD_S  # loopback: the floor
    assert start_lead([0.01, 0.06]) == pytest.approx(0.12)  # twice the slowest
    assert start_lead([0.01, 2.0]) == MAX_LEAD_S  # bounded
    assert start_lead([0.01, None]) == pytest.approx(0.02)  # one did not connect: its call fails anyway
    assert start_lead([None, None]) == MAX_LEAD_S


_STOP_WHEN_FLAGGED = """
import os, signal, sys
if "tfprofd.daemon.capture_worker" in sys.orig_argv and os.path.exists({flag!r}):
    os.kill(os.getpid(), signal.SIGSTOP)  # an import that hangs: this worker never says it is ready
"""


def test_a_waiting_worker_that_never_gets_ready_takes_no_capture_and_is_replaced(tmp_path):
    """A pre-started worker stuck before it was ready was kept for good, and the next capture was handed to it
    (and ended at its timeout, blaming the profiler server)."""
    flag, hooks = tmp_path / "hang", tmp_path / "site"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_STOP_WHEN_FLAGGED.format(flag=str(flag)))
    env = {"PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")])}
    with stuck_profiler() as profiler, job_agent(tmp_path, "stuck", profiler, env=env) as agent:
        first = spare(agent)
        flag.touch()  # from now on, every worker hangs before it is ready
        os.kill(first.pid, signal.SIGKILL)
        hung = wait_for(lambda: (found := workers(agent)) and found[0].pid != first.pid
                        and found[0].status() == psutil.STATUS_STOPPED and found[0], 30, message="a hung spare")
        status, answer = agent.call("POST", "/captures", {"job": "stuck"})
        assert status == 202, answer
        wait_for(lambda: f"capture {answer['id']}: worker pid" in agent.log(), 30, message="the capture's worker")
        assert f"worker pid {hung.pid}" not in agent.log() and "started on request" in agent.log()
        flag.unlink()
        health = wait_for(lambda: (h := capture_health(agent))["ready"] and h["pid"] != hung.pid and h, 60,
                          message="the stuck worker replaced by a ready one")
        assert f"(pid {hung.pid}) was not ready 30s after it started" in health["last_exit"], health
        assert not psutil.pid_exists(hung.pid) or psutil.Process(hung.pid).status() == psutil.STATUS_ZOMBIE


def test_a_capture_that_starts_later_is_not_killed_before_its_trace(tmp_path):
    """captures.timeout counts from the trace's start: a delay (or a job-wide capture's instant ahead) comes
    first. With a 5 s timeout and an 8 s delay the worker was killed before its trace began, and the record
    blamed the profiler server."""
    profiler = FakeProfiler()
    try:
        with job_agent(tmp_path, "later", profiler.address, ("--captures.delay", "8s")) as agent:
            status, answer = agent.call("POST", "/captures", {"job": "later"})
            assert status == 202, answer
            record = wait_for(lambda: (r := agent.call("GET", f"/captures/{answer['id']}")[1])["status"]
                              != "running" and r, 60, message="the capture to end")
        assert (record["status"], record["reason"]) == ("done", None), record
        [request] = profiler.requests
        assert request.opts.start_timestamp_ns / 1e9 - record["requested_at"] >= 7.5  # it did start 8 s later
    finally:
        profiler.stop()


@pytest.mark.parametrize("host", ["gpu", "cpu"])
def test_a_process_that_dies_just_after_an_empty_capture_on_a_gpu_host_is_named_died_and_held(tmp_path, request,
                                                                                             host):
    """On an H100, a JAX job's profiling session whose CUPTI setup failed answered with no events, and the job
    crashed 1-3 s later (README, Known issues). The record said "was the process idle?" and nothing held the
    job's automatic captures, so a restarted job could be captured and crashed again. Only a GPU host watches:
    on a CPU host an idle process that answers with no trace and then exits normally is no crash."""
    env = request.getfixturevalue("gpus").env() if host == "gpu" else None
    profiler = FakeProfiler(dies_after=1.0)
    try:
        with job_agent(tmp_path, "crashes", profiler.address, env=env) as agent:
            status, answer = agent.call("POST", "/captures", {"job": "crashes"})
            assert status == 202, answer
            record = wait_for(lambda: (r := agent.call("GET", f"/captures/{answer['id']}")[1])["status"]
                              != "running" and r, 60, message="the capture to end")
            held = metric_value(agent.scrape(), "tfprofd_capture_held_seconds", training_job="crashes")
    finally:
        profiler.stop()
    if host == "gpu":
        assert (record["status"], record["reason"]) == ("failed", "died"), record
        assert "within seconds of a capture that came back with no trace" in record["detail"], record
        assert "collected no events" in record["detail"]  # what the answer itself said
        assert held is not None and held > 0
    else:
        assert (record["status"], record["reason"]) == ("failed", "empty_trace"), record
        assert not held
