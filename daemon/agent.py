"""The agent: builds the collectors from the config, samples them in the background, serves HTTP,
reloads on SIGHUP and stops on SIGTERM."""

from __future__ import annotations

import html
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import psutil

from tfprofd.exporter.base import Clock, Collector, HostPaths
from tfprofd.exporter.cpu import CpuCollector
from tfprofd.exporter.disk import DiskCollector
from tfprofd.exporter.memory import MemoryCollector
from tfprofd.exporter.network import NetworkCollector
from tfprofd.exporter.nvml import NvmlCollector
from tfprofd.exporter.selfstats import SampleStatus, SelfCollector
from tfprofd.exporter.training import TrainingCollector

from . import __version__, logs
from . import config as configmod
from .api import ControlApi, alert_is_for_host
from .captures import CaptureLimit, CaptureManager, Target
from .exposition import CONTENT_TYPE, render
from .httpserver import HttpError, HttpServer, Request, Response, Router, json_response
from .rules import Engine, Rule
from .sampler import CollectorRunner

log = logging.getLogger("tfprofd.agent")

RESTART_ONLY = ("listen", "api.listen", "hook.listen")
COLLECTORS = ("nvml", "cpu", "memory", "disk", "network", "training")


class Agent:
    """One running tfprofd. ``start()`` returns once it serves; ``wait()`` blocks until it stops."""

    def __init__(self, cfg: configmod.Config, reload_source: Callable[[], configmod.Config] | None = None,
                 clock: Clock | None = None, nvml: ModuleType | None = None):
        self.cfg = cfg
        self.reload_source = reload_source
        self.clock = clock or Clock()
        self.nvml_module = nvml
        self.collectors: dict[str, Collector] = {}
        self.runners: dict[str, CollectorRunner] = {}
        self._rendered: dict[str, tuple[int, bytes]] = {}
        self.self_collector = SelfCollector(__version__, self.statuses)
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._reload_requested = False
        self._lock = threading.RLock()
        self.metrics_server: HttpServer | None = None
        self.api_server: HttpServer | None = None
        self.api = Router()
        self.captures: CaptureManager | None = None
        self.rules = Engine(rules=list(cfg.rules), on_fire=self._on_rule_fire, training_active=self._training_active)
        self._last_rule_capture: dict[str, float] = {}

    # ---- collectors ----

    def paths(self) -> HostPaths:
        return HostPaths(Path(self.cfg["procfs_path"]), Path(self.cfg["sysfs_path"]))

    def _configure(self, name: str) -> Collector:
        """Create the named collector, or update the existing one in place so its state survives a reload."""
        cfg, existing = self.cfg, self.collectors.get(name)
        if name == "nvml":
            c = existing if isinstance(existing, NvmlCollector) else NvmlCollector(clock=self.clock,
                                                                                   nvml=self.nvml_module)
            c.pcie_interval = cfg["collectors.nvml.pcie_interval"]
            c.retry_interval = cfg["collectors.nvml.retry_interval"]
            return c
        if name == "training":
            t = existing if isinstance(existing, TrainingCollector) else TrainingCollector(
                cfg["hook.listen"], clock=self.clock, gpu_processes=self.gpu_processes)
            t.max_bytes = cfg["hook.max_datagram_bytes"]
            t.down_after = cfg["collectors.training.down_after"]
            t.expire_after = cfg["collectors.training.expire_after"]
            return t
        if name == "cpu":
            c = existing if isinstance(existing, CpuCollector) else CpuCollector(self.paths())
        elif name == "memory":
            c = existing if isinstance(existing, MemoryCollector) else MemoryCollector(self.paths())
        elif name == "disk":
            c = existing if isinstance(existing, DiskCollector) else DiskCollector(
                self.paths(), cfg["collectors.disk.device_exclude"])
            c.device_exclude = cfg["collectors.disk.device_exclude"]
        elif name == "network":
            c = existing if isinstance(existing, NetworkCollector) else NetworkCollector(
                self.paths(), cfg["collectors.network.device_exclude"])
            c.device_exclude = cfg["collectors.network.device_exclude"]
        else:
            raise ValueError(f"unknown collector {name}")
        c.paths = self.paths()
        return c

    def gpu_processes(self) -> list[tuple[int, str, list[int]]]:
        """(index, uuid, pids) per GPU from the latest NVML sample."""
        nvml = self.collectors.get("nvml")
        if not isinstance(nvml, NvmlCollector):
            return []
        return [(g.index, g.uuid, [pid for pid, _ in g.processes]) for g in nvml.gpus]

    def training(self) -> TrainingCollector | None:
        t = self.collectors.get("training")
        return t if isinstance(t, TrainingCollector) else None

    def signals(self, source: str) -> dict[str, list[tuple[dict[str, str], float]]]:
        """The rule signals a collector's latest sample provides (see rules.SIGNALS)."""
        c = self.collectors.get(source)
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        if isinstance(c, NvmlCollector):
            out["gpu_utilization"] = [({"gpu": str(g.index)}, g.utilization) for g in c.gpus
                                      if g.utilization is not None]
            out["gpu_memory_used_ratio"] = [({"gpu": str(g.index)}, g.memory_used / g.memory_total) for g in c.gpus
                                            if g.memory_used is not None and g.memory_total]
        elif isinstance(c, TrainingCollector):
            now = self.clock.time()
            jobs = c.active_jobs()
            labels = {key: {"training_job": key[0], "worker": key[1]} for key in jobs}
            out["samples_per_second"] = [(labels[k], s.samples_per_second) for k, s in jobs.items()
                                         if s.samples_per_second is not None and s.latest.phase == "train"]
            out["step_seconds"] = [(labels[k], s.recent_step_seconds) for k, s in jobs.items()
                                   if s.recent_step_seconds is not None and s.latest.phase == "train"]
            out["seconds_without_first_step"] = [(labels[k], now - s.latest.process_start) for k, s in jobs.items()
                                                 if s.latest.first_step_seconds is None]
        elif isinstance(c, CpuCollector) and c.latest and c.latest.utilization is not None:
            out["cpu_utilization"] = [({}, c.latest.utilization)]
            out["cpu_iowait"] = [({}, c.latest.iowait)]
        elif isinstance(c, MemoryCollector) and c.used_ratio() is not None:
            out["memory_used_ratio"] = [({}, c.used_ratio())]
        elif isinstance(c, NetworkCollector) and c.latest:
            out["network_receive_utilization"] = [({"device": d}, u[0]) for d, u in c.latest.utilization.items()]
            out["network_transmit_utilization"] = [({"device": d}, u[1]) for d, u in c.latest.utilization.items()]
        return out

    def _training_active(self, labels: dict[str, str]) -> bool:
        """Whether a training job is active where the signal is: its job, its GPU, or anywhere on the host."""
        training = self.training()
        if training is None:
            return False
        training_now = {k for k, s in training.active_jobs().items() if s.latest.phase == "train"}
        if "training_job" in labels:
            return (labels["training_job"], labels.get("worker", "0")) in training_now
        if "gpu" in labels:
            mapping = training.job_gpus()
            if mapping:  # NVML lists the jobs' processes: only a job on this GPU counts
                return any(str(index) == labels["gpu"] and (job, worker) in training_now
                           for index, _, job, worker in mapping)
        return bool(training_now)

    def capture_groups(self, job: str | None, gpu: str | None) -> list[list[Target]]:
        """The captures to start for a job, a GPU, or (neither) every job: one list of targets per job.

        Raises HttpError 404 when nothing to capture matches, with the reason.
        """
        training = self.training()
        jobs = training.active_jobs() if training else {}
        if gpu is not None and training is not None:
            on_gpu = {(j, w) for i, _, j, w in training.job_gpus() if str(i) == str(gpu)}
            if on_gpu:
                jobs = {k: s for k, s in jobs.items() if k in on_gpu}
        if job is not None:
            jobs = {k: s for k, s in jobs.items() if k[0] == job}
            if not jobs:
                raise HttpError(404, f"no training job {job!r} is reporting to this agent")
        if not jobs:
            raise HttpError(404, "no training job is reporting to this agent")
        groups: dict[str, list[Target]] = {}
        for (name, worker), state in sorted(jobs.items()):
            if state.latest.profiler:
                groups.setdefault(name, []).append(Target(name, worker, state.latest.profiler))
        if not groups:
            raise HttpError(404, "the training job has no profiler server (hook started with profiler=False?)")
        return list(groups.values())

    def _on_rule_fire(self, rule: Rule, labels: dict[str, str], value: float | None) -> None:
        if not rule.capture or self.captures is None:
            return
        now = self.clock.monotonic()
        last = self._last_rule_capture.get(rule.name)
        if last is not None and now - last < rule.cooldown:
            log.info("rule %s: no capture, cooldown %.0fs left", rule.name, rule.cooldown - (now - last))
            return
        try:
            groups = self.capture_groups(labels.get("training_job"), labels.get("gpu"))
        except HttpError as exc:
            log.info("rule %s: no capture: %s", rule.name, exc.reason)
            return
        self._last_rule_capture[rule.name] = now
        for group in groups:
            try:
                self.captures.start("rule", group, rule=rule.name, gpu=labels.get("gpu"))
            except CaptureLimit as exc:
                log.warning("rule %s: no capture: %s", rule.name, exc.reason)

    def _alert_is_for_host(self, labels: dict[str, str]) -> bool:
        return alert_is_for_host(labels, self.cfg["alerts.host_label"], self.cfg["alerts.host_value"])

    def capture_settings(self) -> dict[str, object]:
        cfg = self.cfg
        return {
            "mode": cfg["captures.mode"], "duration_ms": int(cfg["captures.duration"] * 1000),
            "options": {"host_tracer_level": cfg["captures.host_tracer_level"],
                        "device_tracer_level": cfg["captures.device_tracer_level"],
                        "python_tracer_level": cfg["captures.python_tracer_level"],
                        "delay_ms": int(cfg["captures.delay"] * 1000)},
            "timeout": cfg["captures.timeout"], "max_per_hour": cfg["captures.max_per_hour"],
            "keep": cfg["captures.keep"], "max_bytes": cfg["captures.max_bytes"], "dir_mode": cfg["captures.dir_mode"],
            "analyze": cfg["captures.analyze"], "analysis_timeout": cfg["captures.analysis_timeout"],
        }

    def enabled(self, name: str) -> bool:
        return bool(self.cfg[f"collectors.{name}.enabled"])

    def _apply(self) -> None:
        """Start, update and stop collector runners to match the current config."""
        psutil.PROCFS_PATH = self.cfg["procfs_path"]
        for name in COLLECTORS:
            if self.enabled(name):
                self.collectors[name] = self._configure(name)
                if name not in self.runners:
                    runner = CollectorRunner(self.collectors[name], lambda: self.cfg["interval"], self.clock,
                                             self._after_sample)
                    self.runners[name] = runner
                    runner.sample_once()  # the first scrape already has data
                    runner.start()
            elif name in self.runners:
                self.runners.pop(name).stop()
                self.collectors.pop(name).close()
                log.info("collector %s disabled", name)

    def _after_sample(self, name: str) -> None:
        """Render right after sampling, in the sampler's thread, so a scrape only joins bytes."""
        collector = self.collectors.get(name)
        if collector is not None:
            self._rendered_part(name, collector)
            self.rules.observe(name, self.runners[name].status.timestamp, self.signals(name))

    def statuses(self) -> dict[str, SampleStatus]:
        return {name: runner.status for name, runner in list(self.runners.items())}

    def _rendered_part(self, name: str, collector: Collector) -> bytes | None:
        """The collector's metrics text, rendered once per version of its data."""
        version = collector.version
        cached = self._rendered.get(name)
        if cached is None or cached[0] != version:
            try:
                cached = (version, render(collector.collect()))
            except Exception:  # a broken collect() must not break the scrape
                log.exception("collector %s failed to render metrics", name)
                runner = self.runners.get(name)  # rules and captures render without a sampling runner
                if runner is not None:
                    runner.status.success = False
                return None
            self._rendered[name] = cached
        return cached[1]

    def exposition(self) -> bytes:
        """The metrics text: the self metrics, then every collector's latest rendering."""
        parts = [render(self.self_collector.collect())]
        extra: dict[str, Collector] = {"rules": self.rules}
        if self.captures is not None:
            extra["captures"] = self.captures
        for name, collector in [*self.collectors.items(), *extra.items()]:
            part = self._rendered_part(name, collector)
            if part is not None:
                parts.append(part)
        return b"".join(parts)

    # ---- HTTP ----

    def _metrics(self, request: Request) -> Response:
        return Response(200, self.exposition(), CONTENT_TYPE)

    def _healthz(self, request: Request) -> Response:
        now, stale_after = self.clock.time(), max(3 * self.cfg["interval"], 10.0)
        collectors = {}
        healthy = not self._stopping.is_set()
        for name, runner in list(self.runners.items()):
            age = now - runner.status.timestamp
            fresh = runner.alive() and age <= stale_after
            healthy = healthy and fresh
            collectors[name] = {"success": runner.status.success, "last_sample_age_seconds": round(age, 3),
                                "sampling": fresh}
        return json_response(200 if healthy else 503, {"status": "ok" if healthy else "unhealthy",
                                                       "collectors": collectors})

    def _landing(self, request: Request) -> Response:
        api_host, api_port = self.api_server.address if self.api_server else ("", 0)
        body = f"""<!doctype html><html><head><title>tfprofd</title></head><body>
<h1>tfprofd {html.escape(__version__)}</h1>
<p>GPU, host and training-throughput metrics for Prometheus, with profile captures when utilization drops.</p>
<ul><li><a href="/metrics">/metrics</a>: Prometheus metrics</li>
<li><a href="/healthz">/healthz</a>: health of the sampling loop</li></ul>
<p>Control API (captures, Alertmanager webhook): http://{html.escape(api_host)}:{api_port}/api/v1/</p>
</body></html>
"""
        return Response(200, body.encode(), "text/html; charset=utf-8")

    def _token(self) -> str:
        path = self.cfg["api.token_file"]
        if path:
            try:
                return Path(path).read_text().strip()
            except OSError as exc:
                log.error("cannot read api.token_file %s: %s; refusing control requests", path, exc)
                return "\0unreadable"  # no client can send this, so every request is refused
        return self.cfg["api.token"]

    # ---- lifecycle ----

    def start(self) -> None:
        logs.setup(self.cfg["log_level"])
        metrics = Router()
        metrics.add("GET", "/", self._landing)
        metrics.add("GET", "/metrics", self._metrics)
        metrics.add("GET", "/healthz", self._healthz)
        self.metrics_server = HttpServer(self.cfg["listen"], metrics, max_body=4096, name="metrics")
        self.api_server = HttpServer(self.cfg["api.listen"], self.api, max_body=self.cfg["api.max_body_bytes"],
                                     token=self._token, name="api")
        state_dir = Path(self.cfg["state_dir"])
        self.captures = CaptureManager(state_dir / "captures", self.capture_settings, self.clock)
        ControlApi(self.api, self.captures, self.capture_groups, self._alert_is_for_host, state_dir)
        with self._lock:
            self._apply()
        self.metrics_server.start()
        self.api_server.start()
        log.info("tfprofd %s serving metrics on %s:%d, control API on %s:%d, hook reports on %s:%d/udp",
                 __version__, *self.metrics_server.address, *self.api_server.address, *self.cfg["hook.listen"])

    def reload(self) -> bool:
        """Re-read the config; on any problem keep the running one and log every problem."""
        if self.reload_source is None:
            return False
        try:
            new = self.reload_source()
        except configmod.ConfigError as exc:
            for problem in exc.problems:
                log.error("config reload rejected: %s", problem)
            return False
        with self._lock:
            for key in RESTART_ONLY:
                if new[key] != self.cfg[key]:
                    log.warning("%s changed; it takes effect after a restart", key)
                new.values[key] = self.cfg[key]
            self.cfg = new
            logs.setup(new["log_level"])
            self.rules.set_rules(list(new.rules))
            self._apply()
        log.info("config reloaded from %s", new.path or "defaults")
        return True

    def request_stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def request_reload(self) -> None:
        self._reload_requested = True
        self._wake.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop())
        signal.signal(signal.SIGINT, lambda *_: self.request_stop())
        signal.signal(signal.SIGHUP, lambda *_: self.request_reload())

    def wait(self) -> None:
        """Block until stopped, reloading whenever asked."""
        while not self._stopping.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._reload_requested and not self._stopping.is_set():
                self._reload_requested = False
                self.reload()
        self.stop()

    def stop(self) -> None:
        self._stopping.set()
        for runner in self.runners.values():
            runner.stop()
        for server in (self.metrics_server, self.api_server):
            if server:
                server.stop()
        for runner in self.runners.values():
            runner.join(timeout=1.0)
        for collector in self.collectors.values():
            collector.close()
        if self.captures is not None:
            self.captures.stop()
            self.captures.wait_idle(timeout=1.0)
        log.info("tfprofd stopped")

