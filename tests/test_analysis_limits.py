"""Long captures are analysed or fail saying what to do: time queued for an analysis worker is not counted
against its timeout, a trace too large for captures.analysis_max_memory fails ``too_large`` before xprof
starts, and the agent's analysis leaves the capture's directory as the capture wrote it (no viewer cache)."""

from __future__ import annotations

import json
import lzma
import time
from pathlib import Path

from test_core_units import FakeClock, Registry

from tfprofd.daemon.captures import CaptureService, default_analysis_memory
from tfprofd.daemon.config import CaptureSettings
from tfprofd.daemon.policy import CapturePolicy
from tfprofd.daemon.records import RecordStore
from tfprofd.daemon.workers import Outcome, WorkerPool
from tfprofd.exporter.base import Clock

from helpers import wait_for

FIXTURES = Path(__file__).parent / "fixtures"


def test_a_queue_wait_past_its_bound_fails_saying_so(tmp_path, monkeypatch):
    pool = WorkerPool("analysis", limit=1)
    assert pool._slots.acquire()  # the only slot taken
    outcome = pool.run("json.tool", [], "{}", timeout=60, queue_timeout=0.5)
    assert outcome.status == "queued" and "no free analysis worker within" in outcome.detail, outcome
    assert outcome.queued_s >= 0.5


def test_the_default_memory_budget_is_a_quarter_of_what_the_agent_may_use(tmp_path):
    """A fast job's default 2 s capture (54 MB, about 4 GB to analyse) must not be too large on a host with room
    for it: the budget follows the host, and a cgroup limit below the host's memory."""
    import psutil

    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "cgroup").write_text("0::/system.slice/tfprofd.service\n")
    unit = tmp_path / "cg" / "system.slice" / "tfprofd.service"
    unit.mkdir(parents=True)
    (unit / "memory.max").write_text("max\n")
    host = psutil.virtual_memory().total
    assert default_analysis_memory(tmp_path, tmp_path / "cg") == host // 4
    (unit / "memory.max").write_text(f"{2 * 2**30}\n")
    assert default_analysis_memory(tmp_path, tmp_path / "cg") == min(host, 2 * 2**30) // 4


def service(tmp_path: Path, traces: list[bytes | int], **settings) -> CaptureService:
    """A capture service whose capture worker writes the next of ``traces`` (bytes, or a sparse file of that
    size) and whose analysis worker is the real one."""
    captures = CaptureService(lambda: CaptureSettings(**settings), RecordStore(tmp_path),
                              CapturePolicy(FakeClock(), tmp_path / "alerts.json"), Registry(), Clock())

    def capture(module: str, args: list[str], stdin: str, timeout: float) -> Outcome:
        run = Path(json.loads(stdin)["logdir"]) / "plugins" / "profile" / "run"
        run.mkdir(parents=True)
        path = run / "w0.xplane.pb"
        trace = traces.pop(0)
        if isinstance(trace, bytes):
            path.write_bytes(trace)
        else:
            with path.open("wb") as f:
                f.truncate(trace)
        return Outcome("ok", {"status": "done", "files": [str(path)], "rpc_sent_at": 1.0})

    captures.capture_workers.run = capture  # type: ignore[method-assign]
    return captures


def finished(captures: CaptureService, record_id: str):
    wait_for(lambda: captures.get(record_id).status not in ("running", "analyzing"), 120,
             message="the record to end")
    return captures.get(record_id)


def test_time_queued_for_an_analysis_worker_is_not_counted_against_its_timeout(tmp_path):
    """One analysis worker, busy with another capture's analysis for longer than captures.analysis_timeout:
    this capture waits, then is analysed with its whole timeout."""
    small = lzma.decompress((FIXTURES / "traces" / "plain-small_batch.xplane.pb.xz").read_bytes())
    captures = service(tmp_path, [small], analysis_timeout=10)
    captures.analysis_workers = WorkerPool("analysis", limit=1)
    assert captures.analysis_workers._slots.acquire()  # a slow analysis holds the only worker
    [record] = captures.request("manual")
    wait_for(lambda: captures.get(record.id).status == "analyzing", 30, message="the analysis to be asked for")
    queued_at = time.monotonic()
    wait_for(lambda: time.monotonic() - queued_at > 11, 20, message="a wait past the analysis timeout")
    captures.analysis_workers._slots.release()
    record = finished(captures, record.id)
    assert record.status == "done", (record.status, record.reason, record.detail)


def test_a_too_large_trace_fails_too_large_with_advice_and_the_agent_goes_on(tmp_path):
    """A 100 MB trace against a 512 MiB budget: refused before xprof starts, with what to do; the next
    capture is taken and analysed as usual."""
    small = lzma.decompress((FIXTURES / "traces" / "plain-small_batch.xplane.pb.xz").read_bytes())
    captures = service(tmp_path, [100 * 10**6, small], analysis_max_memory=512 * 2**20, max_per_hour=100)
    [record] = captures.request("manual")
    record = finished(captures, record.id)
    assert (record.status, record.reason) == ("analysis_failed", "too_large"), (record.status, record.reason,
                                                                                 record.detail)
    assert "shorter captures" in record.detail and "captures.analysis_max_memory (512 MiB)" in record.detail
    assert Path(record.files[0]).stat().st_size == 100 * 10**6  # the trace is kept
    assert captures.policy.busy() == frozenset()
    [after] = captures.request("manual")
    assert finished(captures, after.id).status == "done", captures.get(after.id).detail


def test_the_agents_analysis_leaves_the_capture_as_it_was_written(tmp_path):
    """No viewer cache: the directory holds the trace alone, and the record's bytes are the trace's (xprof
    writes its cache when someone opens a copy)."""
    trace = lzma.decompress((FIXTURES / "traces" / "plain-small_batch.xplane.pb.xz").read_bytes())
    captures = service(tmp_path, [trace])
    [record] = captures.request("manual")
    record = finished(captures, record.id)
    assert record.status == "done", record.detail
    files = sorted(p.relative_to(record.directory) for p in Path(record.directory).rglob("*") if p.is_file())
    assert files == [Path("plugins/profile/run/w0.xplane.pb")]
    assert record.bytes == len(trace)


def test_a_trace_whose_events_need_more_than_the_budget_is_refused_before_xprof_reads_it(tmp_path):
    """``tfprofd analyze --max-memory``, as the agent runs it: a trace small in bytes whose events need more than
    the budget is refused with the estimate and what to do, and nothing is written beside it; with the
    estimate as the budget it is analysed. The estimate counts every event and, on long lines, a sample of
    their stats: within 1% of counting them all on the recorded traces, every other event a marker included."""
    import subprocess
    import sys

    from tfprofd.daemon.analysis.memory import BASE_BYTES, BYTES_PER_EVENT, BYTES_PER_STAT, needed_memory
    from tfprofd.daemon.analysis.timeline import load
    from tfprofd.daemon.protos import xplane_pb2

    run = tmp_path / "capture" / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    trace = run / "host.xplane.pb"
    trace.write_bytes(lzma.decompress((FIXTURES / "traces" / "plain-small_batch.xplane.pb.xz").read_bytes()))
    space = load(trace)
    events = sum(len(line.events) for plane in space.planes for line in plane.lines)
    stats = sum(len(event.stats) for plane in space.planes for line in plane.lines for event in line.events)
    estimate = needed_memory(space)
    assert abs(estimate / (BASE_BYTES + BYTES_PER_EVENT * events + BYTES_PER_STAT * stats) - 1) < 0.01
    patterned = xplane_pb2.XSpace()
    line = patterned.planes.add(name="/host:CPU").lines.add(name="python")
    for i in range(10_000):  # every other event a marker with 8 stats: a sample in step with it would be 0 or 2x
        event = line.events.add(metadata_id=1, offset_ps=i)
        for _ in range(8 if i % 2 else 0):
            event.stats.add(metadata_id=1, int64_value=i)
    sampled_stats = (needed_memory(patterned) - BASE_BYTES - BYTES_PER_EVENT * 10_000) / BYTES_PER_STAT
    assert abs(sampled_stats / 40_000 - 1) < 0.05, sampled_stats

    def analyze(budget: int) -> tuple[int, dict]:
        done = subprocess.run([sys.executable, "-m", "tfprofd.daemon.analysis", str(tmp_path / "capture"), "--json",
                               "--max-memory", str(budget)], capture_output=True, text=True, timeout=600)
        return done.returncode, json.loads(done.stdout)

    code, answer = analyze(estimate - 1)
    assert code == 1 and answer["reason"] == "too_large", answer
    assert f"needs about {estimate / 2**20:.0f} MiB" in answer["error"] and "shorter captures" in answer["error"]
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [trace]  # xprof never opened it
    code, answer = analyze(estimate)
    assert code == 0 and answer["steps"] > 0, answer
