"""A capture: every worker's analysis, the slowest worker's facts leading, a straggler named."""

from __future__ import annotations

import statistics
from pathlib import Path

from .classify import STRAGGLER
from .memory import refuse_unread
from .model import ONE_WINDOW, PART_WORDS, CaptureAnalysis, Straggler, WorkerAnalysis
from .worker import analyze_worker
from .xprof import find_traces


def analyze(path: Path, verbose: bool = False, max_memory: int | None = None) -> CaptureAnalysis:
    """Analyse every worker of one capture; raises AnalysisError if none can be read, TooLarge (memory.py) if
    one would need more than ``max_memory`` bytes."""
    traces = find_traces(path)
    if max_memory is not None:
        refuse_unread(traces, max_memory)
    return combine([analyze_worker(trace, verbose, max_memory) for trace in traces])


def combine(workers: list[WorkerAnalysis]) -> CaptureAnalysis:
    """A capture's analysis: the slowest worker's facts lead, every worker is listed, a straggler named."""
    timed = [w for w in workers if w.steps and w.cycle_ms is not None]
    lead = max(timed, key=lambda w: w.cycle_ms or 0.0) if timed else workers[0]
    windows = [w.window for w in workers if w.window]
    skew = overlap = None
    if len(windows) > 1:  # how far apart the workers' profiling sessions started (one window: milliseconds)
        skew = (max(a for a, _ in windows) - min(a for a, _ in windows)) / 1e6
        shortest = min(b - a for a, b in windows)
        common = min(b for _, b in windows) - max(a for a, _ in windows)
        overlap = max(0.0, common / shortest) if shortest > 0 else 0.0
    straggler, summary = None, lead.summary
    others = [w.cycle_ms or 0.0 for w in timed if w is not lead]
    separate = overlap is not None and overlap < ONE_WINDOW  # unrelated traces: no straggler among them
    if others and not separate and (lead.cycle_ms or 0.0) >= STRAGGLER * statistics.median(others):
        def parts(w: WorkerAnalysis) -> dict[str, float]:
            assert w.breakdown_ms is not None and w.between_ms is not None  # timed workers have both
            return {**w.breakdown_ms.to_json(), **w.between_ms.to_json()}

        mine = parts(lead)
        mean = {p: statistics.fmean(parts(w)[p] for w in timed if w is not lead) for p in mine}
        part = max(mean, key=lambda p: mine[p] - mean[p])
        delta = mine[part] - mean[part]
        why = (f"worker {lead.host} takes {lead.cycle_ms:.1f} ms per step (with the time between steps) "
               f"against {statistics.median(others):.1f} ms on the others: +{delta:.1f} ms per step "
               f"{PART_WORDS[part]}")
        straggler = Straggler(host=lead.host, part=part, delta_ms=delta, why=why)
        summary = f"straggler: {why}; {lead.summary}"
    return CaptureAnalysis(lead=lead, workers=tuple(workers), summary=summary, straggler=straggler,
                           window_skew_ms=skew, window_overlap=overlap)
