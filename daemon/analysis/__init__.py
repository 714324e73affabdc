"""Capture analysis: read ``.xplane.pb`` traces headlessly with xprof and say what bound the training step.

Modules, in the order data flows through them:

- ``model``: the typed record (``CaptureAnalysis`` of ``WorkerAnalysis``es, ...) with ``to_json``/``from_json``.
- ``xprof``: finding a capture's traces, running xprof's tools in a private session, its per-step breakdown.
- ``timeline``: reading a trace into a timeline; finding the steps (``find_steps``).
- ``worker``: one worker's trace into a ``WorkerAnalysis``; ``classify``: naming the bottleneck.
- ``capture``: every worker of a capture, the straggler; ``compare``: what changed from the baseline.
- ``report``: the readable report; ``cli``: ``tfprofd analyze`` (``python -m tfprofd.daemon.analysis``).

Importing the package loads the model, comparison and report only (stdlib): xprof loads in the analysis
worker alone.
"""

from .compare import compare, with_comparison
from .model import PART_TYPES, PART_WORDS, CaptureAnalysis, Comparison, WorkerAnalysis
from .report import report

__all__ = ["PART_TYPES", "PART_WORDS", "CaptureAnalysis", "Comparison", "WorkerAnalysis", "compare", "report",
           "with_comparison"]
