"""What the host was doing while a capture traced the job, and whether other processes starved it.

Every capture the agent makes gets a ``HostContext``, measured over the capture window (from just before the
capture worker starts to just after it returns) at the window's two edges, from procfs:

- ``/proc/stat``: CPU time by mode: busy cores, iowait, steal.
- ``/proc/pressure/{cpu,io,memory}``: PSI "some": the share of the window in which some task waited.
- every process's ``/proc/<pid>/stat``: CPU time and parent, so the job's processes (the pids its hook
  reports, and their children) and tfprofd's own (the agent and its workers) are told apart from the rest.
- the job's threads' ``/proc/<pid>/task/<tid>/schedstat``: the time each ran and the time it waited on a run
  queue, ready to run but with no CPU free.

The sampler's snapshots over the window add what it samples anyway (GPU utilization, memory in use), and its
CPU samples of the 30 s before the capture was asked for say how busy the host was when the rule fired.

A rule judges a window of the past (throughput_drop: the mean over the last 20 s), so the load that made it fire
may be over by the time the capture's window opens. For that, the monitor keeps a light reading of each local
job's threads every ``RING_EVERY`` seconds (``/proc/stat``, PSI, the job's reported processes and their threads'
schedstat, the agent's own CPU: no scan of every process), and a capture's ``before`` says whether other
processes starved the job over the span its rule measured (``lookback``), with the same numbers and threshold.

Contention: the job's threads were ready to run on ``wanted`` CPUs on average (run + run-queue wait over the
window, at most the host's CPUs) and ran on ``got``; what they lost (``wanted - got``, no more than what other
processes used) is the CPU other processes took from the job. ``host_contention`` is named when that loss is at
least a quarter of what the job wanted and a fifth of a CPU, and it becomes the capture's cause where CPU
starvation explains the trace's verdict (see ``join``). The trace analysis stays pure: the join happens here,
on its result.
"""

from __future__ import annotations

import logging
import os
import threading
from array import array
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from tfprofd.exporter.base import Clock, HostPaths, parse_pressure

from .analysis.model import CaptureAnalysis, HostVerdict

if TYPE_CHECKING:
    from .jobs import JobRegistry
    from .sampler import Snapshot

log = logging.getLogger("tfprofd.hostcontext")

LOST_SHARE = 0.25  # the job lost at least this share of the CPU it was ready to use...
LOST_CORES = 0.2  # ...and at least this much CPU
MIN_WANTED = 0.1  # a job ready to run on less CPU than this was idle: nothing to starve
BEFORE_SECONDS = 30.0  # the host's load this long before the capture was asked for
RING_EVERY = 5.0  # seconds between the light readings of each local job's threads
RING_KEEP = 130.0  # seconds of light readings kept: the longest lookback a rule's window asks for, and a margin
RING_JOBS = 16  # local jobs read at most (a GPU host runs one per GPU): the cost stays bounded
SAMPLED = ("cpu", "memory", "nvml")  # collectors whose signals over the window go in the record
PSI = ("cpu", "io", "memory")
TOP_OTHERS = 3
CPU_BOUND_SHARE = 0.95  # a job whose threads were ready to use this share of the host's CPUs never slept
CONTENTION_RECOMMENDATION = (
    "Other processes take the CPUs the job is ready to use: move them off this host, give the job CPUs of its "
    "own (a Kubernetes Guaranteed pod with integer CPU requests and the static CPU manager policy, or a cpuset), "
    "or run the other work at a lower weight (nice, systemd CPUWeight=). Then capture again to see the job's "
    "own bottleneck.")


# ---- parsing procfs (pure) ----

@dataclass(frozen=True, slots=True)  # many in the rings of local jobs' light readings
class CpuTimes:
    """/proc/stat's aggregate ``cpu`` line, in clock ticks."""

    busy: int
    idle: int
    iowait: int
    steal: int

    @property
    def total(self) -> int:
        return self.busy + self.idle + self.iowait + self.steal


def parse_proc_stat(text: str) -> tuple[CpuTimes, int]:
    """(the aggregate CPU times, the number of CPUs) from /proc/stat. Guest time is inside user, as there."""
    times, cpus = None, 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name == "cpu":
            v = [int(x) for x in rest.split()[:8]] + [0] * 8
            user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
            times = CpuTimes(user + nice + system + irq + softirq, idle, iowait, steal)
        elif name.startswith("cpu") and name[3:].isdigit():
            cpus += 1
    if times is None or cpus == 0:
        raise ValueError("no cpu lines in /proc/stat")
    return times, cpus


@dataclass(frozen=True, slots=True)  # many in the rings of local jobs' light readings
class PidStat:
    """What one process's /proc/<pid>/stat says: its name, parent and CPU time in ticks (user + system, its
    own and that of its children it waited for: a capture worker that ended counts in the agent's)."""

    pid: int
    comm: str
    ppid: int
    ticks: int


def parse_pid_stat(text: str) -> PidStat:
    """A /proc/<pid>/stat line; the name (in parentheses) may hold spaces and parentheses itself."""
    head, _, tail = text.rpartition(")")
    pid, _, comm = head.partition(" (")
    rest = tail.split()
    if len(rest) < 15:
        raise ValueError(f"short /proc/<pid>/stat: {text[:80]!r}")
    return PidStat(int(pid), comm, int(rest[1]), sum(int(v) for v in rest[11:15]))


def parse_schedstat(text: str) -> tuple[int, int]:
    """(ns run on a CPU, ns waited on a run queue) from /proc/<pid>/task/<tid>/schedstat."""
    run, wait, *_ = (int(v) for v in text.split())
    return run, wait


def descendants(parents: Mapping[int, int], roots: Iterable[int]) -> set[int]:
    """The roots that exist and every process below them, from {pid: parent pid}."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    todo = [r for r in roots if r in parents]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, ()))
    return out


def listening_inodes(net_tcp_texts: Iterable[str], port: int) -> set[int]:
    """Socket inodes in LISTEN state on ``port`` from /proc/net/tcp and tcp6."""
    inodes = set()
    for text in net_tcp_texts:
        for line in text.splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 10 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(parts[9]))
    return inodes


# ---- the record's model ----

@dataclass(frozen=True)
class SeriesSummary:
    """One sampled series over the window: a GPU's utilization, the memory in use, the CPUs' busy share."""

    signal: str
    labels: dict[str, str]
    mean: float
    min: float
    max: float
    samples: int


@dataclass(frozen=True)
class OtherProcess:
    """One of the other processes that used the most CPU in the window."""

    pid: int
    name: str
    cores: float


@dataclass(frozen=True)
class Contention:
    """Other processes starved the job: the CPU it was ready to use, what it got, and who took the rest."""

    wanted_cores: float
    got_cores: float
    lost_share: float
    why: str


@dataclass(frozen=True)
class HostLoad:
    """The host's CPUs as the sampler saw them over the seconds before the capture was asked for, and whether
    other processes starved the job over the ``lookback`` seconds its rule measured (None: not measured)."""

    seconds: float
    cpu_busy: float
    cpu_iowait: float
    lookback: float | None = None
    contention: Contention | None = None


@dataclass(frozen=True)
class HostContext:
    """What the host was doing over a capture window. Cores are averages over the window; shares are of it."""

    seconds: float
    cpus: int | None = None
    busy_cores: float | None = None
    steal_cores: float | None = None
    iowait_share: float | None = None
    psi_some: dict[str, float] = field(default_factory=dict)  # resource -> share of the window
    job_cores: float | None = None
    job_wait_cores: float | None = None  # threads ready to run but on a run queue, on average
    job_processes: int = 0
    job_threads: int = 0
    tfprofd_cores: float | None = None  # the agent and its capture/analysis workers
    other_cores: float | None = None  # everything else: busy - job - tfprofd
    top_others: list[OtherProcess] = field(default_factory=list)
    sampled: list[SeriesSummary] = field(default_factory=list)
    before: HostLoad | None = None
    contention: Contention | None = None
    note: str | None = None  # what could not be measured, and why

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> HostContext:
        """A host context from its JSON; raises ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("host context: expected an object")
        try:
            values = dict(data)
            values["top_others"] = [OtherProcess(**o) for o in data.get("top_others", [])]
            values["sampled"] = [SeriesSummary(**s) for s in data.get("sampled", [])]
            if data.get("contention") is not None:
                values["contention"] = Contention(**data["contention"])
            if data.get("before") is not None:
                before = dict(data["before"])
                if before.get("contention") is not None:
                    before["contention"] = Contention(**before["contention"])
                values["before"] = HostLoad(**before)
            context = cls(**values)
        except TypeError as exc:
            raise ValueError(f"host context: {exc}") from None
        for f in fields(cls):
            value = getattr(context, f.name)
            if f.name in ("seconds", "cpus", "busy_cores", "steal_cores", "iowait_share", "job_cores",
                          "job_wait_cores", "job_processes", "job_threads", "tfprofd_cores", "other_cores"):
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                    raise ValueError(f"host context: {f.name} is not a number")
        if not isinstance(context.psi_some, dict) or not all(isinstance(v, (int, float))
                                                              for v in context.psi_some.values()):
            raise ValueError("host context: psi_some holds a value that is not a number")
        return context

    @property
    def contended(self) -> Contention | None:
        """Other processes starved the job over the capture window, else over the span its rule measured."""
        if self.contention is not None:
            return self.contention
        return self.before.contention if self.before is not None else None

    def lines(self) -> list[str]:
        """The context for people, a few lines."""
        if self.cpus is None:
            return [f"host: {self.note or 'not measured'}"]
        psi = ", ".join(f"{r} {s:.0%}" for r, s in sorted(self.psi_some.items()))
        out = [f"host over the {self.seconds:.1f} s capture window: {self.busy_cores:.1f} of {self.cpus} CPUs busy"
               + (f", iowait {self.iowait_share:.0%}" if self.iowait_share else "")
               + (f"; waiting (PSI some): {psi}" if psi else "")]
        if self.job_cores is not None:
            out.append(f"  the job {self.job_cores:.2f} CPUs ({self.job_processes} processes, {self.job_threads} "
                       f"threads), tfprofd {self.tfprofd_cores:.2f}, other processes {self.other_cores:.2f}"
                       + (": " + ", ".join(f"{o.name} (pid {o.pid}) {o.cores:.2f}" for o in self.top_others)
                          if self.top_others else ""))
        if self.before is not None:
            out.append(f"  before the capture ({self.before.seconds:.0f} s): CPUs {self.before.cpu_busy:.0%} busy, "
                       f"iowait {self.before.cpu_iowait:.0%}")
            if self.before.contention is not None:
                out.append(f"  contended before the capture: {self.before.contention.why}")
        out += [f"  {s.signal}{_labels(s.labels)}: mean {s.mean:.2f} (min {s.min:.2f}, max {s.max:.2f})"
                for s in self.sampled if s.signal.startswith(("gpu", "sm_"))]
        if self.contention is not None:
            out.append(f"  contended: {self.contention.why}")
        if self.note:
            out.append(f"  note: {self.note}")
        return out


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else ""


# ---- one edge of the window ----

@dataclass(frozen=True, slots=True)  # many in the rings of local jobs' light readings
class Edge:
    """Everything read at one edge of the window."""

    monotonic: float
    cpu: CpuTimes
    cpus: int
    psi: dict[str, float]  # resource -> cumulative "some" seconds
    processes: dict[int, PidStat]
    tasks: Tasks  # the job's threads
    job: frozenset[int]
    tfprofd: frozenset[int]


def _read_host(paths: HostPaths) -> tuple[CpuTimes, int, dict[str, float]]:
    text = paths.read_proc("stat")
    if text is None:
        raise ValueError(f"cannot read {paths.procfs}/stat")
    cpu, cpus = parse_proc_stat(text)
    psi = {}
    for resource in PSI:
        some = parse_pressure(paths.read_proc(f"pressure/{resource}") or "").get("some")
        if some is not None:
            psi[resource] = some
    return cpu, cpus, psi


def _read_processes(paths: HostPaths, names: Iterable[str]) -> dict[int, PidStat]:
    processes: dict[int, PidStat] = {}
    for name in names:
        stat = paths.read_proc(f"{name}/stat")
        if stat:
            try:
                processes[int(name)] = parse_pid_stat(stat)
            except ValueError:
                continue
    return processes


def read_edge(paths: HostPaths, roots: Iterable[int], agent_pid: int | None, now: float) -> Edge:
    """Read one edge; raises ValueError when /proc/stat cannot be read."""
    cpu, cpus, psi = _read_host(paths)
    try:
        names = [n for n in os.listdir(paths.procfs) if n.isdigit()]
    except OSError:
        names = []
    processes = _read_processes(paths, names)
    parents = {pid: p.ppid for pid, p in processes.items()}
    job = frozenset(descendants(parents, roots))
    tfprofd = frozenset(descendants(parents, [agent_pid])) if agent_pid is not None else frozenset()
    return Edge(now, cpu, cpus, psi, processes, _read_tasks(paths, job), job, tfprofd)


def read_light_edge(paths: HostPaths, roots: Iterable[int], agent_pid: int | None, now: float) -> Edge:
    """An edge of the job's reported processes and the agent, each with its children (from
    ``/proc/<pid>/task/<tid>/children``: a job's data-loading workers are its own, the agent's capture workers
    are tfprofd's), without a scan of every process: cheap enough to take every few seconds. ``measure``
    between two of them has no top others. Raises ValueError when /proc/stat cannot be read."""
    return read_light_edges(paths, {"": roots}, agent_pid, now)[""]


def read_light_edges(paths: HostPaths, jobs: Mapping[str, Iterable[int]], agent_pid: int | None,
                     now: float) -> dict[str, Edge]:
    """``read_light_edge`` for each job, from one reading of what their edges share (the host's CPU and
    pressure, the agent's processes), and sharing it: read again for each, 16 local jobs read /proc/stat and
    the pressure files 16 times every 5 s, and their rings kept 16 copies (issue 24). No job: nothing is read."""
    if not jobs:
        return {}
    cpu, cpus, psi = _read_host(paths)
    tfprofd_pids = _family(paths, [agent_pid]) if agent_pid is not None else set()
    tfprofd_processes = _read_processes(paths, {str(p) for p in tfprofd_pids})
    tfprofd = frozenset(tfprofd_processes)
    edges = {}
    for name, roots in jobs.items():
        job_pids = _family(paths, [p for p in roots if p != agent_pid]) - tfprofd_pids
        processes = {**_read_processes(paths, {str(p) for p in job_pids}), **tfprofd_processes}
        job = frozenset(p for p in job_pids if p in processes)
        edges[name] = Edge(now, cpu, cpus, psi, processes, _read_tasks(paths, job), job, tfprofd)
    return edges


def _family(paths: HostPaths, roots: Iterable[int], most: int = 1024) -> set[int]:
    """The roots and their descendants as the kernel lists each thread's children (at most ``most``)."""
    out: set[int] = set()
    todo = list(roots)
    while todo and len(out) < most:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        try:
            tids = os.listdir(paths.procfs / str(pid) / "task")
        except OSError:
            continue
        for tid in tids:
            text = paths.read_proc(f"{pid}/task/{tid}/children") or ""
            todo.extend(int(c) for c in text.split() if c.isdigit())
    return out


class Tasks:
    """A job's threads at one edge: each one's ns run and ns waited on a run queue, in arrays of 8 bytes a
    number, not a dict of tuples: the rings of 16 local jobs of a 118-thread process (a TensorFlow job's count),
    26 readings each, took 1.30 MiB instead of 1.82 (issue 24)."""

    __slots__ = ("run", "tids", "wait")

    def __init__(self, times: Mapping[int, tuple[int, int]]):
        self.tids = array("q", times)
        self.run = array("q", (run for run, _ in times.values()))
        self.wait = array("q", (wait for _, wait in times.values()))

    def __len__(self) -> int:
        return len(self.tids)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tasks) and (self.tids, self.run, self.wait) == (other.tids, other.run, other.wait)

    __hash__ = None  # type: ignore[assignment]  # equal by value, and mutable arrays

    def __repr__(self) -> str:
        return f"Tasks({len(self)} threads)"

    def since(self, before: Tasks) -> tuple[int, int]:
        """ns run and waited since ``before`` by these threads (a thread new since counts in full)."""
        start = {tid: i for i, tid in enumerate(before.tids)}
        run = wait = 0
        for i, tid in enumerate(self.tids):
            j = start.get(tid)
            run += self.run[i] - (before.run[j] if j is not None else 0)
            wait += self.wait[i] - (before.wait[j] if j is not None else 0)
        return run, wait


def _read_tasks(paths: HostPaths, job: Iterable[int]) -> Tasks:
    """The job's threads, with the ns each ran and waited on a run queue."""
    tasks: dict[int, tuple[int, int]] = {}
    for pid in job:
        try:
            tids = os.listdir(paths.procfs / str(pid) / "task")
        except OSError:
            continue
        for tid in tids:
            sched = paths.read_proc(f"{pid}/task/{tid}/schedstat")
            if sched:
                try:
                    tasks[int(tid)] = parse_schedstat(sched)
                except ValueError:
                    continue
    return Tasks(tasks)


def _ticks(before: Edge, after: Edge, pids: Iterable[int]) -> int:
    """CPU ticks the processes used between the edges (a process new at the second edge counts in full)."""
    total = 0
    for pid in pids:
        end = after.processes.get(pid)
        if end is None:
            continue
        start = before.processes.get(pid)
        total += max(end.ticks - (start.ticks if start is not None and start.ppid == end.ppid else 0), 0)
    return total


def measure(before: Edge, after: Edge, clock_ticks: int, job_visible: bool, note: str | None = None,
            span: str = "capture window") -> HostContext:
    """The host context between two edges (pure); ``contention`` filled when other processes starved the job.
    ``span`` names the interval between the edges in the contention's words."""
    seconds = after.monotonic - before.monotonic
    delta = CpuTimes(*(max(getattr(after.cpu, f) - getattr(before.cpu, f), 0)
                       for f in ("busy", "idle", "iowait", "steal")))
    if seconds <= 0 or delta.total <= 0:
        return HostContext(max(seconds, 0.0), note=note or "no CPU time passed between the window's edges")
    # /proc/stat counts ticks on every CPU: scale to the window's length in CPUs
    per_tick = after.cpus / delta.total
    busy, steal = delta.busy * per_tick, delta.steal * per_tick
    psi = {r: min(max((after.psi[r] - before.psi[r]) / seconds, 0.0), 1.0)
           for r in PSI if r in after.psi and r in before.psi}
    tfprofd = _ticks(before, after, after.tfprofd - after.job) / clock_ticks / seconds
    context = HostContext(round(seconds, 3), after.cpus, busy, steal, delta.iowait / delta.total, psi, note=note)
    if not job_visible or not after.job:
        return replace(context, tfprofd_cores=tfprofd, note=note or "the job's processes are not visible to the agent "
                     "(another pid namespace, or none reported over the local socket); its share is unknown")
    if after.tasks:
        run, wait = after.tasks.since(before.tasks)
        job, job_wait = max(run, 0) / 1e9 / seconds, max(wait, 0) / 1e9 / seconds
    else:
        job, job_wait = _ticks(before, after, after.job) / clock_ticks / seconds, None
    others = max(busy - job - tfprofd, 0.0)
    rest = sorted(((pid, p) for pid, p in after.processes.items() if pid not in after.job | after.tfprofd),
                  key=lambda kv: -_ticks(before, after, [kv[0]]))[:TOP_OTHERS]
    top = [OtherProcess(pid, p.comm, round(_ticks(before, after, [pid]) / clock_ticks / seconds, 3))
           for pid, p in rest]
    context = replace(context, job_cores=job, job_wait_cores=job_wait, job_processes=len(after.job),
                    job_threads=len(after.tasks), tfprofd_cores=tfprofd, other_cores=others,
                    top_others=[o for o in top if o.cores >= 0.05])
    return replace(context, contention=contention(context, span))


def contention(c: HostContext, span: str = "capture window") -> Contention | None:
    """Whether other processes starved the job in this window, with the numbers; None if they did not
    (or the job's run-queue wait could not be measured)."""
    if c.cpus is None or c.job_cores is None or c.job_wait_cores is None or c.other_cores is None:
        return None
    wanted = min(c.job_cores + c.job_wait_cores, float(c.cpus))
    if wanted < MIN_WANTED:
        return None
    others = c.other_cores + (c.tfprofd_cores or 0.0)
    lost = min(max(wanted - c.job_cores, 0.0), others)
    share = lost / wanted
    if share < LOST_SHARE or lost < LOST_CORES:
        return None
    waited = c.job_wait_cores / (c.job_cores + c.job_wait_cores)
    ours = (f" ({c.tfprofd_cores:.1f} of them tfprofd's own workers)"
            if (c.tfprofd_cores or 0) >= 0.1 * max(others, 0.1) and (c.tfprofd_cores or 0) >= 0.1 else "")
    top = f"; most: {', '.join(f'{o.name} (pid {o.pid}) {o.cores:.1f}' for o in c.top_others)}" if c.top_others else ""
    why = (f"other processes used {others:.1f} of {c.cpus} CPUs{ours}; the job's threads were ready to run on "
           f"{wanted:.1f} CPUs but ran on {c.job_cores:.1f}, waiting for a CPU {waited:.0%} of the time they were "
           f"ready (run-queue wait from /proc/<pid>/task/*/schedstat over the {c.seconds:.1f} s {span}){top}")
    return Contention(round(wanted, 3), round(c.job_cores, 3), round(share, 3), why)


# ---- joining the trace's verdict with the host context ----

@dataclass(frozen=True)
class TraceVerdict:
    """What the trace analysis alone concluded: the parts of its result the join needs."""

    kind: str
    summary: str
    hardware: str
    input_share: float | None = None  # of the step, waiting for input

    @classmethod
    def of(cls, analysis: CaptureAnalysis) -> TraceVerdict:
        lead = analysis.lead
        return cls(lead.bottleneck, analysis.summary, lead.hardware, lead.input_bound_ratio)


@dataclass(frozen=True)
class Cause:
    """The capture's final cause after the join: ``kind`` replaces the trace's verdict, which stays visible."""

    kind: str
    why: str
    recommendation: str
    trace_kind: str
    trace_summary: str


def join(trace: TraceVerdict, host: HostContext | None, rule: str | None = None) -> Cause | None:
    """The final cause when host contention explains the step better than the trace's verdict; else None.

    CPU contention stretches host work (``host``, ``small_batch``), CPU compute (``device`` on a CPU-only trace)
    and a trace too starved to show steps (``unknown``): there, contention is the cause. It does not make a GPU
    compute longer. A step that waits for input is contention's too when the job was CPU-bound throughout (its
    threads were ready to use every CPU of the host) and the wait is no larger than the share of that CPU it
    did not get: a pipeline starved of CPU. Otherwise it keeps its ``input`` verdict (or ``transfer``), with
    the contention noted beside it: a job whose threads want fewer CPUs than the host has also sleeps, and a
    reader that sleeps on storage (the demo's injected bottleneck) is not explained by a CPU hog.

    Contention over the span the rule measured counts as well as over the capture window: a rule judges the
    recent past, and the load that made it fire may be gone once the capture starts."""
    c = host.contended if host is not None else None
    if c is None:
        return None
    cpu_bound = trace.kind in ("host", "small_batch", "unknown") or (
        trace.kind == "device" and trace.hardware in ("CPU_ONLY", ""))
    starved_input = (trace.kind == "input" and trace.input_share is not None and trace.input_share <= c.lost_share
                     and host.cpus is not None and c.wanted_cores >= CPU_BOUND_SHARE * host.cpus)
    if not (cpu_bound or starved_input):
        return None
    why = c.why + (f"; the job was ready to use every CPU, and the step's {trace.input_share:.0%} wait for input "
                   f"is within the {c.lost_share:.0%} of that it did not get: its input pipeline was starved of CPU"
                   if starved_input else "")
    return Cause("host_contention", why + _fired(rule), CONTENTION_RECOMMENDATION, trace.kind, trace.summary)


def _fired(rule: str | None) -> str:
    return f" (rule {rule} fired while the host was contended)" if rule else ""


def apply(analysis: CaptureAnalysis, host: HostContext | None,
          rule: str | None = None) -> tuple[CaptureAnalysis, Cause | None]:
    """The analysis with the join's cause leading (the trace's own verdict stays on its lead worker); when the
    host was contended but the trace's verdict stands, its summary says so. Also returns the cause, if one leads."""
    cause = join(TraceVerdict.of(analysis), host, rule)
    if cause is not None:
        return replace(analysis, host_verdict=HostVerdict(cause.kind, cause.why, cause.recommendation),
                       summary=f"{cause.kind}: {cause.why}; the trace alone says {cause.trace_summary}"), cause
    if host is not None and host.contended is not None:
        return replace(analysis, summary=f"{analysis.summary}; the host was contended too: {host.contended.why}"
                                         f"{_fired(rule)}"), None
    return analysis, None


# ---- the agent's part: windows around captures, and the sampler's series ----

@dataclass
class Window:
    """A capture window being measured."""

    job: str
    first: Edge | None
    visible: bool
    opened: float
    note: str | None = None


class HostMonitor:
    """Measures capture windows, and keeps the sampler's host series while one is open (nothing otherwise,
    but the CPU's busy share of the last ``BEFORE_SECONDS`` and a light reading of each local job's threads
    every ``RING_EVERY`` seconds over the last ``RING_KEEP``)."""

    def __init__(self, paths: HostPaths, jobs: JobRegistry, clock: Clock):
        self.paths = paths
        self.jobs = jobs
        self.clock = clock
        self.clock_ticks = os.sysconf("SC_CLK_TCK")
        self._open = 0
        self._series: deque[tuple[float, str, Snapshot]] = deque()
        self._cpu: deque[tuple[float, float, float]] = deque()  # (monotonic, busy, iowait)
        self._ring: dict[str, deque[Edge]] = {}  # job -> light edges, oldest first
        self._ring_at: float | None = None
        self._lock = threading.Lock()

    def on_snapshot(self, snapshot: Snapshot) -> None:
        if snapshot.collector not in SAMPLED:
            return
        with self._lock:
            if snapshot.collector == "cpu":
                busy = snapshot.signals.get("cpu_utilization") or ()
                iowait = snapshot.signals.get("cpu_iowait") or ()
                if busy and iowait:
                    self._cpu.append((snapshot.monotonic, busy[0][1], iowait[0][1]))
                while self._cpu and self._cpu[0][0] < snapshot.monotonic - BEFORE_SECONDS:
                    self._cpu.popleft()
            if self._open:
                self._series.append((snapshot.monotonic, snapshot.collector, snapshot))
            due = snapshot.collector == "cpu" and (self._ring_at is None
                                                   or snapshot.monotonic - self._ring_at >= RING_EVERY)
            if due:
                self._ring_at = snapshot.monotonic
        if due:
            self._read_ring(snapshot.monotonic)

    def _local_roots(self) -> dict[str, list[int]]:
        """The jobs whose processes reported over the local socket (the kernel vouched for their pids), at most
        ``RING_JOBS`` of them."""
        local = self.jobs.local_pids()  # one pass: a scan per job was O(jobs²) with 1,000 UDP jobs (issue 24)
        return {job: local[job] for job in sorted(local)[:RING_JOBS]}

    def _read_ring(self, now: float) -> None:
        """One light reading per local job; a job whose processes changed starts its ring anew."""
        try:
            edges = read_light_edges(self.paths, self._local_roots(), self._agent_pid(), now)
        except ValueError:  # /proc/stat unreadable: no edge this time
            edges = {}
        with self._lock:
            for job in [j for j in self._ring if j not in edges]:
                del self._ring[job]
            for job, edge in edges.items():
                ring = self._ring.setdefault(job, deque())
                if ring and ring[-1].job != edge.job:
                    ring.clear()
                ring.append(edge)
                while ring and ring[0].monotonic < now - RING_KEEP:
                    ring.popleft()

    def _agent_pid(self) -> int | None:
        try:  # the agent's pid as the procfs it reads numbers it (/host/proc in a container)
            return int(os.readlink(self.paths.procfs / "self"))
        except (OSError, ValueError):
            return None

    def _roots(self, job: str) -> tuple[list[int], str | None]:
        """The job's pids the agent can trust to be its processes here, and why some are left out."""
        roots, left = [], []
        for p in self.jobs.processes(job):
            if p.local or self._owns_profiler_port(p.pid, p.profiler):
                roots.append(p.pid)
            else:
                left.append(p.pid)
        note = (f"pid(s) {', '.join(map(str, left))} reported over UDP could not be matched to a process here "
                "(none holds the job's profiler port)") if left else None
        return roots, note

    def _owns_profiler_port(self, pid: int, profiler: str | None) -> bool:
        """Whether process ``pid`` holds the listening socket of the job's profiler (a UDP report's pid may be
        another pid namespace's number)."""
        if not profiler:
            return False
        try:
            port = int(profiler.rpartition(":")[2])
        except ValueError:
            return False
        texts = [t for name in ("tcp", "tcp6") if (t := self.paths.read_proc(f"net/{name}"))]
        inodes = listening_inodes(texts, port)
        if not inodes:
            return False
        try:
            fds = os.listdir(self.paths.procfs / str(pid) / "fd")
        except OSError:
            return False
        for fd in fds:
            try:
                target = os.readlink(self.paths.procfs / str(pid) / "fd" / fd)
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                return True
        return False

    def open(self, job: str) -> Window:
        """Read the window's first edge (call just before the capture starts); ``close`` it in any case."""
        now = self.clock.monotonic()
        roots, note = self._roots(job)
        try:
            window = Window(job, read_edge(self.paths, roots, self._agent_pid(), now), bool(roots), now, note)
        except ValueError as exc:
            window = Window(job, None, False, now, str(exc))
        with self._lock:
            self._open += 1
        return window

    def close(self, window: Window, before: HostLoad | None = None) -> HostContext:
        """Read the window's second edge and say what the host did in between."""
        now = self.clock.monotonic()
        with self._lock:
            self._open -= 1
            taken = [(t, c, s) for t, c, s in self._series if window.opened <= t <= now]
            if not self._open:
                self._series.clear()
        context = HostContext(round(now - window.opened, 3), note=window.note)
        if window.first is not None:
            try:
                roots = sorted(window.first.job)  # the processes found at the first edge, and their new children
                last = read_edge(self.paths, roots, self._agent_pid(), now)
                context = measure(window.first, last, self.clock_ticks, window.visible, window.note)
            except ValueError as exc:
                context = replace(context, note=str(exc))
        return replace(context, sampled=summarise(taken), before=before)

    def load_before(self, job: str | None = None, lookback: float | None = None) -> HostLoad | None:
        """The CPUs' busy and iowait shares over the last ``BEFORE_SECONDS`` as the sampler saw them, and, for a
        local ``job``, whether other processes starved it over the last ``lookback`` seconds (the span its rule
        measured): from the newest light reading at least that old (the oldest kept if none is) to now."""
        with self._lock:
            samples = list(self._cpu)
            ring = list(self._ring.get(job, ())) if job is not None else []
        if not samples:
            return None
        import statistics  # at a capture only (it loads fractions and decimal: 0.5 MB resident all the time)

        load = HostLoad(round(samples[-1][0] - samples[0][0], 1), statistics.fmean(s[1] for s in samples),
                        statistics.fmean(s[2] for s in samples))
        if not ring or not lookback:
            return load
        now = self.clock.monotonic()
        first = next((e for e in reversed(ring) if e.monotonic <= now - lookback), ring[0])
        try:
            last = read_light_edge(self.paths, sorted(first.job), self._agent_pid(), now)
        except ValueError:
            return load
        if last.monotonic - first.monotonic < RING_EVERY / 2:
            return load  # too short a span to say anything
        span = measure(first, last, self.clock_ticks, True, span="span before the capture that its rule measured")
        return replace(load, lookback=round(span.seconds, 1), contention=span.contention)


def summarise(taken: list[tuple[float, str, Snapshot]]) -> list[SeriesSummary]:
    """Each sampled series over the window: mean, min, max."""
    import statistics  # at a capture only, as in load_before

    values: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}
    for _, _, snapshot in taken:
        for signal, series in snapshot.signals.items():
            for labels, value in series:
                values.setdefault((signal, tuple(sorted(labels.items()))), []).append(value)
    return [SeriesSummary(signal, dict(labels), round(statistics.fmean(v), 4), round(min(v), 4), round(max(v), 4),
                          len(v)) for (signal, labels), v in sorted(values.items())]
