"""Reading a trace into a timeline, on its own clock: the capture's span, the steps (found here, from the
step markers), the time between them, how busy the framework's ops keep a CPU within the steps, the ops
tf.data runs, and on each GPU its device ops (with the kernels each launched) and memory copies.

Steps are found in one place, ``find_steps``: every source of steps (host step markers, the device's own
``Steps`` line, repeated executions of one tf.function) is a function of the events gathered in ``Events``:

- host step markers: any host event with a ``step_num`` stat. tfprofd's hook, tf_keras's fit and custom loops
  mark steps ``Trace("train", step_num=n, _r=1)``; Keras 3's ``TensorBoard(profile_batch=...)`` marks them
  ``Trace("Profiled batch", step_num=n)`` without ``_r=1`` (xprof is handed a copy with it added). Training steps
  per marker: its ``steps`` stat (the hook's) where it has one; else, where the steps run in a TF while loop
  (``steps_per_execution > 1``), the input iterator's calls inside the marker;
- the busiest GPU's ``Steps`` line;
- no markers at all: the executions of the tf.function the Python thread runs most time in (a custom loop's
  ``train_step``), each one step; such steps are *inferred*, and said to be.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .xprof import StepHints, bookkeeping

if TYPE_CHECKING:
    from ..protos.xplane_pb2 import XEvent, XSpace

Interval = tuple[int, int]  # picoseconds on the trace's clock


@dataclass
class DeviceOpTimes:
    """A device op type's time in the capture (replicas merged), its ops, and the kernels they launched."""

    name: str
    ms: float = 0.0
    kernels: dict[str, float] = field(default_factory=dict)
    ops: set[str] = field(default_factory=set)


@dataclass
class DeviceEvents:
    """One GPU plane: its ``Steps`` line, its kernels and its memory copies."""

    name: str  # "GPU:4"
    steps: list[Interval] = field(default_factory=list)
    kernels: list[Interval] = field(default_factory=list)
    copies_ms: dict[str, float] = field(default_factory=dict)


COPY_KINDS = {"H2D": ("H2D", "HtoD"), "D2H": ("D2H", "DtoH"), "D2D": ("D2D", "DtoD"), "P2P": ("P2P", "PtoP")}
ITERATOR_CALLS = ("IteratorGetNextOp::DoCompute", "IteratorGetNextAsOptionalOp::DoCompute")  # one per batch fetched
MIN_CALLS = 3  # a tf.function executed this often in the capture can be the training step
LAUNCH_THREADS = ("tf_Compute", "tf_numa", "tf_inter_op", "tf_gpu")  # host threads that run ops and launch kernels


def copy_kind(*names: str) -> str | None:
    """The kind of memory copy the first name that tells says (``MemcpyDtoD`` and ``MemcpyD2D`` alike)."""
    for name in names:
        for kind, spellings in COPY_KINDS.items():
            if any(s in name for s in spellings):
                return kind
    return None


@dataclass
class Events:
    """What ``read_events`` gathers from a trace for finding steps and measuring them."""

    low: int | None = None
    high: int | None = None
    host_steps: list[Interval] = field(default_factory=list)  # host step markers
    marker_steps: list[int] = field(default_factory=list)  # training steps each marker covers (``steps`` stat)
    loops: bool = False  # a TF while loop ran (executor events with an iteration number above 0)
    window: Interval | None = None  # the profiling session's (start, stop) in Unix ns (Task Environment plane)
    fetches: list[Interval] = field(default_factory=list)  # the stepping thread waiting on the input iterator
    device_steps: dict[str, list[Interval]] = field(default_factory=dict)  # each GPU's ``Steps`` line
    ops: list[Interval] = field(default_factory=list)  # TF ops on the host's compute threads (each line's merged)
    input_ops: set[str] = field(default_factory=set)
    device_ops: dict[str, DeviceOpTimes] = field(default_factory=dict)
    copies_ms: dict[str, float] = field(default_factory=dict)
    devices: dict[str, DeviceEvents] = field(default_factory=dict)  # every GPU plane, by name ("GPU:4")
    threads: dict[str, list[Interval]] = field(default_factory=dict)  # the host's launch threads' events, merged
    # (traces with a GPU: the launch facts are theirs alone)
    marker_names: set[str] = field(default_factory=set)  # the host step markers' names
    unrooted: bool = False  # some step marker lacks ``_r=1`` (Keras 3's "Profiled batch")
    iterator_calls: list[Interval] = field(default_factory=list)  # the input iterator's get-next calls, any thread
    functions: dict[str, list[Interval]] = field(default_factory=dict)  # tf.function calls from Python, by name
    # the host events with a step_num or tf_function_call stat, bookkeeping aside (the only ones xprof's copy may
    # mark as steps, see xprof.mark_steps), by plane and line index, each line's in its order
    marked: list[tuple[int, int, XEvent]] = field(default_factory=list)


@dataclass(frozen=True)
class Steps:
    """The steps a trace shows: their intervals, and how many training steps each holds."""

    markers: list[Interval]
    per_marker: float = 1.0  # steps_per_execution: training steps per marker
    source: str = "none"  # "host markers", "device steps", "inferred" or "none"
    found: str = ""  # how they were found, in words
    unrooted: bool = False  # markers xprof ignores unless given ``_r=1``
    function: str | None = None  # inferred steps: the tf.function whose executions they are

    @property
    def on_host(self) -> bool:
        return self.source in ("host markers", "inferred")


@dataclass(frozen=True)
class Timeline:
    """What the trace itself shows (see the module's docstring)."""

    capture_s: float = 0.0
    steps: Steps = field(default_factory=lambda: Steps([]))
    loops: bool = False
    window: Interval | None = None
    between_steps_input: float = 0.0  # of the time between steps, the stepping thread fetching the next batch
    input_wait_ms: float | None = None  # per step, the input iterator's calls inside the steps (waiting for input)
    ops_busy: float | None = None  # of the steps, the framework's ops running on a CPU
    input_ops: frozenset[str] = frozenset()
    device_ops: dict[str, DeviceOpTimes] = field(default_factory=dict)
    copies_ms: dict[str, float] = field(default_factory=dict)
    devices: tuple[DeviceEvents, ...] = ()  # every GPU plane, in the trace's order
    threads: dict[str, list[Interval]] = field(default_factory=dict)  # host launch threads, merged (GPU traces)
    error: str | None = None  # why the timeline could not be read (xprof's facts still stand)

    @property
    def markers(self) -> list[Interval]:
        return self.steps.markers

    @property
    def hints(self) -> StepHints:
        """What xprof's copy of the trace must say for xprof to find these steps."""
        return StepHints(hide_loops=self.loops, root_markers=self.steps.unrooted, step_function=self.steps.function)


def load(trace: Path) -> XSpace:
    """The trace's XSpace (raises whatever parsing the protobuf raises)."""
    from ..protos import xplane_pb2

    return xplane_pb2.XSpace.FromString(trace.read_bytes())


def deciding(plane: str, line: str) -> bool:
    """The lines that say which steps a trace has, and so what xprof's copy needs (all but a few traces): the
    host's threads but tf.data's (in an input-bound trace, nearly all of its events) and TF's op executors' (in
    a compute-bound one), and the GPUs' steps. Whether a TF while loop ran on the executors is asked of the
    start of their lines (``executors_loop``)."""
    if plane.startswith("/host"):
        return not line.startswith(("tf_data", *LAUNCH_THREADS))
    return line == "Steps"


def the_rest(plane: str, line: str) -> bool:
    return not deciding(plane, line)


def predicted_hints(space: XSpace, ev: Events) -> StepHints:
    """What xprof's copy of the trace will need, from the events of the deciding lines (and, where the steps are
    the host's, whether the executors' lines show a TF while loop early on: then ``ev.loops`` is set, as reading
    their lines would set it): the whole timeline's hints, unless the only step markers, loops or tf.function
    calls that count are on tf.data's threads, or a loop's first iteration on the executors comes late."""
    steps = find_steps(ev)
    if steps.on_host and not ev.loops:
        ev.loops = executors_loop(space)
    return StepHints(hide_loops=ev.loops and steps.on_host, root_markers=steps.unrooted, step_function=steps.function)


PROBED = 8  # executors_loop looks at the first 1/PROBED of each executor thread's events


def executors_loop(space: XSpace) -> bool:
    """Whether an event early on TF's op executors' threads (the first 1/``PROBED`` of each one's events, 1,000 at
    least) is a TF while loop's iteration, by ``read_events``'s rule: an ``iter_num`` above 0, on an event that is
    not a step marker or a tf.function call. A loop runs every step (``steps_per_execution`` > 1, an RNN), so its
    iterations show from the first step a capture holds; the lines are read in full in any case."""
    for plane in space.planes:
        if not plane.name.startswith("/host"):
            continue
        stat_names = {i: m.name for i, m in plane.stat_metadata.items()}
        loop_stat = next((i for i, name in stat_names.items() if name == "iter_num"), None)
        if loop_stat is None:
            continue
        function_stat = next((i for i, name in stat_names.items() if name == "tf_function_call"), None)
        not_loops = {i for i, name in stat_names.items() if name == "step_num"} | {function_stat} - {None}
        skipped = bookkeeping({i: m.name for i, m in plane.event_metadata.items()})
        for line in plane.lines:
            if not line.name.startswith(LAUNCH_THREADS):
                continue
            events = line.events
            for event in itertools.islice(events, max(1000, len(events) // PROBED)):
                if event.metadata_id in skipped:
                    continue
                for st in event.stats:
                    if st.metadata_id == loop_stat and (st.int64_value or st.uint64_value) > 0 and \
                            not_loops.isdisjoint(other.metadata_id for other in event.stats):
                        return True
    return False


_ITERATOR_CALL, _FETCH, _OP, _INPUT_OP = 1, 2, 4, 8  # what a host event is, by its name (_host_kinds)


def _host_kinds(names: dict[int, str]) -> dict[int, int]:
    """What each event name of a host plane makes an event (flags): the input iterator's get-next call; on the
    stepping thread, a wait for the next batch; on the executors' threads, a TF op (named "name:Type"; executor
    bookkeeping is not); on tf.data's threads, an input op."""
    kinds = {}
    for i, name in names.items():
        kind = _ITERATOR_CALL if name in ITERATOR_CALLS else 0
        kind |= _FETCH if "IteratorGetNext" in name else 0
        kind |= _OP if ":" in name else 0
        kind |= _INPUT_OP if name and not name.startswith(("Iterator::", "Threadpool", "Executor")) else 0
        if kind:
            kinds[i] = kind
    return kinds


def read_events(space: XSpace, only: Callable[[str, str], bool] | None = None, into: Events | None = None) -> Events:
    """Gather the events that matter from the trace's planes: those of the lines ``only(plane, line)`` keeps,
    added to ``into`` (the same events as one pass over every line, whatever the order of the passes)."""
    ev = Events() if into is None else into
    low, high = float("inf"), float("-inf")
    gpus = any(plane.name.startswith("/device:GPU:") for plane in space.planes)  # launch threads: GPU traces only
    for plane_index, plane in enumerate(space.planes):
        names = {i: m.name for i, m in plane.event_metadata.items()}
        stat_names = {i: m.name for i, m in plane.stat_metadata.items()}
        step_stats = {i for i, name in stat_names.items() if name == "step_num"}
        mark_stats = {i for i, name in stat_names.items() if name in ("step_num", "tf_function_call")}
        count_stat = next((i for i, name in stat_names.items() if name == "steps"), None)
        loop_stat = next((i for i, name in stat_names.items() if name == "iter_num"), None)
        root_stat = next((i for i, name in stat_names.items() if name == "_r"), None)
        function_stat = next((i for i, name in stat_names.items() if name == "tf_function_call"), None)
        counted = step_stats | mark_stats | {function_stat, loop_stat} - {None}  # stats that make an event count
        wanted = bool(counted)
        skipped = bookkeeping(names)  # none of them counts
        if plane.name == "Task Environment":
            stats = {stat_names.get(st.metadata_id): st.int64_value or st.uint64_value for st in plane.stats}
            if stats.get("profile_start_time") and stats.get("profile_stop_time"):
                ev.window = (stats["profile_start_time"], stats["profile_stop_time"])
        host = plane.name.startswith("/host")
        device = None
        if plane.name.startswith("/device:GPU:"):
            device = ev.devices.setdefault(plane.name, DeviceEvents(plane.name.removeprefix("/device:")))
        plane_ops: list[tuple[int, int, str]] = []
        kernels: list[tuple[int, int, str]] = []
        kinds = _host_kinds(names) if host else {}
        for line_index, line in enumerate(plane.lines):
            base, line_name = line.timestamp_ns * 1000, line.name  # read once: each read makes a Python object
            if only is not None and not only(plane.name, line_name):
                continue
            compute_thread = host and line_name.startswith(LAUNCH_THREADS)
            data_thread = host and line_name.startswith("tf_data")
            thread: list[Interval] | None = [] if compute_thread and gpus else None  # merged when the line is read
            line_ops: list[Interval] = []
            copy_line = "Memcpy" in line_name and "Compute" not in line_name
            # what makes an event an op of this line (its name, found once a plane, not once an event)
            taken = _OP if compute_thread else _INPUT_OP if data_thread else _FETCH
            for event in line.events:
                start = base + event.offset_ps
                end = start + event.duration_ps
                if start < low:
                    low = start
                if end > high:
                    high = end
                metadata_id = event.metadata_id
                if compute_thread:
                    span = (start, end)  # one tuple for the thread's span and, if it is one, the op's
                    if thread is not None:
                        thread.append(span)
                if host:
                    kind = kinds.get(metadata_id, 0)
                    if kind & _ITERATOR_CALL:
                        ev.iterator_calls.append((start, end))
                    # the trace's hot loop (a stat read is a Python object made): an event's stats are gathered
                    # only where one of them counts here; most events have none (83% of a Keras 3 trace's Python
                    # thread's 600,000), most of the others only the executors' bookkeeping, and making a dict of
                    # each event's stats took half the read
                    stats = None
                    raw = event.stats if wanted and metadata_id not in skipped else None
                    if raw:
                        for st in raw:
                            if st.metadata_id in counted:
                                stats = {other.metadata_id: other for other in raw}
                                break
                    if stats is not None:
                        if mark_stats and not mark_stats.isdisjoint(stats):
                            ev.marked.append((plane_index, line_index, event))
                        name = names.get(metadata_id, "")
                        if step_stats and not step_stats.isdisjoint(stats):
                            ev.host_steps.append((start, end))
                            count = stats.get(count_stat)
                            ev.marker_steps.append((count.int64_value or count.uint64_value) if count is not None
                                                   else 0)
                            ev.marker_names.add(name)
                            ev.unrooted |= root_stat not in stats
                            continue
                        if function_stat in stats:
                            ev.functions.setdefault(name, []).append((start, end))
                            continue
                        # an op: its loop iteration, if any, is counted too (executors_loop's rule)
                        if not ev.loops and (loop := stats.get(loop_stat)) is not None and (
                                loop.int64_value or loop.uint64_value) > 0:
                            ev.loops = True
                    if kind & taken:
                        if taken is _FETCH:
                            ev.fetches.append((start, end))
                        elif taken is _OP:
                            line_ops.append(span)
                        else:
                            ev.input_ops.add(names[metadata_id].split(":")[0])
                    continue
                name = names.get(metadata_id, "")
                if line_name == "Steps":
                    ev.device_steps.setdefault(plane.name, []).append((start, end))
                    if device is not None:
                        device.steps.append((start, end))
                elif line_name == "TensorFlow Ops":
                    plane_ops.append((start, end, name))
                elif name.startswith("Memcpy") or copy_line:
                    # the event's own name first: one stream's line may carry several kinds of copy
                    kind = copy_kind(name, line_name) or "other"
                    ms = event.duration_ps / 1e9
                    ev.copies_ms[kind] = ev.copies_ms.get(kind, 0.0) + ms
                    if device is not None:
                        device.copies_ms[kind] = device.copies_ms.get(kind, 0.0) + ms
                elif line_name.startswith("Stream"):
                    kernels.append((start, end, name))
                    if device is not None:
                        device.kernels.append((start, end))
            # only their union is used: a line's (most of a compute-bound trace's events) is not held in full
            if thread is not None:
                ev.threads.setdefault(line_name, []).extend(merge(thread))
            ev.ops.extend(merge(line_ops))
        _attach_kernels(sorted(plane_ops), kernels, ev.device_ops)
    if high >= low:
        ev.low = int(low) if ev.low is None else min(ev.low, int(low))
        ev.high = int(high) if ev.high is None else max(ev.high, int(high))
    return ev


def find_steps(ev: Events) -> Steps:
    """The steps: the host's step markers, else the busiest device's own ``Steps`` line, else the executions
    of the tf.function the Python thread spends most time in (see the module's docstring)."""
    if ev.host_steps:
        markers = merge(ev.host_steps)
        names = ", ".join(f"'{n}'" for n in sorted(ev.marker_names))
        found = f"step markers ({names}" + (", without _r=1)" if ev.unrooted else ")")
        per_marker, counted = _steps_per_marker(ev, markers)
        if counted:
            found += f"; {per_marker:.0f} steps per marker, counted from the input iterator's calls in the while loop"
        return Steps(markers, per_marker, "host markers", found, ev.unrooted)
    device = max(ev.device_steps.values(), key=len, default=[])
    if device:
        return Steps(merge(device), 1.0, "device steps", "the GPU's own steps line")
    calls = {name: spans for name, spans in ev.functions.items() if len(spans) >= MIN_CALLS}
    if calls:
        name = max(calls, key=lambda n: sum(b - a for a, b in calls[n]))
        return Steps(merge(calls[name]), 1.0, "inferred",
                     f"inferred: no step markers; each of the {len(calls[name])} executions of tf.function '{name}' "
                     "taken for a step", function=name)
    return Steps([], 1.0, "none", "no step markers, no device steps, no repeated tf.function")


def _steps_per_marker(ev: Events, markers: list[Interval]) -> tuple[float, bool]:
    """Training steps per merged marker, and whether they were counted from the iterator's calls: the markers'
    ``steps`` stat where any has one; else, where a while loop ran, the iterator's calls in each marker."""
    if any(ev.marker_steps):
        stated = [0] * len(markers)
        for (start, _), steps in zip(ev.host_steps, ev.marker_steps, strict=True):
            i = bisect.bisect_right(markers, (start, float("inf"))) - 1
            stated[i] = max(stated[i], steps)
        return statistics.fmean(s or 1 for s in stated), False
    if not ev.loops or not ev.iterator_calls:
        return 1.0, False
    starts = sorted(a for a, _ in ev.iterator_calls)
    counts = [bisect.bisect_left(starts, b) - bisect.bisect_left(starts, a) for a, b in markers]
    if statistics.median(counts) <= 1:
        return 1.0, False
    return statistics.fmean(max(1, c) for c in counts), True


def timeline(ev: Events) -> Timeline:
    """The timeline of the events gathered from every line of a trace."""
    steps = find_steps(ev)
    markers = steps.markers
    gaps = [(a[1], b[0]) for a, b in itertools.pairwise(markers) if b[0] > a[1]]
    host_marked = steps.on_host
    calls = merge(ev.iterator_calls)
    stepped = len(markers) * steps.per_marker
    return Timeline(
        capture_s=(ev.high - ev.low) / 1e12 if ev.low is not None and ev.high is not None else 0.0, steps=steps,
        loops=ev.loops and host_marked, window=ev.window,
        between_steps_input=covered(merge(ev.fetches), gaps) if gaps and ev.fetches else 0.0,
        input_wait_ms=covered(calls, markers) * sum(b - a for a, b in markers) / 1e9 / stepped
        if markers and calls else None,
        ops_busy=covered(merge(ev.ops), markers) if host_marked and ev.ops else None,
        input_ops=frozenset(ev.input_ops), device_ops=ev.device_ops, copies_ms=ev.copies_ms,
        devices=tuple(ev.devices.values()), threads={name: merge(spans) for name, spans in ev.threads.items() if spans})


def _attach_kernels(plane_ops: list[tuple[int, int, str]], kernels: list[tuple[int, int, str]],
                    device_ops: dict[str, DeviceOpTimes]) -> None:
    """Add a device plane's TF ops (replicas merged) and each kernel to the op whose span holds its start."""
    starts = [o[0] for o in plane_ops]
    for start, end, name in plane_ops:
        kind = op_type(name)
        op = device_ops.setdefault(kind, DeviceOpTimes(kind))
        op.ms += (end - start) / 1e9
        op.ops.add(name.split("/", 1)[-1] if name.startswith("replica_") else name)
    for start, end, kernel in kernels:
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and plane_ops[i][1] >= start:
            op = device_ops[op_type(plane_ops[i][2])]
            op.kernels[kernel] = op.kernels.get(kernel, 0.0) + (end - start) / 1e9


def op_type(name: str) -> str:
    """The TF op type of a device op event (``replica_4/bert/.../einsum/Einsum:Einsum`` → ``Einsum``)."""
    return name.rpartition(":")[2] or name


def merge(intervals: list[Interval]) -> list[Interval]:
    """The intervals merged where they overlap, sorted."""
    if not intervals:
        return []
    ordered = sorted(intervals)
    merged: list[Interval] = []
    low, high = ordered[0]
    for start, end in ordered:
        if start > high:
            merged.append((low, high))
            low, high = start, end
        elif end > high:
            high = end
    merged.append((low, high))
    return merged


def covered(busy: list[Interval], windows: list[Interval]) -> float:
    """Share of the windows' time that the busy intervals cover (both merged and sorted)."""
    total = sum(b - a for a, b in windows)
    done, i = 0, 0
    for start, end in windows:
        while i < len(busy) and busy[i][1] <= start:
            i += 1
        j = i
        while j < len(busy) and busy[j][0] < end:
            done += min(end, busy[j][1]) - max(start, busy[j][0])
            j += 1
    return done / total if total else 0.0
