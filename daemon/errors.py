"""Domain errors: what the agent's parts raise when a request cannot be served. Only the HTTP layer
(api.py) turns them into status codes."""

from __future__ import annotations

from typing import Any


class DomainError(Exception):
    """A request the agent understood but cannot serve; ``reason`` is for the user."""

    def __init__(self, reason: str, **details: Any):
        super().__init__(reason)
        self.reason = reason
        self.details = details


class InvalidRequest(DomainError):
    """The request itself is wrong (a field out of range, an unknown option)."""


class NotFound(DomainError):
    """A named thing does not exist (a capture id)."""


class NoTrainingJob(NotFound):
    """No reporting training job matches (yet: it may start reporting later)."""


class NoProfiler(NotFound):
    """The job reports but has no profiler server the agent may use."""


class AmbiguousJob(DomainError):
    """Several jobs match and the request named none."""


class CaptureBusy(DomainError):
    """A capture of that process is running (one at a time per process)."""


class BudgetSpent(DomainError):
    """captures.max_per_hour is reached."""


class CoolingDown(DomainError):
    """The rule captured this target less than its cooldown ago."""


class CaptureHeld(DomainError):
    """A worker of the job died during one of its captures: automatic captures of it wait (captures.hold)."""


class AgentStopping(DomainError):
    """The agent is stopping (SIGTERM): it starts no capture."""


class ForwardFailed(DomainError):
    """An alert for another host could not be handed to that host's agent (a retry may reach it)."""


class StorageError(DomainError):
    """The agent cannot write its state (full disk, permissions)."""


class DiscoveryFailed(DomainError):
    """Prometheus could not say where a job's workers are (unreachable, slow, or an answer not understood)."""
