"""1,000 training jobs (issue 24): the training series written by hand are what prometheus_client writes,
whatever the labels and values, through jobs coming and going and scrapes racing a re-render; a burst of
UDP reports shares one read of the host's socket table."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from prometheus_client.utils import floatToGoString

from tfprofd.daemon.exposition import OPENMETRICS, TEXT, render, render_library
from tfprofd.exporter.base import Environment, Sectioned, gauge, go_float
from tfprofd.exporter.hook import PHASES, STEP_BUCKETS, Reporter
from tfprofd.exporter.training import (
    UNIX_PAUSE_S,
    Counts,
    HookSettings,
    Sender,
    TrainingCollector,
    UdpTable,
    _job_families,
    _job_lines,
    _Row,
    unix_pause,
)

from helpers import FakeClock, proc_state, wait_for

HOSTILE = ['a"b', "back\\slash", "new\nline", 'all "\\\n" three', "ünïcödé ✓ 日本", "", "\\n", '"', "\\",
           "x" * 1000, ('"\\\n' * 334)[:1000], "{}=,# EOF", "\t tab and spaces "]
NUMBERS = [0, 1, 7, 999_999, 1_000_000, 1_234_567, 2**53, -1, -(10**15), -(10**15) - 1, 10**16,
           0.0, -0.0, 0.5, 1e-9, 1e-5, 0.1 + 0.2, 123456.75, 1234567.5, 1e16, 3.14e21, 1e300, -2.5, -1e20,
           float("inf"), float("-inf"), float("nan"), True, False]


def test_sample_values_are_written_as_prometheus_client_writes_them():
    rng = random.Random(24)
    values = NUMBERS + [rng.randint(-(2**60), 2**60) for _ in range(2000)] + \
        [rng.uniform(-1e7, 1e7) for _ in range(2000)] + [10 ** rng.uniform(-12, 25) for _ in range(2000)] + \
        [float(rng.randint(0, 10**8)) for _ in range(2000)] + [rng.randint(10**6, 10**15) for _ in range(2000)] + \
        [10**k + d for k in range(5, 17) for d in (-1, 0, 1)] + [rng.uniform(1e6, 1e15) for _ in range(2000)]
    for value in values:
        assert go_float(value) == floatToGoString(value), value


def _row(rng: random.Random, hostile: bool) -> _Row:
    def name() -> str:
        return rng.choice(HOSTILE) if hostile and rng.random() < 0.7 else f"job{rng.randrange(10**6)}"

    def number(integer: bool = False) -> float:
        if rng.random() < 0.3:
            return rng.choice([n for n in NUMBERS if isinstance(n, int) and not isinstance(n, bool)] if integer
                              else NUMBERS)
        return rng.randrange(10**rng.randint(1, 9)) if integer else rng.uniform(0, 10**rng.randint(0, 8))

    def maybe(value: float) -> float | None:
        return None if rng.random() < 0.25 else value

    buckets = tuple(sorted(number(integer=True) for _ in STEP_BUCKETS))
    totals = Counts(number(True), number(True), number(True), number(True), number(), buckets)
    return _Row(key=(name(), name()), totals=totals, processes=rng.randint(0, 64), up=rng.random() < 0.8,
                rate=maybe(number()), batch_size=maybe(number(integer=True)), epoch=maybe(number(integer=True)),
                phase=rng.choice([*PHASES, None]), first_step_seconds=maybe(number()),
                profilers=tuple(sorted({rng.choice([*HOSTILE, "127.0.0.1:6009", "[::1]:1"])
                                        for _ in range(rng.randint(0, 3))})))


def _sectioned(rows: list[_Row]) -> Sectioned:
    head = [gauge("hook_jobs", "Jobs.", [], [((), len(rows))])]
    return Sectioned(head, _job_families, [(r.key, r) for r in rows], _job_lines)


@pytest.mark.parametrize("hostile", [False, True])
def test_hand_written_training_lines_are_byte_identical_to_prometheus_client(hostile):
    """Random jobs, with labels of quotes, backslashes, newlines, unicode and 1,000 characters, and values
    of NaN, ±Inf, Go's exponents; rendered through one cache while jobs come, change and expire."""
    rng = random.Random(240 + hostile)
    rows = [_row(rng, hostile) for _ in range(300)]
    assert any(len(r.key[0]) == 1000 for r in rows) or not hostile
    caches: dict = {TEXT: {}, OPENMETRICS: {}}
    labels: dict = {}  # label sets as written, kept across renderings of plain families (the agent's own part)
    for _ in range(6):
        families = _sectioned(rows)
        for fmt in (TEXT, OPENMETRICS):
            assert render(families, fmt, caches[fmt]) == render_library(list(families), fmt), fmt
            plain = list(_job_families(rows))  # the same series as plain families, as rule_active comes
            assert render(plain, fmt, None, labels) == render_library(plain, fmt), fmt
        keep = [r for r in rows if rng.random() < 0.7]  # the rest expire; some of the kept change, new ones come
        rows = [_row(rng, hostile) if rng.random() < 0.3 else r for r in keep] + [_row(rng, hostile) for _ in range(60)]


def _changed(rng: random.Random, row: _Row) -> _Row:
    """The same job a sample later: a few of its values changed (to zeros of either sign, NaN, None and
    counts past a million among others), most kept."""
    fresh = _row(rng, hostile=False)
    totals = row.totals._replace(**{f: getattr(fresh.totals, f) for f in row.totals._fields if rng.random() < 0.3})
    if rng.random() < 0.5:  # some buckets move, the others stay
        buckets = [b if rng.random() < 0.6 else b + rng.choice([1, 10**6, 10**12]) for b in totals.buckets]
        totals = totals._replace(buckets=tuple(sorted(buckets)))
    fields = {f: getattr(fresh, f) for f in row._fields[2:] if rng.random() < 0.3}
    for f in ("rate", "first_step_seconds"):
        if rng.random() < 0.15:
            fields[f] = rng.choice([0.0, -0.0, float("nan"), None, 0])
    return row._replace(totals=totals, **fields)


@pytest.mark.parametrize("hostile", [False, True])
def test_a_job_rendered_again_is_byte_identical_to_prometheus_client_where_lines_are_reused(hostile):
    """A job that reports again is rendered from its last lines, reusing those whose values are written
    alike: every changed value, zero's sign, NaN and None must still show, in both formats."""
    rng = random.Random(2400 + hostile)
    rows = [_row(rng, hostile) for _ in range(200)]
    caches: dict = {TEXT: {}, OPENMETRICS: {}}
    for _ in range(25):
        families = _sectioned(rows)
        for fmt in (TEXT, OPENMETRICS):
            assert render(families, fmt, caches[fmt]) == render_library(list(families), fmt), fmt
        rows = [_changed(rng, r) for r in rows]


def _cumulative(rng: random.Random) -> Counts:
    """A job's counts as a hook sends them: cumulative buckets in runs (none below its usual step time, its
    compilation steps past the rest), the last runs often the step count itself, counts past a million."""
    buckets, count = [], 0
    for _ in STEP_BUCKETS:
        count += rng.choice([0, 0, 0, 1, rng.randrange(10**7)])
        buckets.append(count)
    step_count = buckets[-1] + rng.choice([0, 0, 1, rng.randrange(10**3)])
    return Counts(step_count, step_count * rng.choice([1, 64]), 0, step_count, rng.uniform(0, 10**6), tuple(buckets))


def test_a_histogram_in_runs_of_one_count_is_byte_identical_as_its_steps_come():
    """A job's step histogram is written run by run, each run of equal cumulative counts in one go, the step
    count's text shared with +Inf, _count and steps_total: a run that grows, splits or merges with the next
    as steps come must still show every bucket's own count, in both formats."""
    rng = random.Random(24024)
    rows = [_row(rng, hostile=False)._replace(totals=_cumulative(rng)) for _ in range(200)]
    rows.append(rows[0]._replace(key=("all", "zero"), totals=Counts()))
    caches: dict = {TEXT: {}, OPENMETRICS: {}}
    for _ in range(25):
        families = _sectioned(rows)
        for fmt in (TEXT, OPENMETRICS):
            assert render(families, fmt, caches[fmt]) == render_library(list(families), fmt), fmt
        grown = []
        for row in rows:
            new = list(row.totals.buckets)
            for _ in range(rng.randrange(3)):  # steps in some bucket: it and every bucket above it count them
                at, steps = rng.randrange(len(new)), rng.choice([1, 25, 10**6])
                new[at:] = [b + steps for b in new[at:]]
            steps = new[-1] - row.totals.buckets[-1] + rng.choice([0, 0, 1])  # and some past the last bound
            grown.append(row._replace(totals=row.totals._replace(
                steps=row.totals.steps + steps, step_count=row.totals.step_count + steps, buckets=tuple(new),
                step_sum=row.totals.step_sum + steps * 0.02)))
        rows = grown


def test_a_scrape_rendering_while_a_sample_renders_gets_its_own_snapshot_whole():
    """Scrape threads and the sampling thread share one section cache: each rendering must be exactly its
    own snapshot's, whichever rendering last filled the cache."""
    rng = random.Random(2424)
    rows = [_row(rng, True) for _ in range(200)]
    snapshots = []
    for _ in range(4):
        rows = [_row(rng, True) if rng.random() < 0.5 else r for r in rows if rng.random() < 0.9]
        families = _sectioned(rows)
        snapshots.append((families, render_library(list(families), OPENMETRICS)))
    cache: dict = {}
    wrong: list[int] = []

    def scrape(seed: int) -> None:
        pick = random.Random(seed)
        for _ in range(40):
            i = pick.randrange(len(snapshots))
            if render(snapshots[i][0], OPENMETRICS, cache) != snapshots[i][1]:
                wrong.append(i)

    threads = [threading.Thread(target=scrape, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_a_burst_of_udp_reports_shares_one_read_of_the_socket_table(tmp_path):
    """Reading /proc/net/udp costs ~2 ms with a thousand sockets on the host: per report, the agent could not
    keep up with 1,000 jobs. A batch reads it once; each report is still its own socket's."""
    senders = []
    for _ in range(40):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        senders.append(s)
    free = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    free.bind(("127.0.0.1", 0))
    unused_port = free.getsockname()[1]
    free.close()  # a port no socket of this host sends from
    (tmp_path / "self").mkdir()
    shutil.copytree(Path("/proc/self/net"), tmp_path / "self" / "net", ignore=lambda d, names: [
        n for n in names if n not in ("udp", "udp6")])
    table = UdpTable(tmp_path)
    collector = TrainingCollector(HookSettings(socket="", listen=None), Environment())
    try:
        assert table.on_port(senders[0].getsockname()[1])[0].uid == os.geteuid()
        shutil.rmtree(tmp_path / "self")  # read once: the rest of the batch must not need the files
        for i, s in enumerate(senders):
            reporter = Reporter(job=f"burst{i}", worker="0", profiler=False, addr="127.0.0.1:9")
            payload = json.dumps(reporter.report()).encode()
            sender = Sender(local=False, address="127.0.0.1", port=s.getsockname()[1])
            assert collector.receive(payload, sender, table)
        stray = json.dumps(Reporter(job="stray", worker="0", profiler=False, addr="127.0.0.1:9").report()).encode()
        assert not collector.receive(stray, Sender(local=False, address="127.0.0.1", port=unused_port), table)
        assert collector.accepted == 40 and collector.rejected["unverified_sender"] == 1
        origins = {key[0] for job in collector.jobs.values() for key in job.processes}
        assert origins == {f"udp:127.0.0.1:uid={os.geteuid()}"}
    finally:
        collector.close()
        for s in senders:
            s.close()



def test_rule_series_are_built_again_exactly_when_a_rule_state_changes():
    """The agent's own part holds a rule_active series per rule and job (3,000 with 1,000 jobs): built again
    only when a state comes, goes, or changes; what a scrape reads follows every change."""
    from tfprofd.daemon.rules import Condition, Engine, Rule
    from tfprofd.exporter.registry import signal_catalog

    engine = Engine([Rule("low", "", (Condition("gpu_utilization", below=0.5),), for_seconds=2)], signal_catalog())

    def observe(t: float, **gpus: float) -> None:
        engine.observe("nvml", t, {"gpu_utilization": [({"gpu": g}, v) for g, v in gpus.items()]}, lambda _: True)

    def active() -> dict[str, float]:
        families = engine.collect()
        assert render(families, OPENMETRICS) == render_library(families, OPENMETRICS)
        return {s.labels["gpu"]: s.value for s in families[0].samples}

    observe(0, g0=0.9)
    first = engine.collect()
    observe(1, g0=0.8)
    assert engine.collect() is first and active() == {"g0": 0.0}  # nothing changed: the same families
    observe(2, g0=0.1, g1=0.9)
    assert active() == {"g0": 0.0, "g1": 0.0}  # a new series
    observe(4, g0=0.1, g1=0.9)
    assert active() == {"g0": 1.0, "g1": 0.0}  # firing
    assert [s.value for s in engine.collect()[1].samples] == [1.0]
    observe(5, g1=0.9)
    assert active() == {"g1": 0.0}  # g0 gone
    engine.set_rules([])
    assert active() == {}


def test_rule_series_of_hostile_jobs_are_written_as_prometheus_client_writes_them_while_states_change():
    """rule_active of jobs named with quotes, backslashes, newlines, unicode and 1,000 characters, rendered
    through the agent's caches (label sets, families kept while unchanged) in both formats while states come,
    fire, resolve and go; a family that is the same object as last time is written from its kept lines."""
    from tfprofd.daemon.exposition import Exposition
    from tfprofd.daemon.rules import Condition, Engine, Rule
    from tfprofd.exporter.registry import signal_catalog

    rng = random.Random(2424)
    engine = Engine([Rule("slow", "", (Condition("samples_per_second", below=10),), for_seconds=1),
                     Rule("b\"a\\d\nrule ✓", "", (Condition("step_seconds", above=1),), for_seconds=0)],
                    signal_catalog())
    exposition = Exposition(clock=lambda: 0.0, reusing=("agent",))
    jobs = sorted({*HOSTILE, *(f"job{i}" for i in range(40))})
    bodies: dict[str, bytes] = {}
    for t in range(12):
        live = [j for j in jobs if rng.random() < 0.8]
        engine.observe("training", float(t), {
            "samples_per_second": [({"training_job": j, "worker": w}, rng.choice([1.0, 100.0, float("nan")]))
                                   for j in live for w in ("0", HOSTILE[t % len(HOSTILE)])],
            "step_seconds": [({"training_job": j, "worker": "0"}, rng.choice([0.1, 2.0])) for j in live]},
            lambda _: True)
        families = engine.collect()
        for fmt in (TEXT, OPENMETRICS):
            body = exposition._render("agent", engine.collect, fmt)
            assert body == render_library(families, fmt), (t, fmt)
            assert exposition._kept["agent"]["tfprofd_rule_active"][0] is families[0]  # the next one reuses it
            if engine.collect() is families and fmt in bodies and t % 3 == 0:
                assert exposition._render("agent", engine.collect, fmt) == body
            bodies[fmt] = body
    assert {s.value for s in engine.collect()[0].samples} == {0.0, 1.0}
    assert any('\\"' in s.labels["training_job"] or "\n" in s.labels["training_job"]
               for s in engine.collect()[0].samples)


def test_a_family_kept_from_the_last_rendering_is_written_again_only_while_it_is_the_same_object():
    """The agent's own part keeps the lines of families that did not change (rule_active: 3,000 series with
    1,000 jobs); a new family of the same name, even with the same labels, is written from its own values."""
    kept: dict = {}
    labels: dict = {}
    first = [gauge("rule_active", "Whether.", ["rule", "training_job"], [(("r", j), 0.0) for j in HOSTILE])]
    for fmt in (TEXT, OPENMETRICS, TEXT):
        assert render(first, fmt, None, labels, kept) == render_library(first, fmt)
    assert kept["tfprofd_rule_active"][0] is first[0]
    second = [gauge("rule_active", "Whether.", ["rule", "training_job"], [(("r", j), 1.0) for j in HOSTILE])]
    for fmt in (OPENMETRICS, TEXT):
        body = render(second, fmt, None, labels, kept)
        assert body == render_library(second, fmt) and b" 0.0\n" not in body
    assert render([], TEXT, None, labels, kept) == b"" and kept == {}  # families that are gone are dropped


def test_a_report_is_handled_at_once_not_after_the_gathering(monkeypatch):
    """A job's last report comes as it exits, and its sockets (the report's, its profiler's) close with it: below
    the gathering rate a report is checked against the socket tables at once (handled after a gathering, every
    short job's final report was refused: its sender was gone)."""
    import tfprofd.exporter.training as training

    monkeypatch.setattr(training, "UDP_GATHER_SECONDS", 600.0)  # a gathering that outlasts the test
    collector = TrainingCollector(HookSettings(socket="", listen=("127.0.0.1", 0)), Environment())
    try:
        for n, job in enumerate(("first", "last"), 1):  # a few jobs' reports, far below the gathering rate
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.sendto(json.dumps(Reporter(job=job, worker="0", profiler=False, addr="127.0.0.1:9").report())
                         .encode(), collector.udp_address)
                wait_for(lambda n=n: collector.accepted + sum(collector.rejected.values()) == n, 60,
                         message=f"report {n} to be handled, not gathered")
        assert collector.accepted == 2, {k: v for k, v in collector.rejected.items() if v}
    finally:
        collector.close()


def test_a_listener_with_nothing_to_read_sleeps_until_a_report_or_close():
    """A job that is not reporting costs nothing: the listener waits on its sockets alone (it woke five times a
    second to look at a stop flag), and close() wakes it at once."""
    collector = TrainingCollector(HookSettings(socket="", listen=("127.0.0.1", 0)), Environment())
    try:
        listener = next(t for t in threading.enumerate() if t.name == "tfprofd-hook-listener")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(json.dumps(Reporter(job="one", worker="0", profiler=False, addr="127.0.0.1:9").report())
                     .encode(), collector.udp_address)
            wait_for(lambda: collector.accepted == 1, 60, message="the report to be handled")

        def wakes() -> int:
            status = Path(f"/proc/self/task/{listener.native_id}/status").read_text()
            return sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)

        def sleeping() -> bool:  # not running, nor waiting for a CPU (preempted, it switches no more than asleep)
            return proc_state(Path(f"/proc/self/task/{listener.native_id}/stat")) == "S"

        def settled() -> bool:  # back to waiting: on a busy machine it may still be finishing the report
            first = wakes()
            threading.Event().wait(0.1)
            return wakes() == first and sleeping()

        wait_for(settled, 60, message="the listener to wait again")
        before = wakes()
        threading.Event().wait(1.0)  # a second with nothing to read
        assert wakes() == before
    finally:
        collector.close()
    assert not listener.is_alive()


SENDING = textwrap.dedent("""
    import sys, time
    from tfprofd.exporter.hook import Reporter
    jobs = [Reporter(job=f"job{i}", worker="0", profiler=False, addr="unix:" + sys.argv[1]) for i in range(40)]
    failed = 0
    for reporter in jobs:  # jobs at their own phases: one report every 20 ms
        failed += not reporter.flush()
        time.sleep(0.02)
    sys.exit(failed)
""")
LISTENING = textwrap.dedent("""
    import json, subprocess, sys, threading
    from pathlib import Path
    from tfprofd.exporter.base import Environment
    from tfprofd.exporter.training import HookSettings, TrainingCollector
    sys.path.insert(0, sys.argv[2])
    from helpers import wait_for
    Path("/proc/sys/net/unix/max_dgram_qlen").write_text(sys.argv[3])  # this network namespace's queue
    collector = TrainingCollector(HookSettings(socket=sys.argv[1], listen=None), Environment())
    listener = next(t for t in threading.enumerate() if t.name == "tfprofd-hook-listener")
    status = Path(f"/proc/self/task/{listener.native_id}/status")
    def waits():
        return next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("volunt"))
    before = waits()
    sender = subprocess.run([sys.executable, "-c", sys.argv[4], sys.argv[1]], timeout=120)
    wait_for(lambda: collector.accepted == 40 - sender.returncode, 60, message="every report to be handled")
    print(json.dumps({"refused": sender.returncode, "waits": waits() - before}))
    collector.close()
""")


def _own_network_namespace() -> bool:
    """Whether this test may make a network namespace of its own (root, with CAP_SYS_ADMIN)."""
    return os.geteuid() == 0 and shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--net", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _own_network_namespace(),
                    reason="sets the Unix datagram queue in a network namespace of its own")
@pytest.mark.parametrize("queue", [512, 10])
def test_reports_on_the_unix_socket_at_their_own_phases_are_read_a_few_times_a_second(tmp_path, queue):
    """Jobs on the host report at their own phases: the listener woke for each report (a cold wake costs more
    than the report, 0.4-0.6% of a core for 20 jobs). Where the kernel queues 512 datagrams (systemd's
    net.unix.max_dgram_qlen), it now reads the Unix socket at most every UNIX_PAUSE_S; with the kernel's
    default of 10 it reads each at once, as before. Either way the queue refuses none of the reports."""
    done = subprocess.run(["unshare", "--net", sys.executable, "-c", LISTENING, str(tmp_path / "hook.sock"),
                           str(Path(__file__).parent), str(queue), SENDING], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["refused"] == 0
    if queue == 512:
        assert seen["waits"] <= 20  # 0.8 s of reports: a few reads (it was a wake for each of the 40)


def test_the_unix_socket_rests_no_longer_than_its_queue_allows():
    assert unix_pause(0.0, 512) == unix_pause(20.0, 512) == UNIX_PAUSE_S == 0.25
    assert unix_pause(1024.0, 512) == 0.125  # 128 reports meanwhile: a quarter of systemd's queue
    assert unix_pause(20.0, 10) == unix_pause(0.0, 63) == 0.0  # the kernel's default queue: read at once


def test_a_listener_that_cannot_start_leaves_nothing_open_or_bound(tmp_path, monkeypatch):
    """Whatever fails while the listener starts (here the wake-up pair, on a host out of file descriptors), its
    sockets are closed and its socket file removed at once: the next start, or a reload that enables the hook
    again, found the path "in use by another running agent" until the garbage collector closed them."""
    path = tmp_path / "hook.sock"
    fds = len(os.listdir("/proc/self/fd"))

    def out_of_descriptors(*args: object) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    with monkeypatch.context() as patched:
        patched.setattr(socket, "socketpair", out_of_descriptors)
        with pytest.raises(OSError, match="cannot open the hook's report socket: Too many open files"):
            TrainingCollector(HookSettings(socket=str(path), listen=("127.0.0.1", 0)), Environment())
    assert not path.exists()
    assert len(os.listdir("/proc/self/fd")) == fds
    collector = TrainingCollector(HookSettings(socket=str(path), listen=("127.0.0.1", 0)), Environment())
    try:
        assert path.exists()
    finally:
        collector.close()
        collector.close()  # twice, as a failed reload and then shutdown may
    assert not path.exists()


def test_a_udp_report_is_vouched_for_only_by_a_socket_table_read_made_after_it_came(monkeypatch):
    """A socket the table lists may close, and its port be bound by another user, before a datagram from that
    port comes: no read of the table vouches for a datagram received after it. At the gathering rate a batch
    waits 0.25 s for more, and its one read is made once every datagram of it is in, gathered ones too."""
    from tfprofd.exporter import training

    received: dict[bytes, int] = {}  # a datagram -> how many the listener had received by then, itself included
    last_read = [0]  # datagrams received when the socket table was last read
    vouched: list[tuple[bytes, int]] = []  # a datagram, and datagrams received by the read that vouched for it
    recv_udp, diag = TrainingCollector._recv_udp, training.diag_udp_sockets

    def recv(self: TrainingCollector, sock: socket.socket) -> tuple[bytes, Sender]:
        payload, sender = recv_udp(self, sock)
        received[payload] = len(received) + 1
        return payload, sender

    def read(ports: object = None) -> dict:
        last_read[0] = len(received)
        return diag(ports)

    monkeypatch.setattr(TrainingCollector, "_recv_udp", recv)
    monkeypatch.setattr(training, "diag_udp_sockets", read)
    collector = TrainingCollector(HookSettings(socket="", listen=("127.0.0.1", 0)), Environment())
    receive = collector.receive

    def checked(payload: bytes, sender: Sender, table: UdpTable | None = None) -> bool:
        ok = receive(payload, sender, table)  # the table is read at its batch's first report
        vouched.append((payload, last_read[0]))
        return ok

    collector.receive = checked  # type: ignore[method-assign]
    senders = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(400)]
    try:
        for i, s in enumerate(senders):  # past the gathering rate: the first drain starts a gathering
            s.sendto(json.dumps(Reporter(job=f"j{i}", worker="0", profiler=False, addr="127.0.0.1:9").report())
                     .encode(), collector.udp_address)
        wait_for(lambda: collector.accepted + sum(collector.rejected.values()) == len(senders), 60,
                 message="every report handled")
        assert collector.accepted == len(senders), {k: v for k, v in collector.rejected.items() if v}
        assert len(vouched) == len(senders)
        assert [p for p, read_after in vouched if received[p] > read_after] == []
    finally:
        collector.close()
        for s in senders:
            s.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to open sockets as another user")
def test_the_kernels_socket_list_tells_each_users_udp_sender_apart():
    """The agent asks the kernel (sock_diag over netlink) who owns a datagram's socket instead of reading
    /proc/net/udp: another user's socket, IPv4 or IPv6, is that user's; a port two users share
    (SO_REUSEADDR) vouches for neither; and every socket reads as /proc/net/udp{,6} lists it."""
    from tfprofd.exporter.training import Rejected, identify_udp_sender, parse_proc_net

    shared = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    shared.bind(("127.0.0.1", 0))
    shared_port = shared.getsockname()[1]
    own = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    try:
        own.bind(("::1", 0))
    except OSError:
        own.close()
        shared.close()
        pytest.skip("no IPv6 loopback on this host")
    other = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, socket, sys
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        v4 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        v4.bind(("127.0.0.1", 0))
        v6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        v6.bind(("::", 0))
        same = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        same.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        same.bind(("127.0.0.1", {shared_port}))  # the port root's socket is bound to
        print(v4.getsockname()[1], v6.getsockname()[1], flush=True)
        sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        v4_port, v6_port = map(int, other.stdout.readline().split())
        asked = {v4_port, v6_port, own.getsockname()[1], shared_port}
        for table in (UdpTable(), UdpTable(ports=asked)):  # every socket listed, or (a few datagrams) their ports
            assert identify_udp_sender("127.0.0.1", v4_port, table=table).uid == 65534
            assert identify_udp_sender("::1", v6_port, table=table).uid == 65534  # bound to every address
            assert identify_udp_sender("::1", own.getsockname()[1], table=table).uid == 0
            with pytest.raises(Rejected) as info:
                identify_udp_sender("127.0.0.1", shared_port, table=table)
            assert info.value.reason == "unverified_sender" and "several users ([0, 65534])" in str(info.value)
            assert UdpTable.diag_problem is None  # the kernel answered: no text table was read
            listed = [s for name in ("udp", "udp6")
                      for s in parse_proc_net(Path(f"/proc/self/net/{name}").read_text())]
            for port in (v4_port, v6_port, own.getsockname()[1], shared_port, 1):
                assert sorted(map(repr, table.on_port(port))) == sorted(repr(s) for s in listed if s.port == port)
    finally:
        other.communicate("\n", timeout=10)
        shared.close()
        own.close()


def test_without_the_kernels_socket_list_senders_are_identified_from_proc(monkeypatch, caplog):
    """Where netlink's sock_diag does not answer (no udp_diag module, a sandbox), /proc/net/udp is read."""
    import errno

    from tfprofd.exporter import training

    def refused(ports: object = None) -> None:
        raise OSError(errno.EPROTONOSUPPORT, "Protocol not supported")

    monkeypatch.setattr(training, "diag_udp_sockets", refused)
    monkeypatch.setattr(UdpTable, "diag_problem", None)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        caplog.set_level("INFO", logger="tfprofd.training")
        assert training.identify_udp_sender("127.0.0.1", s.getsockname()[1]).uid == os.geteuid()
        assert training.identify_udp_sender("127.0.0.1", s.getsockname()[1]).uid == os.geteuid()
    assert UdpTable.diag_problem == "[Errno 93] Protocol not supported"
    assert caplog.text.count("identified from /proc/net/udp") == 1


def test_a_batch_asks_the_kernel_for_the_sockets_on_its_senders_ports_in_one_read():
    """A batch of datagrams from a few dozen ports is checked against one sock_diag read filtered to those ports
    (not one read per port, nor every socket on the host): it lists exactly the sockets on them, whatever ports
    they are (the lowest, the highest, ports nobody has bound), as the kernel's full list does."""
    from tfprofd.exporter.training import PORT_FILTER, diag_udp_sockets, identify_udp_sender

    sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(40)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in sockets]
        every = diag_udp_sockets()
        rng = random.Random(24)
        for n in (1, 2, 3, 17, PORT_FILTER - 2):
            asked = {*rng.sample(ports, min(n, len(ports))), 1, 65535, rng.randint(1, 65535)}
            listed = diag_udp_sockets(asked)
            assert set(listed) <= asked
            assert {p: sorted(listed.get(p, [])) for p in asked} == {p: sorted(every.get(p, [])) for p in asked}
        table = UdpTable(ports=set(ports))  # a batch from these ports: one read, filtered to them
        assert all(identify_udp_sender("127.0.0.1", p, table=table).uid == os.geteuid() for p in ports)
    finally:
        for s in sockets:
            s.close()


def test_a_socket_the_text_table_missed_is_looked_for_in_another_read(monkeypatch):
    """/proc/net/udp is written a page a read, each resuming by counting sockets from the first: one another
    process closes meanwhile shifts the count, and a socket past it goes unlisted (1,000 sockets beside one
    process opening and closing others: a tenth missed in each read). Where sock_diag does not answer, a port
    no read lists is read again, up to three reads, before its report is refused; a port found costs none."""
    from tfprofd.exporter import training

    line = "  1: 0100007F:{port:04X} 00000000:0000 07 00000000:00000000 00:00000000 00000000  {uid}  0 1 2 ref 0 0"
    reads = [{4000: [line.format(port=4000, uid=1000)]},  # the first read missed port 4001
             {4000: [line.format(port=4000, uid=1000)], 4001: [line.format(port=4001, uid=1001)]},
             {4000: [line.format(port=4000, uid=1000)]}]
    made = []

    def read(self: object) -> dict[int, list[str]]:
        made.append(1)
        return dict(reads[(len(made) - 1) % len(reads)])  # a fresh listing, as each read of the file is

    monkeypatch.setattr(training.UdpTable, "_read", read)
    monkeypatch.setattr(training.UdpTable, "diag_problem", "sock_diag: refused (a test)")
    table = training.UdpTable()
    assert [s.uid for s in table.on_port(4000)] == [1000] and len(made) == 1
    assert [s.uid for s in table.on_port(4001)] == [1001] and len(made) == 2  # the second read lists it
    assert table.on_port(4002) == [] and len(made) == training.TEXT_READS  # listed nowhere: refused
    assert training.identify_udp_sender("127.0.0.1", 4001, table=table).uid == 1001
    made.clear()
    reads.insert(0, {})  # a first read that listed nothing: what later reads add is kept for the next lookups
    table = training.UdpTable()
    assert [s.uid for s in table.on_port(4000)] == [1000] and len(made) == 2
    assert [s.uid for s in table.on_port(4001)] == [1001] and len(made) == 3
    assert [s.uid for s in table.on_port(4000)] == [1000] and len(made) == 3


def test_a_large_batch_reads_every_socket_but_keeps_only_those_on_its_ports():
    """A batch from more ports than the kernel filters well reads every socket, and keeps those on its ports:
    the kernel's reads of sockets alike are sliced in C (only a socket on a batch's port is unpacked), and
    give what reading each message in Python gives, whatever the read (a mixed one is read message by message)."""
    from tfprofd.exporter import training

    sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(600)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in sockets]
        asked = {*random.Random(24).sample(ports, 3 * training.PORT_FILTER), 1, 65535}
        every = training.diag_udp_sockets()
        assert set(ports) <= set(every)
        listed = training.diag_udp_sockets(asked)
        assert set(listed) <= asked
        assert {p: sorted(listed.get(p, [])) for p in asked} == {p: sorted(every.get(p, [])) for p in asked}
        # the kernel's own reads, as it sent them, through both ways of reading them
        reads = []
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, training.NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(10)  # a kernel that ended the dump otherwise fails the test rather than hang it
            nl.send(training._dump_request(7, socket.AF_INET))
            while not reads or len(reads[-1]) > training._NLMSG.size + 4:  # up to the dump's end (NLMSG_DONE)
                reads.append(nl.recv(1 << 16))
        assert len(reads) > 2
        wanted = {socket.htons(p) for p in asked}
        for data in reads[:-1]:
            for only in (None, wanted):
                sliced: dict = {}
                alone: dict = {}
                assert training._diag_alike(data, 7, sliced, only)
                assert not training._diag_part(data, 7, alone, only)
                assert sliced == alone
                assert not training._diag_alike(data, 8, {}, only)  # another request's answer
        mixed = reads[0] + reads[-1]  # sockets, then the dump's end: read a message at a time
        assert not training._diag_alike(mixed, 7, {}, None)
        assert training._diag_part(mixed, 7, {}, None)
        with pytest.raises(OSError, match="malformed netlink message"):  # cut short: /proc is read instead
            training._diag_part(reads[0][:-10], 7, {}, None)
    finally:
        for s in sockets:
            s.close()


def test_sock_diag_reads_keep_one_socket_and_a_failure_on_it_is_read_again_on_a_new_one(monkeypatch):
    """Below the gathering rate every UDP report has a socket-table read of its own, so the reads share one netlink
    socket. A dump left unfinished on it (the kernel then refuses the next: EBUSY) costs no read: it is made again
    on a new socket and lists exactly its port's sockets. Only a new socket's failure is an error (then /proc is
    read); the socket is closed after it, and the next read opens another."""
    from tfprofd.exporter import training

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as mine, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        mine.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        port = mine.getsockname()[1]
        expected = training.diag_udp_sockets({port})
        assert [uid for *_, uid in expected[port]] == [os.geteuid()]
        kept = training._SOCK_DIAG._socket
        assert kept is not None
        assert training.diag_udp_sockets({port}) == expected and training._SOCK_DIAG._socket is kept
        kept.send(training._dump_request(training._SOCK_DIAG._seq + 1, socket.AF_INET))  # unfinished: every socket
        assert training.diag_udp_sockets({port}) == expected  # not the other socket, nor the host's others
        assert training._SOCK_DIAG._socket not in (None, kept)

        def refused(*args: object) -> bool:
            raise OSError(errno.EPROTO, "malformed netlink message from sock_diag")

        monkeypatch.setattr(training, "_diag_part", refused)
        monkeypatch.setattr(training, "_diag_alike", lambda *args: False)
        with pytest.raises(OSError, match="malformed"):
            training.diag_udp_sockets({port})
        assert training._SOCK_DIAG._socket is None
        monkeypatch.undo()
        assert training.diag_udp_sockets({port}) == expected


def test_a_udp_report_from_a_pods_address_costs_no_socket_table_read(monkeypatch):
    """A datagram from an address that is neither loopback nor one of this host's (a pod on the pod network,
    another host) was sent by no socket here: it is a peer's (its address only) without reading the socket table,
    which a lone report paid for each. From loopback or one of the host's own addresses the table is read."""
    from tfprofd.exporter import training

    reads: list[object] = []
    monkeypatch.setattr(training, "diag_udp_sockets", lambda ports=None: reads.append(ports) or {})
    table = training.UdpTable(ports={41005})
    for pod in ("192.0.2.7", "::ffff:192.0.2.7", "2001:db8::7"):
        sender = training.identify_udp_sender(pod, 41005, table=table)
        assert sender == training.Sender(local=False, address=str(training._ip(pod)), port=41005)
    assert reads == []
    with pytest.raises(training.Rejected, match="no socket of this host"):
        training.identify_udp_sender("127.0.0.1", 41005, table=table)
    assert reads == [{41005}]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no datagram is sent: the host's own address on its default route
            own = probe.getsockname()[0]
        except OSError:  # no route off loopback
            own = "0.0.0.0"
    if own != "0.0.0.0":
        training.identify_udp_sender(own, 41006, table=training.UdpTable(ports={41006}))
        assert reads == [{41005}, {41006}]


def test_a_child_forked_during_a_sock_diag_read_reads_on_a_socket_of_its_own():
    """A process forked without exec while another thread reads the kernel's socket list (the lock held, the kept
    socket open) reads on its own: it neither waits forever on the lock nor shares the parent's socket, where
    each would read the other's answers."""
    from tfprofd.exporter import training

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as mine:
        mine.bind(("127.0.0.1", 0))
        port = mine.getsockname()[1]
        expected = training.diag_udp_sockets({port})
        kept = training._SOCK_DIAG._socket
        with training._SOCK_DIAG._lock:  # as a read in progress on the listener's thread holds it
            pid = os.fork()
            if pid == 0:
                try:
                    same = training.diag_udp_sockets({port}) == expected
                    os._exit(0 if same and training._SOCK_DIAG._socket.fileno() != kept.fileno() else 1)
                except BaseException:
                    os._exit(2)
        try:
            status = _child_status(pid, 20)
        finally:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        assert status == 0
        assert training._SOCK_DIAG._socket is kept and training.diag_udp_sockets({port}) == expected


def _child_status(pid: int, timeout: float) -> int | None:
    """A forked child's exit status, once it exits within ``timeout`` seconds (None if it did not)."""
    found: list[int] = []

    def exited() -> bool:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            found.append(os.waitstatus_to_exitcode(status))
        return bool(done)

    try:
        wait_for(exited, timeout, message="the forked child")
    except AssertionError:
        return None
    return found[0]


def test_a_job_that_reports_again_hands_the_rules_the_same_labels_dict():
    """1,000 jobs report every second, so each is frozen again at every sample: its labels dict stays the same
    object, which the rules engine keeps a sorted key for instead of sorting it again (issue 24)."""
    clock = FakeClock()
    collector = TrainingCollector(HookSettings(socket="", listen=None), Environment(clock=clock))
    reporter = Reporter(job="again", worker="0", profiler=False, addr="127.0.0.1:9")
    reporter.phase = "train"
    try:
        handed = []
        for _ in range(4):  # its first report gives no step time yet
            reporter.record(25, 1600, 0.5)
            report = reporter.report()
            report["time"] = clock.wall
            assert collector.receive(json.dumps(report).encode(), Sender(local=False, address="127.0.0.1"))
            clock.mono += 1
            clock.wall += 1
            collector.sample()
            handed += [labels for labels, _ in collector.rule_signals()["step_seconds"]]
        assert len(handed) == 3 and handed[0] == {"training_job": "again", "worker": "0"}
        assert handed[1] is handed[0] and handed[2] is handed[0]
    finally:
        collector.close()


def _local_process(procfs: Path, job: str, pid: int) -> tuple[FakeClock, TrainingCollector, Reporter, Sender]:
    """A collector on a fake clock and procfs where ``pid`` lives, and a hook of ``job`` in that process."""
    from tfprofd.exporter.base import HostPaths

    clock = FakeClock()
    (procfs / str(pid)).mkdir()
    collector = TrainingCollector(HookSettings(socket="", listen=None),
                                  Environment(paths=HostPaths(procfs=procfs), clock=clock))
    reporter = Reporter(job=job, worker="0", profiler=False, addr="127.0.0.1:9")
    return clock, collector, reporter, Sender(local=True, pid=pid, uid=os.geteuid())


def test_a_process_that_exited_is_retired_a_sample_later_with_its_last_report(tmp_path, caplog):
    """A job's last report comes as it exits, and may wait in the Unix socket's queue while the socket rests
    (up to 0.25 s): a sample that found the pid gone in between retired the process at once, and the last
    report then came as a new process (its profiler no longer checkable: refused, its counts lost; without
    one, logged as reporting and retired a second time). It is now retired a sample later."""
    import logging

    caplog.set_level(logging.INFO, logger="tfprofd")
    pid = 4242
    clock, collector, reporter, sender = _local_process(tmp_path, "ending", pid)

    def report(steps: int) -> None:
        reporter.record(steps, steps * 64, steps * 0.01)
        assert collector.receive(json.dumps({**reporter.report(), "pid": pid}).encode(), sender)

    try:
        report(10)
        collector.sample()
        (tmp_path / str(pid)).rmdir()  # the process exits; its last report is still queued
        clock.mono += 1.0
        collector.sample()
        report(5)  # read from the queue after that sample
        clock.mono += 1.0
        collector.sample()
        [job] = collector.jobs.values()
        assert not job.processes and job.folded.steps == 15
        assert caplog.text.count("reporting: pid 4242") == 1 and caplog.text.count("stopped reporting") == 1
    finally:
        collector.close()


def test_reports_on_both_sockets_keep_the_listener_alive(tmp_path):
    """Where jobs report on the Unix socket and pods over UDP (the chart's setup), a UDP report after a Unix
    one killed the listener (the Unix socket's rate took the name of the UDP one's)."""
    collector = TrainingCollector(HookSettings(socket=str(tmp_path / "hook.sock"), listen=("127.0.0.1", 0)),
                                  Environment())
    try:
        host, pod = (Reporter(job=job, worker="0", profiler=False, addr=addr) for job, addr in (
            ("host", f"unix:{tmp_path / 'hook.sock'}"), ("pod", "{}:{}".format(*collector.udp_address))))
        for n, reporter in enumerate((host, pod, host, pod), 1):
            assert reporter.flush()
            wait_for(lambda n=n: collector.accepted == n, 30, message=f"report {n} to be handled")
        assert collector.problem() is None
    finally:
        collector.close()


def test_a_late_report_of_a_process_taken_for_gone_is_stale_and_unsent_reports_count_once(tmp_path):
    """A process retired after its pid went away (its reports folded into the job's counts) whose older
    datagram comes late was taken for the process reporting again, with fewer counts than it had: the job's
    counters went back. Reports a hook could not send are told by the next one it sent, and each counts once,
    however the process comes and goes."""
    pid = 4343
    clock, collector, reporter, sender = _local_process(tmp_path, "late", pid)

    def report(steps: int, **change: object) -> dict:
        reporter.record(steps, steps * 64, steps * 0.01)
        return {**reporter.report(), "pid": pid, **change}

    def receive(data: dict) -> bool:
        return collector.receive(json.dumps(data).encode(), sender)

    try:
        early = report(10)
        assert receive(report(5, unsent=1))  # seq 2: one report (seq 1, early) was refused to the hook
        assert collector.unsent == 1
        (tmp_path / str(pid)).rmdir()
        for _ in range(3):  # found gone, then retired a sample later
            collector.sample()
            clock.mono += 1.0
        [job] = collector.jobs.values()
        assert not job.processes and job.folded.steps == 15
        assert not receive(early) and collector.rejected["stale"] == 1  # the refused report, come late after all
        assert job.folded.steps == 15 and not job.processes
        (tmp_path / str(pid)).mkdir()
        report(1)  # seq 4 refused
        assert receive(report(1, unsent=1))  # the process reports again: seq 5 tells of seq 4
        assert collector.unsent == 2 and collector.jobs[("late", "0")].totals().steps == 17
        assert not receive(report(1, unsent=1)) and collector.rejected["invalid_field"] == 1  # none was refused
        assert not receive({**report(1), "unsent": 10**7 + 1}) and collector.rejected["invalid_field"] == 2
        assert collector.unsent == 2
    finally:
        collector.close()
