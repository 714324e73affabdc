"""Worker processes for captures and analyses: short-lived, bounded in number, killed as a whole.

Each worker runs ``python -m <module>`` in its own process group, so a timeout kills everything it
started. It dies with the agent even when the agent is killed with SIGKILL: the worker asks the kernel
for SIGKILL when its parent goes (``PR_SET_PDEATHSIG``) and exits at once if the parent is already gone
(``die_with_parent``, called first thing in every worker module).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

log = logging.getLogger("tfprofd.workers")

PARENT_ENV = "TFPROFD_WORKER_PARENT"
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a worker: be killed when the agent goes; exit now if it is gone already."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return  # run by hand (tfprofd analyze), not as a worker
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != int(parent):
        os._exit(1)


@dataclass(frozen=True)
class Outcome:
    """How a worker ended: ``ok`` with the JSON it printed, or a failure reason and what it said."""

    status: str  # ok, timeout, queued (no free worker in time), stopped, error
    result: dict[str, Any] | None
    detail: str = ""
    queued_s: float = 0.0  # how long it waited for a free worker


class WorkerPool:
    """Runs workers, at most ``limit`` at once; ``stop()`` kills every running one."""

    def __init__(self, name: str, limit: int):
        self.name = name
        self._slots = threading.BoundedSemaphore(limit)
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def run(self, module: str, args: list[str], stdin: str, timeout: float,
            queue_timeout: float | None = None) -> Outcome:
        """Wait at most ``queue_timeout`` (default: ``timeout``) for a free worker, then give the worker
        ``timeout`` from its start: time spent queued never shortens a worker's own time."""
        queued_at = time.monotonic()
        wait = timeout if queue_timeout is None else queue_timeout
        while not self._slots.acquire(timeout=0.2):
            if self._stopping.is_set():
                return Outcome("stopped", None, "the agent stopped", time.monotonic() - queued_at)
            if time.monotonic() - queued_at > wait:
                return Outcome("queued", None, f"no free {self.name} worker within {wait:.0f}s",
                               time.monotonic() - queued_at)
        queued_s = time.monotonic() - queued_at
        try:
            return replace(self._run(module, args, stdin, time.monotonic() + timeout), queued_s=queued_s)
        finally:
            self._slots.release()

    def _run(self, module: str, args: list[str], stdin: str, deadline: float) -> Outcome:
        if self._stopping.is_set():
            return Outcome("stopped", None, "the agent stopped")
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, start_new_session=True, umask=0o027)
        with self._lock:
            self._running.add(proc)
        try:
            out, err = proc.communicate(stdin, timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return Outcome("timeout", None, "killed at its deadline")
        finally:
            with self._lock:
                self._running.discard(proc)
        if self._stopping.is_set() and proc.returncode < 0:
            return Outcome("stopped", None, "the agent stopped")
        return _parse(out, proc.returncode, err)

    def stop(self) -> None:
        """Kill every running worker's process group; workers asked for later do not start."""
        self._stopping.set()
        with self._lock:
            running = list(self._running)
        for proc in running:
            _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _parse(out: str, returncode: int, err: str) -> Outcome:
    """A worker's JSON: all of stdout, or its last line (xprof's C++ logging may also write to stdout)."""
    lines = out.strip().splitlines()
    for candidate in (out, lines[-1] if lines else ""):
        try:
            result = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(result, dict):
            return Outcome("ok", result)
    return Outcome("error", None, f"worker exited {returncode}: {err.strip()[-500:] or 'no output'}")
