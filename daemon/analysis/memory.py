"""How much memory a trace's analysis needs, and refusing one that would need more than it may have.

An analysis's peak memory against its largest trace, measured by bench/analysis_cost.py; xprof's own conversion
peaks the same (its converters hold the whole trace). What grows is the events and their stats, not the bytes:
29 bytes of memory per byte of a CPU trace with few stats per event, 81 per byte of the Keras demo job's trace,
17 per byte of a GPU trace. Traces where xprof finds many steps (short steps, steps_per_execution > 1) peak
highest per event: calibrated on every recorded trace enlarged to 25 MB, the estimate is 1.15-2.9x the peak
(1 KiB an event was under it by up to 24% on five of them, issue 24).

The estimate is made from the trace the analysis parses anyway (a second parse and a loop over every event's
stats cost 0.4 s of a 25 MB trace's analysis, issue 24): events are counted per line, stats on a sample of each
long line's events.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from .xprof import AnalysisError

if TYPE_CHECKING:
    from ..protos.xplane_pb2 import XSpace

BASE_BYTES = 64 * 1024**2  # Python, xprof's libraries
BYTES_PER_EVENT = 1664
BYTES_PER_STAT = 320
FLOOR_PER_TRACE_BYTE = 8  # no trace measured needs less: larger than max/8 is too large unread
SAMPLED = 2048  # a line's events whose stats are counted; more and the line's stats are estimated from these


class TooLarge(AnalysisError):
    """The capture's analysis would need more memory than it may have."""


def needed_memory(space: XSpace) -> int:
    """The memory analysing the parsed trace needs, estimated from its events and their stats. A line's stats
    are counted on up to ``SAMPLED`` of its events drawn at random (evenly spaced ones could fall in step with
    a line's pattern: every other event a marker), the same draw for the same line."""
    events = stats = 0
    for plane in space.planes:
        for line in plane.lines:
            line_events = line.events
            count = len(line_events)
            events += count
            if count <= SAMPLED:
                stats += sum(len(event.stats) for event in line_events)
            else:
                drawn = random.Random(count).sample(range(count), SAMPLED)
                stats += round(sum(len(line_events[i].stats) for i in drawn) * count / SAMPLED)
    return BASE_BYTES + BYTES_PER_EVENT * events + BYTES_PER_STAT * stats


def refuse(trace: Path, needed: int, max_bytes: int) -> None:
    """Raise TooLarge, saying what to do, if ``needed`` bytes are more than ``max_bytes``."""
    if needed > max_bytes:
        raise TooLarge(f"{trace.name} ({trace.stat().st_size / 1e6:.0f} MB) needs about {needed / 2**20:.0f} MiB "
                       f"to analyse, more than captures.analysis_max_memory ({max_bytes / 2**20:.0f} MiB) "
                       f"allows: take shorter captures (captures.duration, or duration_ms), or raise "
                       f"captures.analysis_max_memory with the memory limit; the trace is kept for `tfprofd "
                       f"analyze` on a machine with more memory")


def refuse_unread(traces: list[Path], max_bytes: int) -> None:
    """Refuse, before any is read, a capture with a trace too large by its size alone."""
    for trace in traces:
        refuse(trace, FLOOR_PER_TRACE_BYTE * trace.stat().st_size, max_bytes)
