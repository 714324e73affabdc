"""Capture analysis: read ``.xplane.pb`` traces headlessly with xprof and say what bound the training step.

For each worker's trace (one ``<host>.xplane.pb`` per worker in a run directory):

- the step breakdown is xprof's own: the per-step event-type times it stores in its OpStats, grouped
  as its input-pipeline analysis groups them (``op_stats_to_input_pipeline_analysis.cc``): waiting for
  input, host-to-device, device compute, device-to-device, collectives, host compute, kernel launch,
  compile, output, and "all others". The parts add up to the step.
- the timeline (this module reads the trace itself): the capture's span, the steps' span and the time
  between steps, and on CPU-only traces how much of each step the framework's ops actually run.
- ops: the top host and input-pipeline ops, and device ops with their GPU kernels.

Then it names the bottleneck in the order the seed guides investigate (input, time between steps,
host-side launch and overhead, transfers, the device), compares with the job's baseline when there is
one, and names a straggler among several workers. xprof runs in a private session directory with the
trace linked in, so its cache never lands in (or is read from) the user's folders.

Runs in its own process (``python -m tfprofd.daemon.analysis PATH --json``): xprof needs 200-450 MB
the agent must not hold.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The parts of a step, with xprof's EventType numbers (xprof/utils/event_span.h) as its input-pipeline
# analysis groups them. Types it leaves out of every part (pre/post-processing, batching, runtime,
# host-to-host) count in "other", with the time no event covers.
PART_TYPES: dict[str, tuple[int, ...]] = {
    "input_wait": (110,), "host_to_device": (80, 170), "device_compute": (140, 150), "device_to_device": (120, 160),
    "device_collectives": (100,), "host_compute": (10,), "kernel_launch": (90,), "compile": (60,),
    "output": (130,), "other": (0,)}
PART_WORDS = {"input_wait": "waiting for input", "host_to_device": "copying to the device",
              "device_compute": "device compute", "device_to_device": "device-to-device copies",
              "device_collectives": "collectives (all-reduce)", "host_compute": "host compute",
              "kernel_launch": "kernel launches", "compile": "compilation", "output": "output to the host",
              "other": "all others (untraced host time: Python, I/O, waiting)",
              "between_steps_input": "between steps fetching the next batch",
              "between_steps_other": "between steps (callbacks, post-processing)"}
DEVICE_PARTS = ("device_compute", "device_to_device", "device_collectives", "host_to_device", "output")

# Thresholds, all shares of time, so no verdict hinges on the machine's speed.
INPUT_BOUND = 0.20  # xprof's "highly input-bound"
TRANSFER = 0.10  # host-to-device copies in the step
BETWEEN_STEPS = 0.30  # of the stepping span spent between steps (callbacks, post-processing)
KERNEL_LAUNCH = 0.15  # xprof's "highly kernel-launch bound"
ALL_OTHERS = 0.15  # xprof's "highly all-others bound"
DEVICE_BUSY = 0.50  # the device computes at least half the step
OPS_BUSY = 0.50  # on a CPU, the framework's ops run at least half the step
STRAGGLER = 1.10  # a worker whose steps are 10% slower than the others' median

RECOMMENDATIONS = {
    "input": "Make the input pipeline keep up: dataset.map(..., num_parallel_calls=tf.data.AUTOTUNE), "
             ".prefetch(tf.data.AUTOTUNE), interleave reads of several files, cache decoded data, and filter or "
             "preprocess records offline instead of reading data only to drop it.",
    "host": "Cut the host time around each step: run callbacks and post-processing every N steps or move them "
            "into the graph (tf.function, Keras metrics); for kernel-launch latency set "
            "TF_GPU_THREAD_MODE=gpu_private and fuse ops with XLA (jit_compile=True).",
    "transfer": "Overlap host-to-device copies with compute: prefetch to the GPU "
                "(tf.data.experimental.prefetch_to_device), send fewer, larger transfers, and do preprocessing on "
                "the GPU so less data crosses PCIe.",
    "device": "The device is busy computing: speed up the model itself with mixed precision "
              "(keras.mixed_precision.set_global_policy('mixed_float16')), XLA, and Tensor Core-friendly shapes "
              "(multiples of 8); the top device ops below are where to start.",
    "small_batch": "Each step is mostly fixed per-step overhead, not computation: the batch is too small to keep the "
                   "device busy. Increase the batch size (scaling the learning rate) or steps_per_execution.",
    "unknown": "Capture again while the job trains, with step markers (TfprofdCallback, or "
               "tf.profiler.experimental.Trace('train', step_num=n, _r=1) around each step of a custom loop).",
}


class AnalysisError(Exception):
    """The trace could not be analysed (unreadable, corrupt or truncated)."""


# ---- finding traces, and running xprof quietly in a private session ----

def find_traces(path: Path) -> list[Path]:
    """The traces of one capture: the file itself, or every ``.xplane.pb`` of the newest run directory."""
    if not path.exists():
        raise AnalysisError(f"{path} does not exist")
    if path.is_file():
        return [path]
    traces = [p for p in path.glob("**/*.xplane.pb") if p.is_file()]
    if not traces:
        raise AnalysisError(f"no .xplane.pb under {path}")
    newest_run = max({t.parent for t in traces}, key=lambda d: (max(t.stat().st_mtime for t in d.glob("*.xplane.pb")),
                                                                 d.name))
    return sorted(t for t in traces if t.parent == newest_run)


def host_of(trace: Path) -> str:
    return trace.name.removesuffix(".xplane.pb")


@contextlib.contextmanager
def quiet(verbose: bool) -> Iterator[list[str]]:
    """Send xprof's C++ logging (written to the process's stdout and stderr) to a file; its tail is kept
    for error messages."""
    tail: list[str] = []
    if verbose:
        yield tail
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield tail
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sink.seek(max(0, sink.seek(0, 2) - 4000))
            tail.extend(sink.read().decode(errors="replace").splitlines()[-5:])


@contextlib.contextmanager
def private_session(trace: Path, hide_loops: bool = False) -> Iterator[Path]:
    """A fresh directory holding only a link to the trace: xprof caches per directory, so a folder of
    several traces would give every one the first one's answers, and the user's folder stays as it was.

    ``hide_loops``: hold a copy instead, without the loop-iteration ids of TensorFlow's executor events.
    Where a trace has any TF while loop (Keras's steps_per_execution > 1 runs its steps in one, and so do
    some models), xprof takes every loop iteration for a step and ignores the step markers, finding no
    steps at all; without those ids it groups the trace by its step markers."""
    with tempfile.TemporaryDirectory(prefix="tfprofd-analysis-") as tmp:
        linked = Path(tmp) / trace.name
        if hide_loops:
            linked.write_bytes(_without_loop_ids(trace.read_bytes()))
        else:
            linked.symlink_to(trace.resolve())
        yield linked


def _without_loop_ids(data: bytes) -> bytes:
    """The trace with its ``iter_num`` stat renamed (every event and value is kept)."""
    from .protos import xplane_pb2

    space = xplane_pb2.XSpace.FromString(data)
    for plane in space.planes:
        for meta in plane.stat_metadata.values():
            if meta.name == "iter_num":
                meta.name = "iter_num_hidden_by_tfprofd"
    return space.SerializeToString()


def _tool(trace: Path, tool: str) -> Any:
    from xprof.convert import raw_to_tool_data

    try:
        data, _ = raw_to_tool_data.xspace_to_tool_data([str(trace)], tool, {})
    except Exception as exc:  # xprof raises plain exceptions for some corrupt protobufs
        raise AnalysisError(f"cannot analyse {trace.name}: not a readable profile, corrupt or truncated "
                            f"({tool}: {exc})") from None
    if not data:
        if tool == "kernel_stats":
            return {}
        raise AnalysisError(f"cannot analyse {trace.name}: not a readable profile, corrupt or truncated "
                            f"({tool} returned nothing)")
    return json.loads(data)


def _rows(table: dict[str, Any]) -> list[dict[str, Any]]:
    ids = [c.get("id") for c in table.get("cols", [])]
    return [dict(zip(ids, (cell.get("v") if cell else None for cell in row["c"]), strict=False))
            for row in table.get("rows", [])]


def _num(value: Any) -> float:
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


# ---- steps: xprof's per-step breakdown ----

def steps_from_opstats(session_dir: Path) -> list[dict[str, float]] | None:
    """Per step: its duration and parts in ms, from the OpStats xprof wrote (None if it wrote none)."""
    from xprof.protobuf import op_stats_pb2, steps_db_pb2

    path = session_dir / "ALL_HOSTS.op_stats_v2.pb"
    if not path.exists():
        return None
    stats = op_stats_pb2.OpStats.FromString(path.read_bytes())
    steps = []
    for step in stats.step_db.step_sequence:
        infos = [info for _, info in sorted(step.step_info_per_core.items())]
        if not infos:
            continue
        info = infos[0]  # generic hardware keeps every step under one core
        breakdown = steps_db_pb2.GenericStepBreakdown()
        if not info.step_breakdown.Unpack(breakdown):
            continue
        row = {"begin_ms": info.begin_ps / 1e9, "step_ms": info.duration_ps / 1e9}
        accounted = 0.0
        for part, types in PART_TYPES.items():
            row[part] = sum(breakdown.type_ps.get(t, 0) for t in types) / 1e9
            accounted += row[part]
        row["other"] += max(0.0, row["step_ms"] - accounted)  # types no part holds, and untraced time
        if row["step_ms"] > 0:
            steps.append(row)
    return steps


def steps_from_table(pipeline: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per step, from input_pipeline_analyzer's table (input wait and host-to-device come as one there)."""
    columns = {"device_compute": "deviceComputeTimeMs", "device_to_device": "deviceToDeviceTimeMs",
               "device_collectives": "deviceCollectivesTimeMs", "host_compute": "hostComputeTimeMs",
               "kernel_launch": "kernelLaunchTimeMs", "input_wait": "infeedTimeMs", "output": "outfeedTimeMs",
               "compile": "compileTimeMs", "other": "otherTimeMs"}
    steps = []
    for row in _rows(pipeline[1]) if len(pipeline) > 1 else []:
        step = {"begin_ms": 0.0, "step_ms": _num(row.get("stepTimeMs")), "host_to_device": 0.0}
        step.update({part: _num(row.get(column)) for part, column in columns.items()})
        if step["step_ms"] > 0:
            steps.append(step)
    return steps


# ---- the timeline, read from the trace itself ----

def timeline(trace: Path) -> dict[str, Any]:
    """What the trace itself shows, on its own clock: the capture's span, step markers, how busy the
    framework's ops keep a CPU within the steps, which ops run in tf.data, and on each GPU its device ops
    (with the kernels each launched) and memory copies."""
    from .protos import xplane_pb2

    space = xplane_pb2.XSpace.FromString(trace.read_bytes())
    low = high = None
    host_steps: list[tuple[int, int]] = []
    marker_steps: list[int] = []  # training steps each host step marker covers (its ``steps`` stat, else 1)
    loops = False  # a TF while loop ran (executor events with an iteration number above 0)
    window = None  # the profiling session's (start, stop) in Unix ns, from the Task Environment plane
    fetches: list[tuple[int, int]] = []  # the stepping thread waiting on the input iterator
    device_steps: dict[str, list[tuple[int, int]]] = {}
    ops: list[tuple[int, int]] = []
    input_ops: set[str] = set()
    device_ops: dict[str, dict[str, Any]] = {}
    copies: dict[str, float] = {}
    for plane in space.planes:
        names = {i: m.name for i, m in plane.event_metadata.items()}
        stat_names = {i: m.name for i, m in plane.stat_metadata.items()}
        step_stats = {i for i, name in stat_names.items() if name == "step_num"}
        count_stat = next((i for i, name in stat_names.items() if name == "steps"), None)
        loop_stat = next((i for i, name in stat_names.items() if name == "iter_num"), None)
        if plane.name == "Task Environment":
            stats = {stat_names.get(st.metadata_id): st.int64_value or st.uint64_value for st in plane.stats}
            if stats.get("profile_start_time") and stats.get("profile_stop_time"):
                window = (stats["profile_start_time"], stats["profile_stop_time"])
        host = plane.name.startswith("/host")
        plane_ops: list[tuple[int, int, str]] = []
        kernels: list[tuple[int, int, str]] = []
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            compute_thread = host and line.name.startswith(("tf_Compute", "tf_numa", "tf_inter_op", "tf_gpu"))
            data_thread = host and line.name.startswith("tf_data")
            for event in line.events:
                start = base + event.offset_ps
                end = start + event.duration_ps
                low = start if low is None else min(low, start)
                high = end if high is None else max(high, end)
                name = names.get(event.metadata_id, "")
                if host:
                    if step_stats and any(st.metadata_id in step_stats for st in event.stats):
                        host_steps.append((start, end))
                        marker_steps.append(next((st.int64_value or st.uint64_value for st in event.stats
                                                  if st.metadata_id == count_stat), 1) or 1)
                    elif loop_stat is not None and not loops and any(
                            st.metadata_id == loop_stat and (st.int64_value or st.uint64_value) > 0
                            for st in event.stats):
                        loops = True
                    elif "IteratorGetNext" in name and not compute_thread and not data_thread:
                        fetches.append((start, end))
                    elif compute_thread and ":" in name:
                        ops.append((start, end))  # TF ops are named "name:Type"; executor bookkeeping is not
                    elif data_thread and name and not name.startswith(("Iterator::", "Threadpool", "Executor")):
                        input_ops.add(name.split(":")[0])
                elif line.name == "Steps":
                    device_steps.setdefault(plane.name, []).append((start, end))
                elif line.name == "TensorFlow Ops":
                    plane_ops.append((start, end, name))
                elif "Memcpy" in line.name or name.startswith("Memcpy"):
                    kind = next((k for k in ("H2D", "D2H", "D2D", "P2P") if k in line.name or k in name), "other")
                    copies[kind] = copies.get(kind, 0.0) + event.duration_ps / 1e9
                elif line.name.startswith("Stream"):
                    kernels.append((start, end, name))
        _attach_kernels(sorted(plane_ops), kernels, device_ops)
    markers = _merge(host_steps) if host_steps else _merge(max(device_steps.values(), key=len, default=[]))
    gaps = [(a[1], b[0]) for a, b in itertools.pairwise(markers) if b[0] > a[1]]
    return {"capture_s": (high - low) / 1e12 if low is not None else 0.0, "markers": markers,
            "steps_per_marker": statistics.fmean(marker_steps) if marker_steps else 1.0,
            "loops": loops and bool(host_steps), "window": window,
            "between_steps_input": _covered(_merge(fetches), gaps) if gaps and fetches else 0.0,
            "ops_busy": _covered(_merge(ops), markers) if host_steps and ops else None,
            "input_ops": input_ops, "device_ops": device_ops, "copies_ms": copies}


def _attach_kernels(plane_ops: list[tuple[int, int, str]], kernels: list[tuple[int, int, str]],
                    device_ops: dict[str, dict[str, Any]]) -> None:
    """Add a device plane's TF ops (replicas merged) and each kernel to the op whose span holds its start."""
    starts = [o[0] for o in plane_ops]
    for start, end, name in plane_ops:
        kind = _op_type(name)
        op = device_ops.setdefault(kind, {"name": kind, "ms": 0.0, "kernels": {}, "ops": set()})
        op["ms"] += (end - start) / 1e9
        op["ops"].add(name.split("/", 1)[-1] if name.startswith("replica_") else name)
    for start, end, kernel in kernels:
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and plane_ops[i][1] >= start:
            op = device_ops[_op_type(plane_ops[i][2])]
            op["kernels"][kernel] = op["kernels"].get(kernel, 0.0) + (end - start) / 1e9


def _op_type(name: str) -> str:
    """The TF op type of a device op event (``replica_4/bert/.../einsum/Einsum:Einsum`` → ``Einsum``)."""
    return name.rpartition(":")[2] or name


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _covered(busy: list[tuple[int, int]], windows: list[tuple[int, int]]) -> float:
    """Share of the windows' time that the busy intervals cover (both merged and sorted)."""
    total = sum(b - a for a, b in windows)
    covered, i = 0, 0
    for start, end in windows:
        while i < len(busy) and busy[i][1] <= start:
            i += 1
        j = i
        while j < len(busy) and busy[j][0] < end:
            covered += min(end, busy[j][1]) - max(start, busy[j][0])
            j += 1
    return covered / total if total else 0.0


# ---- ops ----

def ops_per_step(op_stats: list[dict[str, Any]], pipeline: list[dict[str, Any]], kernels: dict[str, Any],
                 line: dict[str, Any], steps: int) -> dict[str, list[dict[str, Any]]]:
    """Top input-pipeline, host and device ops by self time per step (``ms_total``: in the whole capture).

    Input: tf.data's iterators, and host ops that ran on tf.data's threads (functions in ``map``). Device:
    the trace's device ops with the kernels each launched; xprof's kernel table where the trace has none.
    """
    per = max(steps, 1)

    def entry(name: Any, ms: float, **more: Any) -> dict[str, Any]:
        return {"name": str(name), "ms_per_step": ms / per, "ms_total": ms, **more}

    rows = [o for o in (_rows(op_stats[1]) if len(op_stats) > 1 else []) if o.get("type") != "IDLE"]
    host = sorted((o for o in rows if o.get("host_or_device") == "Host"), key=lambda o: -_num(o.get("total_self_time")))
    in_data = [o for o in host if str(o.get("operation")).split(":")[0] in line["input_ops"]]
    iterators = [entry(o.get("opName"), _num(o.get("selfTimeInMs")), category=o.get("category"))
                 for o in (_rows(pipeline[2]) if len(pipeline) > 2 else [])]
    out: dict[str, list[dict[str, Any]]] = {
        "input": sorted(iterators + [entry(o.get("operation"), _num(o.get("total_self_time")) / 1000,
                                           category="tf.data function") for o in in_data],
                        key=lambda o: -o["ms_total"])[:8],
        "host": [entry(o.get("operation"), _num(o.get("total_self_time")) / 1000, type=o.get("type"))
                 for o in host if o not in in_data and not str(o.get("operation")).startswith("Iterator::")][:8],
    }
    device = [entry(op["name"], op["ms"] * 1.0, instances=len(op["ops"]), kernels=[
        {"kernel": k[:160], "ms_per_step": ms / per, "ms_total": ms}
        for k, ms in sorted(op["kernels"].items(), key=lambda kv: -kv[1])[:3]])
        for op in sorted(line["device_ops"].values(), key=lambda op: -op["ms"])[:8]]
    if not device:
        device = [entry(k.get("kernel_name"), _num(k.get("total_duration_us")) / 1000, op=k.get("op_name"),
                        tensor_core=bool(k.get("is_kernel_using_tensor_core")), kernels=[])
                  for k in sorted(_rows(kernels) if isinstance(kernels, dict) else [],
                                  key=lambda k: -_num(k.get("total_duration_us")))[:8]]
    out["device"] = device
    return out


# ---- one worker ----

def analyze_worker(trace: Path, verbose: bool = False) -> dict[str, Any]:
    """The facts of one worker's trace, and what bound its steps."""
    try:
        size = trace.stat().st_size
    except OSError as exc:
        raise AnalysisError(f"cannot read {trace}: {exc.strerror}") from None
    if size < 1024:
        raise AnalysisError(f"{trace.name} is {size} bytes: an empty trace (the process was idle)")
    try:
        line = timeline(trace)
    except Exception as exc:  # an unreadable timeline must not hide what xprof could read
        line = {"capture_s": 0.0, "markers": [], "ops_busy": None, "input_ops": set(), "device_ops": {},
                "copies_ms": {}, "between_steps_input": 0.0, "steps_per_marker": 1.0, "loops": False,
                "window": None, "error": f"{type(exc).__name__}: {exc}"}
    with private_session(trace, hide_loops=line["loops"]) as linked, quiet(verbose) as log_tail:
        try:
            overview = _tool(linked, "overview_page")
            pipeline = _tool(linked, "input_pipeline_analyzer")
            op_stats = _tool(linked, "framework_op_stats")
            kernels = _tool(linked, "kernel_stats")
        except AnalysisError as exc:
            raise AnalysisError(f"{exc}{'; xprof said: ' + log_tail[-1] if log_tail else ''}") from None
        steps = steps_from_opstats(linked.parent)
    if steps is None:
        steps = steps_from_table(pipeline)
    per_marker = line["steps_per_marker"]  # xprof's steps are the markers: one execution of N steps each
    if per_marker > 1:
        steps = [{k: (v if k == "begin_ms" else v / per_marker) for k, v in s.items()} for s in steps]
    props = overview[1].get("p", {}) if len(overview) > 1 else {}
    facts: dict[str, Any] = {"host": host_of(trace), "trace": str(trace), "hardware": props.get("hardware_type", ""),
                             "steps": round(len(steps) * per_marker), "capture_seconds": line["capture_s"],
                             "window": line["window"], "xprof_conclusion": props.get("input_conclusion", "")}
    if per_marker > 1:
        facts["executions"] = len(steps)
    if line["loops"]:
        facts["loops_hidden"] = True
    facts["ops"] = ops_per_step(op_stats, pipeline, kernels, line, facts["steps"])
    facts["copies_ms"] = line["copies_ms"]
    if steps:
        times = [s["step_ms"] for s in steps]
        mean = statistics.fmean(times)
        facts["step_time_ms"] = {"mean": mean, "stdev": statistics.pstdev(times), "min": min(times), "max": max(times)}
        facts["breakdown_ms"] = {part: statistics.fmean(s[part] for s in steps) for part in PART_TYPES}
        facts["breakdown"] = {part: ms / mean for part, ms in facts["breakdown_ms"].items()}
        facts["input_bound_ratio"] = facts["breakdown"]["input_wait"] + facts["breakdown"]["host_to_device"]
    facts["ratios"] = _ratios(facts, steps, line)
    if steps:
        between = facts["ratios"]["between_steps"] or 0.0
        facts["cycle_ms"] = facts["step_time_ms"]["mean"] / (1 - between)  # a step and the time after it
        gap = facts["cycle_ms"] - facts["step_time_ms"]["mean"]
        facts["between_ms"] = {"between_steps_input": gap * facts["ratios"]["between_steps_input"],
                               "between_steps_other": gap * (1 - facts["ratios"]["between_steps_input"])}
    kind, why = classify(facts)
    facts.update({"bottleneck": kind, "why": why, "summary": f"{kind}: {why}", "recommendation": RECOMMENDATIONS[kind]})
    facts["xprof_differs"] = _versus_xprof(facts)
    return facts


def _ratios(facts: dict[str, Any], steps: list[dict[str, float]], line: dict[str, Any]) -> dict[str, Any]:
    """Ratios that are not parts of the step: time between steps, coverage, device idle, op activity."""
    markers = line["markers"]
    ratios: dict[str, Any] = {"between_steps": None, "between_steps_input": line.get("between_steps_input", 0.0),
                              "steps_cover": None, "device_idle": None, "ops_busy": line["ops_busy"]}
    if len(markers) >= 2:
        span = markers[-1][1] - markers[0][0]
        ratios["between_steps"] = 1 - sum(b - a for a, b in markers) / span if span else None
    elif len(steps) >= 2:  # no markers in the timeline: xprof's own step begins, on its own clock
        span = steps[-1]["begin_ms"] + steps[-1]["step_ms"] - steps[0]["begin_ms"]
        ratios["between_steps"] = 1 - sum(s["step_ms"] for s in steps) / span if span > 0 else None
    if line["capture_s"] and steps:
        stepping_ms = sum(s["step_ms"] for s in steps) * line.get("steps_per_marker", 1.0)
        ratios["steps_cover"] = min(1.0, stepping_ms / 1000 / line["capture_s"])
    if facts.get("breakdown") and facts["hardware"] not in ("CPU_ONLY", ""):
        ratios["device_idle"] = max(0.0, 1 - sum(facts["breakdown"][p] for p in DEVICE_PARTS))
    return ratios


def classify(facts: dict[str, Any]) -> tuple[str, str]:
    """(bottleneck kind, one sentence with its numbers), in the seeds' order of investigation."""
    if not facts.get("steps"):
        return "unknown", ("the profile has no training steps (no step markers, or the job did not train during "
                           "the capture), so step time cannot be measured")
    b, ms, r = facts["breakdown"], facts["breakdown_ms"], facts["ratios"]
    step = facts["step_time_ms"]["mean"]
    if facts["input_bound_ratio"] >= INPUT_BOUND:
        if b["host_to_device"] >= TRANSFER and b["host_to_device"] > b["input_wait"]:
            return "transfer", (f"host-to-device copies take {b['host_to_device']:.0%} of each {step:.1f} ms step "
                                f"({ms['host_to_device']:.1f} ms)")
        return "input", (f"input-bound: {facts['input_bound_ratio']:.0%} of each {step:.1f} ms step waits for input "
                         f"({ms['input_wait'] + ms['host_to_device']:.1f} ms)")
    if r["between_steps"] is not None and r["between_steps"] >= BETWEEN_STEPS:
        if r["between_steps_input"] >= 0.5:
            return "input", (f"input-bound outside the step markers: {r['between_steps']:.0%} of the time from the "
                             f"first step to the last is spent between steps, {r['between_steps_input']:.0%} of it "
                             f"waiting for the next batch (steps take {step:.1f} ms)")
        return "host", (f"{r['between_steps']:.0%} of the time between the first and last step is spent between "
                        f"steps (callbacks, post-processing; steps take {step:.1f} ms)")
    if b["kernel_launch"] >= KERNEL_LAUNCH:
        return "host", f"kernel launches take {b['kernel_launch']:.0%} of each {step:.1f} ms step"
    if b["host_to_device"] >= TRANSFER:
        return "transfer", f"host-to-device copies take {b['host_to_device']:.0%} of each {step:.1f} ms step"
    on_device = facts["hardware"] not in ("CPU_ONLY", "")
    if on_device:
        if b["other"] >= ALL_OTHERS and b["device_compute"] < 1 - ALL_OTHERS:
            return "host", (f"{b['other']:.0%} of each {step:.1f} ms step ({ms['other']:.1f} ms) is untraced host time "
                            f"('all others': Python, I/O or waiting on other workers) while the GPU computes "
                            f"{b['device_compute']:.0%} ({ms['device_compute']:.1f} ms)")
        if b["device_compute"] >= DEVICE_BUSY:
            return "device", (f"compute-bound: the GPU computes {b['device_compute']:.0%} of each {step:.1f} ms step "
                              f"({ms['device_compute']:.1f} ms)")
        return "small_batch", (f"the GPU idles {r['device_idle']:.0%} of each {step:.1f} ms step with no input, host "
                               "or transfer cause: too little work per step")
    busy = r["ops_busy"]
    if busy is not None and busy < OPS_BUSY:
        return "small_batch", (f"the framework's ops run only {busy:.0%} of each {step:.2f} ms step: the rest is "
                               "fixed per-step overhead")
    busy_text = f"ops run {busy:.0%} of the step" if busy is not None else f"host compute {b['host_compute']:.0%}"
    return "device", f"compute-bound: the CPU computes most of each {step:.1f} ms step ({busy_text})"


def _versus_xprof(facts: dict[str, Any]) -> str | None:
    """Why tfprofd's verdict differs from xprof's own input conclusion, when it does."""
    said = facts.get("xprof_conclusion", "")
    if not said or not facts.get("steps"):
        return None
    xprof_input = "input-bound" in said and "NOT input-bound" not in said and "not input-bound" not in said
    mine_input = facts["bottleneck"] in ("input", "transfer")
    if xprof_input == mine_input:
        return None
    b, ms = facts["breakdown"], facts["breakdown_ms"]
    if xprof_input and "All Others" in said:
        return (f"xprof counts the {b['other']:.0%} 'All Others' time ({ms['other']:.1f} ms per step) as possibly "
                f"input; the trace shows no wait for input in the step (input wait {ms['input_wait']:.1f} ms, "
                f"host-to-device {ms['host_to_device']:.1f} ms), so tfprofd names it {facts['bottleneck']}")
    if xprof_input:
        return (f"xprof calls the job input-bound; tfprofd finds {facts['input_bound_ratio']:.0%} of the step waiting "
                f"for input, under its {INPUT_BOUND:.0%} threshold, and names {facts['bottleneck']}")
    return (f"xprof does not call the job input-bound; tfprofd finds {facts['input_bound_ratio']:.0%} of the step "
            f"waiting for input ({ms['input_wait'] + ms['host_to_device']:.1f} ms)")


# ---- a capture: every worker, the straggler, the baseline ----

def analyze(path: Path, verbose: bool = False) -> dict[str, Any]:
    """Analyse every worker of one capture; raises AnalysisError if none can be read."""
    workers = [analyze_worker(trace, verbose) for trace in find_traces(path)]
    return combine(workers)


def combine(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """A capture's analysis: the slowest worker's facts lead, every worker is listed, a straggler named."""
    timed = [w for w in workers if w.get("steps")]
    lead = max(timed, key=lambda w: w["cycle_ms"]) if timed else workers[0]
    result = {**lead, "workers": workers, "straggler": None, "trace": lead["trace"]}
    windows = [w["window"] for w in workers if w.get("window")]
    if len(windows) > 1:  # how far apart the workers' profiling sessions started (one window: milliseconds)
        result["window_skew_ms"] = (max(a for a, _ in windows) - min(a for a, _ in windows)) / 1e6
    others = [w["cycle_ms"] for w in timed if w is not lead]
    if others and lead["cycle_ms"] >= STRAGGLER * statistics.median(others):
        def parts(w: dict[str, Any]) -> dict[str, float]:
            return {**w["breakdown_ms"], **w["between_ms"]}

        mean = {p: statistics.fmean(parts(w)[p] for w in timed if w is not lead) for p in parts(lead)}
        part = max(mean, key=lambda p: parts(lead)[p] - mean[p])
        delta = parts(lead)[part] - mean[part]
        why = (f"worker {lead['host']} takes {lead['cycle_ms']:.1f} ms per step (with the time between steps) "
               f"against {statistics.median(others):.1f} ms on the others: +{delta:.1f} ms per step "
               f"{PART_WORDS[part]}")
        result["straggler"] = {"host": lead["host"], "part": part, "delta_ms": delta, "why": why}
        result["summary"] = f"straggler: {why}; {lead['summary']}"
    return result


CAUSE_PARTS = {"input": ("input_wait",), "transfer": ("host_to_device",), "host": ("host_compute", "kernel_launch",
               "other"), "device": ("device_compute", "device_to_device", "device_collectives")}
MOVED = 0.25  # a part that moved by this share of the step time's change is worth naming


def _parts_that_moved(parts: list[dict[str, Any]], step_delta: float, cause: str) -> list[dict[str, Any]]:
    """The parts worth naming in the summary (at most three): those that moved by a good share of the step
    time's change, the cause's own parts first (on a shared CPU, heavy preprocessing slows compute too)."""
    moved = [d for d in parts if abs(d["delta_ms"]) >= MOVED * abs(step_delta)] or parts[:1]
    own = CAUSE_PARTS.get(cause, ())
    return sorted(moved, key=lambda d: (d["part"] not in own, -abs(d["delta_ms"])))[:3]


def compare(baseline: dict[str, Any], incident: dict[str, Any], rates: tuple[float | None, float | None] = (None, None),
            batches: tuple[float | None, float | None] = (None, None)) -> dict[str, Any] | None:
    """What changed from the job's baseline capture to this one: throughput, step time, parts, ops."""
    if not baseline.get("steps") or not incident.get("steps"):
        return None
    before, after = baseline["step_time_ms"]["mean"], incident["step_time_ms"]["mean"]
    parts = sorted(({"part": p, "before_ms": baseline["breakdown_ms"][p], "after_ms": incident["breakdown_ms"][p],
                     "delta_ms": incident["breakdown_ms"][p] - baseline["breakdown_ms"][p]} for p in PART_TYPES),
                   key=lambda d: -abs(d["delta_ms"]))
    ops = []
    for kind in ("input", "host", "device"):
        old = {o["name"]: o["ms_per_step"] for o in baseline["ops"].get(kind, [])}
        for o in incident["ops"].get(kind, []):
            grew = o["ms_per_step"] - old.get(o["name"], 0.0)
            if grew > 0:
                ops.append({"name": o["name"], "kind": kind, "before_ms": old.get(o["name"], 0.0),
                            "after_ms": o["ms_per_step"], "delta_ms": grew})
    ops = sorted(ops, key=lambda o: -o["delta_ms"])[:5]
    out: dict[str, Any] = {"baseline_trace": baseline.get("trace"), "step_ms": [before, after, after - before],
                           "parts": parts, "ops": ops, "samples_per_second": list(rates), "batch_size": list(batches),
                           "ops_busy": [baseline["ratios"].get("ops_busy"), incident["ratios"].get("ops_busy")],
                           "between_steps": [baseline["ratios"].get("between_steps"),
                                             incident["ratios"].get("between_steps")]}
    lead = []
    if all(rates):
        lead.append(f"samples/s {rates[0]:.0f} → {rates[1]:.0f} ({rates[1] / rates[0] - 1:+.0%})")
    if all(batches) and batches[0] != batches[1]:
        lead.append(f"batch {batches[0]:.0f} → {batches[1]:.0f}")
    lead.append(f"step time {before:.1f} → {after:.1f} ms ({after - before:+.1f} ms per step)")
    detail = ", ".join(f"{d['delta_ms']:+.1f} ms {PART_WORDS[d['part']]}"
                       for d in _parts_that_moved(parts, after - before, incident["bottleneck"]))
    between = out["between_steps"]
    if None not in between and between[1] - between[0] >= 0.2:
        detail = f"time between steps {between[0]:.0%} → {between[1]:.0%} of the stepping span"
    busy = out["ops_busy"]
    if incident["bottleneck"] == "small_batch" and None not in busy:
        detail = f"ops busy {busy[0]:.0%} → {busy[1]:.0%} of the step (per-step overhead dominates)"
    if ops:
        o = ops[0]
        growth = f"×{o['after_ms'] / o['before_ms']:.0f}" if o["before_ms"] > 0 else "new"
        detail += f"; {o['name']} self time {growth} ({o['before_ms']:.2f} → {o['after_ms']:.2f} ms per step)"
    out["summary"] = f"{', '.join(lead)}: {detail}; cause: {incident['bottleneck']}"
    return out


# ---- the xprof viewer's cache, for read-only users ----

def write_viewer_cache(capture_dir: Path) -> None:
    """Leave in each run directory what xprof's viewer writes on first open (its tool list, OpStats, trace
    viewer tables, cache_version.txt), made by xprof's own plugin code, so a user who cannot write into
    the capture still opens it."""
    from werkzeug.test import EnvironBuilder
    from werkzeug.wrappers import Request
    from xprof.server import DataProvider, ProfilePluginLoader, TBContext

    context = TBContext(str(capture_dir), DataProvider(str(capture_dir)), TBContext.Flags(False))
    context.hide_capture_profile_button, context.enable_tab_name_label, context.src_prefix = True, False, None
    plugin = ProfilePluginLoader().load(context)

    def request(**args: str) -> Request:
        return Request(EnvironBuilder(path="/data", query_string=args).get_environ())

    for run in plugin.runs_imp(request()):
        run_dir = plugin._run_dir(run, request(run=run))
        for tool in plugin.run_tools_imp(run, request(run=run)):
            if tool in ("memory_profile", "op_profile", "roofline_model", "hlo_stats"):
                continue  # opened rarely and cheap to make; not worth their share of the disk budget
            for host in plugin._run_host_impl(run, run_dir, tool) or [{"hostname": ""}]:
                with contextlib.suppress(Exception):
                    plugin.data_impl(request(run=run, tag=tool, host=host["hostname"]))


# ---- reporting ----

def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def report(a: dict[str, Any]) -> str:
    """A readable report for people."""
    lines = []
    if a.get("comparison"):
        lines.append(f"what changed: {a['comparison']['summary']}")
    lines += [f"bottleneck: {a['bottleneck']}", f"why: {a['summary']}", f"what to try: {a['recommendation']}"]
    workers = a.get("workers") or [a]
    if len(workers) > 1:
        window = (f", traced over one window (sessions started {a['window_skew_ms']:.1f} ms apart)"
                  if a.get("window_skew_ms") is not None else "")
        lines.append(f"workers: {len(workers)}{window}" + (f"; straggler: {a['straggler']['why']}"
                                                           if a.get("straggler") else "; no straggler"))
        for w in workers:
            step = f"{w['step_time_ms']['mean']:.2f} ms" if w.get("steps") else "no steps"
            lines.append(f"  {w['host']}: {step}, {w['bottleneck']}")
    lines.append(f"trace: {a['trace']}" + (f" ({a['hardware']})" if a.get("hardware") else ""))
    if a.get("steps"):
        st = a["step_time_ms"]
        runs = f" in {a['executions']} executions (steps_per_execution)" if a.get("executions") else ""
        lines.append(f"steps: {a['steps']}{runs} in a {a['capture_seconds']:.2f} s capture, step time mean "
                     f"{st['mean']:.2f} ms (stdev {st['stdev']:.2f}, min {st['min']:.2f}, max {st['max']:.2f})")
        lines.append("step breakdown (parts of the step, adding up to it):")
        for part, ms in sorted(a["breakdown_ms"].items(), key=lambda kv: -kv[1]):
            if ms > 0:
                lines.append(f"  {a['breakdown'][part]:6.1%} {ms:9.2f} ms  {PART_WORDS[part]}")
        r = a["ratios"]
        lines.append("other ratios (not parts of the step):")
        lines.append(f"  time between steps: {_pct(r['between_steps'])} of the span from the first step to the last"
                     + ("" if r["between_steps"] is not None else " (needs two steps or more)")
                     + (f", {r['between_steps_input']:.0%} of it fetching the next batch"
                        if r.get("between_steps_input") else ""))
        lines.append(f"  steps cover {_pct(r['steps_cover'])} of the capture"
                     + (": most of it is outside steps (start-up, evaluation, checkpoints, or steps without markers)"
                        if r["steps_cover"] is not None and r["steps_cover"] < 0.5 else ""))
        if r["device_idle"] is not None:
            lines.append(f"  device idle within the step: {_pct(r['device_idle'])}")
        if r["ops_busy"] is not None:
            lines.append(f"  framework ops running: {_pct(r['ops_busy'])} of the step (CPU)")
    per_step = a.get("steps", 0) >= 3 and (a["ratios"].get("steps_cover") or 0) >= 0.5
    unit, key = ("per step", "ms_per_step") if per_step else ("in the whole capture", "ms_total")
    for kind in ("input", "host", "device"):
        ops = a.get("ops", {}).get(kind, [])[:5]
        if ops:
            lines.append(f"top {kind} ops {'by type ' if kind == 'device' else ''}by self time {unit}:")
            for o in ops:
                count = f" ({o['instances']} ops)" if o.get("instances", 1) > 1 else ""
                lines.append(f"  {o[key]:9.3f} ms  {o['name']}{count}")
                lines += [f"             {k[key]:.3f} ms  kernel {k['kernel'][:100]}" for k in o.get("kernels", [])]
    if a.get("copies_ms"):
        lines.append("memory copies in the capture: " + ", ".join(f"{kind} {ms:.1f} ms"
                                                                  for kind, ms in sorted(a["copies_ms"].items())))
    if a.get("xprof_conclusion"):
        lines.append(f"xprof says: {a['xprof_conclusion']}")
    if a.get("xprof_differs"):
        lines.append(f"why tfprofd differs: {a['xprof_differs']}")
    if a.get("loops_hidden"):
        lines.append("note: the trace has TensorFlow while loops (steps_per_execution > 1 runs its steps in one); "
                     "xprof's own viewer takes their iterations for steps, tfprofd grouped by the step markers")
    capture = Path(a["trace"]).parent.parent.parent.parent
    if capture.name and Path(a["trace"]).parent.parent.name == "profile":
        lines.append(f"open in the viewer: xprof --logdir {capture} --port 8791 (xprof listens on every interface)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .workers import die_with_parent

    die_with_parent()
    parser = argparse.ArgumentParser(prog="tfprofd analyze",
                                     description="Say what bound the training step in a TensorFlow profile.")
    parser.add_argument("path", type=Path, help="a capture or TensorBoard log directory, or an .xplane.pb")
    parser.add_argument("--baseline", type=Path, help="a capture of the same job while it ran well: say what changed")
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    parser.add_argument("--verbose", action="store_true", help="show xprof's own log lines")
    parser.add_argument("--viewer-cache", action="store_true", help=argparse.SUPPRESS)  # the agent's own captures
    args = parser.parse_args(argv)
    try:
        result = analyze(args.path, args.verbose)
        if args.baseline:
            result["comparison"] = compare(analyze(args.baseline, args.verbose), result)
            if result["comparison"]:
                result["summary"] = f"{result['comparison']['summary']} ({result['summary']})"
        if args.viewer_cache:
            with quiet(args.verbose):
                write_viewer_cache(args.path)
    except (AnalysisError, OSError) as exc:
        if args.json:
            print(json.dumps({"error": str(exc)}))
        else:
            print(f"tfprofd analyze: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
