"""A capture: every worker's analysis, the slowest worker's facts leading, a straggler named."""

from __future__ import annotations

import statistics
from pathlib import Path

from .classify import STRAGGLER
from .model import ONE_WINDOW, PART_WORDS, CaptureAnalysis, Straggler, WorkerAnalysis
from .worker import analyze_worker
from .xprof import AnalysisError, find_traces

# An analysis's peak memory against its largest trace, measured by bench/analysis_cost.py; xprof's own conversion
# peaks the same (its converters hold the whole trace). What grows is the events and their stats, not the bytes:
# 29 bytes of memory per byte of a CPU trace with few stats per event, 81 per byte of the Keras demo job's trace,
# 17 per byte of a GPU trace. Traces where xprof finds many steps (short steps, steps_per_execution > 1) peak
# highest per event: calibrated on every recorded trace enlarged to 25 MB, the estimate is 1.15-2.9x the peak
# (1 KiB an event was under it by up to 24% on five of them, issue 24).
BASE_BYTES = 64 * 1024**2  # Python, xprof's libraries
BYTES_PER_EVENT = 1664
BYTES_PER_STAT = 320
FLOOR_PER_TRACE_BYTE = 8  # no trace measured needs less: larger than max/8 is too large unread


class TooLarge(AnalysisError):
    """The capture's analysis would need more memory than it may have."""


def needed_memory(trace: Path, max_bytes: int) -> int:
    """The memory analysing ``trace`` needs (estimated from its events and stats; from its size alone where that
    is already more than ``max_bytes``, so a huge trace is not read to be refused)."""
    from ..protos import xplane_pb2

    size = trace.stat().st_size
    if FLOOR_PER_TRACE_BYTE * size > max_bytes:
        return FLOOR_PER_TRACE_BYTE * size
    try:
        space = xplane_pb2.XSpace.FromString(trace.read_bytes())
    except Exception:  # a corrupt trace: xprof's own error says what is wrong with it
        return 0
    events = stats = 0
    for plane in space.planes:
        for line in plane.lines:
            events += len(line.events)
            stats += sum(len(event.stats) for event in line.events)
    return BASE_BYTES + BYTES_PER_EVENT * events + BYTES_PER_STAT * stats


def check_memory(path: Path, max_bytes: int) -> None:
    """Raise TooLarge, saying what to do, if analysing the capture would need more than ``max_bytes``."""
    for trace in find_traces(path):
        needed = needed_memory(trace, max_bytes)
        if needed > max_bytes:
            raise TooLarge(f"{trace.name} ({trace.stat().st_size / 1e6:.0f} MB) needs about {needed / 2**20:.0f} MiB "
                           f"to analyse, more than captures.analysis_max_memory ({max_bytes / 2**20:.0f} MiB) "
                           f"allows: take shorter captures (captures.duration, or duration_ms), or raise "
                           f"captures.analysis_max_memory with the memory limit; the trace is kept for `tfprofd "
                           f"analyze` on a machine with more memory")


def analyze(path: Path, verbose: bool = False) -> CaptureAnalysis:
    """Analyse every worker of one capture; raises AnalysisError if none can be read."""
    return combine([analyze_worker(trace, verbose) for trace in find_traces(path)])


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
