"""The host context of a capture: parsing procfs, the job/others split, the contention verdict and its join
with the trace's verdict (fixture /proc trees: tests/fixtures/hostcontext)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tfprofd.daemon.analysis import CaptureAnalysis
from tfprofd.daemon.hostcontext import (
    HostContext,
    TraceVerdict,
    apply,
    contention,
    descendants,
    join,
    listening_inodes,
    measure,
    parse_pid_stat,
    parse_proc_stat,
    parse_schedstat,
    read_edge,
)
from tfprofd.daemon.jobs import Target
from tfprofd.daemon.policy import CapturePolicy
from tfprofd.daemon.records import CaptureRecord
from tfprofd.exporter.base import Clock, HostPaths

from helpers import FIXTURES, FakeClock

EDGES = FIXTURES / "hostcontext"
JOB, AGENT = 100, 200


def edges(job_roots=(JOB,)):
    before = read_edge(HostPaths(EDGES / "before"), job_roots, AGENT, now=10.0)
    after = read_edge(HostPaths(EDGES / "after"), sorted(before.job), AGENT, now=12.0)
    return before, after


def window(visible: bool = True) -> HostContext:
    return measure(*edges(), clock_ticks=100, job_visible=visible)


def test_proc_files_parse():
    times, cpus = parse_proc_stat((EDGES / "after" / "stat").read_text())
    assert cpus == 2 and (times.busy, times.idle, times.iowait, times.steal) == (1880, 8016, 104, 0)
    hog = parse_pid_stat((EDGES / "after" / "300" / "stat").read_text())
    assert (hog.pid, hog.comm, hog.ppid, hog.ticks) == (300, "my (hog) x", 1, 1270)
    assert parse_schedstat("5300000000 1500000000 20\n") == (5_300_000_000, 1_500_000_000)
    assert descendants({100: 1, 150: 100, 151: 150, 200: 1, 210: 200}, [100, 999]) == {100, 150, 151}
    tcp = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
           "   0: 0100007F:1771 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1\n"
           "   1: 0100007F:1771 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 4343 1\n")
    assert listening_inodes([tcp], 0x1771) == {4242}  # the listening socket, not an accepted connection
    with pytest.raises(ValueError):
        parse_proc_stat("intr 1 2 3\n")
    with pytest.raises(ValueError):
        parse_pid_stat("12 (cut short) S 1")


def test_the_job_and_its_child_are_told_from_tfprofd_and_the_others():
    c = window()
    assert (c.seconds, c.cpus, c.busy_cores) == (2.0, 2, pytest.approx(1.9))
    assert c.iowait_share == pytest.approx(0.01)
    assert c.psi_some == pytest.approx({"cpu": 0.6, "io": 0.02, "memory": 0.0})
    # run and run-queue wait of the job's three threads (two in pid 100, one in its child 150)
    assert (c.job_processes, c.job_threads) == (2, 3)
    assert c.job_cores == pytest.approx(0.5) and c.job_wait_cores == pytest.approx(0.75)
    assert c.tfprofd_cores == pytest.approx(0.1)  # the agent and a capture worker that started in the window
    assert c.other_cores == pytest.approx(1.3)
    assert [(o.pid, o.name, o.cores) for o in c.top_others] == [(300, "my (hog) x", 1.35)]


def test_other_processes_starving_the_job_is_contention_with_the_numbers():
    c = window().contention
    assert c is not None
    assert (c.wanted_cores, c.got_cores, c.lost_share) == (1.25, 0.5, 0.6)
    assert c.why.startswith("other processes used 1.4 of 2 CPUs; the job's threads were ready to run on 1.2 CPUs "
                            "but ran on 0.5, waiting for a CPU 60% of the time they were ready (run-queue wait "
                            "from /proc/<pid>/task/*/schedstat over the 2.0 s capture window)")
    assert c.why.endswith("most: my (hog) x (pid 300) 1.4")


def test_a_job_that_waits_on_itself_or_sleeps_is_not_contended():
    base = window()
    # the job alone oversubscribes the CPUs: it waits, but for its own threads
    alone = HostContext(2.0, 2, 2.0, 0.0, 0.0, {}, job_cores=1.9, job_wait_cores=2.5, tfprofd_cores=0.05,
                        other_cores=0.05)
    # a reader that sleeps on I/O wants little CPU, so waiting for half of it loses little
    sleeper = HostContext(2.0, 2, 2.0, 0.0, 0.0, {}, job_cores=0.12, job_wait_cores=0.12, tfprofd_cores=0.0,
                          other_cores=1.8)
    assert contention(base) is not None
    assert contention(alone) is None and contention(sleeper) is None


def test_a_job_not_visible_here_has_no_split_and_no_verdict():
    c = window(visible=False)
    assert c.job_cores is None and c.contention is None and c.busy_cores == pytest.approx(1.9)
    assert "not visible to the agent" in c.note
    assert "not visible" in "\n".join(c.lines())


def test_a_procfs_without_stat_is_an_error_not_a_guess(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        read_edge(HostPaths(tmp_path), [JOB], AGENT, now=1.0)


def saturated() -> HostContext:
    """The window, with the job's threads ready to use both CPUs (CPU-bound throughout): it lost 70% of them."""
    host = replace(window(), job_wait_cores=1.6)
    return replace(host, contention=contention(host))


@pytest.mark.parametrize("kind, hardware, ratio, host, final", [
    ("device", "CPU_ONLY", None, window, "host_contention"),  # CPU compute stretched by the neighbours
    ("small_batch", "CPU_ONLY", None, window, "host_contention"),
    ("host", "GPU", None, window, "host_contention"),
    ("device", "GPU", None, window, "device"),  # CPU contention does not make GPU kernels longer
    ("input", "CPU_ONLY", 0.3, window, "input"),  # the job wanted 1.2 of 2 CPUs: it also slept, maybe on reads
    ("input", "GPU", 0.3, saturated, "host_contention"),  # CPU-bound, a wait within the CPU lost: starved
    ("input", "CPU_ONLY", 0.9, saturated, "input"),  # a wait longer than the starvation explains
    ("transfer", "GPU", 0.3, saturated, "transfer"),
])
def test_the_join_names_contention_only_where_it_explains_the_step(kind, hardware, ratio, host, final):
    host = host()
    parts = {} if ratio is None else {
        "breakdown_ms": {"input_wait": 10 * ratio, "device_compute": 10 * (1 - ratio)},
        "breakdown": {"input_wait": ratio, "device_compute": 1 - ratio}, "input_bound_ratio": ratio}
    analysis = CaptureAnalysis.from_json({"bottleneck": kind, "summary": f"{kind}: the trace's sentence",
                                          "hardware": hardware, "recommendation": "the trace's advice", **parts})
    joined, cause = apply(analysis, host, rule="throughput_drop")
    stored = CaptureAnalysis.from_json(json.loads(json.dumps(joined.to_json())))  # as a record keeps it
    for result in (joined, stored):
        assert result.bottleneck == final
        if final == "host_contention":
            assert cause is not None and result.lead.bottleneck == kind
            assert result.summary.startswith("host_contention: other processes used 1.4 of 2 CPUs")
            assert "(rule throughput_drop fired while the host was contended)" in result.summary
            if kind == "input":
                assert "the job was ready to use every CPU, and the step's 30% wait for input is within the 70% " \
                       "of that it did not get: its input pipeline was starved of CPU" in result.summary
            assert result.summary.endswith(f"the trace alone says {kind}: the trace's sentence")
            assert result.lead.recommendation == "the trace's advice"
            assert "CPUs of its own" in result.recommendation
            assert result.to_json()["trace_bottleneck"] == kind
        else:
            assert cause is None and "trace_bottleneck" not in result.to_json()
            assert result.summary == (f"{kind}: the trace's sentence; the host was contended too: "
                                      f"{host.contention.why} (rule throughput_drop fired while the host was "
                                      "contended)")


def test_no_contention_leaves_the_trace_verdict_alone():
    quiet = HostContext(2.0, 2, 0.6, 0.0, 0.0, {}, job_cores=0.5, job_wait_cores=0.01, tfprofd_cores=0.05,
                        other_cores=0.05)
    analysis = CaptureAnalysis.from_json({"bottleneck": "device", "summary": "device: compute-bound",
                                          "hardware": "CPU_ONLY"})
    assert apply(analysis, quiet) == (analysis, None) and apply(analysis, None) == (analysis, None)
    assert join(TraceVerdict.of(analysis), window()) is not None


def test_the_record_stores_the_typed_context_and_reads_it_back():
    record = CaptureRecord(id="20260101T000000Z-abcdef", trigger="rule", job="j", targets=[], requested_at=1.0,
                           duration_ms=2000, mode="agent", host=window())
    data = json.loads(json.dumps(record.public()))
    assert data["host"]["contention"]["lost_share"] == 0.6
    again = CaptureRecord.from_dict(data)
    assert again.host == record.host
    bad = {**data, "host": {**data["host"], "busy_cores": "lots"}}
    with pytest.raises(ValueError, match="busy_cores"):
        CaptureRecord.from_dict(bad)
    with pytest.raises(ValueError, match="host context"):
        CaptureRecord.from_dict({**data, "host": {"seconds": 1, "surprise": 2}})


def test_a_contended_capture_gives_its_rule_cooldown_back(tmp_path: Path):
    policy = CapturePolicy(Clock(), tmp_path / "alerts.json")
    targets = [Target("j", "0", "127.0.0.1:6009")]
    admission = policy.admit(targets, None, rule="throughput_drop", cooldown=600)
    policy.release(admission)
    with pytest.raises(Exception, match="cooldown"):
        policy.admit(targets, None, rule="throughput_drop", cooldown=600)
    assert policy.forgive("throughput_drop", admission.addresses)
    policy.release(policy.admit(targets, None, rule="throughput_drop", cooldown=600))
    assert not policy.forgive("other_rule", admission.addresses)



def test_a_host_that_stays_busy_gets_the_cooldown_lifted_once_per_cooldown(tmp_path: Path):
    clock = FakeClock()
    policy = CapturePolicy(clock, tmp_path / "alerts.json")
    targets = [Target("j", "0", "127.0.0.1:6009")]

    def contended_capture() -> bool:
        admission = policy.admit(targets, None, rule="step_time_outlier", cooldown=1800)
        policy.release(admission)
        return policy.forgive("step_time_outlier", admission.addresses)

    assert contended_capture()  # lifted: the rule may capture the job's own cause when it next fires
    clock.mono += 60
    assert not contended_capture()  # contended again within the lifted cooldown: this one stands
    clock.mono += 60
    with pytest.raises(Exception, match="cooldown"):
        policy.admit(targets, None, rule="step_time_outlier", cooldown=1800)
    clock.mono += 1800
    assert contended_capture()  # a new cooldown, a new lift


class _Registry:
    def __init__(self, *processes):
        self.listed = list(processes)

    def processes(self, job):
        return self.listed

    def jobs(self):
        return {p.job for p in self.listed}

    def local_pids(self):
        pids = {}
        for p in self.listed:
            if p.local:
                pids.setdefault(p.job, []).append(p.pid)
        return {job: sorted(found) for job, found in pids.items()}


def test_a_window_on_a_procfs_without_stat_says_why_and_keeps_no_samples(tmp_path):
    from tfprofd.daemon.hostcontext import HostMonitor
    from tfprofd.exporter.training import ProcessView

    reported = ProcessView("j", "0", 4242, False, "train", True, "127.0.0.1:6009")  # UDP, not matched here
    monitor = HostMonitor(HostPaths(tmp_path), _Registry(reported), Clock())
    window = monitor.open("j")
    context = monitor.close(window)
    assert context.cpus is None and context.contention is None
    assert context.note == f"cannot read {tmp_path}/stat"
    assert monitor._open == 0 and not monitor._series


def test_a_udp_pid_that_does_not_hold_the_profiler_port_is_not_the_job(tmp_path):
    from tfprofd.daemon.hostcontext import HostMonitor
    from tfprofd.exporter.training import ProcessView

    # the fixture's pid 100 has no fd holding a socket on the profiler's port: another namespace's number
    reported = ProcessView("j", "0", JOB, False, "train", True, "127.0.0.1:6009")
    monitor = HostMonitor(HostPaths(EDGES / "after"), _Registry(reported), Clock())
    context = monitor.close(monitor.open("j"))
    assert context.job_cores is None and "could not be matched to a process here" in context.note


class _ManualClock(Clock):
    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def _host_at(proc: Path, busy: int, idle: int, job_run_s: float, job_wait_s: float) -> None:
    """A 2-CPU procfs: the host's CPU ticks so far and the job's two threads' schedstat (split evenly)."""
    (proc / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0\n")
    (proc / str(JOB)).mkdir(exist_ok=True)
    (proc / str(JOB) / "stat").write_text(f"{JOB} (python3) S 1 {JOB} {JOB} 0 -1 0 0 0 0 0 "
                                          f"{int(job_run_s * 100)} 0 0 0 20 0 2 0 1 0 0\n")
    for tid in (JOB, JOB + 1):
        (proc / str(JOB) / "task" / str(tid)).mkdir(parents=True, exist_ok=True)
        (proc / str(JOB) / "task" / str(tid) / "schedstat").write_text(
            f"{int(job_run_s / 2 * 1e9)} {int(job_wait_s / 2 * 1e9)} 1\n")


def test_a_rule_that_fired_on_load_gone_by_the_capture_says_the_host_was_contended(tmp_path):
    """Issue 24: a CPU hog starved the job over the 20 s the rule measured, then stopped; the capture's own
    window is quiet. The record must still say the host was contended, not blame the job's compute."""
    from tfprofd.daemon.hostcontext import HostMonitor
    from tfprofd.daemon.sampler import Snapshot
    from tfprofd.exporter.training import ProcessView

    clock = _ManualClock()
    local = ProcessView("j", "0", JOB, True, "train", True, "127.0.0.1:6009")
    monitor = HostMonitor(HostPaths(tmp_path), _Registry(local), clock)

    def sample(busy: int, idle: int, run: float, wait: float) -> None:
        _host_at(tmp_path, busy, idle, run, wait)
        monitor.on_snapshot(Snapshot("cpu", 0.0, clock.now, True, 0.0, {"cpu_utilization": [({}, 1.0)],
                                                                       "cpu_iowait": [({}, 0.0)]}, (), list))

    # 20 s, both CPUs busy: the job ran on 0.8 of them and waited for a CPU on 2.4 (a hog took 1.2)
    for second in range(0, 21):
        clock.now = float(second)
        sample(busy=second * 200, idle=0, run=0.8 * second, wait=2.4 * second)
    before = monitor.load_before("j", lookback=20.0)
    assert before is not None and before.contention is not None, before
    assert before.lookback == 20.0 and before.contention.got_cores == 0.8
    assert "other processes used 1.2 of 2 CPUs" in before.contention.why
    assert "span before the capture that its rule measured" in before.contention.why

    # the hog stopped: over the 4 s capture window the job has the CPUs to itself (its own threads queue)
    window = monitor.open("j")
    clock.now = 24.0
    sample(busy=4000 + 800, idle=0, run=16 + 4 * 1.95, wait=48 + 4 * 0.5)
    host = monitor.close(window, before)
    assert host.contention is None and host.contended == before.contention

    record = CaptureRecord(id="20260101T000000Z-abcdef", trigger="rule", job="j", targets=[], requested_at=1.0,
                           duration_ms=4000, mode="agent", rule="step_time_outlier", host=host)
    stored = CaptureRecord.from_dict(json.loads(json.dumps(record.public())))  # as the API serves it
    assert stored.host == host
    analysis = CaptureAnalysis.from_json({"bottleneck": "device", "summary": "device: compute-bound",
                                          "hardware": "CPU_ONLY"})
    joined, cause = apply(analysis, stored.host, rule="step_time_outlier")
    assert cause is not None and joined.bottleneck == "host_contention"
    assert joined.summary.startswith("host_contention: other processes used 1.2 of 2 CPUs")
    assert "(rule step_time_outlier fired while the host was contended)" in joined.summary
    assert "contended before the capture: other processes used 1.2" in "\n".join(stored.host.lines())

    # a job left alone over the rule's span is not called contended
    for second in range(25, 46):
        clock.now = float(second)
        sample(busy=4800 + (second - 24) * 200, idle=0, run=23.8 + (second - 24) * 1.95,
               wait=50 + (second - 24) * 0.5)
    assert monitor.load_before("j", lookback=20.0).contention is None


def test_a_jobs_child_processes_are_its_own_in_the_light_readings(tmp_path):
    """A job whose data-loading workers are child processes: their CPU is the job's, not other processes' (the
    light readings of a rule's span read only the reported pids, and called the job's own workers neighbours)."""
    from tfprofd.daemon.hostcontext import read_light_edge

    def at(now: float, busy: int, root_s: float, child_s: float):
        _host_at(tmp_path, busy, int(now * 200) - busy, root_s, 0.1 * now)
        (tmp_path / str(JOB) / "task" / str(JOB) / "children").write_text("300 ")
        (tmp_path / "300" / "task" / "300").mkdir(parents=True, exist_ok=True)
        (tmp_path / "300" / "stat").write_text(f"300 (loader) R {JOB} 300 300 0 -1 0 0 0 0 0 {int(child_s * 100)} "
                                               "0 0 0 20 0 1 0 1 0 0\n")
        (tmp_path / "300" / "task" / "300" / "schedstat").write_text(f"{int(child_s * 1e9)} 0 1\n")
        return read_light_edge(HostPaths(tmp_path), [JOB], None, now=now)

    context = measure(at(0.0, 0, 0.0, 0.0), at(10.0, 1900, 4.0, 15.0), clock_ticks=100, job_visible=True)
    assert context.job_cores == pytest.approx(1.9) and context.other_cores == pytest.approx(0.0, abs=0.01)
    assert context.contention is None


def test_the_light_readings_of_several_jobs_read_the_host_and_the_agent_once(tmp_path):
    """Each local job's ring read the host's CPU and pressure and the agent's processes again, every 5 s, and
    kept a copy of them: with 20 jobs, 0.5 MiB of the agent's 35 MiB (issue 24). One reading serves them all."""
    from tfprofd.daemon.hostcontext import read_light_edges

    _host_at(tmp_path, 100, 300, 1.0, 0.1)
    for pid, name in ((400, "other_job"), (AGENT, "tfprofd")):
        (tmp_path / str(pid) / "task" / str(pid)).mkdir(parents=True)
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) S 1 {pid} {pid} 0 -1 0 0 0 0 0 50 0 0 0 20 0 1 0 "
                                                  "1 0 0\n")
        (tmp_path / str(pid) / "task" / str(pid) / "schedstat").write_text("500000000 0 1\n")
    reads: list[str] = []

    class Counted(HostPaths):
        def read_proc(self, relative: str) -> str | None:
            reads.append(relative)
            return super().read_proc(relative)

    edges = read_light_edges(Counted(tmp_path), {"a": [JOB], "b": [400], "c": [JOB]}, AGENT, now=5.0)
    assert {name: sorted(edge.job) for name, edge in edges.items()} == {"a": [JOB], "b": [400], "c": [JOB]}
    assert all(edge.tfprofd == {AGENT} and AGENT in edge.processes for edge in edges.values())
    assert set(edges["a"].processes) == set(edges["c"].processes) == {JOB, AGENT}  # each its own, and the agent's
    assert set(edges["b"].processes) == {400, AGENT}
    assert reads.count("stat") == 1 and reads.count(f"{AGENT}/stat") == 1
    assert all(reads.count(f"pressure/{resource}") <= 1 for resource in ("cpu", "io", "memory"))
    assert reads.count(f"{JOB}/stat") == 2 and reads.count("400/stat") == 1  # each job's own, as before
    reads.clear()
    assert read_light_edges(Counted(tmp_path), {}, AGENT, now=10.0) == {} and reads == []  # no local job: nothing
