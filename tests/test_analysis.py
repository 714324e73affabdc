"""Analysis failures: corrupt, truncated and empty traces, and traces without step markers."""

from __future__ import annotations

import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FIXTURES, job_reporting, metric_value, start_training, wait_capture, wait_for

pytestmark = pytest.mark.tf


def analyze_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfprofd.daemon", "analyze", *args], capture_output=True, text=True,
                          timeout=120)


def test_corrupt_trace_is_a_clear_error(tmp_path):
    trace = tmp_path / "plugins/profile/2026_01_01_00_00_00/host_1.xplane.pb"
    trace.parent.mkdir(parents=True)
    trace.write_bytes(os.urandom(4096))
    result = analyze_cli(str(tmp_path))
    assert result.returncode == 1 and "cannot analyse host_1.xplane.pb: not a readable profile" in result.stderr
    as_json = analyze_cli(str(trace), "--json")
    assert as_json.returncode == 1 and "corrupt or truncated" in json.loads(as_json.stdout)["error"]
    assert trace.exists()  # the raw file stays


def test_empty_and_missing_traces(tmp_path):
    trace = tmp_path / "tiny.xplane.pb"
    trace.write_bytes(b"\x0a" * 200)
    assert "an empty trace" in analyze_cli(str(trace)).stderr
    assert "does not exist" in analyze_cli(str(tmp_path / "nothing-here")).stderr
    (tmp_path / "empty-dir").mkdir()
    assert "no .xplane.pb under" in analyze_cli(str(tmp_path / "empty-dir")).stderr


@pytest.fixture(scope="module")
def unmarked(tmp_path_factory):
    """An agent, and a capture of a Keras job trained without step markers."""
    from helpers import AgentProcess

    tmp = tmp_path_factory.mktemp("analysis")
    (tmp / "tfprofd.yaml").write_text("rules: []\n")
    agent = AgentProcess(tmp, args=["--config", str(tmp / "tfprofd.yaml"), "--captures.max-per-hour", "100"]).start()
    job = start_training(agent.hook_port, "--job", "plain", "--no-markers", "--seconds", "600")  # killed at the end
    try:
        wait_for(lambda: (metric_value(agent.scrape(), "tfprofd_training_steps_total", training_job="plain") or 0) > 50,
                 90, message="the unmarked job to train")
        status, answer = agent.call("POST", "/captures", {"job": "plain", "duration_ms": 1000})
        assert status == 202, answer
        record = wait_capture(agent, answer["id"], timeout=180)
        yield agent, record
    finally:
        job.kill()
        job.wait()
        agent.stop()


def test_a_fit_without_step_markers_gets_inferred_steps_and_says_so(unmarked):
    agent, record = unmarked
    assert record["status"] == "done", record
    analysis = record["analysis"]
    assert analysis["steps_inferred"] is True and analysis["steps"] > 0, analysis["summary"]
    assert "executions of tf.function 'multi_step_on_iterator'" in analysis["steps_found"], analysis["steps_found"]
    kind = analysis["bottleneck"]
    assert kind != "unknown", analysis["summary"]
    assert metric_value(agent.scrape(), "tfprofd_capture_bottleneck_info", training_job="plain", kind=kind) == 1
    # no viewer cache beside the trace (built on demand: tfprofd analyze --viewer-cache): the bytes are the trace's
    directory = Path(record["directory"])
    trace = directory / record["files"][0]
    assert record["bytes"] == trace.stat().st_size


def test_truncated_trace_is_a_clear_error_and_keeps_the_files(unmarked, tmp_path):
    _, record = unmarked
    source = Path(record["directory"]) / record["files"][0]
    trace = tmp_path / "captures" / "truncated" / record["files"][0]
    trace.parent.mkdir(parents=True)
    trace.write_bytes(source.read_bytes()[: source.stat().st_size // 3])
    result = analyze_cli(str(tmp_path / "captures" / "truncated"), "--json")  # what the agent's worker runs
    assert result.returncode == 1 and "corrupt or truncated" in json.loads(result.stdout)["error"]
    assert trace.exists()


def test_idle_process_gives_empty_trace_and_the_stub_is_deleted(unmarked, tmp_path):
    agent, _ = unmarked
    job = start_training(agent.hook_port, "--job", "idle", "--idle", "40", "--seconds", "1")
    try:
        wait_for(lambda: job_reporting(agent, "idle"), 90, message="the idle job to report")
        status, answer = agent.call("POST", "/captures", {"job": "idle", "duration_ms": 1000})
        assert status == 202, answer
        record = wait_capture(agent, answer["id"], timeout=120)
    finally:
        job.kill()
        job.wait()
    assert (record["status"], record["reason"]) == ("failed", "empty_trace"), record
    assert not list(Path(record["directory"]).glob("**/*.xplane.pb"))
    assert agent.proc.poll() is None
    shutil.rmtree(record["directory"], ignore_errors=True)


@pytest.mark.parametrize("as_json", [False, True], ids=["report", "json"])
def test_a_reader_that_goes_away_ends_the_analysis_quietly(tmp_path, as_json):
    """`tfprofd analyze ... | head`: the reader closes the pipe before the report is written."""
    trace = tmp_path / "localhost.xplane.pb"
    trace.write_bytes(lzma.decompress((FIXTURES / "traces" / "plain-small_batch.xplane.pb.xz").read_bytes()))
    proc = subprocess.Popen([sys.executable, "-m", "tfprofd.daemon", "analyze", str(trace), *(["--json"] * as_json)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before anything is written: every write meets a closed pipe
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, stderr
    assert stderr == "", stderr  # no BrokenPipeError traceback, no "Exception ignored" at exit


@pytest.mark.parametrize("where", ["load", "timeline"])
def test_a_timeline_that_cannot_be_read_is_said_not_hidden(tmp_path, monkeypatch, where):
    """Our own read of the trace fails (parsing it, in the first pass; or building the timeline, in the thread
    beside xprof): xprof's tables still give a verdict, and the analysis says the timeline is missing from it,
    with why (it used to be dropped unsaid)."""
    from tfprofd.daemon.analysis import worker
    from tfprofd.daemon.analysis.model import WorkerAnalysis

    def broken(*args):
        raise RuntimeError("stat metadata 42 is missing")

    monkeypatch.setattr(worker, where, broken)
    trace = tmp_path / "localhost.xplane.pb"
    trace.write_bytes(lzma.decompress((FIXTURES / "traces" / "plain-input_bottleneck.xplane.pb.xz").read_bytes()))
    analysis = worker.analyze_worker(trace)
    assert analysis.timeline_error == "RuntimeError: stat metadata 42 is missing"
    assert "the trace's timeline could not be read (RuntimeError: stat metadata 42 is missing)" in analysis.summary
    assert WorkerAnalysis.from_json(json.loads(json.dumps(analysis.to_json()))) == analysis
