"""The agent's side of the hook protocol: validation, and a fuzz of malformed datagrams."""

from __future__ import annotations

import json
import random
import signal
import socket
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tfprofd.exporter import hook
from tfprofd.exporter.hook import Reporter
from tfprofd.exporter.training import (
    MAX_BRACKETS,
    REJECT_REASONS,
    UDP_GATHER_SECONDS,
    UDP_GATHER_STEP,
    UDP_GATHER_STEP_ROOMY,
    Rejected,
    dropped_since,
    gather_step,
    parse_report,
    parse_report_fast,
)

from helpers import metric_value, proc_state, reports_socket, wait_for


def valid(**overrides) -> dict:
    reporter = Reporter(job="j", worker="0", profiler=False)
    reporter.record(3, 96, 0.03)
    report = reporter.report()
    report.update(overrides)
    return report


def encode(report: dict) -> bytes:
    return json.dumps(report).encode()


def test_a_valid_report_parses():
    report = parse_report(encode(valid()), 8192)
    assert (report.job, report.steps, report.samples, report.step_count) == ("j", 3, 96, 3)


MALFORMED = [
    (b"\xff\xfe garbage", "malformed_json"),
    (b'{"v": 1, "job": "j"', "malformed_json"),
    (b'{"v": 1, "job": -}', "malformed_json"),  # a value that is none: not the agent's internal_error
    (b"[1, 2, 3]", "not_an_object"),
    (encode(valid(v=2)), "unknown_version"),
    (encode(valid(steps=-1)), "invalid_field"),
    (encode(valid(samples=10**30)), "invalid_field"),
    (encode(valid(steps="12")), "invalid_field"),
    (encode(valid(job="")), "invalid_field"),
    (encode(valid(job="a b")), "invalid_field"),
    (encode(valid(job="resnet\n")), "invalid_field"),  # a trailing newline is not a name character
    (encode(valid(phase="sleeping")), "invalid_field"),
    (encode(valid(pid=True)), "invalid_field"),
    (encode(valid(unsent=-1)), "invalid_field"),
    (encode(valid(unsent="3")), "invalid_field"),
    (encode(valid(step_seconds={"count": 1, "sum": 0.1, "buckets": [1, 0] + [0] * 13})), "invalid_field"),
    (encode(valid(profiler="not an address")), "invalid_field"),
    (b"{" + b" " * 9000 + b"}", "too_large"),
]


@pytest.mark.parametrize(("payload", "reason"), MALFORMED)
def test_malformed_reports_are_rejected_with_a_reason(payload, reason):
    with pytest.raises(Rejected) as info:
        parse_report(payload, 8192)
    assert info.value.reason == reason


def test_names_of_hostile_reports_hold_bounded_memory():
    """A job's name is checked once and kept (a process sends the same one in every report): a flood of reports
    with a new long name each, valid or not, is refused or read, and keeps at most 2,048 short names."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(6000):
            name = (f"{i:06d}" + "x" * 8000) if i % 2 else f"job-{i:06d}-" + "y" * 110
            try:
                parse_report(encode(valid(job=name)), 65536)
            except Rejected as exc:
                assert exc.reason == "invalid_field" and i % 2
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1_000_000  # 3,000 names of 8,000 characters kept would be 24 MB; 2,048 of 121, 0.5 MB


def _hook_payloads(rng: random.Random) -> list[bytes]:
    """Reports as the hook writes them (compact JSON), with values at and past every bound, and each once more
    with a byte changed."""
    edges = {"pid": [0, 1, 2**53, 2**53 + 1], "seq": [0, 2**53, 2**53 + 1], "steps": [2**53 + 1],
             "time": [0, 5, 1e-05, 999999999999.9, 1e12, 1e20], "process_start": [0.5, 1e12],
             "first_step_seconds": [None, 0, 2.5e-07, 1e12], "batch_size": [None, 0, 64, 2**53 + 1],
             "skipped_steps": [0, 7, 2**53 + 1], "epoch": [0, 3, 2**53 + 1],
             "profiler": [None, "127.0.0.1:6009", "[::1]:6009", "trainer-0.svc.cluster.local:6009", "::1:6009",
                          "host:0", "host:65536", "a b:1", "[x{{{{{{{{{{{{{{{{]:1"],
             "unsent": [1, 10**7, 10**7 + 1], "phase": ["train", "idle", "evaluate", "predict"],
             "job": ["resnet", "a" * 128, "a" * 129, "x/y@z+1:2.3_4-5"]}
    payloads = []
    for i in range(400):
        reporter = Reporter(job=f"job{i}", worker=str(i % 3), profiler=False, batch_size=rng.choice((None, 32)))
        for _ in range(rng.randint(0, 4)):
            reporter.record(rng.randint(1, 40), rng.randint(0, 4000), rng.random() * rng.choice((1e-4, 1, 300)))
        report = reporter.report(outlier=rng.random() < 0.2)
        for key in rng.sample(sorted(edges), rng.randint(0, 2)):
            report[key] = rng.choice(edges[key])
        if rng.random() < 0.1:
            report["step_seconds"]["count"] = rng.choice((0, report["step_seconds"]["buckets"][-1] - 1, 2**53 + 1))
        if rng.random() < 0.05:
            report["step_seconds"]["buckets"][rng.randrange(15)] += rng.choice((-1, 1, 2**53))
        payload = json.dumps(report, separators=(",", ":")).encode()
        at = rng.randrange(len(payload))
        payloads += [payload, payload[:at] + rng.choice(b'0123456789.,:-+eE"{}[]nul \\x\xff').to_bytes(1, "big")
                     + payload[at + 1:]]
    return payloads


def test_reports_as_the_hook_writes_them_are_read_as_json_loads_reads_them(monkeypatch):
    """parse_report decodes a report with JSON's scanner, not json.loads (issue 24). On the hook's own encoding,
    with values at and past their bounds and a byte changed, it accepts and refuses what json.loads' decoding
    does, with the same values, reasons and details: a value that is none inside the object (``"pid":-``) was
    the agent's internal_error, with a traceback logged for every such datagram."""
    from tfprofd.exporter import training

    def outcome(payload: bytes) -> tuple[str, object]:
        try:
            return "read", parse_report(payload, 8192)
        except Rejected as exc:
            return exc.reason, str(exc)

    payloads = _hook_payloads(random.Random(24))
    read = [outcome(p) for p in payloads]
    monkeypatch.setattr(training, "_decode", json.loads)
    assert [outcome(p) for p in payloads] == read
    kinds = [kind for kind, _ in read]
    assert kinds.count("read") > 150 and kinds.count("malformed_json") > 50 and kinds.count("invalid_field") > 50


def _msgspec_edges() -> list[bytes]:
    """Reports where msgspec's reading of JSON and of types could part from ``json.loads`` and ``parse_report``."""
    base = encode(valid())
    text = base.decode()
    edges = [encode(valid(**change)) for change in (
        {"v": 1.0}, {"v": True}, {"v": "1"}, {"outlier": "yes"}, {"outlier": 1}, {"outlier": True}, {"outlier": None},
        {"time": 5}, {"time": -0.0}, {"time": 1e12}, {"time": 999999999999.99}, {"first_step_seconds": 0},
        {"skipped_steps": None}, {"batch_size": None}, {"unsent": None}, {"unsent": 10**7}, {"profiler": 6009},
        {"profiler": "127.0.0.1:6009"}, {"job": "a" * 128}, {"job": "a" * 129}, {"job": "j\n"}, {"worker": ""},
        {"pid": 0}, {"pid": -1}, {"pid": 2**64}, {"seq": 2**53}, {"extra": {"a": [1, {"b": 2}]}},
        {"step_seconds": None},
        {"step_seconds": {"count": 3, "sum": 0.03, "buckets": [0.0] * 15}},
        {"step_seconds": {"count": 3, "sum": 0.03, "buckets": [0] * 14}},
        {"step_seconds": {"count": 3, "sum": 0.03, "buckets": [0] * 16}},
        {"step_seconds": {"count": 3, "sum": 0.03, "buckets": [3] * 15, "more": 1}},
        {"step_seconds": {"count": 2, "sum": 0.03, "buckets": [3] * 15}})]
    edges += [
        base[:-1] + b',"pid":7,"pid":8}',  # duplicate keys: the last one counts, in both
        base.replace(b'"pid"', b'"p\\u0069d"'),  # an escaped key
        base.replace(b'"job": "j"', b'"job": "\\ud800"'),  # a lone surrogate
        base.replace(b'"job": "j"', b'"job": "j\\u0000"'),
        base.replace(b'"job": "j"', b'"job": "\xed\xa0\x80"'),  # a surrogate encoded in UTF-8
        b"\xef\xbb\xbf" + base,  # a byte-order mark: json.loads reads it
        b" \n" + base + b" \t",
        base + b"x",
        text.encode("utf-16"),
        base.replace(b'"time": ', b'"time": NaN, "t": '),
        base.replace(b'"time": ', b'"time": Infinity, "t": '),
        base.replace(b'"epoch": 0', b'"epoch": 0.0'),
        base.replace(b'"epoch": 0', b'"epoch": 1e0'),
        base.replace(b'"epoch": 0', b'"epoch": -0'),
        base[:-1] + b',"deep":' + b"[" * 12 + b"]" * 12 + b"}",
        *(base[:-1] + b',"unknown":' + value + b"}" for value in (
            b'"\\q"', b'"\\u12"', b'"a\nb"', b'"a\tb"', b'"\x7f"', b"01", b"1.", b"-", b".5", b"1e", b"1e5", b"-0",
            b"tru", b"nul", b"[1,]", b'{"a":1,}', b'{"a"}', b"[1 2]", b'"\xc3\xa9"', b"\xc3\xa9")),
        base.replace(b'"worker": "0"', b'"worker": "0", "\xff": 1'),
        # an integer of more digits than Python converts, where msgspec skips it (a field it does not know)
        *(base[:-1] + b',"unknown":' + sign + b"1" * 4301 + b"}" for sign in (b"", b"-")),
        base[:-1] + b',"unknown":' + b"1" * 4300 + b"}",
        base.replace(b'"step_seconds": {', b'"step_seconds": {"unknown": [' + b"9" * 5000 + b'], '),
        base[:-1] + b',"deep":' + b"[" * 20 + b"]" * 20 + b"}",
    ]
    return edges


def test_the_fast_reading_of_reports_accepts_and_refuses_as_parse_report(monkeypatch):
    """Where reports come at FAST_PARSE_RATE or more, msgspec decodes them (``parse_report_fast``, issue 24): it reads
    the same Report as ``parse_report``, and refuses with the same reason and detail, on the hook's own encoding with
    values at and past their bounds and a byte changed, the malformed reports above, and JSON where msgspec and
    json.loads could differ. It reads the hook's valid reports itself, not by handing them to parse_report."""
    from tfprofd.exporter import training

    assert training._wire() is not None, "msgspec, a dependency of the agent, is installed"
    payloads = [*_hook_payloads(random.Random(31)), *_msgspec_edges(),
                *(p for p, _ in MALFORMED), *(encode(valid(job=f"j{i}", pid=i + 1)) for i in range(50))]

    def outcome(parse, payload: bytes) -> tuple[str, object]:
        try:
            return "read", parse(payload, 8192)
        except Rejected as exc:
            return exc.reason, str(exc)

    slow = [outcome(parse_report, p) for p in payloads]
    handed: list[bytes] = []

    def counted(payload: bytes, max_bytes: int) -> training.Report:
        handed.append(payload)
        return parse_report(payload, max_bytes)

    monkeypatch.setattr(training, "parse_report", counted)
    fast = [outcome(parse_report_fast, p) for p in payloads]
    assert [(p, *f) for p, f, s in zip(payloads, fast, slow, strict=True) if f != s] == []
    read_alone = [p for p, (kind, _) in zip(payloads, fast, strict=True) if kind == "read" and p not in handed]
    assert len(read_alone) > 200 and [kind for kind, _ in slow].count("invalid_field") > 50


def test_reports_that_come_many_a_second_are_read_by_msgspec_and_few_never_load_it(agents):
    """20 jobs' reports leave msgspec unloaded, so the agent stays as small as README's 20-job figure; 1,000 reports
    as fast as the Unix socket takes them are read by it (FAST_PARSE_RATE), every one of them accepted."""
    agent = agents()
    maps = Path(f"/proc/{agent.proc.pid}/maps")

    def accepted(count: int) -> bool:
        return metric_value(agent.scrape(), "tfprofd_hook_reports_total") == count

    reporters = [Reporter(job=f"many{i}", worker="0", profiler=False) for i in range(250)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:  # blocking: a full queue waits, never drops
        for i in range(20):
            reporter = Reporter(job=f"few{i}", worker="0", profiler=False)
            reporter.record(2, 64, 0.02)
            sock.sendto(encode(reporter.report()), str(agent.hook_socket))
        wait_for(lambda: accepted(20), 10, message="20 reports accepted")
        assert "msgspec" not in maps.read_text()
        for _ in range(4):
            for reporter in reporters:
                reporter.record(2, 64, 0.02)
                sock.sendto(encode(reporter.report()), str(agent.hook_socket))
    wait_for(lambda: accepted(1020), 20, message="1,020 reports accepted")
    assert "msgspec" in maps.read_text()
    text = agent.scrape()
    assert metric_value(text, "tfprofd_training_samples_total", training_job="many249") == 4 * 64
    assert sum(metric_value(text, "tfprofd_hook_reports_rejected_total", reason=r) for r in REJECT_REASONS) == 0


def test_fuzzed_datagrams_never_crash_the_agent_and_are_counted(agents):
    agent = agents()
    rng = random.Random(1234)
    sent: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)
    payloads: list[tuple[bytes, str]] = []
    for _ in range(150):
        junk = rng.randbytes(rng.randint(1, 2000))
        payloads.append((junk, "too_deep" if junk.count(b"[") + junk.count(b"{") > MAX_BRACKETS else "malformed_json"))
    base = encode(valid())
    for cut in range(1, len(base) - 1, 7):
        payloads.append((base[:cut], "malformed_json"))
    for bad in ({"steps": 2**64}, {"samples": -5}, {"epoch": 1.5}, {"worker": None}, {"time": "now"},
                {"step_seconds": []}, {"pid": 0}, {"seq": -1}):
        payloads.append((encode(valid(**bad)), "invalid_field"))
    payloads.append((b"x" * 65000, "too_large"))
    payloads.append((encode(valid(v="1")), "unknown_version"))
    payloads.append((b"null", "not_an_object"))

    def all_counted():
        text = agent.scrape()
        return all(metric_value(text, "tfprofd_hook_reports_rejected_total", reason=r) == n for r, n in sent.items())

    with reports_socket() as sock:
        for i, (payload, reason) in enumerate(payloads):
            sock.sendto(payload, ("127.0.0.1", agent.hook_port))
            sent[reason] += 1
            if i % 20 == 19:  # a full receive buffer drops datagrams (an agent not scheduled meanwhile): 20 at a time
                wait_for(all_counted, 10, message=f"rejections counted by reason: {sent}")
        sock.sendto(encode(valid(job="fine")), ("127.0.0.1", agent.hook_port))

    wait_for(all_counted, 10, message=f"rejections counted by reason: {sent}")
    text = agent.scrape()
    assert metric_value(text, "tfprofd_hook_reports_total") == 1
    assert metric_value(text, "tfprofd_training_samples_total", training_job="fine") == 96
    assert agent.proc.poll() is None


def test_stale_and_decreasing_reports_are_rejected(agents):
    agent = agents()
    reporter = Reporter(job="order", worker="0", profiler=False, addr=f"127.0.0.1:{agent.hook_port}")
    reporter.record(10, 320, 0.1)
    first = reporter.report()
    reporter.record(10, 320, 0.1)
    second = reporter.report()
    with reports_socket() as sock:
        for payload in (first, second, first, {**second, "seq": 99, "steps": 1}):
            sock.sendto(encode(payload), ("127.0.0.1", agent.hook_port))
    wait_for(lambda: metric_value(agent.scrape(), "tfprofd_hook_reports_rejected_total", reason="counter_decreased")
             == 1, 5, message="decrease rejected")
    text = agent.scrape()
    assert metric_value(text, "tfprofd_hook_reports_rejected_total", reason="stale") == 1
    assert metric_value(text, "tfprofd_training_steps_total", training_job="order") == 20


def test_a_restarted_training_process_continues_the_job_counters(agents):
    agent = agents()
    with reports_socket() as sock:
        sock.sendto(encode(valid(job="again", pid=100, steps=50, samples=1600)), ("127.0.0.1", agent.hook_port))
        sock.sendto(encode(valid(job="again", pid=200, steps=5, samples=160)), ("127.0.0.1", agent.hook_port))
    wait_for(lambda: metric_value(agent.scrape(), "tfprofd_training_samples_total", training_job="again") == 1760,
             5, message="counters carried over")


def test_reporter_never_blocks_or_raises_without_an_agent():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reporter = Reporter(job="alone", profiler=False, addr=f"127.0.0.1:{port}")
    for _ in range(5):
        with reporter.step(batch_size=8):
            pass
        reporter.flush()
    assert reporter.steps == 5 and reporter.samples == 40


@pytest.mark.parametrize(("env", "worker"), [
    ({}, "0"),
    ({"HOROVOD_RANK": "3"}, "3"),  # Horovod, without TF_CONFIG: each host's process had been worker "0"
    ({"OMPI_COMM_WORLD_RANK": "5", "RANK": "9"}, "5"),  # the first launcher variable set
    ({"SLURM_PROCID": "12"}, "12"),
    ({"JOB_COMPLETION_INDEX": "007"}, "7"),
    ({"RANK": "-1", "PMI_RANK": "x", "SLURM_PROCID": "\u0663"}, "0"),  # no rank there: not a name taken from it
    ({"RANK": "2", "TF_CONFIG": json.dumps({"task": {"type": "worker", "index": 4}})}, "worker-4"),
])
def test_the_worker_name_comes_from_the_launcher_where_nothing_names_it(monkeypatch, env, worker):
    for name in ("TF_CONFIG", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "RANK",
                 "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Reporter(job="ranked", profiler=False).worker == worker
    assert Reporter.shared(job=f"ranked-{worker}-{len(env)}", profiler=False).worker == worker
    assert Reporter(job="ranked", worker="named", profiler=False).worker == "named"


def test_one_reporter_per_job_and_worker_in_a_process():
    first = Reporter.shared(job="same", worker="0", profiler=False)
    assert Reporter.shared(job="same", worker="0", profiler=False) is first
    assert Reporter.shared(job="same", worker="1", profiler=False) is not first


def test_steps_nobody_reports_are_still_counted_in_bounded_memory():
    reporter = Reporter(job="unstarted", profiler=False, addr="127.0.0.1:9")  # its thread never started
    tracemalloc.start()
    try:
        for _ in range(400_000):
            reporter.begin_step()
            reporter.end_step(1, 4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20e6  # a queue of every step would hold over 50 MB
    assert reporter.report_counts() == (400_000, 1_600_000, 0)
    assert reporter.report()["step_seconds"]["count"] == 400_000


class Listener:
    """A UDP socket that collects the hook's reports."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.reports: list[dict] = []

    def read(self) -> list[dict]:
        while True:
            try:
                self.reports.append(json.loads(self.sock.recv(65536)))
            except TimeoutError:
                return self.reports

    def first(self, test) -> dict | None:
        return next((r for r in self.read() if test(r)), None)

    def latest_seq(self) -> int:
        return max((r["seq"] for r in self.read()), default=0)


def wait_for_outliers_looked_for(reporter: Reporter, latest_seq) -> int:
    """Wait until the hook looks for outlier steps (its threshold set: after its first report, and again past its
    one early report a second): a step of the fast ones that a busy machine stalled may have been one, and a slow
    step the test makes must be seen as the next. Returns the last seq sent before the slow step."""
    wait_for(lambda: reporter._outlier_above < float("inf"), 20, message="the hook to look for outlier steps")
    return latest_seq()


@contextmanager
def fast_steps_reported(listener: Listener) -> Iterator[tuple[Reporter, int]]:
    """A reporter to ``listener`` that has reported 200 fast steps and looks for outliers: (it, the last seq)."""
    reporter = Reporter(job="jump", profiler=False, addr=listener.addr, interval=0.2).start()
    try:
        for _ in range(200):
            with reporter.step(batch_size=8):
                pass
        wait_for(lambda: listener.first(lambda r: r["step_seconds"]["count"] == 200), 20,
                 message="the fast steps reported")
        yield reporter, wait_for_outliers_looked_for(reporter, listener.latest_seq)
    finally:
        reporter.close()


def test_a_step_far_longer_than_the_last_ones_is_reported_early_in_a_report_of_its_own(monkeypatch):
    listener = Listener()
    with fast_steps_reported(listener) as (reporter, mark):
        monkeypatch.setattr(hook, "OUTLIER_EVERY", 60.0)  # the second slow step below comes within it, however late
        with reporter.step(batch_size=8):
            time.sleep(0.05)  # the step the input pipeline stalls
        outlier = wait_for(lambda: listener.first(lambda r: r.get("outlier") and r["seq"] > mark), 20,
                           message="a flagged report")
        with reporter.step(batch_size=8):
            time.sleep(0.05)  # another: at most one early report per OUTLIER_EVERY
        wait_for(lambda: listener.first(lambda r: r["step_seconds"]["count"] == 202 and r["seq"] >= outlier["seq"] + 3),
                 20, message="the last step and two reports more")
    before = next(r for r in listener.reports if r["seq"] == outlier["seq"] - 1)
    # The report just before, sent as the slow step ended, holds the fast steps only; the flagged one (the agent
    # samples on it at once) holds the slow step and what came after it (nothing here), undiluted by the fast
    # steps of the same second.
    assert before["step_seconds"]["count"] == 200 and outlier["step_seconds"]["count"] == 201
    assert outlier["step_seconds"]["sum"] - before["step_seconds"]["sum"] >= 0.05
    # The second slow step, within the second, brings no early report of its own.
    assert [r["seq"] for r in listener.reports if r.get("outlier") and r["seq"] > mark] == [outlier["seq"]]
    assert parse_report(encode(outlier), 8192).outlier


def test_after_an_outlier_and_a_pause_the_next_slow_step_is_reported_early_too():
    """A stall, then training pauses (or its steps are few): the next stall, a second or more later, is still
    reported at once; the threshold is the one before the first stall, not inflated by it nor lost."""
    listener = Listener()
    with fast_steps_reported(listener) as (reporter, mark):
        with reporter.step(batch_size=8):
            time.sleep(0.05)  # the first stall, the last step for a while
        first = wait_for(lambda: listener.first(lambda r: r.get("outlier") and r["seq"] > mark), 20,
                         message="the first flagged report")
        wait_for_outliers_looked_for(reporter, listener.latest_seq)
        with reporter.step(batch_size=8):
            time.sleep(0.05)  # the second stall
        second = wait_for(lambda: listener.first(lambda r: r.get("outlier") and r["seq"] > first["seq"]), 20,
                          message="the second stall flagged")
    assert second["step_seconds"]["count"] == 202


SLOW_STEP_RULES = """
rules:
  - name: slow_step
    description: a step over 40 ms
    signal: step_seconds
    above: 0.04
    cooldown: 0s
    capture: false
"""


def test_an_outlier_step_is_seen_by_the_rules_before_the_next_interval(agents, tmp_path):
    config = tmp_path / "rules.yaml"
    config.write_text(SLOW_STEP_RULES)
    agent = agents(args=["--config", str(config), "--interval", "120"])  # no scheduled sample during the test
    reporter = Reporter(job="jump", profiler=False, addr=f"127.0.0.1:{agent.hook_port}", interval=0.2).start()
    try:
        with reporter.step(batch_size=8):
            pass
        wait_for(lambda: metric_value(agent.scrape(), "tfprofd_training_steps_total", training_job="jump") == 1, 20,
                 message="the job known (its first report asks for a sample)")
        for _ in range(200):
            with reporter.step(batch_size=8):
                pass
        with reporter.step(batch_size=8):
            time.sleep(0.01)  # a step a busy machine stalled: an outlier, under the rule's 40 ms
        wait_for_outliers_looked_for(reporter, lambda: reporter._seq)
        with reporter.step(batch_size=8):
            time.sleep(0.06)
        wait_for(lambda: "rule slow_step firing" in agent.log(), 60,
                 message="the rule to see the slow step (the next scheduled sample is 120 s away)")
        # and /metrics says so from that sample on: the agent's part was rendered at most every half interval (60 s
        # here), so a rule that fired soon after a rendering read quiet to every scrape until the next one
        wait_for(lambda: metric_value(agent.scrape(), "tfprofd_rule_active", rule="slow_step") == 1, 10,
                 message="/metrics to show the rule firing")
    finally:
        reporter.close()


def test_reports_the_kernel_dropped_on_a_full_udp_socket_are_counted_and_logged(agents):
    """A UDP socket whose buffer is full drops what comes (a burst from many jobs, an agent that is paused):
    every report sent is accepted, rejected or counted as dropped, and the log says what to do."""
    if int(Path("/sys/class/net/lo/mtu").read_text()) < 60028:
        pytest.skip("loopback's MTU would fragment 60 kB reports (fragments past netdev_max_backlog go uncounted)")
    agent = agents(args=["--hook.max-datagram-bytes", "65507"])
    payload = encode(valid(job="burst")).ljust(60000)  # JSON may end in blanks: 60 kB a report
    # The agent asks for a 4 MiB buffer, which the kernel doubles at most: it holds fewer than 8 MiB / 60 kB. Fewer
    # than net.core.netdev_max_backlog (1000) in all, or loopback could drop some before the socket, uncounted.
    flood = 2 * (4 << 20) // len(payload) + 300
    with reports_socket() as sock:
        agent.signal(signal.SIGSTOP)
        try:
            for _ in range(flood):
                sock.sendto(payload, ("127.0.0.1", agent.hook_port))
        finally:
            agent.signal(signal.SIGCONT)

        def read() -> tuple[float, float, float]:
            text = agent.scrape()
            return (metric_value(text, "tfprofd_hook_reports_total"),
                    metric_value(text, "tfprofd_hook_reports_rejected_total", reason="stale"),
                    metric_value(text, "tfprofd_hook_reports_dropped_total"))

        wait_for(lambda: read()[0] == 1, 10, message="the first report accepted")
        # the reports queued before the buffer filled cannot tell of the drops after them: a later one does
        sock.sendto(payload, ("127.0.0.1", agent.hook_port))
        wait_for(lambda: sum(read()) == flood + 1, 10, message="every report accepted, rejected or dropped")
    accepted, stale, dropped = read()
    assert accepted == 1 and dropped > 150 and stale == flood - dropped  # the same report again: stale
    wait_for(lambda: "hook reports on the UDP socket" in agent.log(), 5, message="the drops logged")
    assert "its receive buffer" in agent.log() and ("raise net.core.rmem_max" in agent.log()
                                                     or "the agent fell behind" in agent.log())


def test_a_drop_count_older_than_one_seen_adds_nothing():
    """Each datagram carries the kernel's count of the socket's drops as it read it, which Linux 6.18 does before
    the queue's lock: with a queue per NUMA node, a datagram that says 5 can follow one that says 7. The
    counter must not take that for 2^32 - 2 more drops; it wraps as the kernel's u32 does."""
    seen = total = 0
    for count in (7, 5, 9, 2**32 - 3, 4):
        grew = dropped_since(seen, count)
        seen, total = (seen + grew) % 2**32, total + grew
    assert total == 9  # 5 is behind 7; 2^32 - 3 and 4 are behind 9 (more than half the range ahead of it)
    seen, total = 2**32 - 3, 0
    for count in (2**32 - 1, 2, 1):  # across the wrap: 2 more, 3 more, then an older one
        grew = dropped_since(seen, count)
        seen, total = (seen + grew) % 2**32, total + grew
    assert (seen, total) == (2, 5)


def test_a_udp_gathering_drains_slowly_only_where_the_buffer_holds_what_comes_meanwhile():
    """The slower drain (fewer wakes) is chosen from the reports' rate and size, and only where a report of every
    job at once (hook.max_jobs) fits too: a low max_jobs with many more senders, or large reports, overflowed a
    default-sized buffer (a review: 650 of 6,000 dropped, none with 20 ms drains), and so did one 0.25 s wait
    at 150 reports a second before 1,000 came within 0.1 s (another review: 490-680 of them dropped)."""
    default, roomy = 2 * 212992, 2 * (4 << 20)  # granted with the kernel's default rmem_max, and with 4 MiB
    assert gather_step(roomy, 1000, 350, 1000) == UDP_GATHER_SECONDS  # 1,000 jobs at their own phases: one wait
    assert gather_step(roomy, 6000, 350, 1000) == UDP_GATHER_STEP_ROOMY
    assert gather_step(default, 1000, 350, 1000) == UDP_GATHER_STEP
    assert gather_step(default, 150, 350, 1000) == UDP_GATHER_STEP  # every job at once would not fit
    assert gather_step(default, 3000, 350, 100) == UDP_GATHER_STEP  # many senders, whatever max_jobs says
    assert gather_step(roomy, 3000, 8000, 1000) == UDP_GATHER_STEP  # large reports take far more of the buffer
    assert gather_step(default, 300, 350, 100) == UDP_GATHER_STEP_ROOMY
    assert gather_step(default, 150, 350, 100) == UDP_GATHER_SECONDS  # a few jobs: room enough anywhere


BURST_SENDER = r"""
import json, socket, sys, time
from tfprofd.exporter.hook import Reporter
target = (sys.argv[1], int(sys.argv[2]))
sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(1000)]
payloads = [json.dumps(Reporter(job=f"job{i}", worker="0", profiler=False, addr="127.0.0.1:9").report()).encode()
            for i in range(1000)]
start = time.perf_counter()
for i, (s, payload) in enumerate(zip(sockets, payloads)):
    while time.perf_counter() < start + i * 1e-4:  # 1,000 reports within 0.1 s
        pass
    s.sendto(payload, target)
sockets[0].sendto(b"the drops' count", target)  # queued after the burst: it carries the kernel's count of drops
print(flush=True)
sys.stdin.read()  # the senders' sockets stay open until their reports are checked
"""


@pytest.mark.skipif(int(Path("/proc/sys/net/core/rmem_max").read_text()) < 212992,
                    reason="a receive buffer smaller than the kernel's default")
def test_every_job_reporting_at_once_on_a_default_sized_buffer_is_received(monkeypatch):
    """With the kernel's default rmem_max (the socket granted 425,984 bytes), 1,000 jobs that report within
    0.1 s of a quiet moment are all received: a gathering that starts as reports ramp up drains every 20 ms
    until it has measured them, and drains slowly only where a report of every job at once fits (one 0.25 s
    wait, chosen from the rate so far, dropped 490-550 of them)."""
    import subprocess
    import sys

    from tfprofd.exporter import training
    from tfprofd.exporter.base import Environment
    from tfprofd.exporter.training import HookSettings, TrainingCollector

    monkeypatch.setattr(training, "UDP_BUFFER", 212992)  # what the kernel allows by default
    collector = TrainingCollector(HookSettings(socket="", listen=("127.0.0.1", 0)), Environment())
    try:
        host, port = collector.udp_address
        with subprocess.Popen([sys.executable, "-c", BURST_SENDER, host, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) as sender:
            assert sender.stdout is not None and sender.stdin is not None
            sender.stdout.readline()  # sent
            wait_for(lambda: collector.accepted + sum(collector.rejected.values()) + collector.dropped == 1001, 60,
                     message="every report accepted, rejected or counted as dropped")
            sender.stdin.close()
        assert (collector.accepted, collector.dropped) == (1000, 0)
        assert collector.rejected["malformed_json"] == 1
    finally:
        collector.close()


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (SIGSTOP takes effect a moment after it is sent)."""
    states = [state for task in Path(f"/proc/{pid}/task").iterdir() if (state := proc_state(task / "stat"))]
    return bool(states) and all(state in ("T", "t") for state in states)


def test_reports_a_full_unix_socket_refused_are_counted_from_the_hooks_next_report(agents):
    """The kernel refuses a Unix datagram to a socket whose queue is full (an agent paused, many processes
    starting at once): the hook counts what it could not send and its next report tells the agent."""
    agent = agents()
    reporter = Reporter(job="refused", worker="0", profiler=False, addr=f"unix:{agent.hook_socket}")
    reporter.record(1, 32, 0.01)
    queue = int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
    agent.signal(signal.SIGSTOP)
    try:
        wait_for(lambda: _stopped(agent.proc.pid), 10, message="every thread of the agent stopped")
        sent = [reporter.flush() for _ in range(queue + 20)]
    finally:
        agent.signal(signal.SIGCONT)
    refused = sent.count(False)
    assert refused >= 19, sent
    wait_for(lambda: metric_value(agent.scrape(), "tfprofd_hook_reports_total") == sent.count(True), 10,
             message="the queued reports accepted")
    assert metric_value(agent.scrape(), "tfprofd_hook_reports_unsent_total") == 0
    assert reporter.flush()
    wait_for(lambda: metric_value(agent.scrape(), "tfprofd_hook_reports_unsent_total") == refused, 10,
             message="the refused reports counted")
    assert reporter.flush()  # the same count again adds nothing
    wait_for(lambda: metric_value(agent.scrape(), "tfprofd_hook_reports_total") == sent.count(True) + 2, 10,
             message="the last report accepted")
    assert metric_value(agent.scrape(), "tfprofd_hook_reports_unsent_total") == refused
    wait_for(lambda: f"could not send {refused} reports" in agent.log(), 10, message="the refusals logged")
    advice = "set net.unix.max_dgram_qlen to 512" if queue < 64 else "the agent was down, stopped or short of CPU"
    assert advice in agent.log()
