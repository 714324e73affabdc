"""Training collector: receives the hook's reports, validates them, and exports throughput per job.

Reports arrive on a Unix datagram socket (a host's training processes; the kernel tells the sender's
pid, which the report must carry) and, where configured, over UDP. A UDP datagram from a socket of this
host (loopback, or an address of the host: the socket is in the agent's network namespace) is as good
as its socket's owner in /proc/net/udp: its pid must be that uid's process and its profiler port one that
uid listens on. From a pod (another namespace) only the source address is known: the profiler must be
on it, and its pid, which means nothing here, is never joined to NVML's. Nothing a sender writes can make
the agent profile another process than the sender.

Series are labelled ``training_job`` and ``worker`` (``job`` belongs to Prometheus' scrape target). The
agent keeps state per reporting process and sums the processes of a (job, worker): two users' jobs of
the same name add up instead of clobbering each other, and a restarted process continues the job's
counters. A process that stops reporting stops counting as training at once (its pid is gone) or
after ``stale_after``; the job reads down after ``down_after`` and is forgotten after ``expire_after``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import ipaddress
import itertools
import json
import json.scanner
import logging
import math
import operator
import os
import re
import selectors
import socket
import stat
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

from prometheus_client.core import HistogramMetricFamily, Metric

from .base import PREFIX, Collector, Environment, Sectioned, Signals, counter, gauge, go_float, label_value
from .hook import PHASES, SCHEMA_VERSION, STEP_BUCKETS, default_socket_path
from .options import option, parse_bool, parse_duration, parse_host, parse_int, parse_optional_address, parse_str

log = logging.getLogger("tfprofd.training")

REJECT_REASONS = ("too_large", "too_deep", "malformed_json", "not_an_object", "unknown_version", "invalid_field",
                  "stale", "counter_decreased", "pid_mismatch", "untrusted_profiler", "unverified_sender",
                  "too_many_jobs", "internal_error")
SECURITY_REASONS = frozenset({"pid_mismatch", "untrusted_profiler", "unverified_sender"})  # logged as warnings
MAX_NAME_CHARS = 128  # a job or worker name
_NAME = re.compile(rf"[A-Za-z0-9_.:/@+-]{{1,{MAX_NAME_CHARS}}}")
_MAX_COUNT = 2**53
MAX_BRACKETS = 16  # the schema nests 3 deep; more brackets than this is not a report
MAX_UNSENT = 10**7  # refused reports one report may tell of (115 days of a report a second): more is not a hook's
MAX_PROCESSES_PER_JOB = 64
RATE_STALE_SECONDS = 5.0  # a process silent this long no longer counts as training or has a rate
OUTLIER_WAKE_EVERY = 0.4  # s: a process's flagged reports ask for a sample at most this often (the hook: 2 a second)
FOLDED_KEPT = 64  # processes per job whose counters were folded in, remembered to undo a fold
NEW_JOB_LOGS_PER_MINUTE = 20
REFUSED_LOGS_PER_MINUTE = 20
UDP_GATHER_SECONDS = 0.25  # a UDP report waits at most this long for others to share its socket-table read
UDP_GATHER_STEP = 0.02  # s: a gathering drains the socket this often (its buffer holds far more than that)
UDP_GATHER_STEP_ROOMY = 0.125  # s: as often, where the socket's buffer holds what comes meanwhile (gather_step)
UDP_GATHER_RATE = 100.0  # UDP reports a second from which they are gathered (below it, each burst is read alone)
FAST_PARSE_RATE = 100.0  # reports a second from which msgspec decodes them (parse_report_fast; ~1 MiB resident)
UNIX_PAUSE_S = 0.25  # after its reports are read, the Unix socket waits at most this long before the next read
UNIX_QUEUE_DEFAULT = 10  # the kernel's default net.unix.max_dgram_qlen (systemd sets 512)
LATE_REPORT_S = 2 * UNIX_PAUSE_S  # a process whose pid is gone is retired this long after a sample saw it
UNIX_REST_QUEUE = 64  # below this queue the socket never rests: jobs that start reporting at once could fill it
DRAIN_AT_ONCE = 256  # datagrams read at most before the next wait (the stop flag is seen under a flood)
UDP_BATCH = 1024  # datagrams at most in one batch
UDP_BATCH_BYTES = 1 << 20  # and bytes (a flood of 64 KiB datagrams holds no more than the socket's buffer)
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_CMSG_SPACE = socket.CMSG_SPACE(_CREDS.size)
UDP_BUFFER = 4 << 20  # bytes the agent asks for; the kernel grants twice that, or twice net.core.rmem_max if less
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)  # Linux's value, where Python's headers do not name it
_DROPS = struct.Struct("I")  # SO_RXQ_OVFL's message: the datagrams the socket dropped so far (wraps at 2^32)
_DROPS_SPACE = socket.CMSG_SPACE(_DROPS.size)
DROPS_LOG_EVERY = 60.0  # s: kernel drops are logged at most this often


class Rejected(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Report(NamedTuple):
    job: str
    worker: str
    pid: int
    seq: int
    time: float
    process_start: float
    phase: str
    epoch: int
    steps: int
    samples: int
    skipped_steps: int
    batch_size: int | None
    step_count: int
    step_sum: float
    step_buckets: tuple[int, ...]
    first_step_seconds: float | None
    profiler: str | None
    outlier: bool = False  # it ends with a step far longer than the ones before, or follows such a report: sample now
    unsent: int = 0  # reports of this process its socket refused since its last one sent (queue full, or no agent)


class Sender(NamedTuple):
    """Who sent a datagram: a local process the kernel vouches for, or a UDP peer: a socket of this host (its
    owner's uid known from /proc/net/udp) or a remote one such as a pod (its address only)."""

    local: bool
    pid: int | None = None
    uid: int | None = None
    address: str | None = None  # UDP source address
    port: int | None = None  # UDP source port

    @property
    def origin(self) -> str:
        return "local" if self.local else _udp_origin(self.address, self.uid)


@functools.lru_cache(maxsize=4096)
def _udp_origin(address: str | None, uid: int | None) -> str:
    """A UDP sender's origin, the same string for every report of a source: it keys the sender's process, and a
    string made afresh for each report was written and hashed again each time (1,000 reports a second)."""
    return f"udp:{address}" if uid is None else f"udp:{address}:uid={uid}"


# A decoded report's values are of JSON's types exactly (a bool's type is bool, not int): ``type() is`` tests them in
# one step, where isinstance took two or three (1,000 reports a second, issue 24).
def _int(data: dict[str, Any], key: str, optional: bool = False) -> int | None:
    value = data.get(key)
    if type(value) is int and 0 <= value <= _MAX_COUNT:
        return value
    if value is None and optional:
        return None
    raise Rejected("invalid_field", f"{key} must be an integer in 0..2^53, got {_show(value)}")


def _float(data: dict[str, Any], key: str, optional: bool = False) -> float | None:
    value = data.get(key)
    kind = type(value)
    if (kind is float or kind is int) and 0 <= value < 1e12:
        return float(value)
    if value is None and optional:
        return None
    raise Rejected("invalid_field", f"{key} must be a non-negative number, got {_show(value)}")


@functools.lru_cache(maxsize=2048)  # a job and a worker name for each of hook.max_jobs' default 1,000 series
def _matches_name(value: str) -> bool:
    """Whether a string of at most MAX_NAME_CHARS matches a name's pattern: kept, as a process names the same two in
    every report."""
    return _NAME.fullmatch(value) is not None


def _is_name(value: object) -> bool:
    """Whether a decoded value is a job or worker name. A longer string is no name, and is not kept: hostile reports'
    names hold at most 2,048 of MAX_NAME_CHARS each."""
    return type(value) is str and len(value) <= MAX_NAME_CHARS and _matches_name(value)


def _name(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    if not _is_name(value):
        raise Rejected("invalid_field",
                       f"{key} must be 1-{MAX_NAME_CHARS} characters of [A-Za-z0-9_.:/@+-], got {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_profiler_address(value: Any) -> str:
    """``host:port`` with a real host (IP or DNS name) and a port in 1..65535; raises Rejected."""
    if not isinstance(value, str) or len(value) > 260:
        raise Rejected("invalid_field", f"profiler must be host:port, got {_show(value)}")
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise Rejected("invalid_field", f"profiler must be host:port with a port in 1..65535, got {_show(value)}")
    try:
        parse_host(host)
    except ValueError:
        raise Rejected("invalid_field", f"profiler must be host:port with a real host, got {_show(value)}") from None
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise Rejected("invalid_field", f"an IPv6 profiler host must be in brackets, got {_show(value)}")
    return value


@functools.lru_cache(maxsize=1024)
def _profiler_address(value: str) -> str:
    """``parse_profiler_address`` of a string, kept: a process names the same server in every report, and parsing
    it was 3 µs of each (1,000 jobs: 0.3% of a core, issue 24). Only valid addresses are kept (a Rejected is not)."""
    return parse_profiler_address(value)


_scan_json = json.scanner.make_scanner(json.JSONDecoder())  # what json.loads runs, with json.loads' settings


def _decode(payload: bytes) -> Any:
    """``json.loads(payload)``, without its Python steps (an encoding guessed, whitespace skipped at both ends)
    for a payload that is an object from its first byte to its last, as every report is: a quarter of the
    decoding of 1,000 reports a second (issue 24). The same values, and the same errors, as json.loads."""
    # json.loads finds UTF-8 for such a payload (a second byte 0 would be UTF-16 or 32: left to json.loads)
    if payload[:1] != b"{" or payload[-1:] != b"}" or payload[1:2] == b"\0":
        return json.loads(payload)
    text = payload.decode("utf-8", "surrogatepass")
    try:
        data, end = _scan_json(text, 0)
    except StopIteration as exc:  # a value that is none inside the object: json.loads' own error for it (the
        raise json.JSONDecodeError("Expecting value", text, exc.value) from None  # scanner leaves it to its caller)
    return data if end == len(text) else json.loads(payload)  # more after the object: json.loads' own error


def parse_report(payload: bytes, max_bytes: int) -> Report:
    """Validate one datagram of the hook's schema (README: "Hook report schema"); raise Rejected."""
    if len(payload) > max_bytes:
        raise Rejected("too_large", f"{len(payload)} bytes > {max_bytes}")
    if payload.count(b"[") + payload.count(b"{") > MAX_BRACKETS:
        raise Rejected("too_deep", "more nesting than a report has")
    try:
        data = _decode(payload)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Rejected("malformed_json", str(exc)) from None
    if not isinstance(data, dict):
        raise Rejected("not_an_object", type(data).__name__)
    if data.get("v") != SCHEMA_VERSION or isinstance(data.get("v"), bool):
        raise Rejected("unknown_version", _show(data.get("v")))
    phase = data.get("phase")
    if not isinstance(phase, str) or phase not in PHASES:
        raise Rejected("invalid_field", f"phase must be one of {PHASES}, got {_show(phase)}")
    step = data.get("step_seconds")
    if not isinstance(step, dict):
        raise Rejected("invalid_field", "step_seconds must be an object")
    buckets = step.get("buckets")
    # in C calls, not a Python loop per bucket (1,000 reports a second, issue 24): JSON's only int type is int
    # (a bool's is bool), and counts that never decrease are all within 0..2^53 when the first and last are
    if (not isinstance(buckets, list) or len(buckets) != len(STEP_BUCKETS) or not set(map(type, buckets)) <= {int}
            or not all(map(operator.le, buckets, buckets[1:])) or not 0 <= buckets[0] <= buckets[-1] <= _MAX_COUNT):
        raise Rejected("invalid_field", f"step_seconds.buckets must be {len(STEP_BUCKETS)} non-decreasing counts")
    step_count = _int(step, "count")
    if buckets[-1] > step_count:
        raise Rejected("invalid_field", "step_seconds.count is below the last bucket")
    profiler = data.get("profiler")
    if profiler is not None:
        profiler = _profiler_address(profiler) if type(profiler) is str else parse_profiler_address(profiler)
    pid = _int(data, "pid")
    if not pid:
        raise Rejected("invalid_field", "pid must be positive")
    return Report(  # by position: by keyword it took 1.3 µs, a tenth of a report's parsing (issue 24)
        _name(data, "job"), _name(data, "worker"), pid, _int(data, "seq"), _float(data, "time"),
        _float(data, "process_start"), phase, _int(data, "epoch"), _int(data, "steps"), _int(data, "samples"),
        _int(data, "skipped_steps", optional=True) or 0, _int(data, "batch_size", optional=True), step_count,
        _float(step, "sum"), tuple(buckets), _float(data, "first_step_seconds", optional=True), profiler,
        data.get("outlier") is True, _unsent(data))


@functools.cache
def _wire() -> tuple[Any, type[Exception]] | None:
    """msgspec's JSON decoder of a report, typed and bounded as ``parse_report`` checks its fields, and the error it
    raises; None where msgspec is not installed. Imported on first use (~1 MiB resident), where reports are many."""
    try:
        import msgspec
    except ImportError:
        return None
    from typing import Annotated

    count = Annotated[int, msgspec.Meta(ge=0, le=_MAX_COUNT)]
    number = Annotated[float, msgspec.Meta(ge=0, lt=1e12)]
    buckets = Annotated[tuple[count, ...], msgspec.Meta(min_length=len(STEP_BUCKETS), max_length=len(STEP_BUCKETS))]
    step = msgspec.defstruct("Step", [("count", count), ("sum", number), ("buckets", buckets)])
    report = msgspec.defstruct("Report", [
        ("v", Literal[SCHEMA_VERSION]), ("job", str), ("worker", str), ("pid", count), ("seq", count),
        ("time", number), ("process_start", number), ("phase", Literal[PHASES]), ("epoch", count), ("steps", count),
        ("samples", count), ("step_seconds", step), ("skipped_steps", count | None, None),
        ("batch_size", count | None, None), ("first_step_seconds", number | None, None),
        ("profiler", str | None, None), ("outlier", Any, False), ("unsent", count | None, None)])
    return msgspec.json.Decoder(report), msgspec.MsgspecError


def parse_report_fast(payload: bytes, max_bytes: int) -> Report:
    """``parse_report``, the same Report and the same Rejected, in a fifth of its time (1,000 jobs report every second:
    decoding and checking them was a seventh of the agent's CPU; issue 24): msgspec decodes the hook's schema and
    checks its types and bounds in one C pass, and what it cannot say alone (names, the buckets' order, the profiler)
    is checked here. Whatever it refuses, or any check here, goes to ``parse_report``, which says why (or reads what
    msgspec is stricter about: a version of 1.0, an ``outlier`` that is not a bool)."""
    wire = _wire()
    # the hook writes ASCII (JSON's escapes for the rest); msgspec skips the bytes of a field it does not know
    # without checking that they are UTF-8, or that an integer there has no more digits than Python converts
    # (sys.get_int_max_str_digits), both of which json.loads refuses
    digits = sys.get_int_max_str_digits()
    if (wire is None or len(payload) > max_bytes or not payload.isascii()
            or payload.count(b"[") + payload.count(b"{") > MAX_BRACKETS
            or (digits and len(payload) > digits and re.search(rb"[0-9]{%d}" % (digits + 1), payload))):
        return parse_report(payload, max_bytes)
    decoder, error = wire
    try:
        data = decoder.decode(payload)
    except error:
        return parse_report(payload, max_bytes)
    step, job, worker, profiler, unsent = data.step_seconds, data.job, data.worker, data.profiler, data.unsent
    buckets = step.buckets
    if (not data.pid or buckets[-1] > step.count or not all(map(operator.le, buckets, buckets[1:]))
            or not _is_name(job) or not _is_name(worker)
            or (unsent is not None and unsent > MAX_UNSENT)):
        return parse_report(payload, max_bytes)
    if profiler is not None:
        try:
            profiler = _profiler_address(profiler)
        except Rejected:
            return parse_report(payload, max_bytes)
    return Report(job, worker, data.pid, data.seq, data.time, data.process_start, data.phase, data.epoch, data.steps,
                  data.samples, data.skipped_steps or 0, data.batch_size, step.count, step.sum, buckets,
                  data.first_step_seconds, profiler, data.outlier is True, unsent or 0)


def _unsent(data: dict[str, Any]) -> int:
    """A report's ``unsent`` (0 where it has none); Rejected "invalid_field" past MAX_UNSENT."""
    unsent = _int(data, "unsent", optional=True) or 0
    if unsent > MAX_UNSENT:
        raise Rejected("invalid_field", f"unsent must be at most {MAX_UNSENT}")
    return unsent


def _check_unsent(report: Report, last_seq: int) -> None:
    """Each report the hook could not send took a seq of its own: one sent after the report ``last_seq`` (-1:
    none seen) tells of at most as many as it skipped (Rejected "invalid_field" otherwise)."""
    if report.unsent > max(report.seq - max(last_seq, 0) - 1, 0):
        raise Rejected("invalid_field", f"unsent {report.unsent} is more than the reports before seq {report.seq}")


# ---- trust: whose pid and profiler server a report may name ----

_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}
OWN_PROC = Path("/proc")  # the agent's own namespaces: /proc/self/net is where its sockets live
TCP_LISTEN = 0x0A
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@functools.lru_cache(maxsize=4096)
def _peer(text: str) -> tuple[Address, str, bool] | None:
    """``_ip(text)``, its text as the sender's address, and whether it is loopback: kept, as every report of a pod
    comes from the same address (writing it back and testing it was 1.5 µs a report; issue 24)."""
    address = _ip(text)
    return None if address is None else (address, str(address), address.is_loopback)


@functools.lru_cache(maxsize=4096)  # a datagram's source address, parsed again for every report otherwise
def _ip(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def _is_loopback(host: str) -> bool:
    address = _ip(host)
    return host.lower() in _LOOPBACK_NAMES if address is None else address.is_loopback


@dataclass(frozen=True)
class ProcSocket:
    """One socket of /proc/net/{tcp,tcp6,udp,udp6}: its local address and port, state and owner's uid."""

    address: Address  # an IPv4-mapped IPv6 address is given as IPv4
    port: int
    state: int
    uid: int


@functools.lru_cache(maxsize=4096)
def _hex_address(text: str) -> Address:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    if len(raw) != 16:
        raise ValueError(f"address {text!r} is neither 4 nor 16 bytes")
    address = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return address.ipv4_mapped or address


def _parse_socket_line(line: str) -> ProcSocket | None:
    parts = line.split()
    if len(parts) < 8:
        return None
    try:
        host, _, port_text = parts[1].partition(":")
        return ProcSocket(_hex_address(host), int(port_text, 16), int(parts[3], 16), int(parts[7]))
    except ValueError:
        return None


def parse_proc_net(text: str, port: int | None = None) -> list[ProcSocket]:
    """The sockets of a /proc/net/{tcp,tcp6,udp,udp6} text (only those on ``port``, if given: a host may
    have thousands); lines that do not parse are skipped."""
    sockets = []
    needle = f":{port:04X} " if port is not None else ""
    for line in text.splitlines()[1:]:
        if needle not in line:
            continue
        found = _parse_socket_line(line)
        if found is not None and (port is None or found.port == port):
            sockets.append(found)
    return sockets


def unix_pause(rate: float, queue: int) -> float:
    """How long the Unix socket rests after a read, at ``rate`` reports a second, when the kernel queues at most
    ``queue`` datagrams for it (a full queue refuses the next report). Jobs at their own phases woke the
    listener for each report, and a cold wake costs more than the report (20 jobs: 0.4-0.6% of a core). A
    report waits at most UNIX_PAUSE_S (the sampler reads them once an interval anyway), and the reports
    expected meanwhile fill at most a quarter of the queue. The kernel checked each sender's credentials as it
    sent, so a late read vouches for a report as an early one does (unlike a UDP sender's socket, which may
    close meanwhile). Where the queue is the kernel's default of 10, the socket does not rest."""
    if queue < UNIX_REST_QUEUE:
        return 0.0
    return min(UNIX_PAUSE_S, queue / 4 / rate) if rate > 0 else UNIX_PAUSE_S


def unix_queue(procfs: Path = OWN_PROC) -> int:
    """How many datagrams the kernel queues for a Unix datagram socket in the agent's network namespace."""
    try:
        return max(1, int((procfs / "sys/net/unix/max_dgram_qlen").read_text()))
    except (OSError, ValueError):
        return UNIX_QUEUE_DEFAULT


def gather_step(buffer: int, per_second: float, largest: int, at_once: int) -> float:
    """How long a UDP gathering may leave the socket undrained: the longest of ``UDP_GATHER_SECONDS`` (one
    wait a gathering) and ``UDP_GATHER_STEP_ROOMY`` over which the reports that come at four times
    ``per_second`` (a ramp) fit in the ``buffer``, where ``at_once`` reports (every job at the same moment)
    fit in it too, each taking what the kernel charges for a datagram of ``largest`` bytes (at most twice its
    size and 1 KiB: 1,280 bytes for 344, 16,644 for 8,000 on loopback); ``UDP_GATHER_STEP`` otherwise (the
    kernel's default rmem_max with 1,000 jobs: 150 reports a second, then 1,000 within 0.1 s, overflowed
    anything slower, 490-680 of them dropped)."""
    cost = 2 * largest + 1024
    if at_once * cost <= buffer:
        for step in (UDP_GATHER_SECONDS, UDP_GATHER_STEP_ROOMY):
            if 4 * per_second * step * cost <= buffer:
                return step
    return UDP_GATHER_STEP


def dropped_since(seen: int, count: int) -> int:
    """How many more datagrams the kernel's count of a socket's drops (a u32, SO_RXQ_OVFL) says it dropped since
    it said ``seen``: 0 for a count older than that (each datagram carries the count as it was when the kernel
    read it, which Linux 6.18 does before taking the queue's lock: with a queue per NUMA node, a datagram that
    carries 5 can follow one that carries 7). Counts half the u32 range apart or less are compared."""
    grew = (count - seen) % 2**32
    return grew if grew < 2**31 else 0


class _Rate:
    """Events a second over the last whole second (the current one's count until a second has passed)."""

    def __init__(self) -> None:
        self._start, self._count, self._last = time.monotonic(), 0, 0.0

    @property
    def last_second(self) -> float:
        """The rate over the last whole second (0 until one has passed)."""
        return self._last

    def add(self, count: int) -> float:
        now = time.monotonic()
        self._count += count
        if now - self._start >= 1.0:
            self._last, self._start, self._count = self._count / (now - self._start), now, 0
        return max(self._last, float(self._count))


_NLMSG = struct.Struct("=IHHII")  # struct nlmsghdr: length, type, flags, seq, pid
_DIAG_REQUEST = struct.Struct("=BBBxI48x")  # struct inet_diag_req_v2: family, protocol, ext, states, id (any)
_DIAG_MESSAGE = struct.Struct("=BBxxH2x16s40xI4x")  # struct inet_diag_msg: family, state, sport, src, uid
_DIAG_PORT = struct.Struct("=H")  # inet_diag_msg's source port, read as the kernel wrote it (big-endian)
_BYTECODE_OP = struct.Struct("=BBH")  # struct inet_diag_bc_op: code, yes, no (a port operand: 0, 0, port)
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_BC_S_GE, INET_DIAG_BC_S_LE = 2, 3
TEXT_READS = 3  # reads of /proc/net/udp at most for a port none of them lists (UdpTable._listed)
PORT_FILTER = 64  # a batch from at most this many source ports asks the kernel for their sockets, not for every one
_NLM_F_DUMP_REQUEST = 0x301  # NLM_F_REQUEST | NLM_F_DUMP
_NLMSG_ERROR, _NLMSG_DONE = 2, 3


_DiagEntry = tuple[int, int, bytes, int]  # family, state, local address, uid: a ProcSocket once asked for


def diag_udp_sockets(ports: Collection[int] | None = None) -> dict[int, list[_DiagEntry]]:
    """The agent's network namespace's UDP sockets (IPv4 and IPv6), by local port, as the kernel's sock_diag
    lists them over netlink: what /proc/net/udp{,6} says, without formatting and parsing text (a third of
    the cost with a thousand sockets); with ``ports``, only those bound to one of them (from a few,
    ``PORT_FILTER``, the kernel filters them: a tenth of the cost again). Raises OSError where the kernel
    does not answer (no udp_diag module, netlink refused by a sandbox)."""
    wanted = None if ports is None else {socket.htons(port) for port in ports}  # as the kernel writes them
    only = b"" if wanted is None or len(wanted) > PORT_FILTER else _port_filter(sorted(map(socket.ntohs, wanted)))
    return _SOCK_DIAG.dump(wanted, only)


class _SockDiag:
    """The netlink socket the agent's sock_diag reads go through, kept open from one read to the next, blocking
    with the kernel's own timeouts: below the gathering rate each UDP report has a read of its own, and a socket
    opened for each (its ``settimeout`` polling before every send and receive: 15 system calls a read, not 6)
    cost 12% of the listener's CPU at 20 jobs reporting over UDP (issue 24). Its reads are one at a time (a
    lock), each dump under a sequence number of its own. A read that fails closes the socket; one that failed on
    the kept socket is made again on a new one (a dump it left unfinished makes the kernel refuse the next one),
    so only a new socket's failure says the kernel does not answer. The timeouts bound each wait for the kernel:
    a signal that interrupts one (handled, not raised) starts it again. A child forked without exec gets a
    lock and a socket of its own (the parent's, shared, would hand each the other's answers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._seq = 0
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self.close()  # the child's copy of the descriptor: the parent's socket stays open

    def dump(self, wanted: set[int] | None, only: bytes) -> dict[int, list[_DiagEntry]]:
        with self._lock:
            while True:
                kept = self._socket
                try:
                    return self._dump(kept or self._open(), wanted, only)
                except OSError:
                    self.close()
                    if kept is None:
                        raise
                except BaseException:
                    self.close()
                    raise

    def _dump(self, nl: socket.socket, wanted: set[int] | None, only: bytes) -> dict[int, list[_DiagEntry]]:
        found: dict[int, list[_DiagEntry]] = {}
        for family in (socket.AF_INET, socket.AF_INET6):
            self._seq = seq = self._seq % 0xFFFFFFFF + 1
            nl.send(_dump_request(seq, family, only))
            while True:
                data = nl.recv(1 << 16)
                if _diag_alike(data, seq, found, wanted):
                    continue
                if _diag_part(data, seq, found, wanted):
                    break
        return found

    def _open(self) -> socket.socket:
        nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
        try:  # the kernel answers at once; never hang the listener on it (an OSError: then /proc is read)
            for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
                nl.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(NETLINK_TIMEOUT_S, 0))
        except OSError:
            nl.close()
            raise
        self._socket = nl
        return nl

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


_TIMEVAL = struct.Struct("ll")  # struct timeval: seconds, microseconds (native sizes)
NETLINK_TIMEOUT_S = 2
_SOCK_DIAG = _SockDiag()


def _dump_request(seq: int, family: int, only: bytes = b"") -> bytes:
    """A netlink request for a dump of the UDP sockets of ``family``, through the bytecode filter ``only``."""
    request = _DIAG_REQUEST.pack(family, socket.IPPROTO_UDP, 0, 0xFFFFFFFF) + only
    return _NLMSG.pack(_NLMSG.size + len(request), SOCK_DIAG_BY_FAMILY, _NLM_F_DUMP_REQUEST, seq, 0) + request


def _port_filter(ports: list[int]) -> bytes:
    """sock_diag bytecode that accepts a socket whose local port is one of ``ports`` (ascending). The kernel
    walks a program along its "yes" jumps (each to the next test here) and accepts one that ends exactly at
    its end; a "no" jumps to the end (accepted) or 4 bytes past it (refused). For each port: a local port
    below it is none of them (refused); then one above it goes on to the next port, and one not above it is
    it (accepted); past the last port, one not at most it is refused."""
    length, tests = 16 * len(ports), b""
    for i, port in enumerate(ports):
        left = length - 16 * i  # bytes from this port's first test to the end
        tests += _BYTECODE_OP.pack(INET_DIAG_BC_S_GE, 8, left + 4) + _BYTECODE_OP.pack(0, 0, port)
        if i < len(ports) - 1:
            tests += _BYTECODE_OP.pack(INET_DIAG_BC_S_GE, 8, left - 8) + _BYTECODE_OP.pack(0, 0, port + 1)
        else:
            tests += _BYTECODE_OP.pack(INET_DIAG_BC_S_LE, 8, 12) + _BYTECODE_OP.pack(0, 0, port)
    return struct.pack("=HH", 4 + len(tests), INET_DIAG_REQ_BYTECODE) + tests


def _diag_add(data: bytes, offset: int, found: dict[int, list[_DiagEntry]]) -> None:
    family, state, port, src, uid = _DIAG_MESSAGE.unpack_from(data, offset + _NLMSG.size)
    found.setdefault(socket.ntohs(port), []).append((family, state, src, uid))


def _diag_part(data: bytes, seq: int, found: dict[int, list[_DiagEntry]], wanted: set[int] | None) -> bool:
    """Add one netlink read's sockets on ``wanted`` ports (None: every port; as the kernel writes a port,
    big-endian) to ``found``; whether the dump is complete."""
    offset = 0
    while offset + _NLMSG.size <= len(data):
        length, kind, _, got_seq, _ = _NLMSG.unpack_from(data, offset)
        if length < _NLMSG.size or offset + length > len(data):
            raise OSError(errno.EPROTO, "malformed netlink message from sock_diag")
        if got_seq == seq:
            if kind == _NLMSG_DONE:
                return True
            if kind == _NLMSG_ERROR:
                code = -struct.unpack_from("=i", data, offset + _NLMSG.size)[0]
                raise OSError(code, f"sock_diag refused the UDP dump: {os.strerror(code)}")
            if (kind == SOCK_DIAG_BY_FAMILY and length >= _NLMSG.size + _DIAG_MESSAGE.size
                    and (wanted is None or _DIAG_PORT.unpack_from(data, offset + _NLMSG.size + 4)[0] in wanted)):
                _diag_add(data, offset, found)
        offset += (length + 3) & ~3
    return False


def _diag_alike(data: bytes, seq: int, found: dict[int, list[_DiagEntry]], wanted: set[int] | None) -> bool:
    """``_diag_part`` for a read of sockets only, each message as long as the first (an IPv4 dump's reads are:
    124 bytes a socket, 261 a read, on Linux 6.18), in slices C takes: only a socket on a ``wanted`` port is
    unpacked in Python (a step per socket was 1 ms of a read of 2,000, issue 24). False, adding nothing, for
    any other read (the dump's end, an error, a mixed one such as IPv6 sockets with and without a v6only
    attribute: ``_diag_part`` reads it)."""
    length = int.from_bytes(data[:4], sys.byteorder)
    if length < _NLMSG.size + _DIAG_MESSAGE.size or length % 4 or len(data) % length:
        return False
    count, words, halves = len(data) // length, memoryview(data).cast("I"), memoryview(data).cast("H")
    if (words[::length // 4].tolist().count(length) != count  # each message's length, type and sequence
            or halves[2::length // 2].tolist().count(SOCK_DIAG_BY_FAMILY) != count
            or words[2::length // 4].tolist().count(seq) != count):
        return False
    ports = halves[(_NLMSG.size + 4) // 2::length // 2].tolist()  # inet_diag_msg's id.idiag_sport
    for i in range(count) if wanted is None else itertools.compress(range(count), map(wanted.__contains__, ports)):
        _diag_add(data, i * length, found)
    return True


@functools.lru_cache(maxsize=4096)
def _diag_address(family: int, raw: bytes) -> Address | None:
    if family == socket.AF_INET:
        return ipaddress.IPv4Address(raw[:4])
    if family == socket.AF_INET6:
        address = ipaddress.IPv6Address(raw)
        return address.ipv4_mapped or address
    return None


class UdpTable:
    """The agent's network namespace's UDP sockets (/proc/self/net/udp and udp6), indexed by local port: a
    batch of datagrams drained from the socket shares one read. With a thousand reporting sockets a read costs
    about 2 ms, so reading it for every report cost more than a core at 1,000 reports a second (issue 24).
    The agent's own namespace is asked over netlink (``diag_udp_sockets``), where the kernel answers.

    A read is always made after the datagrams it vouches for were received (a socket listed before a datagram
    came may have closed, and its port been bound by someone else, by then): the listener makes one for each
    batch, once the batch is in."""

    diag_problem: ClassVar[str | None] = None  # why netlink did not answer (then /proc is read from then on)

    def __init__(self, own_proc: Path = OWN_PROC, ports: Collection[int] | None = None):
        """``ports``: the source ports the table will be asked about, if known (the netlink read keeps the
        sockets on them alone)."""
        self._own_proc = own_proc
        self._ports = ports
        self._lines: dict[int, list[str]] | None = None
        self._text_reads = 0  # reads of /proc/net/udp that ``_lines`` holds
        self._diag: dict[int, list[_DiagEntry]] | None = None

    def on_port(self, port: int) -> list[ProcSocket]:
        """The sockets bound to ``port``."""
        return list(_sockets(port, *self._listed(port)))

    def owners(self, address: str, port: int) -> Owners:
        """Who may have sent from ``address``:``port`` (a datagram's source, as received)."""
        return _owners(address, port, *self._listed(port))

    def _listed(self, port: int) -> tuple[tuple[_DiagEntry, ...], tuple[str, ...]]:
        """The sockets on ``port`` as the kernel listed them: over netlink, or as /proc/net/udp lines."""
        if self._ports is not None and port not in self._ports:  # asked about another port: every socket
            self._ports = self._diag = None
        if self._lines is None and self._diag is None:
            if self._own_proc == OWN_PROC and UdpTable.diag_problem is None:
                try:
                    self._diag = diag_udp_sockets(self._ports)  # now: after the datagrams came
                except OSError as exc:
                    UdpTable.diag_problem = str(exc)
                    log.info("UDP senders are identified from /proc/net/udp (sock_diag: %s)", exc)
            if self._diag is None:
                self._lines, self._text_reads = self._read(), 1
        if self._diag is not None:
            return tuple(self._diag.get(port, ())), ()
        lines = self._lines
        assert lines is not None  # read above, where netlink gave no listing
        while port not in lines and self._text_reads < TEXT_READS:
            # The kernel writes /proc/net/udp a page a read and finds where it left off by counting sockets from
            # the first: one that another process closes meanwhile shifts the count, and a socket past it goes
            # unlisted (1,000 sockets and one process opening and closing others: a tenth of them missed in each
            # read; sock_diag missed none). A port listed nowhere is read again, still after its datagram came.
            for key, found in self._read().items():
                lines.setdefault(key, found)
            self._text_reads += 1
        return (), tuple(lines.get(port, ()))

    def _read(self) -> dict[int, list[str]]:
        lines: dict[int, list[str]] = {}
        for name in ("self/net/udp", "self/net/udp6"):
            try:
                text = (self._own_proc / name).read_text()
            except (OSError, UnicodeDecodeError):
                continue  # no IPv6 on this kernel
            for line in text.splitlines()[1:]:
                local = line.split(None, 2)[1:2]
                try:
                    key = int(local[0].rpartition(":")[2], 16) if local else -1
                except ValueError:
                    continue
                lines.setdefault(key, []).append(line)
        return lines


def _sockets(port: int, entries: tuple[_DiagEntry, ...], lines: tuple[str, ...]) -> Iterator[ProcSocket]:
    """The sockets on ``port`` from the kernel's netlink entries or /proc/net/udp lines."""
    for family, state, src, uid in entries:
        address = _diag_address(family, src)
        if address is not None:
            yield ProcSocket(address, port, state, uid)
    for line in lines:
        found = _parse_socket_line(line)
        if found is not None and found.port == port:
            yield found


class Owners(NamedTuple):
    """Who may have sent a UDP datagram, by the sockets on its source port."""

    uids: frozenset[int]  # owners of a socket that may have sent from the source address
    bound_here: bool  # a socket is bound to the source address itself (not only to every address)
    loopback: bool  # the source address is a loopback address
    text: str  # the source address as the agent writes it (an IPv4-mapped IPv6 address as IPv4)


@functools.lru_cache(maxsize=4096)
def _owners(address: str, port: int, entries: tuple[_DiagEntry, ...], lines: tuple[str, ...]) -> Owners:
    """``UdpTable.owners``, kept for the same source and the same listing (the kernel's, each byte of it): a
    thousand jobs' reports each second make the same answer, ~3 µs of ipaddress objects and comparisons each."""
    ip = _ip(address)
    if ip is None:  # no socket sends from what is not an IP address
        return Owners(frozenset(), False, False, address)
    exact = list(_sockets(port, entries, lines))
    return Owners(frozenset(sender_uids(exact, ip, port)), any(s.address == ip for s in exact), ip.is_loopback,
                  str(ip))


def _reaches(bound: Address, target: Address) -> bool:
    """Whether a socket bound to ``bound`` has ``target`` as its address (an unspecified bind has every one)."""
    return bound == target or bound.is_unspecified


def sender_uids(udp: list[ProcSocket], address: Address, port: int) -> set[int]:
    """Uids owning a UDP socket that may have sent from ``address``:``port``."""
    return {s.uid for s in udp if s.port == port and _reaches(s.address, address)}


def listener_uids(tcp: list[ProcSocket], address: Address, port: int) -> set[int]:
    """Uids owning a TCP socket in LISTEN state that a connection to ``address``:``port`` would reach."""
    return {s.uid for s in tcp if s.state == TCP_LISTEN and s.port == port and _reaches(s.address, address)}


def pid_uids(status_text: str | None) -> set[int] | None:
    """A process's real and effective uids from /proc/<pid>/status; None if there is no such process."""
    if status_text is None:
        return None
    for line in status_text.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()[1:3]
            if len(fields) == 2 and all(f.isdigit() for f in fields):
                return {int(f) for f in fields}
    return None


def _read_sockets(procfs: Path, port: int, *names: str) -> list[ProcSocket]:
    sockets = []
    for name in names:
        try:
            sockets += parse_proc_net((procfs / name).read_text(), port)
        except (OSError, UnicodeDecodeError):
            continue  # no IPv6 on this kernel, or no such namespace
    return sockets


def _is_own_address(address: Address) -> bool:
    """Whether ``address`` is one of this network namespace's addresses (binding to it works); fails safe:
    where the kernel lets anyone bind any address (ip_nonlocal_bind), every address counts as local."""
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(address), 0))
    except OSError:
        return False
    return True


OWN_ADDRESS_KEPT_S = 10.0  # how long whether an address is this namespace's is known without binding to it again
_own_addresses: dict[str, tuple[bool, float]] = {}  # by the address as text (an address object is slower to hash)


def _may_be_own(address: Address, text: str) -> bool:
    """``_is_own_address``, known for OWN_ADDRESS_KEPT_S: it only decides whether the socket table is read for a
    datagram (an address that became this host's meanwhile is taken for a peer's a few seconds longer: its
    senders are trusted less, never more)."""
    now = time.monotonic()
    known = _own_addresses.get(text)
    if known is None or now - known[1] > OWN_ADDRESS_KEPT_S:
        if len(_own_addresses) >= 4096:  # a node with many pods: bounded
            _own_addresses.clear()
        known = _own_addresses[text] = (_is_own_address(address), now)
    return known[0]


def identify_udp_sender(address: str, port: int, own_proc: Path = OWN_PROC, table: UdpTable | None = None) -> Sender:
    """Who sent a UDP datagram: a process of this host (its socket is in the agent's network namespace,
    which tells its uid) or a remote peer such as a pod (its address only). Raises Rejected
    ("unverified_sender") for a loopback source whose socket is not found or has several owners. ``table``:
    the sockets as a batch of datagrams read them (else read now). From an address that is neither loopback nor
    one of this namespace's (a pod's on the pod network, another host's), no socket here sent it: the table is not
    read (below the gathering rate each such report took a read of its own, 40% of its CPU; issue 24)."""
    peer = _peer(address)
    if peer is None:
        raise Rejected("unverified_sender", f"source address {address!r} is not an IP address")
    ip, canonical, loopback_source = peer
    if not loopback_source and not _may_be_own(ip, canonical):
        return Sender(False, None, None, canonical, port)
    uids, bound_here, loopback, text = (table or UdpTable(own_proc)).owners(address, port)
    if uids and (loopback or bound_here or _is_own_address(ip)):
        if len(uids) > 1:
            raise Rejected("unverified_sender", f"sockets of several users ({sorted(uids)}) use {address} port {port}")
        return Sender(local=False, address=text, uid=next(iter(uids)), port=port)
    if loopback:
        raise Rejected("unverified_sender", f"no socket of this host sends from {address} port {port}")
    return Sender(local=False, address=text, port=port)


def check_pid(report: Report, sender: Sender, own_proc: Path = OWN_PROC) -> bool:
    """Whether a UDP report's pid is the sender's process in the agent's pid namespace (so NVML's pids may be
    joined to it). From loopback, another user's pid is refused (Rejected "pid_mismatch"). From one of the
    host's addresses it may be a hostNetwork pod's own pid (another pid namespace): it is just not joined.
    A pid that does not exist here, or a remote sender's, means nothing and is not joined either."""
    if sender.uid is None:
        return False
    uids = pid_uids(_read_text(own_proc / str(report.pid) / "status"))
    if uids is None:
        return False
    if sender.uid not in uids:
        if not _is_loopback(sender.address or ""):
            return False
        raise Rejected("pid_mismatch", f"pid {report.pid} belongs to uid {min(uids)}, the sender is uid {sender.uid}")
    return True


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def check_profiler(report: Report, sender: Sender, env: Environment, own_proc: Path = OWN_PROC) -> str | None:
    """The profiler address the agent may use for this report's process; raises Rejected("untrusted_profiler").

    A process of this host (unix socket, or UDP from a socket in the agent's network namespace) may name a
    server on loopback (or, over UDP, its own source address) whose port a socket of the sender's uid
    listens on, so another user's server is never named. A remote UDP sender's server must be on its own
    address.
    """
    if report.profiler is None:
        return None
    host, _, port_text = report.profiler.rpartition(":")
    port = int(port_text)
    if sender.local:
        if not _is_loopback(host):
            raise Rejected("untrusted_profiler", f"a local process reports a profiler on {host}, not loopback")
        tcp = _read_sockets(env.paths.procfs, port, f"{sender.pid}/net/tcp", f"{sender.pid}/net/tcp6")
        target = ipaddress.IPv4Address("127.0.0.1")
    elif sender.uid is not None:
        peer = _ip(sender.address or "")
        if not _is_loopback(host) and _ip(host) != peer:
            raise Rejected("untrusted_profiler", f"profiler host {host} is neither loopback nor the sender's "
                                                 f"address {sender.address}")
        tcp = _read_sockets(own_proc, port, "self/net/tcp", "self/net/tcp6")
        target = ipaddress.IPv4Address("127.0.0.1") if _is_loopback(host) else peer
    else:
        peer = _ip(sender.address or "")
        if _ip(host) != peer and not (_is_loopback(host) and peer is not None and peer.is_loopback):
            raise Rejected("untrusted_profiler", f"profiler host {host} is not the sender's address {sender.address}")
        return report.profiler
    uids = listener_uids(tcp, target, port)
    if uids != {sender.uid}:
        owners = f"uid {', '.join(map(str, sorted(uids)))}" if uids else "no socket"
        raise Rejected("untrusted_profiler", f"port {port} is listened on by {owners}, not only by the sender's "
                                             f"uid {sender.uid}")
    return f"127.0.0.1:{port}" if _is_loopback(host) else f"{host}:{port}"


# ---- state ----

class Counts(NamedTuple):
    """A process's (or a job's summed) cumulative counters."""

    steps: int = 0
    samples: int = 0
    skipped: int = 0
    step_count: int = 0
    step_sum: float = 0.0
    buckets: tuple[int, ...] = (0,) * len(STEP_BUCKETS)

    def plus(self, other: Counts, sign: int = 1) -> Counts:
        return Counts(self.steps + sign * other.steps, self.samples + sign * other.samples,
                      self.skipped + sign * other.skipped, self.step_count + sign * other.step_count,
                      self.step_sum + sign * other.step_sum,
                      tuple(x + sign * y for x, y in zip(self.buckets, other.buckets, strict=True)))


_ZERO = Counts()


def _counts(r: Report) -> Counts:
    return Counts(r.steps, r.samples, r.skipped_steps, r.step_count, r.step_sum, r.step_buckets)


ProcessKey = tuple[str, int, float]  # origin, pid, process start


@dataclass
class ProcessState:
    key: ProcessKey
    latest: Report
    last_seen: float  # monotonic
    profiler: str | None  # the address the agent may profile (checked), None if none
    pid_verified: bool = False  # the pid is the sender's process in the agent's pid namespace
    samples_per_second: float | None = None
    recent_step_seconds: float | None = None
    recent_batch: float | None = None  # samples per step between the last two reports
    woken_at: float = float("-inf")  # monotonic: when an outlier report of it last asked for a sample
    gone_at: float | None = None  # monotonic: when a sample first found its pid gone


@dataclass
class JobState:
    """One (training_job, worker): its live processes and the counts of those that went away."""

    processes: dict[ProcessKey, ProcessState] = field(default_factory=dict)
    folded: Counts = _ZERO
    folded_by: OrderedDict[ProcessKey, tuple[Counts, int]] = field(default_factory=OrderedDict)  # and its last seq
    last_seen: float = 0.0
    dirty: bool = True  # a report or a retired process changed it since it was last frozen
    frozen: _Frozen | None = None

    def totals(self) -> Counts:
        if len(self.processes) == 1 and self.folded is _ZERO:  # the common case, without summing
            return _counts(next(iter(self.processes.values())).latest)
        total = self.folded
        for p in self.processes.values():
            total = total.plus(_counts(p.latest))
        return total


class ProcessView(NamedTuple):
    """A reporting process as the rest of the agent sees it."""

    job: str
    worker: str
    pid: int
    local: bool
    phase: str
    training: bool  # in phase train and reporting now
    profiler: str | None  # checked profiler address, if any
    samples_per_second: float | None = None
    batch_size: float | None = None  # declared, else measured (samples per step)
    pid_verified: bool = False  # the pid is this process in the agent's pid namespace (NVML's pids join it)


@dataclass(frozen=True)
class TrainingProcesses:
    """Every process that reports to this agent, for the agent's job registry."""

    processes: tuple[ProcessView, ...]


class _Row(NamedTuple):
    """One (training_job, worker) series as a sample froze it."""

    key: tuple[str, str]
    totals: Counts
    processes: int
    up: bool
    rate: float | None
    batch_size: float | None
    epoch: int | None
    phase: str | None
    first_step_seconds: float | None
    profilers: tuple[str, ...]


class _Frozen(NamedTuple):
    """One job's part of a sample, kept while nothing about the job changes (an idle job costs nothing)."""

    row: _Row
    labels: dict[str, str]
    signals: tuple[tuple[str, float], ...]
    views: tuple[ProcessView, ...]
    until: float  # monotonic time past which time alone changes it (a process goes quiet, the job down)


@dataclass(frozen=True)
class _Sampled:
    rows: tuple[_Row, ...] = ()
    rejected: tuple[tuple[str, int], ...] = ()
    accepted: int = 0
    dropped: int = 0
    unsent: int = 0
    signals: Signals = field(default_factory=dict)
    facts: TrainingProcesses = TrainingProcesses(())


@dataclass(frozen=True)
class HookSettings:
    enabled: bool = option(True, parse_bool, "Receive reports from the training hook.")
    socket: str = option(default_socket_path(), parse_str,
                         "Unix datagram socket where training processes on this host report (the kernel tells "
                         "the agent the sender's pid); empty turns it off.", restart=True)
    listen: tuple[str, int] | None = option(None, parse_optional_address,
                                            "UDP address for reports from pods (e.g. 0.0.0.0:9847 with "
                                            "hostNetwork); empty (the default) turns UDP off.", restart=True)
    max_datagram_bytes: int = option(8192, parse_int, "Largest hook report accepted; larger ones are rejected.",
                                     minimum=512, maximum=65507)
    max_jobs: int = option(1000, parse_int, "At most this many (training_job, worker) series; reports of more "
                           "are rejected (too_many_jobs).", minimum=1, maximum=100000)
    down_after: float = option(30.0, parse_duration, "A job that has not reported for this long is marked down "
                               "(tfprofd_training_up 0).", minimum=1, maximum=86400)
    expire_after: float = option(600.0, parse_duration, "A job that has not reported for this long has its "
                                 "series removed.", minimum=1, maximum=7 * 86400)


class TrainingCollector(Collector):
    name = "training"
    never_blocks = True
    section = "hook"
    Settings = HookSettings
    signals: ClassVar[dict[str, tuple[str, ...]]] = {
        "samples_per_second": ("training_job", "worker"),
        "step_seconds": ("training_job", "worker"),
        "seconds_without_first_step": ("training_job", "worker"),
    }

    def __init__(self, settings: HookSettings, env: Environment):
        super().__init__(settings, env)
        self.clock = env.clock
        self.jobs: dict[tuple[str, str], JobState] = {}
        self._order: list[tuple[str, str]] | None = None  # the jobs' keys sorted (None: sort again)
        self.accepted = 0
        self.rejected = dict.fromkeys(REJECT_REASONS, 0)
        self.dropped = 0  # reports the kernel dropped on the UDP socket (its buffer full), as later ones told
        self.unsent = 0  # reports the hooks' sockets refused to send, as the next reports they sent told
        self._drops_seen = 0  # the kernel's count (a u32) in the latest report that carried one
        # reports lost (dropped, unsent): the count and monotonic time at the last warning of each
        self._warned: dict[str, tuple[int, float]] = dict.fromkeys(("dropped", "unsent"), (0, -math.inf))
        self._udp_buffer = 0  # bytes of the UDP socket's receive buffer, as the kernel granted them
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._problem: str | None = None
        self._parse = parse_report  # parse_report_fast once reports come at FAST_PARSE_RATE (the listener says)
        self._new_job_logs: list[float] = []
        self._refused_logs: list[float] = []
        self._refused_suppressed = 0
        self._sampled = _Sampled()
        self._logs_suppressed = 0
        self._selector = selectors.DefaultSelector()
        self._sockets: list[socket.socket] = []
        # close() wakes the listener through this pair, so it waits on its sockets alone: a timeout to look at
        # the stop flag woke it five times a second with no report to read (issue 24)
        self._closing: socket.socket | None = None
        self._wake_closing: socket.socket | None = None
        self._thread: threading.Thread | None = None  # set once started: close() joins only a started thread
        try:  # whatever fails, nothing stays open or bound (the next start or a reload would find it in use)
            if settings.socket:
                self._sockets.append(self._open_unix(Path(settings.socket)))
            if settings.listen:
                self._sockets.append(self._open_udp(settings.listen))
                self._udp_buffer = self._sockets[-1].getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)  # as granted
            self._closing, self._wake_closing = socket.socketpair()
            for sock in (*self._sockets, self._closing):
                self._selector.register(sock, selectors.EVENT_READ)
        except OSError as exc:
            self.close()
            raise OSError(exc.errno, f"cannot open the hook's report socket: {exc.strerror or exc}") from None
        thread = threading.Thread(target=self._guarded_loop, name="tfprofd-hook-listener", daemon=True)
        try:
            thread.start()
        except BaseException:
            self.close()
            raise
        self._thread = thread

    # ---- sockets ----

    @staticmethod
    def _open_udp(address: tuple[str, int]) -> socket.socket:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UDP_BUFFER)  # ride out bursts from many workers
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)  # each datagram says how many the kernel dropped
        except OSError as exc:  # a kernel or sandbox without it: reports are received, drops go uncounted
            log.info("the hook's UDP socket cannot count the reports the kernel drops (SO_RXQ_OVFL: %s)", exc)
        sock.bind(address)
        sock.setblocking(False)
        return sock

    @staticmethod
    def _open_unix(path: Path) -> socket.socket:
        """The report socket, group-writable (training users join the agent's group), never world-writable."""
        path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        parent = path.parent.lstat()
        if parent.st_uid != os.geteuid() or parent.st_mode & 0o022:
            raise PermissionError(errno.EPERM, f"{path.parent} must be the agent's own directory, writable only by "
                                               "it (another user could swap the socket)")
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                try:
                    probe.connect(str(path))
                    raise OSError(errno.EADDRINUSE, f"{path} is in use by another running agent")
                except ConnectionRefusedError:
                    path.unlink()  # left behind by an agent that died
                finally:
                    probe.close()
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        old = os.umask(0o117)  # the socket file comes out 0660 whatever the agent's umask
        try:
            sock.bind(str(path))
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old)
        sock.setblocking(False)
        return sock

    @property
    def udp_address(self) -> tuple[str, int] | None:
        for sock in self._sockets:
            if sock.family != socket.AF_UNIX:
                return sock.getsockname()[:2]
        return None

    # ---- receiving ----

    def _guarded_loop(self) -> None:
        try:
            self._receive_loop()
        except BaseException as exc:  # whatever kills the listener must turn health red
            self._problem = f"hook listener died: {type(exc).__name__}: {exc}"
            log.exception("the hook listener thread died; training reports are no longer received")

    def _receive_loop(self) -> None:
        rate, unix_rate, queue, last_unix_read = _Rate(), _Rate(), unix_queue(), time.monotonic()
        resting: dict[socket.socket, float] = {}  # a Unix socket read a moment ago: when it is read again
        while not self._stop.is_set():
            due = min(resting.values(), default=None)
            events = self._selector.select(None if due is None else max(due - time.monotonic(), 0.0))
            now = time.monotonic()
            for rested in [s for s, at in resting.items() if at <= now]:
                del resting[rested]
                self._selector.register(rested, selectors.EVENT_READ)
            for key, _ in events:
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                if sock is self._closing:
                    return
                batch = self._drain(sock, DRAIN_AT_ONCE)
                if batch is None:
                    return
                udp = sock.family != socket.AF_UNIX  # once a batch: socket.family makes an enum each time
                if not udp and len(batch) < DRAIN_AT_ONCE:  # a flood is read on at once
                    per_second = unix_rate.add(len(batch))
                    # the rate over the last second, or since the last read if higher (jobs just started)
                    burst = max(per_second, len(batch) / max(now - last_unix_read, 1e-3))
                    last_unix_read, pause = now, unix_pause(burst, queue)
                    if pause > 0:
                        self._selector.unregister(sock)
                        resting[sock] = now + pause
                else:  # UDP, or a flood on the Unix socket (DRAIN_AT_ONCE)
                    per_second = rate.add(len(batch)) if udp and batch else float(len(batch))
                if per_second >= FAST_PARSE_RATE:
                    self._parse = parse_report_fast
                if udp and batch and per_second >= UDP_GATHER_RATE:
                    first = len(batch)
                    if not self._gather(sock, batch, per_second, steady=rate.last_second >= UDP_GATHER_RATE) \
                            or self._stop.is_set():
                        return
                    rate.add(len(batch) - first)
                table = UdpTable(ports=_ports(batch))  # read once for the batch, when its first UDP report needs it
                for payload, sender in batch:
                    self.receive(payload, sender, table)

    def _drain(self, sock: socket.socket, limit: int) -> list[tuple[bytes, Sender]] | None:
        """Up to ``limit`` datagrams waiting on the socket; None once the collector is closing."""
        batch = []
        # the family once a drain: socket.family makes an enum each time (5% of the agent's CPU per datagram)
        recv = self._recv_unix if sock.family == socket.AF_UNIX else self._recv_udp
        for _ in range(limit):
            try:
                batch.append(recv(sock))
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                if self._stop.is_set():
                    return None
                break
        return batch

    def _gather(self, sock: socket.socket, batch: list[tuple[bytes, Sender]], per_second: float,
                steady: bool) -> bool:
        """Add more UDP datagrams to ``batch`` for ``UDP_GATHER_SECONDS`` after its first, from ``UDP_GATHER_RATE``
        reports a second (False once the collector is closing): 1,000 jobs report at their own phases, so draining alone
        left batches of a few datagrams and a 2 ms read of the socket table for each (13% of a core). The first
        datagrams wait with them and share their read (handled at once, they took a second read each gathering: 1,000
        jobs' CPU is 0.93-0.96x without it). Reports wait at most that long; the sampler reads them once an interval
        anyway. The price: a job's last report gathered after its process exited (its socket closed) cannot be verified
        and is refused (``unverified_sender``), so below that rate nothing is gathered. The socket is drained every
        ``UDP_GATHER_STEP``, not as each datagram comes: jobs at their own phases woke the loop for every one (a wait, a
        read and a read that found none each); once a gathering, or every ``UDP_GATHER_STEP_ROOMY``, where the buffer
        the kernel granted holds what comes meanwhile (``gather_step``, from the reports' rate and size, and again at
        each drain): 2 wakes a gathering, not 13. Where the rate was below the gathering rate a second ago (``steady``
        False: reports ramping up), the first wait is ``UDP_GATHER_STEP``, and what comes in it gives the rate.
        ``per_second``: the rate of reports so far."""
        deadline = time.monotonic() + UDP_GATHER_SECONDS
        sizes = [len(payload) for payload, _ in batch]
        size, largest = sum(sizes), max(sizes)
        at_once = self.settings.max_jobs
        step = gather_step(self._udp_buffer, per_second, largest, at_once) if steady else UDP_GATHER_STEP
        waited_from = None
        while True:
            more = self._drain(sock, UDP_BATCH - len(batch))
            if more is None:
                return False
            now = time.monotonic()
            batch += more
            if more:
                sizes = [len(payload) for payload, _ in more]
                size += sum(sizes)
                largest = max(largest, *sizes)
            if waited_from is not None:  # faster or larger reports than before: drain sooner, from this drain on
                step = gather_step(self._udp_buffer, max(per_second, len(more) / max(now - waited_from, 1e-3)),
                                   largest, at_once)
            waited_from = now
            left = deadline - now
            if len(batch) >= UDP_BATCH or size >= UDP_BATCH_BYTES or left <= 0:
                return True
            if self._stop.wait(min(left, step)):
                return True

    @staticmethod
    def _recv_unix(sock: socket.socket) -> tuple[bytes, Sender]:
        payload, ancillary, _, _ = sock.recvmsg(65536, _CMSG_SPACE)
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDS.size:
                pid, uid, _ = _CREDS.unpack(data[:_CREDS.size])
                return payload, Sender(local=True, pid=pid, uid=uid)
        return payload, Sender(local=True)  # no credentials: the pid check rejects it

    def _recv_udp(self, sock: socket.socket) -> tuple[bytes, Sender]:
        payload, ancillary, _, source = sock.recvmsg(65536, _DROPS_SPACE)
        if ancillary:  # only once the kernel has dropped datagrams on this socket (SO_RXQ_OVFL)
            self._count_drops(ancillary)
        # by position, the address and port indexed: unpacked by keyword and pattern, half again as long
        return payload, Sender(False, None, None, source[0], source[1])

    def _count_drops(self, ancillary: list[tuple[int, int, bytes]]) -> None:
        """Add the datagrams the kernel dropped since the last report that said so: a UDP socket whose buffer is
        full (a burst from many jobs, an agent paused) drops what comes, and the next report queued tells."""
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL and len(data) >= _DROPS.size:
                count = _DROPS.unpack_from(data)[0]
                grew = dropped_since(self._drops_seen, count)
                if grew:
                    self._drops_seen = count
                    with self._lock:
                        self.dropped += grew

    def receive(self, payload: bytes, sender: Sender, table: UdpTable | None = None) -> bool:
        """Validate and apply one report; count and drop anything malformed, whatever goes wrong. ``table``:
        the UDP sockets as read for the batch this report came in (else read for this report)."""
        try:
            report = self._parse(payload, self.settings.max_datagram_bytes)
            if sender.local and report.pid != sender.pid:
                raise Rejected("pid_mismatch", f"report says pid {report.pid}, the kernel says {sender.pid}")
            if not sender.local and sender.port is not None:
                sender = identify_udp_sender(sender.address or "", sender.port, table=table)
            with self._lock:
                self._apply(report, sender)
                self.accepted += 1
            return True
        except Rejected as exc:
            reason, detail = exc.reason, str(exc)
        except Exception as exc:  # a bug must cost one report, never the listener
            reason, detail = "internal_error", f"{type(exc).__name__}: {exc}"
            log.exception("hook report could not be handled")
        with self._lock:
            self.rejected[reason] += 1
        if reason in SECURITY_REASONS:
            self._log_refused(detail, sender)
        else:
            log.debug("hook report rejected: %s", detail)
        return False

    def _log_refused(self, detail: str, sender: Sender) -> None:
        """A report that names what its sender does not own: a warning, at most REFUSED_LOGS_PER_MINUTE a minute."""
        now = self.clock.monotonic()
        with self._lock:
            self._refused_logs = [t for t in self._refused_logs if now - t < 60]
            if len(self._refused_logs) >= REFUSED_LOGS_PER_MINUTE:
                self._refused_suppressed += 1
                return
            self._refused_logs.append(now)
            more, self._refused_suppressed = self._refused_suppressed, 0
        where = f"udp {sender.address}:{sender.port}" if not sender.local else f"pid {sender.pid}"
        log.warning("hook report from %s%s refused: %s%s", where, "" if sender.uid is None else f" (uid {sender.uid})",
                    detail, f" ({more} more refusals not logged)" if more else "")

    def _apply(self, report: Report, sender: Sender) -> None:
        series = (report.job, report.worker)
        now = self.clock.monotonic()
        job = self.jobs.get(series)
        if job is None:
            if len(self.jobs) >= self.settings.max_jobs:
                raise Rejected("too_many_jobs",
                               f"already {len(self.jobs)} (training_job, worker) series (hook.max_jobs)")
            job = JobState()
        key: ProcessKey = (sender.origin, report.pid, report.process_start)
        process = job.processes.get(key)
        if process is None:
            folded, last_seq = job.folded_by.get(key, (None, -1))
            if report.seq <= last_seq:  # a datagram older than the last one of a process taken for gone
                raise Rejected("stale", f"seq {report.seq} after {last_seq}")
            _check_unsent(report, last_seq)
            if len(job.processes) >= MAX_PROCESSES_PER_JOB:
                raise Rejected("too_many_jobs", f"{series} already has {MAX_PROCESSES_PER_JOB} live processes")
            pid_verified = sender.local or check_pid(report, sender)
            profiler = check_profiler(report, sender, self.env)
            if folded is not None:  # a process we took for gone reports again: take its counts back out
                job.folded = job.folded.plus(folded, -1)
                del job.folded_by[key]
            if series not in self.jobs:
                self.jobs[series] = job
                self._order = None
            job.processes[key] = ProcessState(key, report, now, profiler, pid_verified)
            self.unsent += report.unsent
            self._log_new(report, sender, profiler)
            self.wake()  # the job registry should know it before the next interval
        else:
            previous = process.latest
            if report.seq <= previous.seq:
                raise Rejected("stale", f"seq {report.seq} after {previous.seq}")
            if (report.steps < previous.steps or report.samples < previous.samples
                    or report.skipped_steps < previous.skipped_steps
                    or report.step_count < previous.step_count or report.step_sum < previous.step_sum
                    or any(map(operator.lt, report.step_buckets, previous.step_buckets))):  # both as many
                raise Rejected("counter_decreased", f"counters went backwards within pid {report.pid}")
            _check_unsent(report, previous.seq)
            if report.profiler != previous.profiler:
                process.profiler = check_profiler(report, sender, self.env)
            elapsed = report.time - previous.time
            if elapsed > 0:
                process.samples_per_second = (report.samples - previous.samples) / elapsed
            steps = report.step_count - previous.step_count
            if steps > 0:
                process.recent_step_seconds = (report.step_sum - previous.step_sum) / steps
            if report.steps > previous.steps:
                process.recent_batch = (report.samples - previous.samples) / (report.steps - previous.steps)
            self.unsent += report.unsent
            process.latest = report
            process.last_seen = now
            if report.outlier and steps > 0 and now - process.woken_at >= OUTLIER_WAKE_EVERY:
                process.woken_at = now
                self.wake()  # the rules see the step time jump now, not at the next interval
        job.last_seen = now
        job.dirty = True

    def _log_new(self, report: Report, sender: Sender, profiler: str | None) -> None:
        """One line per new process, at most NEW_JOB_LOGS_PER_MINUTE a minute (a flood must not flood the log)."""
        now = self.clock.monotonic()
        self._new_job_logs = [t for t in self._new_job_logs if now - t < 60]
        if len(self._new_job_logs) >= NEW_JOB_LOGS_PER_MINUTE:
            self._logs_suppressed += 1
            return
        self._new_job_logs.append(now)
        more = f" ({self._logs_suppressed} more new processes not logged)" if self._logs_suppressed else ""
        self._logs_suppressed = 0
        log.info("training job %s worker %s reporting: pid %d from %s, profiler %s%s", report.job, report.worker,
                 report.pid, sender.origin, profiler or "off", more)

    # ---- sampling: processes that went away, jobs that expired ----

    @staticmethod
    def _pid_gone(process: ProcessState, procfs: str) -> bool:
        # os.path on a str: a Path built per process was two thirds of a sample of 1,000 local processes
        return not os.path.exists(f"{procfs}/{process.latest.pid}")

    def sample(self) -> bool:
        """Retire processes that exited or went quiet, forget jobs that stopped reporting long ago, and
        freeze what this sample serves: metrics, rule signals and the job registry's facts all describe
        the same moment (a job visible in /metrics is one a capture can target)."""
        now = self.clock.monotonic()
        with self._lock:
            candidates = [(series, key, p) for series, job in self.jobs.items() for key, p in job.processes.items()]
        procfs = str(self.env.paths.procfs)
        # outside the lock; a UDP sender's pid is not one of this namespace (no lookup)
        exited = [c for c in candidates if c[1][0] == "local" and self._pid_gone(c[2], procfs)]
        with self._lock:
            down_after = self.settings.down_after
            gone = {(series, key) for series, key, p in candidates if now - p.last_seen > down_after}
            # A process that exited is retired a sample later: its last report may still wait in the Unix
            # socket's queue, and retired first, that report came as a new process whose profiler could no
            # longer be checked (refused: untrusted_profiler, and the process's last counts lost).
            for series, key, p in exited:
                p.gone_at = now if p.gone_at is None else p.gone_at
                if now - p.gone_at >= LATE_REPORT_S:
                    gone.add((series, key))
            for series, key in gone:
                job = self.jobs.get(series)
                process = job.processes.pop(key, None) if job else None
                if process is None:
                    continue
                counts = _counts(process.latest)
                job.folded = job.folded.plus(counts)
                job.dirty = True
                job.folded_by[key] = counts, process.latest.seq
                while len(job.folded_by) > FOLDED_KEPT:
                    job.folded_by.popitem(last=False)
                log.info("training job %s worker %s: pid %d stopped reporting", *series, process.latest.pid)
            for series, job in list(self.jobs.items()):
                if not job.processes and now - job.last_seen > self.settings.expire_after:
                    del self.jobs[series]
                    self._order = None
                    log.info("training job %s worker %s expired after %.0fs without reports", *series,
                             self.settings.expire_after)
            self._sampled = self._freeze(now)
        self._log_losses(now)
        return True

    def _log_losses(self, now: float) -> None:
        """A warning when the kernel dropped reports, or the hooks could not send some, each at most every
        DROPS_LOG_EVERY seconds, with what to do."""
        dropped, unsent = self._sampled.dropped, self._sampled.unsent
        grew = self._due_warning("dropped", dropped, now)
        if grew:
            advice = (f"raise net.core.rmem_max to {UDP_BUFFER} or more (the agent asks for that much)"
                      if self._udp_buffer < 2 * UDP_BUFFER else "the agent fell behind (stopped, or short of CPU)")
            log.warning("the kernel dropped %d hook reports on the UDP socket (%d in all): its receive buffer "
                        "(%d KiB) was full; %s", grew, dropped, self._udp_buffer // 1024, advice)
        grew = self._due_warning("unsent", unsent, now)
        if grew:
            queue = unix_queue()  # the agent's own network namespace's, as the listener reads it
            advice = (f"set net.unix.max_dgram_qlen to 512 (systemd's default) in the agent's network namespace: it "
                      f"is {queue}, so many processes reporting at once fill the queue" if queue < UNIX_REST_QUEUE
                      else "the agent was down, stopped or short of CPU")
            log.warning("the jobs' hooks could not send %d reports (%d in all), as their next reports said: the "
                        "agent's Unix socket was full or absent; %s", grew, unsent, advice)

    def _due_warning(self, what: str, count: int, now: float) -> int:
        """How much ``count`` of reports lost grew since its last warning, where another is due (it is then taken);
        else 0."""
        logged, at = self._warned[what]
        if count <= logged or now - at < DROPS_LOG_EVERY:
            return 0
        self._warned[what] = (count, now)
        return count - logged

    def configure(self, settings: HookSettings) -> None:
        super().configure(settings)
        with self._lock:
            for job in self.jobs.values():
                job.dirty = True  # down_after may have changed

    def _freeze(self, now: float) -> _Sampled:
        """The current state as plain values (called with the lock held). A job that neither reported nor
        crossed a time threshold since the last sample keeps its frozen part: the same row object, so the
        exposition keeps its rendering too."""
        wall = self.clock.time()
        if self._order is None:  # sorted again only when a job came or went, not at every sample
            self._order = sorted(self.jobs)
        jobs, rows, views = self.jobs, [], []
        signals: dict[str, list[tuple[dict[str, str], float]]] = {name: [] for name in self.signals}
        for series in self._order:
            state = jobs[series]
            frozen = state.frozen
            if frozen is None or state.dirty or now > frozen.until:
                frozen = state.frozen = self._freeze_job(series, state, now, wall)
                state.dirty = False
            rows.append(frozen.row)
            views += frozen.views
            for name, value in frozen.signals:
                signals[name].append((frozen.labels, value))
        return _Sampled(tuple(rows), tuple(sorted(self.rejected.items())), self.accepted, self.dropped, self.unsent,
                        signals, TrainingProcesses(tuple(views)))

    def _freeze_job(self, series: tuple[str, str], state: JobState, now: float, wall: float) -> _Frozen:
        """One job's part of a sample: 1,000 jobs that report every second are all frozen again at every sample
        (issue 24), most with one process (``_freeze_one``)."""
        if len(state.processes) == 1:
            return self._freeze_one(series, state, now, wall)
        job, worker = series
        live = sorted(state.processes.values(), key=_report_time)
        rates, steps, waiting = [], [], []
        until = math.inf  # when time alone changes this part: a fresh process goes quiet, the job goes down
        for p in live:
            report = p.latest
            if now - p.last_seen <= RATE_STALE_SECONDS:  # fresh: it counts as training and has a rate
                until = min(until, p.last_seen + RATE_STALE_SECONDS)
                if report.phase == "train":
                    if p.samples_per_second is not None:
                        rates.append(p.samples_per_second)
                    if p.recent_step_seconds is not None:
                        steps.append(p.recent_step_seconds)
            if report.first_step_seconds is None:
                waiting.append(wall - report.process_start)
        up = now - state.last_seen <= self.settings.down_after
        newest = live[-1].latest if live else None
        rate = sum(rates) if rates else None
        row = _Row(series, state.totals(), len(live), up, rate, newest.batch_size if newest else None,
                   max(p.latest.epoch for p in live) if live else None, _phase(live) if live else None,
                   newest.first_step_seconds if newest else None, tuple(sorted({p.profiler or "" for p in live})))
        views = tuple(_view(job, worker, p, now - p.last_seen <= RATE_STALE_SECONDS)
                      for p in state.processes.values())
        if up:
            until = min(until, state.last_seen + self.settings.down_after)
        return self._frozen(state, row, rate, sum(steps) / len(steps) if steps else None,
                            max(waiting) if waiting else None, views, until, now)

    def _freeze_one(self, series: tuple[str, str], state: JobState, now: float, wall: float) -> _Frozen:
        """``_freeze_job`` of a job with one process, without its lists, sorts and sums (the same part)."""
        (p,) = state.processes.values()
        report = p.latest
        fresh = now - p.last_seen <= RATE_STALE_SECONDS
        training = fresh and report.phase == "train"
        rate = p.samples_per_second if training else None
        up = now - state.last_seen <= self.settings.down_after
        until = p.last_seen + RATE_STALE_SECONDS if fresh else math.inf
        if up:
            until = min(until, state.last_seen + self.settings.down_after)
        waiting = wall - report.process_start if report.first_step_seconds is None else None
        row = _Row(series, state.totals(), 1, up, rate, report.batch_size, report.epoch, report.phase,
                   report.first_step_seconds, (p.profiler or "",))
        return self._frozen(state, row, rate, p.recent_step_seconds if training else None, waiting,
                            (_view(*series, p, fresh),), until, now)

    @staticmethod
    def _frozen(state: JobState, row: _Row, rate: float | None, step: float | None, waiting: float | None,
                views: tuple[ProcessView, ...], until: float, now: float) -> _Frozen:
        signals = (() if rate is None else (("samples_per_second", rate),)) + (
            () if step is None else (("step_seconds", step),)) + (
            () if waiting is None else (("seconds_without_first_step", waiting),))
        # the same labels dict from sample to sample: the rules engine keeps its key (see Signals)
        labels = state.frozen.labels if state.frozen is not None else {"training_job": row.key[0],
                                                                        "worker": row.key[1]}
        # a process still waiting for its first step reports a wall-clock age, so it is refrozen every sample
        return _Frozen(row, labels, signals, views, now if waiting is not None else until)

    def rule_signals(self) -> Signals:
        return self._sampled.signals

    def facts(self) -> tuple[TrainingProcesses, ...]:
        return (self._sampled.facts,)

    def problem(self) -> str | None:
        return self._problem

    def close(self) -> None:
        """Remove the socket file first (nothing can report any more), then stop the listener and close."""
        for sock in self._sockets:
            if sock.family == socket.AF_UNIX and sock.fileno() != -1:  # not closed already
                path = sock.getsockname()
                try:
                    if path and stat.S_ISSOCK(os.lstat(path).st_mode):
                        os.unlink(path)
                except OSError:
                    pass
        self._stop.set()
        if self._wake_closing is not None:
            with contextlib.suppress(OSError):  # closed already
                self._wake_closing.send(b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1)
        for sock in (*self._sockets, self._closing, self._wake_closing):
            if sock is not None:
                sock.close()
        self._selector.close()

    def collect(self) -> Sectioned:
        """The hook's own families, then the jobs' families in sections of one job each: a job whose row
        did not change since the last sample keeps its rendering (see ``Sectioned``)."""
        sampled = self._sampled
        head = [counter("hook_reports", "Total training-hook reports accepted.", [], [((), sampled.accepted)]),
                counter("hook_reports_rejected", "Total training-hook reports rejected and dropped, by reason.",
                        ["reason"], (((reason,), n) for reason, n in sampled.rejected)),
                counter("hook_reports_dropped", "Total training-hook reports the kernel dropped on the agent's UDP "
                        "socket, its receive buffer full (counted when a later report arrives).", [],
                        [((), sampled.dropped)]),
                counter("hook_reports_unsent", "Total training-hook reports the jobs' hooks could not send (the "
                        "agent's Unix socket full, or absent), as the next reports they sent told.", [],
                        [((), sampled.unsent)]),
                gauge("hook_jobs", "Number of (training_job, worker) series the agent tracks (at most "
                      "hook.max_jobs).", [], [((), len(sampled.rows))])]
        return Sectioned(head, _job_families, [(r.key, r) for r in sampled.rows], _job_lines)


def _job_families(rows: Sequence[_Row]) -> Iterator[Metric]:
    """The families of these jobs' series."""
    labels = ["training_job", "worker"]
    yield gauge("training_up", "Whether the training job reported within the last down_after seconds.", labels,
                ((r.key, 1.0 if r.up else 0.0) for r in rows))
    yield gauge("training_processes", "Number of processes reporting for the training job.", labels,
                ((r.key, r.processes) for r in rows))
    yield counter("training_steps", "Total training steps (batches) the job has run.", labels,
                  ((r.key, r.totals.steps) for r in rows))
    yield counter("training_samples", "Total training samples (examples) the job has processed.", labels,
                  ((r.key, r.totals.samples) for r in rows))
    yield counter("training_skipped_steps", "Total training steps whose update a mixed-precision loss-scale "
                  "optimizer skipped after a gradient overflow (Keras 3).", labels,
                  ((r.key, r.totals.skipped) for r in rows))
    yield gauge("training_samples_per_second", "Training throughput of the job's processes, summed, between "
                "their last two reports (absent while none trains).", labels,
                ((r.key, r.rate) for r in rows if r.rate is not None))
    yield gauge("training_batch_size", "Batch size the job declared.", labels,
                ((r.key, r.batch_size) for r in rows if r.batch_size is not None))
    yield gauge("training_epoch", "Current epoch of the job (0-based).", labels,
                ((r.key, r.epoch) for r in rows if r.epoch is not None))
    yield gauge("training_phase", "Whether the job is in this phase (1) or not (0).", [*labels, "phase"],
                (([*r.key, phase], 1.0 if phase == r.phase else 0.0)
                 for r in rows if r.phase is not None for phase in PHASES))
    yield gauge("training_first_step_seconds", "Seconds from process start to the job's first training step.",
                labels, ((r.key, r.first_step_seconds) for r in rows if r.first_step_seconds is not None))
    yield gauge("training_info", "Training job metadata: the profiler server address of each of its processes; "
                "the value is 1.", [*labels, "profiler_address"],
                (([*r.key, address], 1) for r in rows for address in r.profilers))
    histogram = HistogramMetricFamily(PREFIX + "training_step_duration_seconds",
                                      "Duration of training steps as the hook measured them.", labels=labels)
    for r in rows:
        buckets = [(repr(bound), float(c)) for bound, c in zip(STEP_BUCKETS, r.totals.buckets, strict=True)]
        buckets.append(("+Inf", float(r.totals.step_count)))
        histogram.add_metric(list(r.key), buckets, r.totals.step_sum)
    yield histogram


_P = PREFIX + "training_"
# the histogram's line starts, up to the job's labels, bucket by bucket, then +Inf and _count: a run of buckets of one
# count is their join, with the job's labels and the count between them
_HISTOGRAM = (*(f'{_P}step_duration_seconds_bucket{{le="{le!r}",' for le in STEP_BUCKETS),
              f'{_P}step_duration_seconds_bucket{{le="+Inf",', f"{_P}step_duration_seconds_count{{")


class _JobLines(list):
    """A job's sample lines, one string per family of ``_job_families``, with what the next rendering of the
    job reuses: the row they were written from and its label text (``written``)."""

    __slots__ = ("labels", "row")


def _written(lines: tuple[str, ...], row: _Row, labels: str) -> _JobLines:
    """A job's lines and what they were written from (list's own constructor: a Python ``__init__`` took twice as
    long, for each of 1,000 jobs every sample)."""
    written = _JobLines(lines)
    written.row, written.labels = row, labels
    return written


def _same(a: float | None, b: float | None) -> bool:
    """Whether two optional values are written alike: equal, and not two zeros that may differ in sign."""
    return a is b or (a == b and a != 0)


_NAN = float("nan")
# what a job's first rendering compares with: NaN equals no value (and `up` is never None), so every line is written
_UNWRITTEN = _written(("",) * 12, _Row(("", ""), Counts(_NAN, _NAN, _NAN, _NAN, _NAN, (_NAN,) * len(STEP_BUCKETS)),
                                      _NAN, None, _NAN, _NAN, _NAN, _NAN, _NAN, (_NAN,)),  # type: ignore[arg-type]
                      "")


def _histogram(labels: str, totals: Counts, count: str) -> str:
    """The step-duration histogram's lines, given the job's label text and its step count's text (with a newline).
    Cumulative buckets come in runs of one count (none below the usual step time, the step count past it): each run
    is one join of its lines' starts, shared by every job, with the job's labels and the count between them, and
    after the last (counts are ints: equal counts are written alike). A job's counts have a bucket for each of
    STEP_BUCKETS, as every report that ``parse_report`` accepts."""
    parts, at = [], 0
    end_count = labels + count
    for value, run in itertools.groupby(totals.buckets):
        end = at + len(tuple(run))
        text = end_count if value == totals.step_count else f"{labels}{go_float(value)}\n"
        parts += (text.join(_HISTOGRAM[at:end]), text)
        at = end
    parts += (_HISTOGRAM[at], end_count, _HISTOGRAM[at + 1], end_count,
              f"{_P}step_duration_seconds_sum{{{labels}{go_float(totals.step_sum)}\n")
    return "".join(parts)


def _job_lines(row: _Row, before: _JobLines | None = None) -> _JobLines:
    """One job's sample lines, family by family as ``_job_families`` makes them, written by hand: building
    the job's prometheus_client families and rendering them cost ~70 µs a job, what kept the agent above
    5% of a core with 1,000 jobs reporting every second (issue 24; ``bench/render_jobs.py`` measures both).
    Given the job's last lines (``before``), a line whose value is the same is reused, not written again: a
    job that reported changes its counts, rate and histogram, not its labels, phase, epoch, batch size or
    profilers. tests/test_many_jobs.py holds it byte-identical to prometheus_client's rendering, hostile labels
    included."""
    if before is None or before.row.key != row.key:
        before = _UNWRITTEN
        labels = f'training_job="{label_value(row.key[0])}",worker="{label_value(row.key[1])}"}} '
    else:
        labels = before.labels
    old, totals = before.row, row.totals
    was = old.totals
    # counts, processes and epoch are ints (``_int`` checks every report), so ``==`` is exact for them; the float
    # fields (rate, batch size, first step) go through ``_same``, which never reuses a zero's line; the histogram
    # is written whole when any of it changed
    histogram = before[11] if totals.buckets == was.buckets and totals.step_count == was.step_count and \
        _same(totals.step_sum, was.step_sum) else None
    # the step count's text, shared by the histogram's +Inf and _count (and its buckets that hold as many) and by
    # steps_total where it is the same int; made only where one of them is written
    count = "" if histogram is not None and totals.steps == was.steps else f"{go_float(totals.step_count)}\n"
    if totals.steps == was.steps:
        steps = before[2]
    else:
        steps = f"{_P}steps_total{{{labels}{count}" if totals.steps == totals.step_count else \
            f"{_P}steps_total{{{labels}{go_float(totals.steps)}\n"
    return _written((
        before[0] if row.up is old.up else f"{_P}up{{{labels}{'1.0' if row.up else '0.0'}\n",
        before[1] if row.processes == old.processes else f"{_P}processes{{{labels}{go_float(row.processes)}\n",
        steps,
        before[3] if totals.samples == was.samples else f"{_P}samples_total{{{labels}{go_float(totals.samples)}\n",
        before[4] if totals.skipped == was.skipped else
        f"{_P}skipped_steps_total{{{labels}{go_float(totals.skipped)}\n",
        before[5] if _same(row.rate, old.rate) else
        "" if row.rate is None else f"{_P}samples_per_second{{{labels}{go_float(row.rate)}\n",
        before[6] if _same(row.batch_size, old.batch_size) else
        "" if row.batch_size is None else f"{_P}batch_size{{{labels}{go_float(row.batch_size)}\n",
        before[7] if row.epoch == old.epoch else
        "" if row.epoch is None else f"{_P}epoch{{{labels}{go_float(row.epoch)}\n",
        before[8] if row.phase == old.phase else "" if row.phase is None else "".join(
            f'{_P}phase{{phase="{p}",{labels}{"1.0" if p == row.phase else "0.0"}\n' for p in PHASES),
        before[9] if _same(row.first_step_seconds, old.first_step_seconds) else "" if row.first_step_seconds is None
        else f"{_P}first_step_seconds{{{labels}{go_float(row.first_step_seconds)}\n",
        before[10] if row.profilers == old.profilers else
        "".join(f'{_P}info{{profiler_address="{label_value(a)}",{labels}1.0\n' for a in row.profilers),
        _histogram(labels, totals, count) if histogram is None else histogram,
    ), row, labels)


def _ports(batch: list[tuple[bytes, Sender]]) -> set[int]:
    """The UDP source ports of a batch of datagrams."""
    return {sender.port for _, sender in batch if sender.port is not None}


def _view(job: str, worker: str, p: ProcessState, fresh: bool) -> ProcessView:
    report = p.latest
    return ProcessView(job, worker, report.pid, p.key[0] == "local", report.phase, fresh and report.phase == "train",
                       p.profiler, p.samples_per_second if fresh else None, report.batch_size or p.recent_batch,
                       p.pid_verified)


def _report_time(process: ProcessState) -> float:
    return process.latest.time


def _phase(live: list[ProcessState]) -> str:
    """A job trains if any of its processes does; otherwise it is in its newest process's phase."""
    return "train" if any(p.latest.phase == "train" for p in live) else live[-1].latest.phase
