"""Captures on pending: the snapshot ring (against a profiler gRPC server of the test's own), discard on
resolve, the discarded counter, budget and cooldown accounting, the UNIMPLEMENTED fallback, the split."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from tfprofd.daemon import captures as captures_module
from tfprofd.daemon.analysis import CaptureAnalysis
from tfprofd.daemon.analysis.onset import drop_time, onset, split_at_drop
from tfprofd.daemon.captures import CaptureService
from tfprofd.daemon.config import CaptureSettings
from tfprofd.daemon.errors import BudgetSpent, CoolingDown
from tfprofd.daemon.jobs import JobRegistry, Target
from tfprofd.daemon.pending import key_of, on_transition
from tfprofd.daemon.policy import CapturePolicy
from tfprofd.daemon.protos import profiler_pb2, xplane_pb2
from tfprofd.daemon.records import RecordStore
from tfprofd.daemon.rules import CLEARED, FIRING, PENDING, RESOLVED, Condition, Engine, Rule, Transition
from tfprofd.daemon.sampler import Snapshot as Sample
from tfprofd.daemon.snapshot_worker import Ring, Snapshot
from tfprofd.exporter.base import Clock
from tfprofd.exporter.nvml import GpuProcesses

from helpers import free_port, wait_for


def xspace(begin_ns: int, end_ns: int, events: int = 200) -> bytes:
    """A trace with TensorFlow ops on an executor thread and a Task Environment window."""
    space = xplane_pb2.XSpace()
    host = space.planes.add(name="/host:CPU")
    host.event_metadata[1].id, host.event_metadata[1].name = 1, "dense/MatMul:MatMul"
    line = host.lines.add(name="tf_Compute", timestamp_ns=begin_ns)
    for i in range(events):
        line.events.add(metadata_id=1, offset_ps=i * 1000, duration_ps=500)
    env = space.planes.add(name="Task Environment")
    for i, (name, value) in enumerate((("profile_start_time", begin_ns), ("profile_stop_time", end_ns)), 1):
        env.stat_metadata[i].id, env.stat_metadata[i].name = i, name
        env.stats.add(metadata_id=i, uint64_value=value)
    return space.SerializeToString()


class FakeProfiler(grpc.GenericRpcHandler):
    """A profiler server at its real boundary (gRPC): with or without the continuous-profiling RPCs."""

    def __init__(self, continuous: bool):
        self.continuous = continuous
        self.calls: list[str] = []
        self.lock = threading.Lock()
        self.since = time.time_ns()
        self.empty: set[str] = set()  # methods that answer with no events (an idle process, a failed session)
        self.gate: threading.Event | None = None  # a Profile call answers only once it is set
        self.fail: set[str] = set()  # methods that answer with an error (INTERNAL)

    def count(self, method: str) -> int:
        with self.lock:
            return self.calls.count(method)

    def service(self, details):
        method = details.method.rsplit("/", 1)[-1]
        if method != "Profile" and not self.continuous:
            return None  # grpc answers UNIMPLEMENTED, as TensorFlow before 2.21 does

        def answer(request: bytes, context) -> bytes:
            if method in self.fail:
                context.abort(grpc.StatusCode.INTERNAL, "refused")
            with self.lock:
                self.calls.append(method)
                gate, empty = (self.gate if method == "Profile" else None), method in self.empty
            if gate is not None:
                gate.wait(60)
            with self.lock:
                begin, self.since = self.since, time.time_ns()
            if empty:
                return profiler_pb2.ProfileResponse(empty_trace=True).SerializeToString()
            if method in ("GetSnapshot", "Profile"):
                return profiler_pb2.ProfileResponse(xspace=xspace(begin, self.since)).SerializeToString()
            return b""

        return grpc.unary_unary_rpc_method_handler(answer)


@contextlib.contextmanager
def serving(handler: FakeProfiler) -> Iterator[tuple[str, grpc.Server]]:
    """The handler as a profiler server on loopback: its address, and the server (stopped at the end)."""
    server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", server
    finally:
        server.stop(0)


@pytest.fixture(params=[True, False], ids=["continuous", "tf_before_2_21"])
def profiler(request):
    handler = FakeProfiler(request.param)
    with serving(handler) as (address, _):
        yield handler, address


class Registry(JobRegistry):
    def __init__(self, address: str):
        super().__init__()
        self.address = address

    def targets(self, job, gpu):
        return [[Target("a", "0", self.address)]]

    def jobs(self):
        return {"a"}


RULE = Rule("throughput_drop", "", (Condition("samples_per_second", below=1.0),), for_seconds=10, cooldown=900)


def service(tmp_path: Path, address: str, **settings) -> CaptureService:
    # device tracer off: a ring is armed on any host, a GPU developer's too (tfprofd arms none where a GPU is)
    base = {"analyze": False, "snapshot_interval": 0.5, "duration": 0.3, "device_tracer_level": 0, **settings}
    return CaptureService(lambda: CaptureSettings(**base), RecordStore(tmp_path),
                          CapturePolicy(Clock(), tmp_path / "alerts.json"), Registry(address), Clock())


def transition(kind: str) -> Transition:
    return Transition(kind, RULE, {"training_job": "a"}, 0.5)


def ended(captures: CaptureService, capture_id: str):
    wait_for(lambda: captures.get(capture_id).status not in ("running", "analyzing"), 60, message="the record to end")
    return captures.get(capture_id)


def discarded(captures: CaptureService) -> dict[str, float]:
    family = next(f for f in captures.collect() if f.name == "tfprofd_captures_discarded")
    return {s.labels["rule"]: s.value for s in family.samples if s.name.endswith("_total")}


def test_a_capture_taken_on_pending_is_kept_when_the_rule_fires(tmp_path, profiler):
    handler, address = profiler
    captures = service(tmp_path, address)
    on_transition(transition(PENDING), captures, True, 1.0, drop_at=time.time() - 3)
    [record] = captures.list()
    if handler.continuous:  # armed at pending: snapshots before the rule fires
        wait_for(lambda: handler.count("GetSnapshot") >= 2, 30, message="two snapshots")
    else:  # older TensorFlow: one capture at once, at pending, traced before the rule fires
        wait_for(lambda: handler.count("Profile") == 1, 30, message="the capture at pending")
        wait_for(lambda: "once rule" in (captures.list()[0].detail or ""), 30, message="the capture traced")
    on_transition(transition(FIRING), captures, True, 1.0, None)
    record = ended(captures, record.id)
    assert record.status == "done", record
    assert "once rule" not in (record.detail or ""), record  # kept: no longer waiting for the rule
    assert len(captures.list()) == 1  # the firing started no second capture
    assert record.context["mode"] == ("snapshots" if handler.continuous else "capture")
    files = [Path(record.directory) / f for f in record.files]
    assert files and all(f.stat().st_size > 1024 for f in files)
    if handler.continuous:
        assert len(files) >= 3 and len({f.parent for f in files}) == len(files)  # consecutive run directories
        assert handler.count("StopContinuousProfiling") == 1
        assert record.started_at < record.requested_at + 5
    assert discarded(captures) == {}


def nvml_lists_a_gpu(captures: CaptureService) -> None:
    """The NVML collector's sample, as the registry gets it: one GPU, no process on it."""
    captures.jobs.on_snapshot(Sample("nvml", time.time(), time.monotonic(), True, 0.0, {},
                                     (GpuProcesses((("0", "GPU-0", frozenset()),)),), lambda: ()))


@pytest.mark.parametrize(("device_tracer_level", "seen_by"), [(1, "nvml"), (0, "nvml"), (1, "driver")])
def test_a_pending_rule_on_a_gpu_host_takes_one_capture_and_arms_no_ring(tmp_path, monkeypatch, device_tracer_level,
                                                                          seen_by):
    """On an H100, JAX's profiler server (TensorFlow's) failed CUPTI at the session a snapshot restarts, and the job
    died of CUDA_ERROR_ILLEGAL_ADDRESS 4 s later (README, Captures). A ring is armed there only with the device
    tracer off (which survived); otherwise one capture at pending, as for TensorFlow before 2.21. The GPU is
    seen by NVML, or (NVML unreadable) by the driver's control device."""
    handler = FakeProfiler(continuous=True)
    with serving(handler) as (address, _):
        captures = service(tmp_path, address, device_tracer_level=device_tracer_level)
        if seen_by == "nvml":
            nvml_lists_a_gpu(captures)
        else:
            control = tmp_path / "nvidiactl"
            control.touch()
            monkeypatch.setattr(captures_module, "NVIDIA_CONTROL", str(control))
        on_transition(transition(PENDING), captures, True, 1.0, drop_at=time.time() - 3)
        [record] = captures.list()
        method = "Profile" if device_tracer_level else "GetSnapshot"
        wait_for(lambda: handler.count(method) >= 1, 30, message=f"the capture at pending ({method})")
        on_transition(transition(FIRING), captures, True, 1.0, None)
        record = ended(captures, record.id)
    assert record.status == "done", record
    if device_tracer_level:
        assert record.context["mode"] == "capture" and "GPU" in record.context["mode_reason"]
        assert handler.count("StartContinuousProfiling") == handler.count("GetSnapshot") == 0
        assert handler.count("Profile") == 1
    else:
        assert record.context["mode"] == "snapshots" and handler.count("StartContinuousProfiling") == 1


def test_a_capture_taken_on_pending_is_discarded_and_counted_when_the_rule_clears(tmp_path, profiler):
    handler, address = profiler
    captures = service(tmp_path, address)
    on_transition(transition(PENDING), captures, True, 1.0, None)
    [record] = captures.list()
    method = "GetSnapshot" if handler.continuous else "Profile"
    wait_for(lambda: handler.count(method) >= 1, 30, message="the capture to run")
    if not handler.continuous:
        wait_for(lambda: list(Path(record.directory).rglob("*.xplane.pb")), 30, message="the trace")
        # traced, the record still says running (the rule decides), and why
        wait_for(lambda: "once rule throughput_drop fires" in (captures.list()[0].detail or ""), 30,
                 message="the record to say it waits for the rule")
        assert captures.list()[0].status == "running"
    on_transition(transition(CLEARED), captures, True, 1.0, None)
    record = ended(captures, record.id)
    assert (record.status, record.reason, record.files) == ("discarded", "cleared", []), record
    assert not Path(record.directory).exists()
    assert discarded(captures) == {"throughput_drop": 1}
    if handler.continuous:
        assert handler.count("StopContinuousProfiling") == 1
    assert captures.policy.busy() == frozenset()
    # it counted: the rule's cooldown holds, and it took a place in the hourly budget
    with pytest.raises(CoolingDown):
        captures.request("rule", "a", rule="throughput_drop", cooldown=900)


def test_a_flapping_rule_cannot_profile_a_job_continuously(tmp_path, profiler, caplog):
    _, address = profiler
    caplog.set_level(logging.INFO, logger="tfprofd")
    captures = service(tmp_path, address, max_per_hour=1)
    for _ in range(3):
        on_transition(transition(PENDING), captures, True, 1.0, None)
        on_transition(transition(CLEARED), captures, True, 1.0, None)
    assert len(captures.list()) == 1
    assert caplog.text.count("rule throughput_drop: no capture") == 2
    assert ended(captures, captures.list()[0].id).status == "discarded"
    on_transition(transition(PENDING), captures, True, 1.0, None)  # once it ended: the cooldown still holds
    assert len(captures.list()) == 1 and "less than its cooldown" in caplog.text
    with pytest.raises(BudgetSpent):  # another rule: the discarded capture took the hour's only place
        captures.request("rule", "a", rule="cpu_bottleneck", cooldown=900)


def test_a_pending_rule_that_never_fires_is_discarded_at_its_deadline(tmp_path, profiler):
    _, address = profiler
    captures = service(tmp_path, address)
    rule = Rule("r", "", RULE.conditions, for_seconds=0.5, cooldown=0)
    on_transition(Transition(PENDING, rule, {"training_job": "a"}, 0.5), captures, True, 0.1, None)
    [record] = captures.list()
    record = ended(captures, record.id)
    assert (record.status, record.reason) == ("discarded", "expired")


def test_a_capture_at_pending_that_fails_says_so_at_once_and_the_firing_captures_again(tmp_path):
    """Nothing answers at the job's address: the record fails now (not when the rule's hour-long ``for`` ends),
    and when the rule then fires it gets a capture of its own rather than the failed one."""
    captures = service(tmp_path, f"127.0.0.1:{free_port()}", snapshots=False)
    rule = Rule("throughput_drop", "", RULE.conditions, for_seconds=3600, cooldown=0)
    on_transition(Transition(PENDING, rule, {"training_job": "a"}, 0.5), captures, True, 1.0, None)
    [first] = captures.list()
    first = ended(captures, first.id)
    assert (first.status, first.reason) == ("failed", "no_server"), first
    on_transition(Transition(FIRING, rule, {"training_job": "a"}, 0.5), captures, True, 1.0, None)
    assert len(captures.list()) == 2
    assert all(ended(captures, r.id).status == "failed" for r in captures.list())


def test_a_capture_at_pending_that_fails_leaves_the_firing_its_own_capture_despite_the_cooldown(tmp_path, profiler):
    """The capture taken on pending booked the rule's cooldown (15 min) and then failed (the process answered with no
    events). The rule's firing still gets a capture of its own, which succeeds: a failed capture does not take the
    firing's turn. With TensorFlow 2.21's ring the firing comes first (the ring is kept, then finds no events); before
    it, the one capture at pending fails before the firing."""
    handler, address = profiler
    handler.empty = {"GetSnapshot"} if handler.continuous else {"Profile"}
    captures = service(tmp_path, address)
    on_transition(transition(PENDING), captures, True, 1.0, None)
    [first] = captures.list()
    if handler.continuous:
        wait_for(lambda: handler.count("GetSnapshot") >= 1, 30, message="the ring's first snapshot")
    else:
        first = ended(captures, first.id)
        assert (first.status, first.reason) == ("failed", "empty_trace"), first
        handler.empty = set()
    on_transition(transition(FIRING), captures, True, 1.0, None)
    first = ended(captures, first.id)
    assert (first.status, first.reason) == ("failed", "empty_trace"), first
    wait_for(lambda: len(captures.list()) == 2, 30, message="the firing's own capture")
    second = ended(captures, captures.list()[0].id)
    assert (second.trigger, second.rule, second.status) == ("rule", "throughput_drop", "done"), second
    assert not (second.context or {}).get("on_pending")
    assert handler.count("Profile") == (1 if handler.continuous else 2)


@pytest.mark.parametrize("resolved", [False, True], ids=["firing", "resolved"])
def test_a_firing_during_the_capture_at_pending_is_not_lost_when_that_capture_fails(tmp_path, resolved):
    """The rule fires while the capture taken on pending still runs (a long capture; on a GPU host the 5 s watch
    after an empty one), so the firing keeps it; then it fails. The firing then captures on its own, unless the rule
    resolved first (a timeout comes up to captures.timeout, 90 s, later): the slowdown is over, and a capture then
    would profile a healthy job and book the cooldown a real firing needs."""
    handler = FakeProfiler(continuous=False)
    handler.empty, handler.gate = {"Profile"}, threading.Event()
    with serving(handler) as (address, _):
        captures = service(tmp_path, address)
        on_transition(transition(PENDING), captures, True, 1.0, None)
        [first] = captures.list()
        wait_for(lambda: handler.count("Profile") == 1, 30, message="the capture at pending to reach the server")
        on_transition(transition(FIRING), captures, True, 1.0, None)
        assert len(captures.list()) == 1  # kept: the firing waits on it
        if resolved:
            on_transition(Transition(RESOLVED, RULE, {"training_job": "a"}, 5.0), captures, True, 1.0, None)
        with handler.lock:
            gate, handler.gate, handler.empty = handler.gate, None, set()  # the next call answers with a trace
        gate.set()  # the capture at pending answers now, with no events
        first = ended(captures, first.id)
        assert (first.status, first.reason) == ("failed", "empty_trace"), first
        if resolved:
            wait_for(lambda: thread_ended(first.id), 30, message="the capture thread to end")
            assert len(captures.list()) == 1, [(r.id, r.status, r.reason) for r in captures.list()]
            return
        wait_for(lambda: len(captures.list()) == 2, 30, message="the firing's own capture")
        second = ended(captures, captures.list()[0].id)
    assert (second.trigger, second.status) == ("rule", "done"), second
    assert handler.count("Profile") == 2


@pytest.mark.parametrize("late", [False, True], ids=["prompt", "late"])
def test_a_rule_whose_captures_keep_failing_gets_at_most_two_a_cooldown(tmp_path, monkeypatch, late):
    """A failed capture at pending hands its cooldown back once per cooldown: a flapping rule on a job whose profiler
    never answers does not fail a capture at every pending. A transition that sees the record failed sees its
    cooldown lifted too, however late the capture thread runs (``late``: 0.3 s late at lifting it)."""
    if late:
        forgive = CapturePolicy.forgive

        def late_forgive(self, rule, addresses):
            time.sleep(0.3)  # a busy 2-core host: the capture thread runs late
            return forgive(self, rule, addresses)

        monkeypatch.setattr(CapturePolicy, "forgive", late_forgive)
    captures = service(tmp_path, f"127.0.0.1:{free_port()}", snapshots=False)
    for _ in range(3):
        on_transition(transition(PENDING), captures, True, 1.0, None)
        for record in captures.list():
            ended(captures, record.id)
        on_transition(transition(CLEARED), captures, True, 1.0, None)
    on_transition(transition(FIRING), captures, True, 1.0, None)
    records = captures.list()
    assert [(r.status, r.reason) for r in records] == [("failed", "no_server")] * 2, records
    with pytest.raises(CoolingDown):
        captures.request("rule", "a", rule="throughput_drop", cooldown=900)


def thread_ended(capture_id: str) -> bool:
    return not [t for t in threading.enumerate() if t.name == f"tfprofd-capture-{capture_id}"]


def test_a_ring_whose_process_died_holds_the_job_and_the_firing_does_not_recapture_it(tmp_path):
    """The snapshot ring's process died (its port closed): the record says 'died', which holds the job's automatic
    captures (README: 'only this reason holds the job's automatic captures'). The firing's recapture must be refused,
    as it is after a died capture in the one-capture mode."""
    handler = FakeProfiler(continuous=True)
    handler.empty = {"GetSnapshot"}  # the ring holds nothing
    with serving(handler) as (address, server):
        captures = service(tmp_path, address)
        on_transition(transition(PENDING), captures, True, 1.0, None)
        [first] = captures.list()
        wait_for(lambda: handler.count("GetSnapshot") >= 1, 30, message="the ring's first snapshot")
        server.stop(0).wait()  # the job's process dies: its port closes
        on_transition(transition(FIRING), captures, True, 1.0, None)
        first = ended(captures, first.id)
    assert (first.status, first.reason) == ("failed", "died"), first
    wait_for(lambda: thread_ended(first.id), 30, message="the capture thread (and its _failed) to end")
    assert len(captures.list()) == 1, [(r.id, r.status, r.reason) for r in captures.list()]
    assert "a" in captures.policy.held(), "a died ring does not hold the job"


class HangingSnapshots(FakeProfiler):
    """GetSnapshot hangs once ``hang`` is set (a slow last snapshot while the ring is kept)."""

    def __init__(self):
        super().__init__(continuous=True)
        self.hang, self.release, self.hanging = threading.Event(), threading.Event(), threading.Event()

    def service(self, details):
        handler = super().service(details)
        if handler is None or not details.method.endswith("/GetSnapshot"):
            return handler
        inner = handler.unary_unary

        def answer(request, context):
            if self.hang.is_set():
                self.hanging.set()
                self.release.wait(60)
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(answer)


def test_no_recapture_is_started_after_the_agent_stopped(tmp_path):
    """The rule fired and kept the ring; the agent stops while the ring's last snapshot is taken (stop kills the
    ring's worker). No capture may start after that."""
    handler = HangingSnapshots()
    with serving(handler) as (address, _):
        captures = service(tmp_path, address)
        on_transition(transition(PENDING), captures, True, 1.0, None)
        [first] = captures.list()
        wait_for(lambda: handler.count("GetSnapshot") >= 1, 30, message="the ring's first snapshot")
        handler.hang.set()
        on_transition(transition(FIRING), captures, True, 1.0, None)
        wait_for(handler.hanging.is_set, 30, message="a snapshot that hangs")
        captures.stop()
        first = ended(captures, first.id)
        wait_for(lambda: thread_ended(first.id), 30, message="the capture thread (and its _failed) to end")
        records = captures.list()
        handler.release.set()
    assert len(records) == 1, [(r.id, r.trigger, r.status, r.reason, r.detail) for r in records]


def test_one_jobs_failed_capture_at_pending_does_not_discard_another_jobs_good_one(tmp_path):
    """A rule without a training_job label (a GPU's or the host's) captures every job it covers, all waiting on one
    pending entry. Job b's capture fails at once (nothing answers); job a's is traced. b's failure must not decide
    the shared entry 'cleared' and so discard a's good capture: the rule then fires and a's capture is its turn.
    b is captured anew for the firing."""
    handler = FakeProfiler(continuous=False)
    dead = f"127.0.0.1:{free_port()}"
    with serving(handler) as (address, _):

        class TwoJobs(Registry):
            def targets(self, job, gpu):
                groups = [[Target("a", "0", address)], [Target("b", "0", dead)]]
                return [g for g in groups if job in (None, g[0].job)]

            def jobs(self):
                return {"a", "b"}

        captures = service(tmp_path, "unused", snapshots=False)
        captures.jobs = TwoJobs("unused")
        gpu_rule = lambda kind: Transition(kind, RULE, {"gpu": "0"}, 0.5)  # noqa: E731
        on_transition(gpu_rule(PENDING), captures, True, 1.0, None)
        by_job = {r.job: r for r in captures.list()}
        b = ended(captures, by_job["b"].id)
        assert (b.status, b.reason) == ("failed", "no_server"), b
        wait_for(lambda: thread_ended(b.id), 30, message="b's capture thread (and its _failed) to end")
        on_transition(gpu_rule(FIRING), captures, True, 1.0, None)
        a = ended(captures, by_job["a"].id)
        wait_for(lambda: len(captures.list()) == 3, 30, message="b captured anew for the firing")
    assert a.status == "done", (a.status, a.reason, a.detail)
    again = captures.list()[0]
    assert (again.job, again.trigger, ended(captures, again.id).reason) == ("b", "rule", "no_server")


def test_capture_on_pending_off_captures_when_the_rule_fires(tmp_path, profiler):
    handler, address = profiler
    captures = service(tmp_path, address)
    on_transition(transition(PENDING), captures, False, 1.0, None)
    assert captures.list() == []
    on_transition(transition(FIRING), captures, False, 1.0, None)
    record = ended(captures, captures.list()[0].id)
    assert record.status == "done" and handler.count("Profile") == 1


def test_the_ring_is_bounded_in_count_and_bytes():
    ring = Ring(keep=3, max_bytes=10_000)
    for i in range(5):
        ring.add(Snapshot(bytes(1000), i, i + 1))
    assert [s.begin_ns for s in ring.items] == [2, 3, 4] and ring.dropped == 2 and ring.bytes == 3000
    ring.add(Snapshot(bytes(9500), 5, 6))  # the newest fits alone: the older ones go
    assert [s.begin_ns for s in ring.items] == [5] and ring.bytes == 9500
    ring.add(Snapshot(bytes(20_000), 6, 7))  # over the bound by itself: nothing is kept
    assert not ring.items and ring.bytes == 0


def test_a_ring_worker_keeps_only_the_newest_snapshots(tmp_path):
    handler = FakeProfiler(True)
    with serving(handler) as (address, _):
        captures = service(tmp_path, address, snapshot_keep=2)
        on_transition(transition(PENDING), captures, True, 1.0, None)
        wait_for(lambda: handler.count("GetSnapshot") >= 4, 30, message="four snapshots")
        on_transition(transition(FIRING), captures, True, 1.0, None)
        record = ended(captures, captures.list()[0].id)
    assert record.status == "done" and len(record.files) == 2 and "older ones dropped" in record.detail


def test_a_ring_is_armed_in_the_capture_worker_started_ahead_and_a_new_one_waits(tmp_path):
    handler = FakeProfiler(True)
    with serving(handler) as (address, _):
        captures = service(tmp_path, address)
        captures.start_workers()
        try:
            wait_for(lambda: captures.capture_workers.state().ready, 60, message="a capture worker started ahead")
            first = captures.capture_workers.state().pid
            on_transition(transition(PENDING), captures, True, 1.0, None)
            wait_for(lambda: handler.count("StartContinuousProfiling") == 1, 30, message="the ring armed")
            wait_for(lambda: captures.capture_workers.state().ready, 60, message="a new worker started ahead")
            on_transition(transition(FIRING), captures, True, 1.0, None)
            record = ended(captures, captures.list()[0].id)
            used = next(f for f in captures.collect() if f.name == "tfprofd_capture_workers_used")
            used = {s.labels["start"]: s.value for s in used.samples if s.name.endswith("_total")}
        finally:
            captures.stop()
    assert record.status == "done" and record.context["mode"] == "snapshots" and record.files
    assert used == {"prestarted": 1, "cold": 0}  # arming was an RPC, not a process start
    assert captures.capture_workers.state().pid != first


def test_the_engine_says_when_a_pending_rule_clears_without_firing():
    engine = Engine([RULE], {"samples_per_second": ("training", ("training_job",))})
    signals = {"samples_per_second": [({"training_job": "a"}, 0.5)]}
    kinds = [t.kind for t in engine.observe("training", 0.0, signals, lambda labels: True)]
    assert kinds == [PENDING]
    signals = {"samples_per_second": [({"training_job": "a"}, 5.0)]}
    [t] = engine.observe("training", 1.0, signals, lambda labels: True)
    assert t.kind == CLEARED and key_of(t) == ("throughput_drop", (("training_job", "a"),))


def test_the_split_finds_where_step_time_jumps():
    assert split_at_drop([10, 11, 10, 10, 30, 32, 31, 11]) == 4
    assert split_at_drop([10, 10, 40, 10, 10]) is None  # one long step is no drop
    assert split_at_drop([30, 31, 30]) is None  # already slow: nothing before it
    assert split_at_drop([10, 10, 10, 30]) == 3  # the last step counts
    noisy_start = [0.5, 0.1, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.4, 0.4, 0.4]  # warm-up, then the drop at 8
    assert drop_time(list(enumerate(noisy_start))) == 8
    assert drop_time(list(enumerate([0.1] * 10))) is None


def facts(cycle: float, begin_s: float, input_ms: float) -> CaptureAnalysis:
    """A snapshot's analysis: steps of ``cycle`` ms, ``input_ms`` of each waiting for input."""
    parts = {"input_wait": input_ms, "host_compute": cycle - input_ms}
    return CaptureAnalysis.from_json({
        "host": "h", "trace": f"/x/{begin_s}/h.xplane.pb", "bottleneck": "input", "why": "", "summary": "input: ...",
        "recommendation": "", "steps": 20, "window": [int(begin_s * 1e9), int((begin_s + 2) * 1e9)],
        "step_time_ms": {"mean": cycle, "stdev": 0, "min": cycle, "max": cycle}, "breakdown_ms": parts,
        "breakdown": {k: v / cycle for k, v in parts.items()}, "input_bound_ratio": input_ms / cycle,
        "cycle_ms": cycle, "between_ms": {}, "ratios": {}})


def test_snapshots_that_hold_the_drop_compare_the_steps_before_with_the_steps_after():
    result = onset([facts(10, 100, 1), facts(10, 102, 1), facts(40, 104, 31), facts(41, 106, 32)], 103.5)
    section = result.onset
    assert section.holds_drop and section.first_slow_step_after_drop_s == 0.0
    assert section.drop_at == 104 and result.lead.cycle_ms == 41 and section.trace_begins_at == 100
    assert section.comparison.step_ms == (10, 41, 31)
    assert "+31.0 ms waiting for input" in section.comparison.summary and "holds the drop" in result.summary
    assert CaptureAnalysis.from_json(result.to_json()).onset == section  # stored in the record and read back


def test_a_trace_that_begins_after_the_drop_says_how_long_after():
    section = onset([facts(40, 110, 31), facts(41, 112, 32)], 103.0).onset
    assert not section.holds_drop and section.first_slow_step_after_drop_s == pytest.approx(7.0)


def test_capture_on_pending_is_set_by_yaml_env_or_flag_and_validated(tmp_path):
    from tfprofd.daemon import config

    path = tmp_path / "tfprofd.yaml"
    path.write_text("captures:\n  on_pending: false\n  snapshot_keep: 4\n")
    cfg = config.load(str(path), env={"TFPROFD_CAPTURES_SNAPSHOT_INTERVAL": "1s"},
                      flags={"captures.snapshots": "false"})
    assert (cfg.captures.on_pending, cfg.captures.snapshot_keep, cfg.captures.snapshot_interval,
            cfg.captures.snapshots) == (False, 4, 1.0, False)
    assert config.load(None, env={}).captures.on_pending is True
    path.write_text("captures:\n  snapshot_keep: 0\n  snapshot_interval: 10ms\n")
    with pytest.raises(config.ConfigError) as info:
        config.load(str(path), env={})
    text = " ".join(map(str, info.value.problems))
    assert "captures.snapshot_keep" in text and "captures.snapshot_interval" in text


def test_the_engine_gives_a_jobs_recent_step_times_for_the_drop_estimate():
    outlier = Rule("step_time_outlier", "", (Condition("step_seconds", "mean", 20, above_baseline=2, baseline=600),))
    engine = Engine([RULE, outlier], {"samples_per_second": ("training", ("training_job",)),
                                      "step_seconds": ("training", ("training_job", "worker"))})
    for t, value in enumerate([0.01] * 6 + [0.3, 0.3]):
        engine.observe("training", float(t), {"step_seconds": [({"training_job": "a", "worker": "0"}, value)],
                                              "samples_per_second": [({"training_job": "a"}, 5.0)]}, lambda _: True)
    points = engine.history("step_seconds", {"training_job": "a"})
    assert len(points) == 8 and drop_time(points) == 6.0
    assert engine.history("step_seconds", {"training_job": "b"}) == []


def test_a_capture_at_pending_whose_worker_cannot_start_leaves_the_firing_its_turn(tmp_path, monkeypatch):
    """Out of processes or descriptors, the capture worker cannot start: the capture fails with that reason, and the
    firing is not lost behind it (the cooldown it booked is lifted, the job captured anew)."""
    from tfprofd.daemon import workers

    def no_process(module, args, ready_fd=None):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(workers, "_spawn", no_process)
    captures = service(tmp_path, f"127.0.0.1:{free_port()}", snapshots=False)
    on_transition(transition(PENDING), captures, True, 1.0, None)
    [first] = captures.list()
    first = ended(captures, first.id)
    assert (first.status, first.reason) == ("failed", "error") and "cannot start a capture worker" in first.detail
    on_transition(transition(FIRING), captures, True, 1.0, None)
    assert len(captures.list()) == 2  # the firing's own capture (which fails the same way)


def test_a_ring_that_cannot_arm_frees_the_process_before_the_firing_captures_it_anew(tmp_path, monkeypatch):
    """The profiler refuses to arm continuous profiling (an error, not UNIMPLEMENTED): the capture fails. A firing
    that comes as the failure is recorded captures the job anew: the process is not still marked busy."""
    from tfprofd.daemon import pending

    handler = FakeProfiler(continuous=True)
    handler.fail = {"StartContinuousProfiling"}
    apply = pending._apply

    def fired_meanwhile(record, result, now, analyze):
        on_transition(transition(FIRING), captures, True, 1.0, None)
        apply(record, result, now, analyze)

    monkeypatch.setattr(pending, "_apply", fired_meanwhile)
    with serving(handler) as (address, _):
        captures = service(tmp_path, address)
        on_transition(transition(PENDING), captures, True, 1.0, None)
        [first] = captures.list()
        first = ended(captures, first.id)
        assert first.status == "failed", first
        wait_for(lambda: len(captures.list()) == 2, 30, message="the firing's own capture")
        second = ended(captures, captures.list()[0].id)
    assert second.status == "done" and not second.context.get("on_pending"), second
