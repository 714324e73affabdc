"""A capture's analysis as a readable report for people."""

from __future__ import annotations

from pathlib import Path

from .classify import MIN_SPAN, MIN_STEPS
from .model import OP_KINDS, PART_WORDS, CaptureAnalysis


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def report(a: CaptureAnalysis) -> str:
    """A readable report for people."""
    w = a.lead
    lines = []
    if a.comparison is not None:
        lines.append(f"what changed: {a.comparison.summary}")
    lines += [f"bottleneck: {a.bottleneck}", f"why: {a.summary}", f"what to try: {a.recommendation}"]
    if len(a.workers) > 1:
        if a.one_window is False:
            lines.append(f"workers: {len(a.workers)} traces from separate sessions, not one window (sessions started "
                         f"{a.window_skew_ms or 0.0:.1f} ms apart, sharing {a.window_overlap or 0.0:.0%} of the "
                         "shortest): each analysed on its own, no straggler compared; the lead is the slowest")
        else:
            window = (f", traced over one window (sessions started {a.window_skew_ms:.1f} ms apart)"
                      if a.window_skew_ms is not None else "")
            lines.append(f"workers: {len(a.workers)}{window}" + (f"; straggler: {a.straggler.why}"
                                                                 if a.straggler else "; no straggler"))
        for other in a.workers:
            step = f"{other.step_time_ms.mean:.2f} ms" if other.steps and other.step_time_ms else "no steps"
            lines.append(f"  {other.host}: {step}, {other.bottleneck}")
    lines.append(f"trace: {w.trace}" + (f" ({w.hardware})" if w.hardware else ""))
    if w.evidence is not None and w.steps:
        lines.append(f"evidence: {w.evidence.sentence()}" + ("" if w.evidence.sufficient else
                     f": too little to conclude (a verdict needs {MIN_STEPS} steps spanning {MIN_SPAN:.0%} of the "
                     "capture)"))
    if w.devices_summary:
        lines.append(f"GPUs: {w.devices_summary}")
    r = w.ratios
    if w.steps and w.step_time_ms is not None and w.breakdown_ms is not None and w.breakdown is not None:
        st = w.step_time_ms
        runs = f" in {w.executions} executions (steps_per_execution)" if w.executions else ""
        lines.append(f"steps: {w.steps}{runs} in a {w.capture_seconds:.2f} s capture, step time mean "
                     f"{st.mean:.2f} ms (stdev {st.stdev:.2f}, min {st.min:.2f}, max {st.max:.2f})")
        if w.steps_found:
            lines.append(f"steps found from: {w.steps_found}"
                         + (" (the steps are inferred: no step markers in the trace)" if w.steps_inferred else ""))
        lines.append("step breakdown (parts of the step, adding up to it):")
        for part, ms in sorted(w.breakdown_ms.items(), key=lambda kv: -kv[1]):
            if ms > 0:
                lines.append(f"  {w.breakdown[part]:6.1%} {ms:9.2f} ms  {PART_WORDS[part]}")
        lines.append("other ratios (not parts of the step):")
        lines.append(f"  time between steps: {_pct(r.between_steps)} of the span from the first step to the last"
                     + ("" if r.between_steps is not None else " (needs two steps or more)")
                     + (f", {r.between_steps_input:.0%} of it fetching the next batch"
                        if r.between_steps_input else ""))
        lines.append(f"  steps cover {_pct(r.steps_cover)} of the capture"
                     + (": most of it is outside steps (start-up, evaluation, checkpoints, or steps without markers)"
                        if r.steps_cover is not None and r.steps_cover < 0.5 else ""))
        if r.device_idle is not None:
            lines.append(f"  device idle within the step: {_pct(r.device_idle)}")
        if r.ops_busy is not None:
            lines.append(f"  framework ops running: {_pct(r.ops_busy)} of the step (CPU)")
    per_step = w.steps >= 3 and (r.steps_cover or 0) >= 0.5
    unit = "per step" if per_step else "in the whole capture"
    for kind in OP_KINDS:
        ops = w.ops.of(kind)[:5]
        if ops:
            lines.append(f"top {kind} ops {'by type ' if kind == 'device' else ''}by self time {unit}:")
            for o in ops:
                count = f" ({o.instances} ops)" if o.instances > 1 else ""
                lines.append(f"  {o.ms_per_step if per_step else o.ms_total:9.3f} ms  {o.name}{count}")
                lines += [f"             {k.ms_per_step if per_step else k.ms_total:.3f} ms  kernel {k.kernel[:100]}"
                          for k in o.kernels]
    if w.copies_ms:
        lines.append("memory copies in the capture: " + ", ".join(f"{kind} {ms:.1f} ms"
                                                                  for kind, ms in sorted(w.copies_ms.items())))
    if w.xprof_conclusion:
        lines.append(f"xprof says: {w.xprof_conclusion}")
    if w.xprof_differs:
        lines.append(f"why tfprofd differs: {w.xprof_differs}")
    if w.loops_hidden:
        lines.append("note: the trace has TensorFlow while loops (steps_per_execution > 1 runs its steps in one); "
                     "xprof's own viewer takes their iterations for steps, tfprofd grouped by the step markers")
    capture = Path(w.trace).parent.parent.parent.parent
    if capture.name and Path(w.trace).parent.parent.name == "profile":
        lines.append(f"open in the viewer: xprof --logdir {capture} --port 8791 (xprof listens on every interface)")
    return "\n".join(lines)
