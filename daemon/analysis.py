"""Capture analysis: read an ``.xplane.pb`` headlessly with xprof and say what bound the training step.

Follows the seeds' order: input pipeline first, then host-side gaps and kernel launches, then
host-to-device copies, then the device itself. Runs in its own process (``python -m
tfprofd.daemon.analysis PATH --json``): xprof needs 200-450 MB the agent must not hold.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

# xprof's own thresholds: under 5% of step time waiting for input is not input-bound, 20% or more is highly.
INPUT_BOUND = 0.20
OUTSIDE_STEP = 0.30  # share of the capture spent between steps (callbacks, post-processing)
KERNEL_LAUNCH = 0.10
TRANSFER = 0.10
DEVICE_BUSY = 0.50
SMALL_STEP_MS = 5.0  # a step this short spends much of its time on per-step overhead

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
    "small_batch": "Steps are short and nothing else holds training back: the batch is too small to keep the "
                   "device busy. Increase the batch size (scaling the learning rate) or steps_per_execution.",
    "unknown": "Capture again while the job trains, with step markers (TfprofdCallback, or "
               "tf.profiler.experimental.Trace('train', step_num=n, _r=1) around each step of a custom loop).",
}

_BREAKDOWN = ("deviceComputeTimeMs", "deviceToDeviceTimeMs", "deviceCollectivesTimeMs", "hostComputeTimeMs",
              "kernelLaunchTimeMs", "infeedTimeMs", "outfeedTimeMs", "compileTimeMs", "otherTimeMs", "stepTimeMs")
_TRANSFER_OP = re.compile(r"memcpy\s*h(2|to)d|hosttodevice", re.IGNORECASE)


class AnalysisError(Exception):
    """The trace could not be analysed (unreadable, corrupt or truncated)."""


def find_trace(path: Path) -> Path:
    """The newest ``.xplane.pb`` in a capture or TensorBoard log directory, or the file itself."""
    if not path.exists():
        raise AnalysisError(f"{path} does not exist")
    if path.is_file():
        return path
    traces = sorted(path.glob("**/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise AnalysisError(f"no .xplane.pb under {path}")
    return traces[-1]


def _tool(trace: Path, tool: str) -> Any:
    from xprof.convert import raw_to_tool_data

    try:
        data, _ = raw_to_tool_data.xspace_to_tool_data([str(trace)], tool, {})
    except Exception as exc:  # xprof raises plain exceptions for some corrupt protobufs
        raise AnalysisError(f"cannot analyse {trace.name}: not a readable profile, corrupt or truncated "
                            f"({tool}: {exc})") from None
    if not data:
        raise AnalysisError(f"cannot analyse {trace.name}: not a readable profile, corrupt or truncated "
                            f"({tool} returned nothing)")
    return json.loads(data)


def _rows(table: dict[str, Any]) -> list[dict[str, Any]]:
    ids = [c.get("id") for c in table.get("cols", [])]
    return [dict(zip(ids, (cell.get("v") if cell else None for cell in row["c"]), strict=False))
            for row in table.get("rows", [])]


def extract(overview: list[dict[str, Any]], op_stats: list[dict[str, Any]], duration_s: float | None
            ) -> dict[str, Any]:
    """The numbers that matter, from xprof's overview_page and framework_op_stats tables."""
    steps = _rows(overview[1]) if len(overview) > 1 else []
    steps = [s for s in steps if (s.get("stepTimeMs") or 0) > 0]
    hardware = overview[1].get("p", {}).get("hardware_type", "") if len(overview) > 1 else ""
    out: dict[str, Any] = {"hardware": hardware, "steps": len(steps),
                           "xprof_input_conclusion": overview[1].get("p", {}).get("input_conclusion", "")
                           if len(overview) > 1 else ""}
    sums = {k: sum(float(s.get(k) or 0) for s in steps) for k in _BREAKDOWN}
    total = sums["stepTimeMs"]
    if steps and total > 0:
        times = [float(s["stepTimeMs"]) for s in steps]
        out["step_time_ms"] = {"mean": statistics.fmean(times), "stdev": statistics.pstdev(times),
                               "min": min(times), "max": max(times)}
        out["input_bound_ratio"] = sums["infeedTimeMs"] / total
        out["shares"] = {
            "input": sums["infeedTimeMs"] / total,
            "host_compute": sums["hostComputeTimeMs"] / total,
            "device_compute": sums["deviceComputeTimeMs"] / total,
            "kernel_launch": sums["kernelLaunchTimeMs"] / total,
            "device_to_device": (sums["deviceToDeviceTimeMs"] + sums["deviceCollectivesTimeMs"]) / total,
            "other": (sums["otherTimeMs"] + sums["compileTimeMs"] + sums["outfeedTimeMs"]) / total,
        }
    ops = _rows(op_stats[1]) if len(op_stats) > 1 else []
    all_ops = _rows(op_stats[0]) if op_stats else []
    device_ops = [o for o in ops if o.get("host_or_device") == "Device"]
    device_self = sum(float(o.get("total_self_time") or 0) for o in device_ops)
    transfer = sum(float(o.get("total_self_time") or 0) for o in device_ops
                   if _TRANSFER_OP.search(f"{o.get('type')} {o.get('operation')}"))
    out.setdefault("shares", {})["transfer"] = transfer / device_self if device_self else 0.0
    idle = {o.get("host_or_device"): float(o.get("host_total_self_time_percent" if o.get("host_or_device") == "Host"
                                                 else "device_total_self_time_percent") or 0)
            for o in all_ops if o.get("type") == "IDLE"}
    out["shares"]["host_idle"] = idle.get("Host", 0.0)
    out["shares"]["device_idle"] = idle.get("Device", 0.0)
    if duration_s and total > 0:
        out["shares"]["outside_step"] = max(0.0, 1.0 - total / 1000 / duration_s)
    out["top_ops"] = {side: [{"operation": o.get("operation"), "type": o.get("type"),
                              "self_ms": float(o.get("total_self_time") or 0) / 1000,
                              "occurrences": int(o.get("occurrences") or 0)}
                             for o in sorted((o for o in ops if o.get("host_or_device") == side),
                                             key=lambda o: -float(o.get("total_self_time") or 0))[:5]]
                      for side in ("Host", "Device")}
    return out


def classify(facts: dict[str, Any]) -> tuple[str, str]:
    """(bottleneck kind, one sentence saying why), in the seeds' order of investigation."""
    if not facts.get("steps"):
        return "unknown", ("the profile has no training steps (no step markers, or the job did not train during "
                           "the capture), so step time cannot be measured")
    shares = facts["shares"]
    step = facts["step_time_ms"]["mean"]
    if facts["input_bound_ratio"] >= INPUT_BOUND:
        return "input", (f"input-bound: {facts['input_bound_ratio']:.0%} of step time waits for input "
                         f"(step {step:.1f} ms)")
    if shares.get("outside_step", 0) >= OUTSIDE_STEP:
        return "host", (f"{shares['outside_step']:.0%} of the capture is outside the training step (callbacks, "
                        f"post-processing between steps; step {step:.1f} ms)")
    if shares["kernel_launch"] >= KERNEL_LAUNCH:
        return "host", f"kernel launches take {shares['kernel_launch']:.0%} of step time (step {step:.1f} ms)"
    if shares["transfer"] >= TRANSFER:
        return "transfer", f"host-to-device copies take {shares['transfer']:.0%} of device time"
    on_device = facts["hardware"] not in ("CPU_ONLY", "")
    compute = shares["device_compute"] if on_device else shares["host_compute"]
    if step < SMALL_STEP_MS and (not on_device or compute < DEVICE_BUSY):
        return "small_batch", (f"steps are short ({step:.2f} ms) and no input, host or transfer cause stands out: "
                               "per-step overhead dominates")
    engine = "device" if on_device else "CPU"
    return "device", f"compute-bound: the {engine} computes {compute:.0%} of a {step:.1f} ms step"


def analyze(path: Path, duration_s: float | None = None) -> dict[str, Any]:
    """Analyse one trace; raises AnalysisError if it cannot be read."""
    trace = find_trace(path)
    if trace.stat().st_size < 1024:
        raise AnalysisError(f"{trace.name} is {trace.stat().st_size} bytes: an empty trace (the process was idle)")
    facts = extract(_tool(trace, "overview_page"), _tool(trace, "framework_op_stats"), duration_s)
    kind, why = classify(facts)
    facts.update({"trace": str(trace), "bottleneck": kind, "summary": f"{kind}: {why}",
                  "recommendation": RECOMMENDATIONS[kind]})
    return facts


def report(a: dict[str, Any]) -> str:
    """A readable report for people."""
    lines = [f"trace: {a['trace']}", f"bottleneck: {a['bottleneck']}", f"why: {a['summary']}",
             f"what to try: {a['recommendation']}"]
    if a.get("steps"):
        st = a["step_time_ms"]
        lines.append(f"steps: {a['steps']}, step time mean {st['mean']:.2f} ms (stdev {st['stdev']:.2f}, "
                     f"min {st['min']:.2f}, max {st['max']:.2f})")
        lines.append(f"input-bound: {a['input_bound_ratio']:.1%}")
        lines.append("shares: " + ", ".join(f"{k} {v:.1%}" for k, v in a["shares"].items()))
    for side, ops in a.get("top_ops", {}).items():
        if ops:
            lines.append(f"top {side.lower()} ops by self time:")
            lines.extend(f"  {o['self_ms']:10.2f} ms  {o['operation']} ({o['type']}, {o['occurrences']}x)" for o in ops)
    if a.get("xprof_input_conclusion"):
        lines.append(f"xprof: {a['xprof_input_conclusion']}")
    lines.append(f"open in TensorBoard: tensorboard --logdir {Path(a['trace']).parents[3]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .workers import die_with_parent

    die_with_parent()
    parser = argparse.ArgumentParser(prog="tfprofd analyze",
                                     description="Say what bound the training step in a TensorFlow profile.")
    parser.add_argument("path", type=Path, help="a capture or TensorBoard log directory, or an .xplane.pb")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds the capture lasted (to measure time outside the training step)")
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    args = parser.parse_args(argv)
    try:
        result = analyze(args.path, args.duration)
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
