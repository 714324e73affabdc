"""The agent: composes collectors, sampling, the job registry, rules, captures and the HTTP servers, and
runs them: reload on SIGHUP, stop on SIGTERM or SIGINT."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import psutil
from prometheus_client.core import Metric

from tfprofd.exporter.base import Clock, Collector, Environment, HostPaths
from tfprofd.exporter.registry import COLLECTORS, signal_catalog

from . import __version__, logs
from . import config as configmod
from .api import ControlApi, Token, alert_is_for_host
from .baselines import Baselines
from .captures import CaptureService
from .cluster import PeerFinder
from .forwarding import AlertForwarder
from .health import AGENT_PART, Endpoints
from .hostcontext import HostMonitor
from .httpserver import EventLoop, HttpServer, Router
from .jobcapture import JobCaptures, PeerClient
from .jobs import JobRegistry
from .pending import on_transition
from .policy import CapturePolicy
from .records import RecordStore, make_dir
from .rules import PENDING, Engine, Transition, log_transition
from .sampler import CollectorRunner, SamplingThread, Snapshot
from .workers import WATCH_AFTER_S

log = logging.getLogger("tfprofd.agent")
M_ARENA_MAX = -8  # mallopt parameter (malloc.h)
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
GC_YOUNG_OBJECTS = 10_000  # see release_startup_memory
CLOSE_WAIT_S = 0.5  # how long stop() waits for the collectors to close, all together


class StartError(Exception):
    """The agent cannot start; the message is one line for the user."""


class Agent:
    """One running tfprofd. ``start()`` returns once it serves; ``wait()`` blocks until it stops."""

    def __init__(self, cfg: configmod.Config, reload_source: Callable[[], configmod.Config] | None = None,
                 clock: Clock | None = None, nvml: object = None):
        self.cfg = cfg
        self.reload_source = reload_source
        self.env = Environment(HostPaths(Path(cfg.core.procfs_path), Path(cfg.core.sysfs_path)), clock or Clock(),
                               nvml)  # type: ignore[arg-type]
        self.jobs = JobRegistry()
        self.engine = Engine(list(cfg.rules), signal_catalog())
        self.collectors: dict[str, Collector] = {}
        self.runners: dict[str, CollectorRunner] = {}
        # the collectors that never block take turns on one thread (one wake an interval for all of them)
        self.sampler = SamplingThread("sampler", lambda: self.cfg.core.interval, self.env.clock, shared=True)
        self.servers: list[HttpServer] = []
        self.loop = EventLoop()
        self.captures: CaptureService | None = None
        self.store: RecordStore | None = None
        # Signals arrive as bytes on a socket pair (signal.set_wakeup_fd): the kernel may deliver one to any
        # thread, and only a write to a file descriptor wakes a main thread blocked waiting for it.
        self._signals, self._signal_writer = socket.socketpair()
        self._signal_writer.setblocking(False)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._live_failed: set[str] = set()
        self._serving = False

    def start(self) -> None:
        logs.setup(self.cfg.core.log_level)
        # A scrape waits for the GIL while a sampling thread runs Python; at CPython's default 5 ms
        # switch interval that wait dominated the p99 of /metrics. 0.5 ms bounds it.
        sys.setswitchinterval(0.0005)
        psutil.PROCFS_PATH = self.cfg.core.procfs_path
        state_dir = prepare_state_dir(Path(self.cfg.core.state_dir))
        token = Token.resolve(self.cfg.api.token, self.cfg.api.token_file, state_dir)
        store = self.store = RecordStore(state_dir)
        policy = CapturePolicy(self.env.clock, state_dir / "alerts_seen.json")
        self.host = HostMonitor(self.env.paths, self.jobs, self.env.clock)
        self.captures = CaptureService(lambda: self.cfg.captures, store, policy, self.jobs, self.env.clock, self.host)
        self.baselines = Baselines(lambda: self.cfg.captures, self.captures, self.jobs, self.engine, self.env.clock)
        metrics, api = Router(), Router()
        self.endpoints = Endpoints(metrics, __version__, lambda: self.runners, self._live, lambda: self.servers,
                                   self._stopping.is_set, lambda: self.cfg.core.interval,
                                   lambda: store.state.last_refusal)
        forwarder = AlertForwarder(lambda: self.cfg.alerts, lambda: self.servers[1].address[1], token.current,
                                   lambda: self.cfg.alerts.host_value or socket.gethostname())
        jobwide = JobCaptures(
            lambda: PeerFinder(self.cfg.cluster, self.cfg.alerts.forward_networks, self.servers[1].address[1]),
            self.captures, store, PeerClient(token.current, lambda: self.cfg.alerts.host_value or socket.gethostname()),
            lambda: (self.cfg.captures.timeout + self.cfg.captures.delay + WATCH_AFTER_S,  # a peer's capture, then
                     self.cfg.captures.analysis_timeout + self.cfg.captures.analysis_queue_timeout),  # its analysis
            lambda: self.cfg.captures.keep)
        ControlApi(api, self.captures, policy, lambda labels: alert_is_for_host(
            labels, self.cfg.alerts.host_label, self.cfg.alerts.host_value), forwarder, jobwide)
        self.servers.append(HttpServer("metrics", self.cfg.core.listen, metrics, max_body=lambda: 4096))
        self.servers.append(HttpServer("api", self.cfg.api.listen, api, max_body=lambda: self.cfg.api.max_body_bytes,
                                       authenticate=token.authenticate))
        self.captures.on_change = lambda: self.endpoints.exposition.forget(AGENT_PART)
        capture_workers = self.captures.capture_workers
        self.endpoints.workers = lambda: {"capture": asdict(capture_workers.state())}
        with self._lock:
            self._apply()
        deadline = self.env.clock.monotonic() + 2.0  # the first scrape has data, unless a collector hangs
        for runner in self.runners.values():
            runner.first_sample.wait(max(0.0, deadline - self.env.clock.monotonic()))
        self.loop.start()
        for server in self.servers:
            server.start(self.loop)
        release_startup_memory()
        self.captures.enforce_retention()
        self._serving = True
        self.captures.start_workers()
        log.info("tfprofd %s serving metrics on %s:%d, control API on %s:%d, hook reports on %s", __version__,
                 *self.servers[0].address, *self.servers[1].address, self._hook_where())

    def _hook_where(self) -> str:
        hook = self.cfg.hook
        where = (([f"unix {hook.socket}"] if hook.socket else [])
                 + ([f"udp {hook.listen[0]}:{hook.listen[1]}"] if hook.listen else []))
        return " and ".join(where) if hook.enabled and where else "off"

    def _live(self) -> list[Metric]:
        """Families computed at scrape time from the agent's state; a part that fails is left out, once logged."""
        out: list[Metric] = []
        for name, source in (("rules", self.engine), ("captures", self.captures), ("jobs", self.jobs),
                             ("state_dir", self.store)):
            try:
                out += source.collect() if source is not None else []
            except Exception:
                if name not in self._live_failed:
                    self._live_failed.add(name)
                    log.exception("the %s metrics failed; the scrape goes on without them", name)
        return out

    def _apply(self) -> None:
        """Start, reconfigure and stop collectors to match the configuration."""
        for name, cls in COLLECTORS.items():
            settings = self.cfg.collectors[name]
            if settings.enabled and name not in self.collectors:
                collector = self.collectors[name] = cls(settings, self.env)
                runner = self.runners[name] = CollectorRunner(
                    collector, lambda: self.cfg.core.interval, self.env.clock,
                    [self.jobs.on_snapshot, self._on_snapshot, self.baselines.on_snapshot, self.endpoints.after_sample,
                     self.host.on_snapshot])
                runner.start(self.sampler if cls.never_blocks else None)
            elif settings.enabled:
                self.collectors[name].configure(settings)
            elif name in self.collectors:
                self.runners.pop(name).stop()  # a sample that finishes afterwards is not published
                self.endpoints.exposition.forget(AGENT_PART)  # at once: its collector_success series goes too
                self.endpoints.exposition.forget(name)
                close_soon(self.collectors.pop(name))
                self.jobs.forget(name)
                log.info("collector %s disabled", name)

    def _on_snapshot(self, snapshot: Snapshot) -> None:
        """Evaluate the rules on a new sample; a rule that captures asks for a capture when it goes pending
        (captures.on_pending) or fires."""
        transitions = self.engine.observe(snapshot.collector, snapshot.monotonic, snapshot.signals,
                                          self.jobs.is_training)
        if transitions:
            self.endpoints.agent_changed()  # rendered by this sample's after_sample, the next subscriber
        for t in transitions:
            log_transition(t)
            if t.rule.capture and self.captures is not None:
                on_transition(t, self.captures, self.cfg.captures.on_pending, self.cfg.core.interval,
                              self._drop_at(t) if t.kind == PENDING else None)

    def _drop_at(self, t: Transition) -> float | None:
        """When the job's steps slowed (Unix time), from the hook's step times, if they show it."""
        job = t.labels.get("training_job")
        if not job:
            return None
        from .analysis.onset import drop_time  # on a pending rule only: ~0.4 MB of resident memory otherwise

        at = drop_time(self.engine.history("step_seconds", {"training_job": job}))
        return None if at is None else at + self.env.clock.time() - self.env.clock.monotonic()

    def reload(self) -> bool:
        """Re-read the config; on any problem keep the running one and log every problem."""
        try:
            new = self.reload_source() if self.reload_source else None
        except configmod.ConfigError as exc:
            for problem in exc.problems:
                log.error("config reload rejected: %s", problem)
            return False
        except Exception:  # whatever a file does to the loader, the running agent stays
            log.exception("config reload rejected")
            return False
        if new is None:
            return False
        new, kept = configmod.keep_restart_only(new, self.cfg)
        for key in kept:
            log.warning("%s changed; it takes effect after a restart", key)
        with self._lock:
            self.cfg = new
            logs.setup(new.core.log_level)
            for t in self.engine.set_rules(list(new.rules)):
                log_transition(t)
                if t.rule.capture and self.captures is not None:  # nothing kept or captured anew for it
                    on_transition(t, self.captures, new.captures.on_pending, new.core.interval, None)
            try:
                self._apply()
            except OSError as exc:
                log.error("config reloaded, but a collector could not start: %s", exc)
        log.info("config reloaded from %s", new.path or "defaults")
        return True

    def install_signal_handlers(self) -> None:
        """Route SIGTERM, SIGINT and SIGHUP to ``wait()`` (call from the main thread, before threads start)."""
        for sig in STOP_SIGNALS | {signal.SIGHUP}:
            signal.signal(sig, lambda *_: None)  # the wakeup fd carries the signal; the handler only catches it
        signal.set_wakeup_fd(self._signal_writer.fileno(), warn_on_full_buffer=False)

    def wait(self) -> None:
        """Block until asked to stop, reloading whenever asked."""
        while True:
            for signum in self._signals.recv(64):
                if signum in STOP_SIGNALS:
                    self.stop()
                    return
                if signum == signal.SIGHUP:
                    self.reload()

    def stop(self) -> None:
        """Stop everything within about a second; a collector blocked in a library call is left behind.

        Collectors close on threads of their own from the start, side by side with the captures and the
        servers (the hook's socket file goes at once), and are waited for together, not one after another."""
        self._stopping.set()
        for runner in self.runners.values():
            runner.stop()
        self.sampler.stop()
        closers = [close_soon(c) for c in self.collectors.values()]
        deadline = time.monotonic() + CLOSE_WAIT_S
        if self.captures is not None:
            self.captures.stop()
        for server in self.servers:
            server.stop(self.loop)
        self.loop.stop()
        for closer in closers:
            closer.join(max(0.0, deadline - time.monotonic()))
        if self._serving:  # a start that failed said why on stderr; it never ran
            log.info("tfprofd stopped")


def limit_malloc_arenas(arenas: int = 1) -> None:
    """glibc gives each new thread its own malloc arena (up to 8 per core); a dozen mostly idle threads
    then hold ~1 MB they never use. One arena serves the agent (call before threads start): its threads
    take turns under the GIL anyway, and a second arena kept the free space of the threads' rendering and
    gzip apart from the main one's, 0.5-0.6 MiB more resident with 20 jobs scraped (issue 24)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, arenas)
    except (OSError, AttributeError):  # not glibc
        pass


def release_startup_memory() -> None:
    """Give the memory that start-up (imports, config parsing) freed back to the system, and leave start-up's
    objects out of later garbage collections: modules, classes and functions are most of the heap and never
    garbage; with 1,000 jobs reporting, each full collection traversed them all (~0.1 s, issue 24).

    The youngest generation is collected after GC_YOUNG_OBJECTS more container objects than were freed, not
    CPython's 700: a sample of 1,000 jobs makes its new rows before the last sample's go (a few thousand
    objects at once, freed a moment later, and no cycle among them), so 700 collected 8-9 times a second for
    nothing and promoted the new rows to be traversed again: 4.5 ms of CPU a second, 0.2 ms at 10,000."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def close_soon(collector: Collector) -> threading.Thread:
    """Close a collector on its own thread: one blocked in NVML must not hold up the others or shutdown."""
    thread = threading.Thread(target=collector.close, name=f"tfprofd-close-{collector.name}", daemon=True)
    thread.start()
    return thread


def prepare_state_dir(path: Path) -> Path:
    """The state directory, created 0750 if missing; refused if others may write into it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        make_dir(path, 0o750, exist_ok=True)
        st = os.stat(path)
    except OSError as exc:
        raise StartError(f"state_dir {path}: {exc.strerror or exc}") from None
    if st.st_mode & stat.S_IWOTH:
        raise StartError(f"state_dir {path} is writable by every user; make it 0750 (or 2750) and restart")
    if not os.access(path, os.W_OK | os.X_OK):
        raise StartError(f"state_dir {path} is not writable by the agent's user (uid {os.geteuid()})")
    return path
