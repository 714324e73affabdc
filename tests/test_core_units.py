"""The core's parts on their own: the capture policy, the capture service, the sampling runner."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path

import pytest

from tfprofd.daemon.captures import CaptureService
from tfprofd.daemon.config import CaptureSettings
from tfprofd.daemon.errors import BudgetSpent, CaptureBusy, CoolingDown, StorageError
from tfprofd.daemon.jobs import JobRegistry, Target
from tfprofd.daemon.policy import CapturePolicy
from tfprofd.daemon.records import RecordStore
from tfprofd.daemon.sampler import WAKE_RATE, CollectorRunner, SamplingThread
from tfprofd.daemon.workers import Outcome
from tfprofd.exporter.base import Clock, Collector, Environment

from helpers import FakeClock, wait_for

GPU1 = [Target("a", "0", "127.0.0.1:1111")]
GPU2 = [Target("b", "0", "127.0.0.1:2222")]


def test_the_hourly_budget_counts_on_monotonic_time_not_the_wall_clock(tmp_path):
    clock = FakeClock()
    policy = CapturePolicy(clock, tmp_path / "alerts.json")
    policy.release(policy.admit(GPU1, max_per_hour=2))
    policy.release(policy.admit(GPU1, max_per_hour=2))
    clock.wall += 7200  # the wall clock jumps two hours ahead: the hour is not over
    with pytest.raises(BudgetSpent):
        policy.admit(GPU1, max_per_hour=2)
    clock.mono += 3600
    policy.release(policy.admit(GPU1, max_per_hour=2))


def test_cooldown_is_per_rule_and_target(tmp_path):
    clock = FakeClock()
    policy = CapturePolicy(clock, tmp_path / "alerts.json")
    policy.release(policy.admit(GPU1, 100, rule="low_gpu_utilization", cooldown=900))
    policy.release(policy.admit(GPU2, 100, rule="low_gpu_utilization", cooldown=900))  # another GPU's job
    policy.release(policy.admit(GPU1, 100, rule="throughput_drop", cooldown=900))  # another rule
    with pytest.raises(CoolingDown):
        policy.admit(GPU1, 100, rule="low_gpu_utilization", cooldown=900)
    clock.wall -= 3600  # a wall-clock step back does not extend it either
    clock.mono += 901
    policy.release(policy.admit(GPU1, 100, rule="low_gpu_utilization", cooldown=900))


def test_one_capture_per_process_at_a_time(tmp_path):
    policy = CapturePolicy(FakeClock(), tmp_path / "alerts.json")
    admission = policy.admit(GPU1, 100)
    with pytest.raises(CaptureBusy):
        policy.admit(GPU1 + GPU2, 100)
    policy.release(admission)
    policy.release(policy.admit(GPU1 + GPU2, 100))


def test_a_capture_released_twice_never_frees_a_later_capture_of_the_same_process(tmp_path):
    """A capture hands its process back once its trace is taken and again when it ends (after its analysis,
    or a pending capture's wait): the second release must not clear a later capture's busy mark."""
    policy = CapturePolicy(FakeClock(), tmp_path / "alerts.json")
    first = policy.admit(GPU1, 100)
    policy.release(first)  # its trace is taken
    second = policy.admit(GPU1, 100)
    policy.release(first)  # the first one ends
    with pytest.raises(CaptureBusy):
        policy.admit(GPU1, 100)
    policy.release(second)
    policy.release(policy.admit(GPU1, 100))


@pytest.mark.parametrize("content", [b"null", b"123", b"[1]", b"{not json", b'{"a": "yesterday"}', b"\xff\xfe"])
def test_a_corrupt_alert_ledger_is_set_aside_with_the_reason(tmp_path, caplog, content):
    path = tmp_path / "alerts.json"
    path.write_bytes(content)
    policy = CapturePolicy(FakeClock(), path)
    assert not policy.alert_handled("x|y")
    assert not path.exists() and len(list(tmp_path.glob("alerts.json.bad-*"))) == 1
    assert str(path) in caplog.text and "set aside" in caplog.text
    policy.remember_alert("x|y")
    assert CapturePolicy(FakeClock(), path).alert_handled("x|y")


class Registry(JobRegistry):
    """A job registry that knows one job, as if the hook had reported it."""

    def targets(self, job, gpu):
        return [GPU1]

    def jobs(self):
        return {"a"}


def service(tmp_path, **settings) -> CaptureService:
    store = RecordStore(tmp_path)
    policy = CapturePolicy(FakeClock(), tmp_path / "alerts.json")
    return CaptureService(lambda: CaptureSettings(**settings), store, policy, Registry(), Clock())


def test_a_capture_whose_worker_raises_ends_failed_and_frees_its_process(tmp_path, monkeypatch):
    captures = service(tmp_path)

    def explode(*args, **kwargs):
        raise RuntimeError("the worker could not even start")

    monkeypatch.setattr(captures.capture_workers, "run", explode)
    [record] = captures.request("manual")
    wait_for(lambda: captures.get(record.id).status not in ("running", "analyzing"), 10, message="the record to end")
    record = captures.get(record.id)
    assert (record.status, record.reason) == ("failed", "error") and "could not even start" in record.detail
    assert captures.policy.busy() == frozenset()
    path = tmp_path / "records" / f"{record.id}.json"  # saved once the thread ends, after the status is final
    wait_for(lambda: json.loads(path.read_text())["status"] == "failed", 10, message="the failed record saved")
    running = next(f for f in captures.collect() if f.name == "tfprofd_captures_running")
    assert running.samples[0].value == 0


def test_stop_leaves_no_record_running_on_disk_when_a_capture_thread_is_slow_to_end(tmp_path, monkeypatch):
    """On a busy host a capture thread may not end before the agent exits: its record must still be final."""
    captures = service(tmp_path)
    entered, release = threading.Event(), threading.Event()

    def slow(*args, **kwargs):
        entered.set()
        release.wait(30)
        return Outcome("stopped", None, "the agent stopped")

    monkeypatch.setattr(captures.capture_workers, "run", slow)
    [record] = captures.request("manual")
    assert entered.wait(10)
    captures.stop(timeout=0.01)
    saved = json.loads((tmp_path / "records" / f"{record.id}.json").read_text())
    assert (saved["status"], saved["reason"]) == ("failed", "agent_stopped"), saved
    release.set()
    wait_for(lambda: captures.get(record.id).status == "failed", 10, message="the thread to end")
    saved = json.loads((tmp_path / "records" / f"{record.id}.json").read_text())
    assert (saved["status"], saved["reason"]) == ("failed", "agent_stopped"), saved


def test_a_failed_analysis_ends_the_record_and_a_good_one_finishes_it(tmp_path, monkeypatch):
    captures = service(tmp_path)
    monkeypatch.setattr(captures.capture_workers, "run",
                        lambda *a, **k: Outcome("ok", {"status": "done", "files": ["x.xplane.pb"], "rpc_sent_at": 1.0}))
    monkeypatch.setattr(captures.analysis_workers, "run", lambda *a, **k: Outcome("timeout", None, "killed"))
    [record] = captures.request("manual")
    wait_for(lambda: captures.get(record.id).status not in ("running", "analyzing"), 10, message="the record to end")
    assert (captures.get(record.id).status, captures.get(record.id).reason) == ("analysis_failed", "analysis_error")
    assert captures.policy.busy() == frozenset()


GOOD_ANALYSIS = {"host": "w0", "trace": "/x/w0.xplane.pb", "bottleneck": "input", "why": "input-bound: 40% of each "
                 "10.0 ms step waits for input (4.0 ms)", "summary": "input: input-bound", "recommendation": "prefetch",
                 "hardware": "CPU_ONLY", "steps": 12, "capture_seconds": 1.0,
                 "step_time_ms": {"mean": 10.0, "stdev": 1.0, "min": 9.0, "max": 12.0},
                 "breakdown_ms": {"input_wait": 4.0, "host_compute": 6.0},
                 "breakdown": {"input_wait": 0.4, "host_compute": 0.6}, "input_bound_ratio": 0.4,
                 "ops": {"input": [{"name": "Iterator::Map", "ms_per_step": 3.0, "ms_total": 36.0}]},
                 "evidence": {"steps": 12, "span_share": 0.9, "capture_seconds": 1.0, "sufficient": True}}


@pytest.mark.parametrize("printed, status", [({**GOOD_ANALYSIS, "steps": "many"}, "analysis_failed"),
                                             ({**GOOD_ANALYSIS, "ops": {"input": "Map"}}, "analysis_failed"),
                                             (GOOD_ANALYSIS, "done")], ids=["steps", "ops", "good"])
def test_the_analysis_worker_output_is_read_into_the_typed_record(tmp_path, monkeypatch, printed, status):
    """What the analysis worker prints is checked at the process boundary: a malformed analysis fails the record
    with the field named; a good one is stored, and reads back the same from disk."""
    captures = service(tmp_path)
    monkeypatch.setattr(captures.capture_workers, "run",
                        lambda *a, **k: Outcome("ok", {"status": "done", "files": ["x.xplane.pb"], "rpc_sent_at": 1.0}))
    monkeypatch.setattr(captures.analysis_workers, "run", lambda *a, **k: Outcome("ok", printed))
    [record] = captures.request("manual")
    wait_for(lambda: captures.get(record.id).status not in ("running", "analyzing"), 10, message="the record to end")
    record = captures.get(record.id)
    assert record.status == status, record.detail
    if status != "done":
        assert record.detail.startswith("the analysis worker printed a malformed analysis: analysis field"), \
            record.detail
        assert record.analysis is None
        return
    assert record.analysis.lead.step_time_ms.mean == 10.0 and record.analysis.lead.ops.input[0].name == "Iterator::Map"
    [reloaded] = [r for r in RecordStore(tmp_path).load() if r.id == record.id]
    assert reloaded.analysis == record.analysis
    bottleneck = next(f for f in captures.collect() if f.name == "tfprofd_capture_bottleneck_info")
    assert [s.labels for s in bottleneck.samples] in ([], [{"training_job": record.job, "kind": "input"}])


def test_no_space_for_the_record_is_a_storage_error_that_frees_the_process(tmp_path, monkeypatch):
    captures = service(tmp_path)

    def full(record):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(captures.store, "save", full)
    with pytest.raises(StorageError, match="No space left"):
        captures.request("manual")
    assert captures.policy.busy() == frozenset()
    assert sorted(os.listdir(tmp_path / "captures")) == []  # no directory left that no record names
    monkeypatch.undo()
    assert captures.request("manual")  # the hourly budget was refunded, the process is free


def test_no_capture_code_ever_sets_a_setgid_bit(tmp_path, monkeypatch):
    """systemd's RestrictSUIDSGID refuses chmod with S_ISGID: the agent must never need one."""
    calls = []
    real_chmod = os.chmod

    def guarded(path, mode, *args, **kwargs):
        calls.append(mode)
        if mode & 0o6000:
            raise PermissionError(errno.EPERM, "Operation not permitted (RestrictSUIDSGID)")
        return real_chmod(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "chmod", guarded)
    state = tmp_path / "state"
    state.mkdir(mode=0o750)
    real_chmod(state, 0o2750)  # the unit's StateDirectoryMode: setgid, set by systemd, not by the agent
    captures = service(state, mode="server")
    captures.capture_workers.run = lambda *a, **k: Outcome("ok", {"status": "failed", "reason": "no_server"})
    [record] = captures.request("manual")
    directory = Path(record.directory)
    assert directory.stat().st_mode & 0o7777 == 0o2770  # group-writable for the training user, group inherited
    assert not any(mode & 0o6000 for mode in calls)


class Flaky(Collector):
    name = "flaky"
    section = "collectors.flaky"

    def __init__(self, settings, env):
        super().__init__(settings, env)
        self.samples = 0

    def sample(self):
        self.samples += 1
        return True

    def collect(self):
        return iter(())


def test_a_failing_subscriber_is_isolated_and_sampling_goes_on(caplog):
    collector = Flaky(None, Environment())
    seen = []

    def full_disk(snapshot):
        raise OSError(errno.ENOSPC, "No space left on device")

    runner = CollectorRunner(collector, lambda: 0.01, Clock(), [full_disk, seen.append])
    runner.start()
    try:
        wait_for(lambda: len(seen) >= 5, 10, message="sampling to go on past the failing subscriber")
        assert runner.state().healthy and runner.state().success
        assert caplog.text.count("failed on a snapshot") == 1  # the same failure is logged once
    finally:
        runner.stop()


def test_wake_samples_before_the_interval_but_a_flood_of_wakes_is_rate_limited():
    collector = Flaky(None, Environment())
    runner = CollectorRunner(collector, lambda: 3600.0, Clock())
    runner.start()
    try:
        wait_for(lambda: collector.samples == 1, 10, message="the first sample")
        collector.wake()
        wait_for(lambda: collector.samples == 2, 10, message="a woken sample long before the interval")
        started = time.monotonic()
        while time.monotonic() - started < 1.0:  # a flood of new processes, each asking for a sample
            collector.wake()
        elapsed = time.monotonic() - started
        assert collector.samples - 2 <= WAKE_RATE * elapsed + 2, collector.samples
    finally:
        runner.stop()


def test_a_dead_sampling_thread_turns_the_collector_unhealthy(caplog):
    class Dying(Flaky):
        def sample(self):
            super().sample()
            if self.samples >= 3:
                raise SystemExit("gone")  # not an Exception: escapes the per-sample guard
            return True

    runner = CollectorRunner(Dying(None, Environment()), lambda: 0.01, Clock())
    runner.start()
    wait_for(lambda: "died" in (runner.state().problem or ""), 10, message="the runner to notice its thread died")
    state = runner.state()
    assert not state.success and "sampling thread died: SystemExit" in state.problem
    assert runner.serving() is None
    assert "sampling thread died" in caplog.text


def test_a_collector_with_a_dead_background_thread_is_unhealthy():
    class Listener(Flaky):
        problem_text = None

        def problem(self):
            return self.problem_text

    collector = Listener(None, Environment())
    runner = CollectorRunner(collector, lambda: 0.01, Clock())
    runner.sample_once()
    assert runner.state().healthy
    collector.problem_text = "hook listener died: RecursionError"
    assert not runner.state().healthy and not runner.state().success and runner.serving() is None


def test_an_overdue_sample_is_unhealthy_until_it_returns():
    release = threading.Event()

    class Hung(Flaky):
        def sample(self):
            if self.samples:
                release.wait(30)
            return super().sample()

    clock = FakeClock()
    runner = CollectorRunner(Hung(None, Environment()), lambda: 1.0, clock)
    runner.sample_once()
    thread = threading.Thread(target=runner.sample_once, daemon=True)
    thread.start()
    wait_for(lambda: runner._sampling_since is not None, 5, message="the sample to block")
    assert runner.state().healthy
    clock.mono += runner.stale_after() + 1
    state = runner.state()
    assert not state.healthy and not state.success and "in progress" in state.problem
    assert runner.serving() is None
    release.set()
    thread.join(5)
    assert runner.state().healthy


def _space(lines: dict[str, list[str]]) -> bytes:
    from tfprofd.daemon.protos import xplane_pb2

    space = xplane_pb2.XSpace()
    host = space.planes.add(name="/host:CPU")
    names: dict[str, int] = {}
    for line_name, events in lines.items():
        line = host.lines.add(name=line_name, timestamp_ns=1)
        for n, name in enumerate(events):
            metadata_id = names.setdefault(name, len(names) + 1)
            host.event_metadata[metadata_id].name = name
            line.events.add(metadata_id=metadata_id, offset_ps=n * 1000, duration_ps=500)
    space.planes.add(name="Task Environment")
    return space.SerializeToString()


def test_a_trace_of_a_process_that_only_answered_the_hook_is_an_empty_trace():
    from tfprofd.daemon.capture_worker import _is_empty

    hook_reads = ["EagerExecute", "ReadVariableOp", "TFE_Py_FastPathExecute_C"] * 100  # the reporter's reads
    idle = _space({"python": hook_reads, "tfprofd-hook": hook_reads})
    assert len(idle) > 2048 and _is_empty(idle)
    assert not _is_empty(_space({"python": hook_reads, "tf_Compute/1": ["dense/MatMul:MatMul"] * 10}))


def test_the_job_registry_says_where_a_job_trains_for_each_kind_of_series():
    from tfprofd.daemon.sampler import Snapshot
    from tfprofd.exporter.nvml import GpuProcesses
    from tfprofd.exporter.training import ProcessView, TrainingProcesses

    def snapshot(collector: str, *facts) -> Snapshot:
        return Snapshot(collector, 0.0, 0.0, True, 0.0, {}, facts, lambda: [])

    registry = JobRegistry()
    assert not registry.is_training({})
    registry.on_snapshot(snapshot("training", TrainingProcesses((
        ProcessView("a", "0", 10, True, "train", True, None), ProcessView("a", "1", 11, True, "eval", False, None),
        ProcessView("b", "0", 12, True, "train", False, None)))))  # b's process went quiet
    assert registry.is_training({"training_job": "a", "worker": "0"})
    assert not registry.is_training({"training_job": "a", "worker": "1"})
    assert registry.is_training({"training_job": "a"}) and not registry.is_training({"training_job": "b"})
    assert registry.is_training({"gpu": "0"}) and registry.is_training({})  # NVML lists none: anywhere on the host
    registry.on_snapshot(snapshot("cpu"))  # a collector without facts changes nothing
    registry.on_snapshot(snapshot("nvml", GpuProcesses((("0", "u0", frozenset({11})), ("1", "u1", frozenset({10})),
                                                        ("2", "u2", frozenset({99}))))))
    assert registry.is_training({"gpu": "1"})  # a's worker 0 trains there
    assert not registry.is_training({"gpu": "0"}) and not registry.is_training({"gpu": "2"})
    registry.forget("training")
    assert not registry.is_training({"gpu": "1"}) and not registry.is_training({"training_job": "a"})


def test_collectors_that_never_block_take_turns_on_one_thread_each_interval():
    """Six collectors on threads of their own were six cold wakes a second (issue 24): those that only read
    /proc share one thread, which samples them together each interval, a woken one alone at once, and keeps
    sampling the others when one is stopped or added back."""
    shared = SamplingThread("sampler", lambda: 3600.0, Clock(), shared=True)
    first, second = Flaky(None, Environment()), Flaky(None, Environment())
    runners = [CollectorRunner(c, lambda: 3600.0, Clock()) for c in (first, second)]
    try:
        for runner in runners:
            runner.start(shared)
        wait_for(lambda: first.samples == second.samples == 1, 10, message="both sampled at once")
        threads = {t.name for t in threading.enumerate()}
        assert "tfprofd-sampler" in threads and "tfprofd-flaky" not in threads
        second.wake()
        wait_for(lambda: second.samples == 2, 10, message="a woken sample long before the interval")
        assert first.samples == 1
        runners[1].stop()
        second.wake()
        first.wake()
        wait_for(lambda: first.samples == 2, 10, message="the other collector sampled on")
        assert second.samples == 2
        again = CollectorRunner(second, lambda: 3600.0, Clock())
        again.start(shared)
        wait_for(lambda: second.samples == 3, 10, message="a collector enabled again")
    finally:
        for runner in runners:
            runner.stop()
        shared.stop()
        shared.join(10)
    assert "tfprofd-sampler" not in {t.name for t in threading.enumerate()}


def test_a_collector_on_a_thread_of_its_own_ends_it_when_stopped():
    runner = CollectorRunner(Flaky(None, Environment()), lambda: 3600.0, Clock())
    runner.start()
    wait_for(lambda: runner.collector.samples == 1, 10, message="the first sample")
    runner.stop()
    runner.join(10)
    assert "tfprofd-flaky" not in {t.name for t in threading.enumerate()}


def test_wakes_during_samples_that_end_past_their_due_time_never_stop_the_sampling():
    """A sample that ended after the next one was due, with a wake asked during it, slept a negative time:
    the shared thread died, and with it every collector on it."""
    class Slow(Flaky):
        def sample(self):
            self.wake()  # as the training collector's listener does for each new process
            time.sleep(0.1)  # a woken sample 0.1 s after a scheduled one ends past the next (0.25 s)
            return super().sample()

    collector = Slow(None, Environment())
    runner = CollectorRunner(collector, lambda: 0.25, Clock())
    runner.start()
    try:
        wait_for(lambda: collector.samples >= 12 or "died" in (runner.state().problem or ""), 30,
                 message="twelve samples")
        assert "died" not in (runner.state().problem or "")
    finally:
        runner.stop()


def test_a_collector_enabled_again_on_a_dead_shared_thread_says_the_thread_died():
    """The shared thread died (with every collector on it); a collector enabled again by a reload joins it: its
    health must say why nothing samples it, not "no sample yet" forever."""
    class Dying(Flaky):
        def sample(self):
            raise SystemExit("gone")  # not an Exception: escapes the per-sample guard

    shared = SamplingThread("sampler", lambda: 3600.0, Clock(), shared=True)
    dying = CollectorRunner(Dying(None, Environment()), lambda: 3600.0, Clock())
    dying.start(shared)
    wait_for(lambda: "died" in (dying.state().problem or ""), 10, message="the shared thread to die")
    again = CollectorRunner(Flaky(None, Environment()), lambda: 3600.0, Clock())
    again.start(shared)
    state = again.state()
    assert not state.healthy and "sampling thread died: SystemExit" in (state.problem or ""), state.problem


def test_a_collector_stopped_while_another_samples_is_not_sampled_again():
    """A reload that disables a collector while the shared thread samples another: the disabled one, though it
    asked for a sample, is not sampled after stop() (its collector is being closed)."""
    clock = FakeClock()
    disabled = Flaky(None, Environment())
    stopped = CollectorRunner(disabled, lambda: 3600.0, clock)

    class Reloading(Flaky):
        def sample(self):
            if self.samples == 1:  # its second sample: the reload happens meanwhile
                disabled.wake()
                stopped.stop()
            return super().sample()

    reloading = Reloading(None, Environment())
    shared = SamplingThread("sampler", lambda: 3600.0, clock, shared=True)
    first = CollectorRunner(reloading, lambda: 3600.0, clock)
    try:
        first.start(shared)
        stopped.start(shared)
        wait_for(lambda: reloading.samples == 1 and disabled.samples == 1, 10, message="both sampled at once")
        for turn in (2, 3):  # the turn during which the other is stopped, then a later one
            clock.mono += 1.0  # past the wake rate limit: a wake is sampled at once
            reloading.wake()
            wait_for(lambda turn=turn: reloading.samples == turn, 10, message=f"sample {turn}")
        assert disabled.samples == 1
    finally:
        first.stop()
        shared.stop()
        shared.join(10)


def test_each_jobs_newest_baseline_is_found_without_reading_every_jobs_records(tmp_path, monkeypatch):
    """The baseline scheduler asks for a steady job's newest baseline at each sample, and retention keeps each job's
    newest: with 1,000 jobs that is 1,000 records, and a scan of all of them per question read a million records a
    sample (issue 24). Each job's newest is still found, also once retention deleted older ones, reading a few
    records per question."""
    from tfprofd.daemon.records import CaptureRecord

    store = RecordStore(tmp_path)
    jobs = [f"job{i:04d}" for i in range(1000)]
    for i, job in enumerate(jobs):
        for k, at in enumerate((1000.0 + i, 5000.0 + i)):  # two baselines each, the second the newer
            store.save(CaptureRecord(id=f"20261128T0000{k:02d}Z-{i:06x}", trigger="baseline", job=job, targets=[],
                                     requested_at=at, duration_ms=500, mode="server", status="done",
                                     finished_at=at + 1))
    captures = service(tmp_path, keep=1)
    reads = [0]
    getattribute = CaptureRecord.__getattribute__

    def counted(record, name):
        reads[0] += 1
        return getattribute(record, name)

    monkeypatch.setattr(CaptureRecord, "__getattribute__", counted)
    assert [captures.last_baseline_time(job) for job in jobs] == [5000.0 + i for i in range(len(jobs))]
    assert reads[0] < 20 * len(jobs)
    monkeypatch.undo()
    captures.enforce_retention()  # keep=1 (none is analysed, so no job's newest baseline is kept for comparisons)
    assert [r.job for r in captures.list()] == ["job0999"]
    assert [captures.last_baseline_time(job) for job in (*jobs[:3], jobs[-1])] == [None, None, None, 5999.0]


def test_retention_keeps_the_baseline_later_captures_compare_with_not_one_from_the_future(tmp_path):
    """A baseline asked for before the wall clock stepped back (a host booted a day ahead, then NTP) is a job's newest
    by its time, but a capture asked for now compares with the newest baseline asked for before it: retention must
    keep that one (it kept the one from the future, and deleted the one the job's captures compare with)."""
    import time

    from tfprofd.daemon.analysis import CaptureAnalysis
    from tfprofd.daemon.records import CaptureRecord

    now = time.time()
    store = RecordStore(tmp_path)
    analysed = CaptureAnalysis.from_json({"bottleneck": "device", "summary": "device: compute-bound", "steps": 50})
    for k, (trigger, at) in enumerate((("baseline", now - 7200), ("baseline", now - 600), ("manual", now - 60),
                                      ("baseline", now + 86400))):
        store.save(CaptureRecord(id=f"20261129T0000{k:02d}Z-00000{k}", trigger=trigger, job="a", targets=[],
                                 requested_at=at, duration_ms=500, mode="server", status="done", finished_at=at + 1,
                                 analysis=analysed))
    captures = service(tmp_path, keep=1)
    probe = CaptureRecord(id="20261129T000100Z-000009", trigger="rule", job="a", targets=[], requested_at=now,
                          duration_ms=500, mode="server")
    assert captures.baseline_of(probe).requested_at == now - 600
    captures.enforce_retention()
    assert captures.baseline_of(probe) is not None and captures.baseline_of(probe).requested_at == now - 600
