"""Capture analysis: read ``.xplane.pb`` traces headlessly with xprof and say what bound the training step.

Modules, in the order data flows through them:

- ``model``: the typed record (``CaptureAnalysis`` of ``WorkerAnalysis``es, ...) with ``to_json``/``from_json``.
- ``xprof``: finding a capture's traces, running xprof's tools in a private session, its per-step breakdown.
- ``timeline``: reading a trace into a timeline; finding the steps (``find_steps``).
- ``worker``: one worker's trace into a ``WorkerAnalysis``; ``classify``: naming the bottleneck.
- ``capture``: every worker of a capture, the straggler; ``compare``: what changed from the baseline.
- ``report``: the readable report; ``cli``: ``tfprofd analyze`` (``python -m tfprofd.daemon.analysis``).

Importing the package loads the model only (stdlib); the comparison and the report load on first use
(the agent compares after a capture; ~0.6 MB of its resident memory otherwise): xprof loads in the analysis
worker alone.
"""

from __future__ import annotations

import importlib
from typing import Any

from .model import PART_TYPES, PART_WORDS, CaptureAnalysis, Comparison, WorkerAnalysis

_LAZY = {"compare": "compare", "with_comparison": "compare", "report": "report"}

__all__ = ["PART_TYPES", "PART_WORDS", "CaptureAnalysis", "Comparison", "WorkerAnalysis", "compare", "report",
           "with_comparison"]


def __getattr__(name: str) -> Any:
    """``compare``, ``with_comparison`` and ``report``, imported on first use (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
