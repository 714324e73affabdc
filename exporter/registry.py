"""The one list of collectors: name → class. Config reads their options from it, rule validation their
signals, and the agent builds them from it."""

from __future__ import annotations

from .base import Collector
from .cpu import CpuCollector
from .disk import DiskCollector
from .kubernetes import KubernetesCollector
from .memory import MemoryCollector
from .network import NetworkCollector
from .nvml import NvmlCollector
from .training import TrainingCollector

COLLECTORS: dict[str, type[Collector]] = {c.name: c for c in (
    NvmlCollector, CpuCollector, MemoryCollector, DiskCollector, NetworkCollector, TrainingCollector,
    KubernetesCollector)}


def signal_catalog() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every rule signal: (the collector that produces it, the labels of its series)."""
    return {signal: (name, labels) for name, cls in COLLECTORS.items() for signal, labels in cls.signals.items()}
