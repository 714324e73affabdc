"""What changed from the job's baseline capture to an incident: throughput, step time, parts, ops.

Ops are compared by identity, not by name: tf.data names carry ``.repeat()``'s pass number
(``ForeverRepeat[28]``) and Keras numbers its layers (``dense_3``, ``dense_7``) anew in every process, so
the names are normalised first and the ops that share an identity are added up.
"""

from __future__ import annotations

import re
from dataclasses import replace

from .model import OP_KINDS, PART_TYPES, PART_WORDS, CaptureAnalysis, Comparison, OpChange, OpTime, Pair, PartChange

CAUSE_PARTS = {"input": ("input_wait",), "transfer": ("host_to_device",), "host": ("host_compute", "kernel_launch",
               "other"), "device": ("device_compute", "device_to_device", "device_collectives")}
MOVED = 0.25  # a part that moved by this share of the step time's change is worth naming
FASTER = 0.05  # an incident whose steps are this much shorter than the baseline's is an improvement
TOP = 8  # ops listed per kind in an analysis (worker.ops_per_step)

_PASS = re.compile(r"\[\d+\]")  # Iterator::...::ForeverRepeat[28]::Map
_SUFFIX = re.compile(r"(?<=[A-Za-z])(?:_\d+)+(?=/|:|$)")  # dense_3/MatMul_1, sequential_1/dense_1_2


def op_identity(name: str) -> str:
    """An op's name without what changes from run to run: pass numbers, layer and op suffixes."""
    return _SUFFIX.sub("", _PASS.sub("", name))


def _by_identity(ops: tuple[OpTime, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for o in ops:
        key = op_identity(o.name)
        out[key] = out.get(key, 0.0) + o.ms_per_step
    return out


def _parts_that_moved(parts: list[PartChange], step_delta: float, cause: str) -> list[PartChange]:
    """The parts worth naming in the summary (at most three): those that moved by a good share of the step
    time's change, the cause's own parts first (on a shared CPU, heavy preprocessing slows compute too)."""
    moved = [d for d in parts if abs(d.delta_ms) >= MOVED * abs(step_delta)] or parts[:1]
    own = CAUSE_PARTS.get(cause, ())
    return sorted(moved, key=lambda d: (d.part not in own, -abs(d.delta_ms)))[:3]


def _op_changes(baseline: CaptureAnalysis, incident: CaptureAnalysis) -> tuple[list[OpChange], list[OpChange]]:
    """(ops whose self time per step changed, largest first; top ops of the baseline gone from the incident's)."""
    changed, gone = [], []
    for kind in OP_KINDS:
        old, new = _by_identity(baseline.lead.ops.of(kind)), _by_identity(incident.lead.ops.of(kind))
        floor = min(new.values()) if len(incident.lead.ops.of(kind)) >= TOP else 0.0  # below it: maybe just unlisted
        for name, after in new.items():
            before = old.get(name, 0.0)
            if after != before:
                changed.append(OpChange(name, kind, before, after, after - before))
        gone += [OpChange(name, kind, before, 0.0, -before) for name, before in old.items()
                 if name not in new and before > floor]
    return sorted(changed, key=lambda o: -abs(o.delta_ms)), sorted(gone, key=lambda o: o.delta_ms)


def _faster(before: float, after: float, rates: Pair, batches: Pair, kind: str) -> bool:
    """Whether the incident trains faster than the baseline: by samples/s where the job reported them, else by
    time per sample where the batch sizes are known, else by the time from one step to the next (``before``,
    ``after``: the step with the time after it), unless the incident's steps are mostly per-step overhead
    (small_batch: a shorter step then carries less work, not more speed)."""
    if rates[0] and rates[1]:
        return rates[1] >= (1 + FASTER) * rates[0]
    if batches[0] and batches[1]:
        return after / batches[1] <= (1 - FASTER) * before / batches[0]
    return after <= (1 - FASTER) * before and kind != "small_batch"


def compare(baseline: CaptureAnalysis, incident: CaptureAnalysis, rates: Pair = (None, None),
            batches: Pair = (None, None), reference: str = "the baseline") -> Comparison | None:
    """What changed from the job's baseline capture to this one (None if either has no steps). ``reference``
    names the baseline in the summary (a job record compares a straggler with another worker)."""
    b, i = baseline.lead, incident.lead
    if not b.steps or not i.steps or b.step_time_ms is None or i.step_time_ms is None \
            or b.breakdown_ms is None or i.breakdown_ms is None:
        return None
    before, after = b.step_time_ms.mean, i.step_time_ms.mean
    faster = _faster(b.cycle_ms or before, i.cycle_ms or after, rates, batches, i.bottleneck)
    parts = sorted((PartChange(p, b.breakdown_ms[p], i.breakdown_ms[p], i.breakdown_ms[p] - b.breakdown_ms[p])
                    for p in PART_TYPES), key=lambda d: -abs(d.delta_ms))
    changed, gone = _op_changes(baseline, incident)
    # a slower run names the ops that grew; a faster one those that shrank
    ops = [o for o in changed if (o.delta_ms < 0 if faster else o.delta_ms > 0)][:5]
    ops_busy, between = (b.ratios.ops_busy, i.ratios.ops_busy), (b.ratios.between_steps, i.ratios.between_steps)
    lead = []
    if rates[0] and rates[1]:
        lead.append(f"samples/s {rates[0]:.0f} → {rates[1]:.0f} ({rates[1] / rates[0] - 1:+.0%})")
    if batches[0] and batches[1] and batches[0] != batches[1]:
        lead.append(f"batch {batches[0]:.0f} → {batches[1]:.0f}")
    lead.append(f"step time {before:.1f} → {after:.1f} ms ({after - before:+.1f} ms per step)")
    if b.cycle_ms and i.cycle_ms and max(b.cycle_ms / before, i.cycle_ms / after) >= 1.25:  # much time between steps
        lead.append(f"step to step {b.cycle_ms:.1f} → {i.cycle_ms:.1f} ms")
    detail = ", ".join(f"{d.delta_ms:+.1f} ms {PART_WORDS[d.part]}"
                       for d in _parts_that_moved(parts, after - before, i.bottleneck))
    if between[0] is not None and between[1] is not None and abs(between[1] - between[0]) >= 0.2 \
            and (between[1] < between[0]) == faster:
        detail = f"time between steps {between[0]:.0%} → {between[1]:.0%} of the stepping span"
    if i.bottleneck == "small_batch" and not faster and ops_busy[0] is not None and ops_busy[1] is not None:
        detail = f"ops busy {ops_busy[0]:.0%} → {ops_busy[1]:.0%} of the step (per-step overhead dominates)"
    if ops:
        o = ops[0]
        growth = f"×{o.after_ms / o.before_ms:.2g}" if o.before_ms > 0 else "new"
        detail += f"; {o.name} self time {growth} ({o.before_ms:.2f} → {o.after_ms:.2f} ms per step)"
    if gone:
        detail += "; no longer among the top ops: " + ", ".join(f"{o.name} ({o.before_ms:.2f} ms per step before)"
                                                             for o in gone[:3])
    if faster:
        summary = f"faster than {reference}: {', '.join(lead)}: {detail}; now: {i.bottleneck}"
    else:
        summary = f"{', '.join(lead)}: {detail}; cause: {i.bottleneck}"
    return Comparison(summary=summary, step_ms=(before, after, after - before), parts=tuple(parts), ops=tuple(ops),
                      samples_per_second=rates, batch_size=batches, ops_busy=ops_busy, between_steps=between,
                      baseline_trace=b.trace, gone=tuple(gone), faster=faster)


def with_comparison(incident: CaptureAnalysis, comparison: Comparison | None) -> CaptureAnalysis:
    """The incident with what changed from its baseline leading its summary (unchanged without one)."""
    if comparison is None:
        return incident
    return replace(incident, comparison=comparison, summary=f"{comparison.summary} ({incident.summary})")
