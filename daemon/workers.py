"""Worker processes for captures and analyses: one per job, bounded in number, killed as a whole.

Each worker runs ``python -m <module>`` in its own process group, so a timeout kills everything it
started. It dies with the agent even when the agent is killed with SIGKILL: the worker asks the kernel
for SIGKILL when its parent goes (``PR_SET_PDEATHSIG``) and exits at once if the parent is already gone
(``die_with_parent``, called first thing in every worker module).

A pool may keep one worker of a module started ahead of time (``prestart``): its imports are done and it
waits on its stdin for the request, so a capture does not wait for a Python process to start. A fresh one
replaces it as soon as it is taken; one that exits while idle is logged, counted and replaced (with a
growing pause if it keeps exiting at once). The kernel ties ``PR_SET_PDEATHSIG`` to the spawning *thread*,
so pre-started workers are spawned by the pool's own thread, which lives as long as the pool.
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

CAPTURE_WORKER = "tfprofd.daemon.capture_worker"  # captures and snapshot rings; one waits, started ahead
# How long a capture worker watches a process that answered with no trace or an error for a crash, on a GPU host
# (capture_worker._watched); the capture's timeout allows for it.
WATCH_AFTER_S = 5.0
PARENT_ENV = "TFPROFD_WORKER_PARENT"
READY_ENV = "TFPROFD_WORKER_READY_FD"  # a pre-started worker writes one byte there once it is ready
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


def signal_ready() -> None:
    """In a pre-started worker, once its imports are done: tell the pool it is ready for a request."""
    fd = os.environ.pop(READY_ENV, None)
    if fd is None:
        return  # started on request or by hand: nobody waits for this
    try:
        os.write(int(fd), b"1")
        os.close(int(fd))
    except (OSError, ValueError):
        pass  # the pool then shows it as not ready; its request is served all the same


@dataclass(frozen=True)
class Outcome:
    """How a worker ended: ``ok`` with the JSON it printed, or a failure reason and what it said."""

    status: str  # ok, timeout, queued (no free worker in time), stopped, error
    result: dict[str, Any] | None
    detail: str = ""
    queued_s: float = 0.0  # how long it waited for a free worker
    pid: int | None = None
    prestarted: bool = False  # the worker was started ahead of the request


@dataclass(frozen=True)
class SpareState:
    """The pre-started worker as /healthz and the metrics show it."""

    ready: bool  # one is started, its imports done, waiting
    pid: int | None
    used: dict[str, int]  # workers handed a request, by how they started: prestarted, cold
    idle_exits: int  # pre-started workers that exited while waiting (and were replaced)
    last_exit: str  # what happened to the latest one that exited while idle or could not start; "" if none


SPARE_BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 15.0, 60.0)  # pause before a new spare, by consecutive quick exits
SPARE_QUICK_EXIT_S = 10.0  # a spare that lived less than this counts as failing to start
SPARE_READY_S = 30.0  # a spare not ready this long after it started is stuck (an import that hangs): replaced


class WorkerPool:
    """Runs workers, at most ``limit`` at once; ``stop()`` kills every running one."""

    def __init__(self, name: str, limit: int, prestart: str | None = None):
        self.name = name
        self.prestart = prestart  # module of which one worker waits, started ahead of its request
        self._slots = threading.BoundedSemaphore(limit)
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._spare: subprocess.Popen | None = None
        self._spare_born = 0.0
        self._spare_taken = False  # a request took the spare since the keeper last looked
        self._ready_pid: int | None = None  # the latest pre-started worker that said it is ready
        self._wake = threading.Event()
        self._keeper: threading.Thread | None = None
        self._used = {"prestarted": 0, "cold": 0}
        self._idle_exits = 0
        self._last_exit = ""

    def start(self) -> None:
        """Start keeping a pre-started worker (if the pool has ``prestart``)."""
        if self.prestart and self._keeper is None and not self._stopping.is_set():
            self._keeper = threading.Thread(target=self._keep_spare, daemon=True, name=f"tfprofd-{self.name}-spare")
            self._keeper.start()

    @property
    def stopping(self) -> bool:
        """``stop()`` ran: the workers were killed, and none starts."""
        return self._stopping.is_set()

    def state(self) -> SpareState:
        with self._lock:
            spare = self._spare
            ready = spare is not None and spare.poll() is None and self._ready_pid == spare.pid
            return SpareState(ready, spare.pid if spare else None,
                              dict(self._used), self._idle_exits, self._last_exit)

    def run(self, module: str, args: list[str], stdin: str, timeout: float,
            queue_timeout: float | None = None) -> Outcome:
        """Wait at most ``queue_timeout`` (default: ``timeout``) for a free worker, then give the worker
        ``timeout`` from its start: time spent queued never shortens a worker's own time."""
        queued_at = time.monotonic()
        wait = timeout if queue_timeout is None else queue_timeout
        refused = self._acquire(wait)
        if refused is not None:
            return replace(refused, queued_s=time.monotonic() - queued_at)
        queued_s = time.monotonic() - queued_at
        try:
            return replace(self._run(module, args, stdin, time.monotonic() + timeout), queued_s=queued_s)
        finally:
            self._slots.release()

    def _acquire(self, wait: float) -> Outcome | None:
        """Take one of the pool's places within ``wait`` seconds; None once taken, else why not."""
        queued_at = time.monotonic()
        while not self._slots.acquire(timeout=0.2):
            if self._stopping.is_set():
                return Outcome("stopped", None, "the agent stopped")
            if time.monotonic() - queued_at > wait:
                return Outcome("queued", None, f"no free {self.name} worker within {wait:.0f}s")
        return None

    def take(self, module: str, queue_timeout: float) -> tuple[subprocess.Popen, bool] | Outcome:
        """A worker of ``module`` to talk to over its stdin and stdout for as long as the caller needs (the
        pre-started one if it waits: no process start), and whether it was pre-started; it holds one of the
        pool's places until ``put_back``. An Outcome says why there is none (stopped, queued, error)."""
        refused = self._acquire(queue_timeout)
        if refused is not None:
            return refused
        if self._stopping.is_set():
            self._slots.release()
            return Outcome("stopped", None, "the agent stopped")
        started = self._start(module, [])
        if isinstance(started, Outcome):
            self._slots.release()
        return started

    def _start(self, module: str, args: list[str]) -> tuple[subprocess.Popen, bool] | Outcome:
        """The pre-started worker if it is of ``module`` and waits, else a new one, and whether it was pre-started;
        it counts as running (``stop()`` kills it). An Outcome says why none could start."""
        proc = self._take_spare() if module == self.prestart and not args else None
        prestarted = proc is not None
        if proc is None:
            try:
                proc = _spawn(module, args)
            except OSError as exc:  # out of processes, descriptors or memory
                return Outcome("error", None, f"cannot start a {self.name} worker: {exc}")
        with self._lock:
            self._running.add(proc)
            self._used["prestarted" if prestarted else "cold"] += 1
        return proc, prestarted

    def put_back(self, proc: subprocess.Popen) -> None:
        """End a worker from ``take`` (killed if it still runs) and free its place."""
        if proc.poll() is None:
            _kill_group(proc)
        proc.wait()
        with self._lock:
            self._running.discard(proc)
        self._slots.release()

    def _run(self, module: str, args: list[str], stdin: str, deadline: float) -> Outcome:
        if self._stopping.is_set():
            return Outcome("stopped", None, "the agent stopped")
        started = self._start(module, args)
        if isinstance(started, Outcome):
            return started
        proc, prestarted = started
        log.debug("%s worker pid %d (%s) took a request", self.name, proc.pid, "pre-started" if prestarted else "cold")
        try:
            out, err = proc.communicate(stdin, timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return Outcome("timeout", None, "killed at its deadline", pid=proc.pid, prestarted=prestarted)
        finally:
            with self._lock:
                self._running.discard(proc)
        if self._stopping.is_set() and proc.returncode < 0:
            return Outcome("stopped", None, "the agent stopped", pid=proc.pid, prestarted=prestarted)
        outcome = _parse(out, proc.returncode, err)
        return Outcome(outcome.status, outcome.result, outcome.detail, pid=proc.pid, prestarted=prestarted)

    def _take_spare(self) -> subprocess.Popen | None:
        """The waiting pre-started worker if it is alive and said it is ready (one still starting may be stuck
        in an import: the keeper replaces it past SPARE_READY_S, and a request meanwhile gets a worker of its
        own); the keeper starts the next one at once."""
        with self._lock:
            spare = self._spare
            if spare is not None and self._ready_pid != spare.pid:
                return None
            self._spare = None
            alive = spare is not None and spare.poll() is None
            self._spare_taken |= alive  # before the keeper wakes: it starts the next one without its backoff
        self._wake.set()
        if spare is not None and not alive:  # died just now: the keeper did not see it yet
            self._spare_exited(spare)
            return None
        return spare

    def _keep_spare(self) -> None:
        """The pool's thread: keeps one pre-started worker waiting; replaces it when taken or when it exits.
        Should it fail, captures go on in workers started on request, and health says why."""
        try:
            self._keep_spare_loop()
        except Exception as exc:
            with self._lock:
                self._last_exit = f"no more pre-started {self.name} workers: {type(exc).__name__}: {exc}"
            log.exception("%s", self._last_exit)

    def _keep_spare_loop(self) -> None:
        quick_exits = 0
        while not self._stopping.is_set():
            with self._lock:
                spare = self._spare
                if self._spare_taken:
                    quick_exits = 0  # a request took it: the next one waits for nothing
                    self._spare_taken = False
                stuck = spare is not None and self._ready_pid != spare.pid \
                    and time.monotonic() - self._spare_born > SPARE_READY_S
                if stuck:
                    self._spare = None
            if stuck and spare is not None:
                _kill_group(spare)
                spare.wait()
                with self._lock:
                    self._running.discard(spare)
                    self._idle_exits += 1
                    self._last_exit = (f"the pre-started {self.name} worker (pid {spare.pid}) was not ready "
                                       f"{SPARE_READY_S:.0f}s after it started; it was killed and a new one started")
                log.warning("%s", self._last_exit)
                quick_exits += 1
                spare = None
            if spare is not None and spare.poll() is not None:
                with self._lock:
                    idle = self._spare is spare
                    if idle:
                        self._spare = None
                if idle:
                    self._spare_exited(spare)
                    quick_exits = quick_exits + 1 if time.monotonic() - self._spare_born < SPARE_QUICK_EXIT_S else 0
                spare = None
            if spare is None:
                if self._stopping.wait(SPARE_BACKOFF_S[min(quick_exits, len(SPARE_BACKOFF_S) - 1)]):
                    break
                try:
                    spare, ready_r = _spawn_waiting(self.prestart or "")
                except OSError as exc:
                    quick_exits += 1
                    with self._lock:
                        self._last_exit = f"cannot start a {self.name} worker: {exc}"
                    log.error("%s", self._last_exit)
                    continue
                with self._lock:
                    self._spare, self._spare_born = spare, time.monotonic()
                    self._running.add(spare)
                threading.Thread(target=self._watch, args=(spare, ready_r), daemon=True,
                                 name=f"tfprofd-{self.name}-watch-{spare.pid}").start()
                if self._stopping.is_set():  # stop() may have run between the spawn and the lock
                    _kill_group(spare)
                    break
            with self._lock:
                waiting = self._spare is not None and self._ready_pid != self._spare.pid
                left = self._spare_born + SPARE_READY_S - time.monotonic()
            self._wake.wait(max(left, 0.1) if waiting else None)  # a spare still starting: till its deadline
            self._wake.clear()

    def _watch(self, proc: subprocess.Popen, ready_fd: int) -> None:
        """Note when the pre-started worker is ready (a byte on its pipe; none if it exits first) and when it
        exits."""
        try:
            ready = os.read(ready_fd, 1) == b"1"
        finally:
            os.close(ready_fd)
        if ready:
            with self._lock:
                self._ready_pid = proc.pid
            self._wake.set()  # the keeper stops counting its start
        proc.wait()
        self._wake.set()

    def _spare_exited(self, spare: subprocess.Popen) -> None:
        """A pre-started worker exited before it was given a request: say so (log, health, metrics)."""
        try:
            err = spare.stderr.read() if spare.stderr else ""
        except (OSError, ValueError):
            err = ""
        with self._lock:
            self._running.discard(spare)
            if self._stopping.is_set():
                return
            self._idle_exits += 1
            self._last_exit = (f"the pre-started {self.name} worker (pid {spare.pid}) exited while idle with "
                             f"{_exit_words(spare.returncode)}{': ' + err.strip()[-300:] if err.strip() else ''}; "
                             "a new one is started")
        log.warning("%s", self._last_exit)

    def stop(self) -> None:
        """Kill every running worker's process group (the pre-started one too); workers asked for later do not
        start."""
        self._stopping.set()
        self._wake.set()
        with self._lock:
            running = list(self._running)
        for proc in running:
            _kill_group(proc)


def _spawn(module: str, args: list[str], ready_fd: int | None = None) -> subprocess.Popen:
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    if ready_fd is not None:
        env[READY_ENV] = str(ready_fd)
    return subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True, umask=0o027,
                            pass_fds=() if ready_fd is None else (ready_fd,))


def _spawn_waiting(module: str) -> tuple[subprocess.Popen, int]:
    """A pre-started worker and the pipe on which it says it is ready."""
    ready_r, ready_w = os.pipe()
    try:
        return _spawn(module, [], ready_w), ready_r
    except OSError:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)


def _exit_words(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


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
