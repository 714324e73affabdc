"""What changed from the job's baseline capture to an incident: throughput, step time, parts, ops."""

from __future__ import annotations

from dataclasses import replace

from .model import OP_KINDS, PART_TYPES, PART_WORDS, CaptureAnalysis, Comparison, OpChange, Pair, PartChange

CAUSE_PARTS = {"input": ("input_wait",), "transfer": ("host_to_device",), "host": ("host_compute", "kernel_launch",
               "other"), "device": ("device_compute", "device_to_device", "device_collectives")}
MOVED = 0.25  # a part that moved by this share of the step time's change is worth naming


def _parts_that_moved(parts: list[PartChange], step_delta: float, cause: str) -> list[PartChange]:
    """The parts worth naming in the summary (at most three): those that moved by a good share of the step
    time's change, the cause's own parts first (on a shared CPU, heavy preprocessing slows compute too)."""
    moved = [d for d in parts if abs(d.delta_ms) >= MOVED * abs(step_delta)] or parts[:1]
    own = CAUSE_PARTS.get(cause, ())
    return sorted(moved, key=lambda d: (d.part not in own, -abs(d.delta_ms)))[:3]


def compare(baseline: CaptureAnalysis, incident: CaptureAnalysis, rates: Pair = (None, None),
            batches: Pair = (None, None)) -> Comparison | None:
    """What changed from the job's baseline capture to this one (None if either has no steps)."""
    b, i = baseline.lead, incident.lead
    if not b.steps or not i.steps or b.step_time_ms is None or i.step_time_ms is None \
            or b.breakdown_ms is None or i.breakdown_ms is None:
        return None
    before, after = b.step_time_ms.mean, i.step_time_ms.mean
    parts = sorted((PartChange(p, b.breakdown_ms[p], i.breakdown_ms[p], i.breakdown_ms[p] - b.breakdown_ms[p])
                    for p in PART_TYPES), key=lambda d: -abs(d.delta_ms))
    ops = []
    for kind in OP_KINDS:
        old = {o.name: o.ms_per_step for o in b.ops.of(kind)}
        for o in i.ops.of(kind):
            grew = o.ms_per_step - old.get(o.name, 0.0)
            if grew > 0:
                ops.append(OpChange(o.name, kind, old.get(o.name, 0.0), o.ms_per_step, grew))
    ops = sorted(ops, key=lambda o: -o.delta_ms)[:5]
    ops_busy, between = (b.ratios.ops_busy, i.ratios.ops_busy), (b.ratios.between_steps, i.ratios.between_steps)
    lead = []
    if rates[0] and rates[1]:
        lead.append(f"samples/s {rates[0]:.0f} → {rates[1]:.0f} ({rates[1] / rates[0] - 1:+.0%})")
    if batches[0] and batches[1] and batches[0] != batches[1]:
        lead.append(f"batch {batches[0]:.0f} → {batches[1]:.0f}")
    lead.append(f"step time {before:.1f} → {after:.1f} ms ({after - before:+.1f} ms per step)")
    detail = ", ".join(f"{d.delta_ms:+.1f} ms {PART_WORDS[d.part]}"
                       for d in _parts_that_moved(parts, after - before, i.bottleneck))
    if between[0] is not None and between[1] is not None and between[1] - between[0] >= 0.2:
        detail = f"time between steps {between[0]:.0%} → {between[1]:.0%} of the stepping span"
    if i.bottleneck == "small_batch" and ops_busy[0] is not None and ops_busy[1] is not None:
        detail = f"ops busy {ops_busy[0]:.0%} → {ops_busy[1]:.0%} of the step (per-step overhead dominates)"
    if ops:
        o = ops[0]
        growth = f"×{o.after_ms / o.before_ms:.0f}" if o.before_ms > 0 else "new"
        detail += f"; {o.name} self time {growth} ({o.before_ms:.2f} → {o.after_ms:.2f} ms per step)"
    return Comparison(summary=f"{', '.join(lead)}: {detail}; cause: {i.bottleneck}", step_ms=(before, after,
                      after - before), parts=tuple(parts), ops=tuple(ops), samples_per_second=rates,
                      batch_size=batches, ops_busy=ops_busy, between_steps=between, baseline_trace=b.trace)


def with_comparison(incident: CaptureAnalysis, comparison: Comparison | None) -> CaptureAnalysis:
    """The incident with what changed from its baseline leading its summary (unchanged without one)."""
    if comparison is None:
        return incident
    return replace(incident, comparison=comparison, summary=f"{comparison.summary} ({incident.summary})")
