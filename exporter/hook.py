"""The in-process training hook: counts steps and samples and tells the tfprofd agent, about once a second.

Keras::

    from tfprofd.exporter.hook import TfprofdCallback
    model.fit(ds, epochs=3, callbacks=[TfprofdCallback(job="resnet")])

Custom training loop (the outer ``with`` tells the agent when training ends)::

    from tfprofd.exporter.hook import Reporter
    with Reporter.shared(job="resnet") as reporter:
        for x, y in dataset:
            with reporter.step(batch_size=len(x)):
                train_step(x, y)

This module imports only the standard library; TensorFlow is touched only when the user already has it
(the callback class is built on first use, the step markers only once ``tensorflow`` is imported).
Per-step work is a few counter updates; reading TensorFlow variables and sending the report happen on
a background thread. Reports are datagrams (to the agent's Unix socket on a host, UDP from a pod)
carrying cumulative counters, so a lost one loses only resolution, and an agent that is down, slow or
restarting never blocks training.
"""

from __future__ import annotations

import atexit
import bisect
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

SCHEMA_VERSION = 1
DEFAULT_UDP_ADDR = "127.0.0.1:9847"
# Upper bounds (seconds) of the step-duration histogram; the agent checks reports against these.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PHASES = ("train", "evaluate", "predict", "idle")

_profiler_address: str | None = None
_profiler_lock = threading.Lock()
_reporters: dict[tuple[str, str], Reporter] = {}
_reporters_lock = threading.Lock()


def _process_start_time() -> float:
    """Unix time this process started (from /proc), or now if /proc is unavailable."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def default_socket_path(euid: int | None = None, runtime_dir: str | None = None) -> str:
    """Where an agent of this user listens for reports: /run/tfprofd for root (and the systemd unit),
    else the user's runtime directory."""
    euid = os.geteuid() if euid is None else euid
    if euid == 0:
        return "/run/tfprofd/hook.sock"
    runtime_dir = runtime_dir if runtime_dir is not None else os.environ.get("XDG_RUNTIME_DIR", "")
    base = runtime_dir or f"/tmp/tfprofd-{euid}"
    return f"{base}/tfprofd/hook.sock"


def report_target(addr: str | None = None) -> str:
    """Where reports go: ``addr``, else TFPROFD_ADDR, else the first agent socket this process may write to
    (the system agent's, then this user's), else UDP to 127.0.0.1:9847."""
    chosen = addr or os.environ.get("TFPROFD_ADDR")
    if chosen:
        return chosen
    for path in ("/run/tfprofd/hook.sock", default_socket_path()):
        if os.path.exists(path) and os.access(path, os.W_OK):
            return "unix:" + path
    return DEFAULT_UDP_ADDR


def _worker_from_tf_config() -> str | None:
    try:
        task = json.loads(os.environ.get("TF_CONFIG", "")).get("task", {})
        return f"{task['type']}-{int(task['index'])}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _default_job() -> str:
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c") else "python"
    return os.path.splitext(script)[0] or "python"


def _open_target(text: str) -> tuple[socket.socket, str | tuple[str, int]]:
    """A non-blocking datagram socket and the address to send to, for ``unix:/path`` or ``host:port``."""
    if text.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        return sock, text[len("unix:"):]
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    return sock, (host, int(port))


def start_profiler_server(port: int | None = None) -> str | None:
    """Start TensorFlow's profiler server once per process; returns ``host:port`` or None if unavailable."""
    global _profiler_address
    with _profiler_lock:
        if _profiler_address is not None:
            return _profiler_address
        if "tensorflow" not in sys.modules:
            return None
        import tensorflow as tf

        if port is None:
            env_port = os.environ.get("TFPROFD_PROFILER_PORT")
            port = int(env_port) if env_port else _free_port()
        tf.profiler.experimental.server.start(port)
        host = os.environ.get("TFPROFD_PROFILER_HOST", "localhost")
        _profiler_address = f"{host}:{port}"
        return _profiler_address


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Reporter:
    """Counts training steps and samples and reports them to the agent from a background thread.

    Use ``Reporter.shared(job, worker)`` to get the process's one reporter for a job: two reporters of
    one job in one process would send conflicting reports. ``with reporter:`` around a custom loop (or
    ``close()``) tells the agent the job stopped training; a loop that just stops is taken as idle once
    no step has run for ``idle_after`` seconds (at least 10 times its longest step).
    """

    @classmethod
    def shared(cls, job: str | None = None, worker: str | None = None, **kwargs: Any) -> Reporter:
        """The process's reporter for (job, worker), created on first use."""
        job = job or os.environ.get("TFPROFD_JOB") or _default_job()
        worker = worker or _worker_from_tf_config() or "0"
        with _reporters_lock:
            reporter = _reporters.get((job, worker))
            if reporter is None:
                reporter = _reporters[(job, worker)] = cls(job=job, worker=worker, **kwargs)
            elif kwargs.get("batch_size") is not None:
                reporter.batch_size = kwargs["batch_size"]
            return reporter

    def __init__(self, job: str | None = None, worker: str | None = None, batch_size: int | None = None,
                 addr: str | None = None, interval: float = 1.0, profiler: bool | None = None,
                 profiler_port: int | None = None, step_markers: bool = True, idle_after: float = 30.0):
        self.job = job or os.environ.get("TFPROFD_JOB") or _default_job()
        self.worker = worker or _worker_from_tf_config() or "0"
        self.batch_size = batch_size
        self.target = report_target(addr)
        self.interval = interval
        self.idle_after = idle_after
        if profiler is None:
            profiler = os.environ.get("TFPROFD_PROFILER", "1").lower() not in ("0", "false", "no", "off")
        self.profiler = profiler
        self.profiler_port = profiler_port
        self.step_markers = step_markers
        self.pid = os.getpid()
        self.process_start = _process_start_time()
        # Counters, updated on the training thread.
        self.steps = 0
        self.samples = 0
        self.epoch = 0
        self.phase = "idle"
        self.step_time_sum = 0.0
        self.step_buckets = [0] * len(STEP_BUCKETS)  # per-bucket (not cumulative) counts; +Inf = steps
        self.first_step_seconds: float | None = None
        # Optional exact counters read on the background thread (set by the Keras callback).
        self.exact_counts: Callable[[], tuple[int, int]] | None = None
        self._seq = 0
        self._sock, self._dest = _open_target(self.target)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._trace: Any = None
        self._step_started = 0.0
        self._in_step = False
        self._last_step_end = 0.0
        self._longest_step = 0.0
        self._step_num = 0
        self.profiler_address: str | None = None

    # ---- lifecycle ----

    def start(self) -> Reporter:
        if self.profiler and self.profiler_address is None:
            try:
                self.profiler_address = start_profiler_server(self.profiler_port)
            except Exception as exc:  # a profiler that cannot start must not stop training
                print(f"tfprofd hook: profiler server not started: {exc}", file=sys.stderr)
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            if self._thread is None:
                atexit.register(self.close)
            self._thread = threading.Thread(target=self._run, name="tfprofd-hook", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """The job stopped training: send a final report (phase idle) and stop the background thread."""
        self.phase = "idle"
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._idle_check()
            self.flush()

    def _idle_check(self) -> None:
        """A custom loop that stopped stepping without close() is idle, not training at 0 samples/s."""
        if self.phase == "train" and not self._in_step and self._last_step_end and self.exact_counts is None:
            quiet = time.perf_counter() - self._last_step_end
            if quiet > max(self.idle_after, 10 * self._longest_step):
                self.phase = "idle"

    def __enter__(self) -> Reporter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- counting ----

    def record(self, steps: int, samples: int, seconds: float) -> None:
        """Count ``steps`` steps that took ``seconds`` in all and processed ``samples`` samples."""
        if self.first_step_seconds is None:
            self.first_step_seconds = max(time.time() - self.process_start, 0.0)
        self.steps += steps
        self.samples += samples
        self.step_time_sum += seconds
        per_step = seconds / steps if steps else seconds
        index = bisect.bisect_left(STEP_BUCKETS, per_step)
        if index < len(self.step_buckets):
            self.step_buckets[index] += steps

    def begin_step(self) -> None:
        """Mark the start of a step (with a profiler step marker when TensorFlow is loaded)."""
        self._in_step = True
        self._step_num += 1
        if self.step_markers and "tensorflow" in sys.modules:
            self._trace = _trace_class()("train", step_num=self._step_num, _r=1)
            self._trace.__enter__()
        self._step_started = time.perf_counter()

    def end_step(self, steps: int = 1, samples: int | None = None) -> None:
        now = time.perf_counter()
        elapsed = now - self._step_started
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            self._trace = None
        if samples is None:
            samples = steps * (self.batch_size or 0)
        self.record(steps, samples, elapsed)
        self._in_step = False
        self._last_step_end = now
        self._longest_step = max(self._longest_step, elapsed / max(steps, 1))

    def step(self, batch_size: int | None = None) -> _Step:
        """Context manager around one training step of a custom loop: ``with reporter.step(batch_size=n):``."""
        return _Step(self, batch_size)

    # ---- reporting ----

    def report(self) -> dict[str, Any]:
        steps, samples = self.steps, self.samples
        if self.exact_counts is not None:
            try:
                steps, samples = self.exact_counts()
            except Exception:  # keep the hook's own counts if TensorFlow cannot be read right now
                pass
        self._seq += 1
        cumulative, running = [], 0
        for count in self.step_buckets:
            running += count
            cumulative.append(running)
        return {
            "v": SCHEMA_VERSION, "job": self.job, "worker": self.worker, "pid": self.pid, "seq": self._seq,
            "time": time.time(), "process_start": self.process_start, "phase": self.phase, "epoch": self.epoch,
            "steps": steps, "samples": samples, "batch_size": self.batch_size,
            "step_seconds": {"count": self.steps, "sum": self.step_time_sum, "buckets": cumulative},
            "first_step_seconds": self.first_step_seconds, "profiler": self.profiler_address,
        }

    def flush(self) -> bool:
        """Send one report now; never raises and never blocks on the agent."""
        with self._send_lock:
            try:
                payload = json.dumps(self.report(), separators=(",", ":")).encode()
                self._sock.sendto(payload, self._dest)
            except (OSError, ValueError):
                return False
            return True


class _Step:
    """One step of a custom training loop (``Reporter.step``)."""

    __slots__ = ("_batch_size", "_reporter")

    def __init__(self, reporter: Reporter, batch_size: int | None):
        self._reporter = reporter
        self._batch_size = batch_size

    def __enter__(self) -> Reporter:
        reporter = self._reporter
        reporter.phase = "train"
        if reporter._thread is None or not reporter._thread.is_alive():
            reporter.start()
        reporter.begin_step()
        return reporter

    def __exit__(self, *exc: object) -> None:
        reporter = self._reporter
        batch = self._batch_size if self._batch_size is not None else reporter.batch_size
        reporter.end_step(1, int(batch or 0))


def _trace_class() -> Any:
    from tensorflow.profiler.experimental import Trace

    return Trace


def _make_callback_class() -> type:
    import keras
    import tensorflow as tf

    class TfprofdCallback(keras.callbacks.Callback):
        """Keras callback reporting exact steps and samples, step times and phase to the tfprofd agent.

        Steps come from the optimizer's ``iterations`` (exact with ``steps_per_execution > 1``). Samples are
        ``steps * batch_size`` when ``batch_size`` is given, else the real batch sizes, counted inside
        the train step (partial last batches included).
        """

        def __init__(self, job: str | None = None, batch_size: int | None = None, worker: str | None = None,
                     addr: str | None = None, profiler: bool | None = None, profiler_port: int | None = None,
                     step_markers: bool = True, interval: float = 1.0):
            super().__init__()
            self.reporter = Reporter.shared(job=job, worker=worker, batch_size=batch_size, addr=addr,
                                            interval=interval, profiler=profiler, profiler_port=profiler_port,
                                            step_markers=step_markers)
            self._samples_var: Any = None
            self._samples_var_base = 0
            self._iterations_base = 0
            self._steps_base = 0
            self._samples_base = 0
            self._last_batch = -1
            self._in_fit = False
            # Report from now on, before the first step: the agent sees slow initialization.
            self.reporter.start()

        def _iterations(self) -> int:
            return int(self.model.optimizer.iterations.numpy())

        def _real_batch_counter(self) -> Any:
            """A variable the model's train step adds each real batch size to (one per model, reused)."""
            counter = getattr(self.model, "_tfprofd_samples", None)
            if counter is not None:
                return counter
            with tf.distribute.get_strategy().scope():
                counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                      synchronization=tf.VariableSynchronization.ON_READ,
                                      aggregation=tf.VariableAggregation.SUM)
            original = self.model.train_step

            def train_step(data: Any) -> Any:
                first = tf.nest.flatten(data)[0]
                counter.assign_add(tf.shape(first, out_type=tf.int64)[0])
                return original(data)

            self.model.train_step = train_step
            self.model.make_train_function(force=True)
            self.model._tfprofd_samples = counter
            return counter

        def _exact(self) -> tuple[int, int]:
            steps = self._steps_base + self._iterations() - self._iterations_base
            if self._samples_var is not None:
                samples = self._samples_base + int(self._samples_var.numpy()) - self._samples_var_base
            else:
                samples = steps * (self.reporter.batch_size or 0)
            return steps, samples

        def on_train_begin(self, logs: Any = None) -> None:
            r = self.reporter
            steps, samples = (r.exact_counts() if r.exact_counts else (r.steps, r.samples))
            self._steps_base, self._samples_base = steps, samples  # earlier fit() calls carry over
            self._iterations_base = self._iterations()
            if r.batch_size is None:
                self._samples_var = self._real_batch_counter()
                self._samples_var_base = int(self._samples_var.numpy())
            r.exact_counts = self._exact
            r.phase = "train"
            self._in_fit = True
            self._last_batch = -1
            r.start()

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.reporter.epoch = epoch
            self._last_batch = -1

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.reporter.begin_step()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            steps = batch - self._last_batch  # batch hooks fire once per steps_per_execution steps
            self._last_batch = batch
            self.reporter.end_step(steps if steps > 0 else 1, 0)

        def on_test_begin(self, logs: Any = None) -> None:
            self.reporter.phase = "evaluate"

        def on_test_end(self, logs: Any = None) -> None:
            self.reporter.phase = "train" if self._in_fit else "idle"

        def on_predict_begin(self, logs: Any = None) -> None:
            self.reporter.phase = "predict"

        def on_predict_end(self, logs: Any = None) -> None:
            self.reporter.phase = "idle"

        def on_train_end(self, logs: Any = None) -> None:
            self._in_fit = False
            self.reporter.phase = "idle"
            self.reporter.flush()  # the exact final counts, not the last periodic report

    return TfprofdCallback


_callback_class: type | None = None


def __getattr__(name: str) -> Any:
    """Build ``TfprofdCallback`` (which needs Keras) only when someone asks for it."""
    global _callback_class
    if name == "TfprofdCallback":
        if _callback_class is None:
            _callback_class = _make_callback_class()
        return _callback_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
