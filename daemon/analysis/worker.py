"""One worker's trace: xprof's per-step breakdown and ops, the timeline's steps and ratios, the verdict.

The step breakdown is xprof's own: the per-step event-type times it stores in its OpStats, grouped as its
input-pipeline analysis groups them (``op_stats_to_input_pipeline_analysis.cc``). The parts add up to the
step.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .classify import STRAGGLER, conclude, evidence, versus_xprof
from .memory import needed_memory, refuse
from .model import (
    DEVICE_PARTS,
    PART_TYPES,
    BetweenSteps,
    DeviceAnalysis,
    KernelTime,
    LaunchFacts,
    Ops,
    OpTime,
    Ratios,
    StepParts,
    StepTime,
    WorkerAnalysis,
)
from .timeline import (
    DeviceEvents,
    Events,
    Interval,
    Steps,
    Timeline,
    covered,
    deciding,
    load,
    merge,
    predicted_hints,
    read_events,
    the_rest,
    timeline,
)
from .xprof import (
    AnalysisError,
    StepHints,
    converter,
    host_of,
    mark_steps,
    num,
    private_session,
    quiet,
    rows,
    steps_from_opstats,
    steps_from_table,
    tool,
)

if TYPE_CHECKING:
    from ..protos.xplane_pb2 import XSpace

JUNK = ("", "dummy", "(null)", "None", "null")  # rows xprof fills with placeholders, not ops
STRETCHED = 1.5  # xprof's mean step over the markers' mean: its steps span the time between the markers too
BEGIN_SLACK_PS = 1_000_000  # xprof's step begins (float ms) against the markers' (ps): 1 µs of rounding


def _junk(name: Any) -> bool:
    return name is None or str(name).split(":")[0].strip() in JUNK


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def ops_per_step(op_stats: list[dict[str, Any]], pipeline: list[dict[str, Any]], kernels: dict[str, Any],
                 line: Timeline, steps: int) -> Ops:
    """Top input-pipeline, host and device ops by self time per step (``ms_total``: in the whole capture).

    Input: tf.data's iterators, and host ops that ran on tf.data's threads (functions in ``map``). Device:
    the trace's device ops with the kernels each launched; xprof's kernel table where the trace has none.
    """
    per = max(steps, 1)

    def entry(name: Any, ms: float, **more: Any) -> OpTime:
        return OpTime(name=str(name), ms_per_step=ms / per, ms_total=ms, **more)

    table = [o for o in (rows(op_stats[1]) if len(op_stats) > 1 else [])
             if o.get("type") != "IDLE" and not _junk(o.get("operation"))]
    host = sorted((o for o in table if o.get("host_or_device") == "Host"), key=lambda o: -num(o.get("total_self_time")))
    in_data = [o for o in host if str(o.get("operation")).split(":")[0] in line.input_ops]
    iterators = [entry(o.get("opName"), num(o.get("selfTimeInMs")), category=_text(o.get("category")))
                 for o in (rows(pipeline[2]) if len(pipeline) > 2 else []) if not _junk(o.get("opName"))]
    inputs = sorted(iterators + [entry(o.get("operation"), num(o.get("total_self_time")) / 1000,
                                       category="tf.data function") for o in in_data],
                    key=lambda o: -o.ms_total)[:8]
    hosts = [entry(o.get("operation"), num(o.get("total_self_time")) / 1000, type=_text(o.get("type")))
             for o in host if o not in in_data and not str(o.get("operation")).startswith("Iterator::")][:8]
    device = [entry(op.name, op.ms, instances=len(op.ops), kernels=tuple(
        KernelTime(kernel=k[:160], ms_per_step=ms / per, ms_total=ms)
        for k, ms in sorted(op.kernels.items(), key=lambda kv: -kv[1])[:3]))
        for op in sorted(line.device_ops.values(), key=lambda op: -op.ms) if not _junk(op.name)][:8]
    if not device:
        device = [entry(k.get("kernel_name"), num(k.get("total_duration_us")) / 1000, op=_text(k.get("op_name")),
                        tensor_core=bool(k.get("is_kernel_using_tensor_core")))
                  for k in sorted(rows(kernels) if isinstance(kernels, dict) else [],
                                  key=lambda k: -num(k.get("total_duration_us")))
                  if not _junk(k.get("kernel_name"))][:8]
    return Ops(input=tuple(inputs), host=tuple(hosts), device=tuple(device))


def analyze_worker(trace: Path, verbose: bool = False, max_memory: int | None = None) -> WorkerAnalysis:
    """The facts of one worker's trace, and what bound its steps; raises TooLarge (memory.py) if its analysis
    would need more than ``max_memory`` bytes."""
    try:
        size = trace.stat().st_size
    except OSError as exc:
        raise AnalysisError(f"cannot read {trace}: {exc.strerror}") from None
    if size < 1024:
        raise AnalysisError(f"{trace.name} is {size} bytes: an empty trace (the process was idle)")
    line, (overview, pipeline, op_stats, kernels, steps) = _read(trace, verbose, max_memory)
    if steps is None:
        steps = steps_from_table(pipeline)
    steps = _within_markers(steps, line)
    per_marker = line.steps.per_marker  # xprof's steps are the markers: one execution of N steps each
    if per_marker > 1:
        steps = [{k: (v if k == "begin_ms" else v / per_marker) for k, v in s.items()} for s in steps]
    props = overview[1].get("p", {}) if len(overview) > 1 else {}
    count = round(len(steps) * per_marker)
    w = WorkerAnalysis(host=host_of(trace), trace=str(trace), bottleneck="unknown", why="", summary="",
                       recommendation="", hardware=str(props.get("hardware_type", "")), steps=count,
                       capture_seconds=line.capture_s, window=line.window,
                       xprof_conclusion=str(props.get("input_conclusion", "")),
                       executions=len(steps) if per_marker > 1 else None, loops_hidden=line.loops,
                       steps_found=line.steps.found, steps_inferred=line.steps.source == "inferred",
                       ops=ops_per_step(op_stats, pipeline, kernels, line, count), copies_ms=dict(line.copies_ms))
    times = [s["step_ms"] for s in steps]
    mean = statistics.fmean(times) if times else 0.0
    if mean > 0:  # steps of no length (markers with no duration) time nothing
        breakdown_ms = StepParts(**{part: statistics.fmean(s[part] for s in steps) for part in PART_TYPES})
        if line.loops:
            breakdown_ms = _waits_in_loops(breakdown_ms, line.input_wait_ms)
        breakdown = breakdown_ms.scaled(1 / mean)
        w = replace(w, step_time_ms=StepTime(mean, statistics.pstdev(times), min(times), max(times)),
                    breakdown_ms=breakdown_ms, breakdown=breakdown,
                    input_bound_ratio=breakdown.input_wait + breakdown.host_to_device)
    w = replace(w, ratios=_ratios(w, steps, line))
    if w.step_time_ms is not None:
        between = w.ratios.between_steps or 0.0
        measured = _start_to_start_ms(steps, per_marker)  # the steps xprof kept, not the markers it left out
        if measured is not None:  # a step and the time after it
            cycle = max(mean, measured)
        else:
            cycle = mean / (1 - between) if between < 1 else mean
        gap = cycle - mean
        w = replace(w, cycle_ms=cycle, between_ms=BetweenSteps(gap * w.ratios.between_steps_input,
                                                               gap * (1 - w.ratios.between_steps_input)))
    w = replace(w, evidence=evidence(count, _span_share(steps, line), line.capture_s), **_devices(line))
    verdict, summary = conclude(w)
    if len(w.devices) > 1 and w.idle_devices:
        summary += f"; {len(w.idle_devices)} of {len(w.devices)} GPUs ran no kernels ({', '.join(w.idle_devices)})"
    if line.error is not None:
        summary += (f"; the trace's timeline could not be read ({line.error[:200]}): steps and their parts come "
                    "from xprof's tables alone")
    return replace(w, bottleneck=verdict.kind, why=verdict.why, summary=summary, timeline_error=line.error,
                   recommendation=verdict.recommendation, xprof_differs=versus_xprof(w, verdict.kind))


def _marked(steps: list[dict[str, float]], line: Timeline) -> list[Interval] | None:
    """The step marker each of xprof's steps begins in, in order (xprof leaves out the first and last markers
    of a capture, and on a GPU begins a step where its device work does, inside its marker); None where a
    step begins in no marker or in the one before it took, or the steps came without their begins."""
    markers = line.markers
    starts = [a for a, _ in markers]
    found: list[int] = []
    for step in steps:
        at = step["begin_ms"] * 1e9
        i = bisect.bisect_right(starts, at + BEGIN_SLACK_PS) - 1
        if i < 0 or at > markers[i][1] + BEGIN_SLACK_PS or (found and i <= found[-1]):
            return None
        found.append(i)
    return [markers[i] for i in found]


def _within_markers(steps: list[dict[str, float]], line: Timeline) -> list[dict[str, float]]:
    """xprof's steps, each cut to its step marker where xprof stretched them over the time between markers.

    On a GPU, xprof's step runs from the start of one step's device work to the next one's: a JAX job on an
    H100 that makes each batch in NumPy between its 14 ms markers got steps of 650, 652 and 3.8 ms, the time
    between steps counted once inside them (as 'all others') and again between the markers. Then each step is
    its marker: xprof's device and input parts (scaled down if they overflow it), and the rest of it 'other'.
    Steps xprof did not stretch (its steps are the markers, as on every CPU trace) are left as they are.
    """
    marked = _marked(steps, line) if len(steps) >= 2 else None
    if marked is None:
        return steps
    durations = [(b - a) / 1e9 for a, b in marked]
    if statistics.fmean(s["step_ms"] for s in steps) <= STRETCHED * statistics.fmean(durations):
        return steps
    out = []
    for step, (begin, _), ms in zip(steps, marked, durations, strict=True):
        parts = {p: step[p] for p in PART_TYPES if p != "other"}
        total = sum(parts.values())
        scale = min(1.0, ms / total) if total > 0 else 1.0
        out.append({**step, **{p: v * scale for p, v in parts.items()}, "begin_ms": begin / 1e9, "step_ms": ms,
                    "other": ms - total * scale})
    return out


def _start_to_start_ms(steps: list[dict[str, float]], per_marker: float) -> float | None:
    """Per step, from the first of xprof's steps to begin to the last one (None without their begins)."""
    begins = [s["begin_ms"] for s in steps]
    if len(begins) < 2 or any(b >= c for b, c in itertools.pairwise(begins)):
        return None
    return (begins[-1] - begins[0]) / (len(begins) - 1) / per_marker


Tables = tuple[Any, Any, Any, Any, list[dict[str, float]] | None]  # xprof's four tools, and its OpStats' steps


def _read(trace: Path, verbose: bool, max_memory: int | None = None) -> tuple[Timeline, Tables]:
    """The trace's timeline, and xprof's tables from the copy the timeline asks for.

    The lines that decide the steps are read first: they say which copy xprof needs, and where it must be
    rewritten (step markers and tf.function calls), the copy is made from the parsed trace then. xprof converts
    it while a thread reads the other lines (xprof's conversion releases the GIL); where the whole timeline asks
    for another copy after all (steps, loops or tf.function calls found only on tf.data's threads, or events to
    mark there), xprof converts that one again. The trace is refused (TooLarge) once parsed, before xprof starts,
    if its analysis would need more than ``max_memory`` bytes."""
    converter()  # imported first: an import holds the GIL, and would hold up xprof's start behind the timeline
    try:
        space = load(trace)
    except Exception as exc:  # an unreadable timeline must not hide what xprof could read (or say what is wrong)
        return _failed(exc), _tables(trace, StepHints(), verbose)
    if max_memory is not None:
        refuse(trace, needed_memory(space), max_memory)
    try:
        ev = read_events(space, only=deciding)
        hints = predicted_hints(space, ev)
    except Exception as exc:  # an unreadable timeline must not hide what xprof could read
        return _failed(exc), _tables(trace, StepHints(), verbose)
    with (private_session(trace, hints, parsed=True) as linked,
          ThreadPoolExecutor(1, thread_name_prefix="tfprofd-timeline") as pool):
        if hints.needed:
            # in place, and the other lines read the same after it: the loop ids it hides are found already
            # (ev.loops), the events it marks are the deciding lines' (read), the stats it adds on no other events
            mark_steps(space, hints, ev.marked)
            linked.write_bytes(space.SerializeToString())
        read = pool.submit(_rest, space, ev)
        del space, ev  # the thread's alone: freed when it is done
        tables = _convert(linked, verbose)
        line, marks_elsewhere = read.result()
    if line.error is None and (line.hints != hints or (hints.needed and marks_elsewhere)):
        tables = _tables(trace, line.hints, verbose)
    return line, tables


def _failed(exc: Exception) -> Timeline:
    return Timeline(steps=Steps([]), error=f"{type(exc).__name__}: {exc}")


def _rest(space: XSpace, ev: Events) -> tuple[Timeline, bool]:
    """The timeline, once the lines not read yet are; and whether they hold events xprof's copy may mark."""
    marked = len(ev.marked)
    try:
        return timeline(read_events(space, only=the_rest, into=ev)), len(ev.marked) > marked
    except Exception as exc:  # an unreadable timeline must not hide what xprof could read
        return _failed(exc), False


def _tables(trace: Path, hints: StepHints, verbose: bool) -> Tables:
    """xprof's four tools' data for the trace (its copy as ``hints`` say), and the steps of its OpStats."""
    with private_session(trace, hints) as linked:
        return _convert(linked, verbose)


def _convert(linked: Path, verbose: bool) -> Tables:
    """xprof's four tools' data for the trace in a private session, and the steps of its OpStats."""
    with quiet(verbose) as log_tail:
        try:
            tables = tuple(tool(linked, name) for name in ("overview_page", "input_pipeline_analyzer",
                                                           "framework_op_stats", "kernel_stats"))
        except AnalysisError as exc:
            raise AnalysisError(f"{exc}{'; xprof said: ' + log_tail[-1] if log_tail else ''}") from None
        return (*tables, steps_from_opstats(linked.parent))


def _waits_in_loops(parts: StepParts, input_wait_ms: float | None) -> StepParts:
    """The step's parts with the input iterator's waits inside a while loop (steps_per_execution > 1) counted as
    waiting for input: xprof counts them as host compute there. The time moves from host compute, then from
    "all others"; the parts still add up to the step."""
    missing = (input_wait_ms or 0.0) - parts.input_wait
    if missing <= 0:
        return parts
    from_compute = min(missing, parts.host_compute)
    from_other = min(missing - from_compute, parts.other)
    return replace(parts, input_wait=parts.input_wait + from_compute + from_other,
                   host_compute=parts.host_compute - from_compute, other=parts.other - from_other)


def _span_share(steps: list[dict[str, float]], line: Timeline) -> float | None:
    """Share of the capture from the first step's start to the last one's end (None if unknown)."""
    if not steps or not line.capture_s:
        return None
    if line.markers:
        span_s = (line.markers[-1][1] - line.markers[0][0]) / 1e12
    else:  # xprof's own step begins, on its own clock
        span_s = (steps[-1]["begin_ms"] + steps[-1]["step_ms"] - steps[0]["begin_ms"]) / 1000
    return min(1.0, span_s / line.capture_s)


def _in(intervals: list[Interval], windows: list[Interval]) -> list[Interval]:
    """The intervals that start within one of the (merged, sorted) windows."""
    starts = [a for a, _ in windows]
    out = []
    for iv in intervals:
        i = bisect.bisect_right(starts, iv[0]) - 1
        if i >= 0 and iv[0] < windows[i][1]:
            out.append(iv)
    return out


def _device(d: DeviceEvents) -> DeviceAnalysis:
    steps = merge(d.steps)
    return DeviceAnalysis(name=d.name, steps=len(steps),
                          step_ms=statistics.fmean(b - a for a, b in steps) / 1e9 if steps else None,
                          busy=covered(merge(d.kernels), steps) if steps and d.kernels else (0.0 if steps else None),
                          kernels=len(d.kernels), copies_ms=dict(d.copies_ms))


def _launch(d: DeviceEvents, line: Timeline) -> LaunchFacts | None:
    """The host thread that runs most of the GPU's steps, and the kernels it launched in them."""
    windows = merge(d.steps)
    kernels = _in(d.kernels, windows)
    if not windows or not kernels or not line.threads:
        return None
    thread, busy = max(((name, covered(spans, windows)) for name, spans in line.threads.items()),
                       key=lambda kv: kv[1])
    return LaunchFacts(device=d.name, thread=thread, thread_busy=busy, kernels_per_step=len(kernels) / len(windows),
                       mean_kernel_us=sum(b - a for a, b in kernels) / len(kernels) / 1e6,
                       gpu_private=any(name.startswith("tf_gpu_private") for name in line.threads))


def _devices(line: Timeline) -> dict[str, Any]:
    """Each GPU (step, busy, idle, copies), those that ran nothing, a straggling one, and the launch thread
    of the GPU with the longest steps."""
    devices = [_device(d) for d in line.devices]
    timed = sorted((d for d in devices if d.step_ms is not None and d.kernels), key=lambda d: -(d.step_ms or 0.0))
    lead = next((d for d in line.devices if timed and d.name == timed[0].name), None)
    out: dict[str, Any] = {"devices": tuple(devices), "idle_devices": tuple(d.name for d in devices if not d.kernels),
                           "launch": _launch(lead, line) if lead is not None else None}
    if len(devices) < 2:
        return out
    parts = []
    for d in timed:
        copies = "; copies " + ", ".join(f"{k} {ms:.1f} ms" for k, ms in sorted(d.copies_ms.items())) \
            if d.copies_ms else ""
        parts.append(f"{d.name} {d.step_ms:.1f} ms per step ({d.steps} step{'' if d.steps == 1 else 's'}; kernels "
                     f"busy {d.busy or 0.0:.0%}, idle {d.idle or 0.0:.0%}{copies})")
    ran = sum(1 for d in devices if d.kernels)
    text = f"{len(devices)} GPUs, {ran} ran kernels" + (": " + ", ".join(parts) if parts else "")
    idle = [d.name + (" (copies only)" if d.copies_ms else "") for d in devices if not d.kernels]
    if idle:
        text += f"; idle (no kernels): {', '.join(idle)}"
    if len(timed) >= 2:
        slowest, others = timed[0], [d.step_ms or 0.0 for d in timed[1:]]
        median = statistics.median(others)
        ratio = (slowest.step_ms or 0.0) / median - 1 if median else 0.0
        if ratio >= STRAGGLER - 1:
            out["straggling_device"] = slowest.name
            text += (f"; {slowest.name} straggles: {slowest.step_ms:.1f} ms per step against {median:.1f} ms on the "
                     f"others (+{ratio:.0%})")
        else:
            text += (f"; no straggling GPU ({slowest.name}'s steps are {ratio:.0%} longer than the others' "
                     f"{median:.1f} ms, under {STRAGGLER - 1:.0%})")
    out["devices_summary"] = text
    return out


def _ratios(w: WorkerAnalysis, steps: list[dict[str, float]], line: Timeline) -> Ratios:
    """Ratios that are not parts of the step: time between steps, coverage, device idle, op activity."""
    markers = line.markers
    between: float | None = None
    if len(markers) >= 2:
        span = markers[-1][1] - markers[0][0]
        between = 1 - sum(b - a for a, b in markers) / span if span else None
    elif len(steps) >= 2:  # no markers in the timeline: xprof's own step begins, on its own clock
        span_ms = steps[-1]["begin_ms"] + steps[-1]["step_ms"] - steps[0]["begin_ms"]
        between = 1 - sum(s["step_ms"] for s in steps) / span_ms if span_ms > 0 else None
    cover = None
    if line.capture_s and steps:
        stepping_ms = sum(s["step_ms"] for s in steps) * line.steps.per_marker
        cover = min(1.0, stepping_ms / 1000 / line.capture_s)
    idle = None
    if w.breakdown is not None and w.hardware not in ("CPU_ONLY", ""):
        idle = max(0.0, 1 - sum(w.breakdown[p] for p in DEVICE_PARTS))
    return Ratios(between_steps=between, between_steps_input=line.between_steps_input, steps_cover=cover,
                  device_idle=idle, ops_busy=line.ops_busy)
