"""Jobs of several workers: MultiWorkerMirroredStrategy counting, one capture window, a worker dying."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from helpers import AgentProcess, free_port, metric_value, start_training, wait_capture, wait_for

pytestmark = pytest.mark.tf

JOBS = Path(__file__).parent / "jobs"


def mwms_workers(agent: AgentProcess, job: str, steps: int) -> list[subprocess.Popen]:
    """Two MultiWorkerMirroredStrategy workers on localhost reporting to ``agent`` every 50 ms."""
    cluster = {"worker": [f"localhost:{free_port()}", f"localhost:{free_port()}"]}
    procs = []
    for index in (0, 1):
        env = {**os.environ, "TFPROFD_ADDR": f"127.0.0.1:{agent.hook_port}",
               "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})}
        procs.append(subprocess.Popen([sys.executable, str(JOBS / "multi_worker.py"), "--job", job, "--steps",
                                       str(steps), "--report-interval", "0.05"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _counts(agent: AgentProcess, job: str, worker: str) -> tuple[float | None, float | None]:
    text = agent.scrape()
    return (metric_value(text, "tfprofd_training_steps_total", training_job=job, worker=worker),
            metric_value(text, "tfprofd_training_samples_total", training_job=job, worker=worker))


def test_multi_worker_mirrored_workers_train_unharmed_and_each_counts_its_own_samples(agents):
    agent = agents()
    for run in range(2):  # reading a sum-on-read counter once aborted these runs in a collective mismatch
        job = f"mwms{run}"
        procs = mwms_workers(agent, job, steps=400)
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (_, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, err[-3000:]
        for out, _ in outs:  # each worker trained on its half of every global batch of 64
            truth = json.loads(out.strip().splitlines()[-1])
            assert (truth["steps"], truth["samples"]) == (400, 400 * 32), truth
            wait_for(lambda w=truth["worker"], j=job: _counts(agent, j, w) == (400, 400 * 32), 10,
                     message=f"{truth['worker']}'s own counts, got {_counts(agent, job, truth['worker'])}")


@pytest.fixture
def two_workers(tmp_path):
    """An agent and one job of two worker processes (each with its profiler server), training a minute."""
    agent = AgentProcess(tmp_path, args=["--captures.baseline", "false"]).start()
    procs = [start_training(agent.hook_port, "--job", "pair", "--worker", f"worker-{i}", "--seconds", "90",
                            "--map-delay", "0.0002") for i in (0, 1)]
    try:
        wait_for(lambda: all(metric_value(agent.scrape(), "tfprofd_training_samples_per_second", training_job="pair",
                                          worker=f"worker-{i}") for i in (0, 1)), 120, message="both workers to train")
        yield agent, procs
    finally:
        for p in procs:
            p.kill()
            p.wait()
        agent.stop()


@pytest.mark.parametrize("mode", ["agent", "server"])
def test_one_capture_traces_every_worker_of_a_job_over_one_window(two_workers, mode):
    agent, _ = two_workers
    if mode == "server":
        agent.stop()
        agent.args += ["--captures.mode", "server"]
        agent.start()
        wait_for(lambda: all(metric_value(agent.scrape(), "tfprofd_training_up", training_job="pair",
                                          worker=f"worker-{i}") == 1 for i in (0, 1)), 30,
                 message="both workers to report to the restarted agent")
    status, answer = agent.call("POST", "/captures", {"job": "pair"})
    assert status == 202, answer
    record = wait_capture(agent, answer["id"], timeout=180)
    assert record["status"] == "done", record
    assert len(record["files"]) == 2 and {t["worker"] for t in record["targets"]} == {"worker-0", "worker-1"}
    analysis = record["analysis"]
    assert len(analysis["workers"]) == 2 and all(w["steps"] for w in analysis["workers"]), analysis["workers"]
    assert analysis["window_skew_ms"] < 250, analysis["window_skew_ms"]  # one window, not one after the other


def _connected(port: int) -> bool:
    return any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
               for c in psutil.net_connections(kind="tcp"))


def test_a_worker_that_dies_during_a_capture_is_named_and_holds_automatic_captures(two_workers):
    agent, procs = two_workers
    status, answer = agent.call("POST", "/captures", {"job": "pair"})
    assert status == 202, answer
    victim = next(t for t in answer_targets(agent, answer["id"]) if t["worker"] == "worker-1")
    port = int(victim["address"].rpartition(":")[2])
    wait_for(lambda: _connected(port), 30, 0.02, message="the capture to reach worker-1's profiler server")
    procs[1].send_signal(signal.SIGKILL)  # as TensorFlow's profiler crash takes a worker down (README)
    record = wait_capture(agent, answer["id"], timeout=120)
    assert (record["status"], record["reason"]) == ("failed", "partial"), record
    assert "stopped answering during the capture" in record["detail"] and victim["address"] in record["detail"]
    held = metric_value(agent.scrape(), "tfprofd_capture_held_seconds", training_job="pair")
    assert held is not None and held > 3600
    alert = {"status": "firing", "labels": {"alertname": "LowThroughput", "training_job": "pair",
                                            "instance": socket.gethostname()},
             "startsAt": "2026-11-21T10:00:00Z", "fingerprint": "held1"}
    status, outcome = agent.call("POST", "/alerts", {"version": "4", "status": "firing", "alerts": [alert]})
    assert status == 200 and not outcome["captures"], outcome
    assert "died during its last capture" in outcome["ignored"][0]["why"], outcome
    status, answer = agent.call("POST", "/captures", {"job": "pair"})  # a person may still ask
    assert status == 202, answer


def answer_targets(agent: AgentProcess, capture_id: str) -> list[dict]:
    status, record = agent.call("GET", f"/captures/{capture_id}")
    assert status == 200, record
    return record["targets"]
