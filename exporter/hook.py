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
from collections import deque
from collections.abc import Callable
from time import perf_counter
from typing import Any, ClassVar

SCHEMA_VERSION = 1
DEFAULT_UDP_ADDR = "127.0.0.1:9847"
# Upper bounds (seconds) of the step-duration histogram; the agent checks reports against these.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PHASES = ("train", "evaluate", "predict", "idle")
FOLD_AT = 65536  # steps queued at most before the training thread counts them itself
OUTLIER_FACTOR = 10.0  # a step this many times longer than the mean of the steps before it is reported at once
OUTLIER_EVERY = 1.0  # seconds: at most one such early report a second

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


# Where launchers put a process's rank (Horovod, Open MPI, MPICH/Intel MPI, Slurm, torchrun, a Kubernetes
# indexed Job): without TF_CONFIG, the workers of a job on several hosts would otherwise all be worker "0".
RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "RANK", "JOB_COMPLETION_INDEX")


def _default_worker() -> str:
    """``TF_CONFIG``'s ``type-index``, else the first launcher rank found (a non-negative integer), else "0"."""
    try:
        task = json.loads(os.environ.get("TF_CONFIG", "")).get("task", {})
        return f"{task['type']}-{int(task['index'])}"
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isascii() and value.isdigit():
            return str(int(value))
    return "0"


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
        worker = worker or _default_worker()
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
        self.worker = worker or _default_worker()
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
        self.skipped = 0  # steps whose update a loss-scale optimizer skipped (mixed precision overflows)
        self.epoch = 0
        self.phase = "idle"
        self.step_time_sum = 0.0
        self.step_buckets = [0] * len(STEP_BUCKETS)  # per-bucket (not cumulative) counts; +Inf = steps
        self.first_step_seconds: float | None = None
        self._done: deque[tuple[float, float, int, int]] = deque()  # (ended, seconds, steps, samples) to count
        self._fold_lock = threading.RLock()  # a report's counters and histogram come from one fold
        # Optional exact (steps, samples, skipped) read on the background thread (set by the Keras callback).
        self.exact_counts: Callable[[], tuple[int, int, int]] | None = None
        self._seq = 0
        self._unsent = 0  # reports the socket refused since the last it sent (the agent's queue full, or no agent)
        self._reported_samples = self._reported_skipped = 0
        self._sock, self._dest = _open_target(self.target)
        self._stop = threading.Event()
        self._early = threading.Event()  # set by the training thread when a step took far longer than the last ones
        # A step longer than this (seconds) is an outlier (inf: none is looked for); what it was when one was seen.
        self._outlier_above = self._outlier_seen = float("inf")
        self._early_next = 0.0  # no early report before this (perf_counter)
        self._fold_n = 0  # steps' time taken in by the folds since the last report of the reporter thread
        self._fold_s = 0.0
        self._thread: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._trace: Any = None  # the step marker of the step running, while a profiling session records
        self._trace_class: Any = None  # TensorFlow's Trace, once TensorFlow is loaded
        self._tracing: Callable[[], bool] | None = None  # whether a profiling session records, ditto
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
            self._early.clear()
            if self._thread is None:
                atexit.register(self.close)
            self._thread = threading.Thread(target=self._run, name="tfprofd-hook", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """The job stopped training: send a final report (phase idle) and stop the background thread."""
        self.phase = "idle"
        self._stop.set()
        self._early.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self.flush()

    def _run(self) -> None:
        """A report every ``interval``; between them, an early one when a step was an outlier (``_outlier``)."""
        due = perf_counter() + self.interval
        follow_up = False  # after an outlier, the next report comes half an interval later, flagged
        while True:
            early = self._early.wait(max(0.0, due - perf_counter()))
            if self._stop.is_set():
                return
            if early:
                self._early.clear()
                self._report_outlier()
                due, follow_up = min(due, perf_counter() + self.interval / 2), True
                continue
            due = max(due + self.interval, perf_counter())
            self._fold()
            self._idle_check()
            self.flush(outlier=follow_up)
            follow_up = False
            self._arm_outlier()

    def _outlier(self) -> None:
        """On the training thread, once a step took over ``_outlier_above``: wake the reporter thread (it reports
        the steps before this one at once)."""
        self._outlier_seen, self._outlier_above = self._outlier_above, float("inf")
        self._early.set()

    def _arm_outlier(self) -> None:
        """After a report: look for steps over OUTLIER_FACTOR times the mean of those taken in since the last
        threshold was set (at most one early report per OUTLIER_EVERY: until then, the steps add up). With no
        step since an outlier (training paused after it), the threshold before it."""
        if perf_counter() < self._early_next or self._early.is_set():  # (an outlier not yet reported: it resets)
            return
        with self._fold_lock:
            n, total, self._fold_n, self._fold_s = self._fold_n, self._fold_s, 0, 0.0
        if n:
            self._outlier_above = OUTLIER_FACTOR * total / n
        elif self._outlier_above == float("inf"):
            self._outlier_above = self._outlier_seen

    def _report_outlier(self) -> None:
        """A report of the steps before the outlier, now; the next one (``_run``: half an interval later, flagged,
        the agent samples on it at once) then holds only the outlier and the steps after it: a slowdown that
        lasts shows undiluted by the fast steps before it, a lone slow step (a stall) diluted by the fast ones
        after it (see README: Captures)."""
        self._early_next = perf_counter() + OUTLIER_EVERY
        with self._send_lock, self._fold_lock:
            self._fold(below=self._outlier_seen)
            self._send(fold=False)
            done = self._done
            if done and done[0][1] > self._outlier_seen:  # the outlier (unless a fold took it in before): counted
                self._count(deque([done.popleft()]))  # now, so in the next report, and left out of the threshold
            self._fold_n, self._fold_s = 0, 0.0  # the next threshold comes from the steps after the outlier

    def _idle_check(self) -> None:
        """A custom loop that stopped stepping without close() is idle, not training at 0 samples/s."""
        if self.phase == "train" and not self._in_step and self._last_step_end and self.exact_counts is None:
            quiet = perf_counter() - self._last_step_end
            if quiet > max(self.idle_after, 10 * self._longest_step):
                self.phase = "idle"

    def __enter__(self) -> Reporter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- counting ----
    # The training thread only queues what each step took: a clock read and an append. The counters and the
    # histogram take the queue in when they are read (by the reporter thread, once a second).

    def record(self, steps: int, samples: int, seconds: float) -> None:
        """Count ``steps`` steps that took ``seconds`` in all and processed ``samples`` samples."""
        self._queue(perf_counter(), seconds, steps, samples)

    def _queue(self, ended: float, seconds: float, steps: int, samples: int) -> None:
        done = self._done
        done.append((ended, seconds, steps, samples))
        if len(done) >= FOLD_AT:  # nobody reads the counts (a reporter never started): keep the queue short
            self._fold()

    def _fold(self, below: float = float("inf")) -> None:
        """Count the steps queued before this call; with ``below``, only those before the first one that took
        longer (an outlier's early report)."""
        with self._fold_lock:
            done = self._done
            if below != float("inf"):
                before: deque[tuple[float, float, int, int]] = deque()
                while done and done[0][1] <= below:
                    before.append(done.popleft())
                done = before
            self._count(done)

    def _count(self, done: deque[tuple[float, float, int, int]]) -> None:
        """Take in the steps queued in ``done`` (as many as it holds now; the training thread may add more).
        Called with ``_fold_lock`` held (by ``_fold`` and ``_report_outlier``)."""
        count, time_before = len(done), self.step_time_sum
        for _ in range(count):
            ended, seconds, steps, samples = done.popleft()
            if self.first_step_seconds is None:
                ended_at = time.time() - (perf_counter() - ended)
                self.first_step_seconds = max(ended_at - self.process_start, 0.0)
            self.steps += steps
            self.samples += samples
            self.step_time_sum += seconds
            per_step = seconds / steps if steps else seconds
            self._longest_step = max(self._longest_step, per_step)
            index = bisect.bisect_left(STEP_BUCKETS, per_step)
            if index < len(self.step_buckets):
                self.step_buckets[index] += steps
        self._fold_n += count  # for the next outlier threshold: the mean of the steps counted since
        self._fold_s += self.step_time_sum - time_before

    def begin_step(self, steps: int = 1) -> None:
        """Mark the start of a step, or of ``steps`` steps run as one (Keras's steps_per_execution), with a
        profiler step marker while a profiling session is active; the marker says how many steps it covers."""
        self._in_step = True
        self._open_step(steps, perf_counter())

    def end_step(self, steps: int = 1, samples: int | None = None) -> None:
        now = perf_counter()
        self._close_step(steps, steps * (self.batch_size or 0) if samples is None else samples, now)
        self._in_step = False
        self._last_step_end = now

    def next_step(self, ended: int, begun: int) -> None:
        """End the ``ended`` steps running (none if 0) and begin ``begun`` more (none if 0) at one instant:
        one call per step for a loop that sees only where steps begin (the Keras callback)."""
        now = perf_counter()
        if ended:
            self._close_step(ended, 0, now)
        if begun:
            self._open_step(begun, now)

    def end_marker(self) -> None:
        """End the running step's profiler marker, if a session records it, before the step itself ends."""
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            self._trace = None

    def _open_step(self, steps: int, now: float) -> None:
        self._step_num += 1
        self._step_started = now
        if self._tracing is None:  # until TensorFlow is loaded (it may be imported after the reporter starts)
            if not self.step_markers or "tensorflow" not in sys.modules:
                return
            self._trace_class, self._tracing = _trace_api()
        if self._tracing():  # no marker object at all unless a profiling session is active
            if steps == 1:
                self._trace = self._trace_class("train", step_num=self._step_num, _r=1)
            else:
                self._trace = self._trace_class("train", step_num=self._step_num, _r=1, steps=steps)

    def _close_step(self, steps: int, samples: int, now: float) -> None:
        self.end_marker()
        seconds = now - self._step_started
        self._queue(now, seconds, steps, samples)
        if seconds > self._outlier_above:  # the only per-step cost of early reports: one comparison
            self._outlier()

    def step(self, batch_size: int | None = None) -> _Step:
        """Context manager around one training step of a custom loop: ``with reporter.step(batch_size=n):``."""
        return _Step(self, batch_size)

    # ---- reporting ----

    def report_counts(self, fold: bool = True) -> tuple[int, int, int]:
        """(steps, samples, skipped steps) as the next report will say (``fold``: with the steps queued)."""
        if fold:
            self._fold()
        if self.exact_counts is not None:
            try:
                return self.exact_counts()
            except Exception:  # keep the hook's own counts if TensorFlow cannot be read right now
                pass
        return self.steps, self.samples, self.skipped

    def report(self, fold: bool = True, outlier: bool = False) -> dict[str, Any]:
        with self._fold_lock:
            steps, samples, skipped = self.report_counts(fold)
            # Counters never go back (the agent would drop the report): a count read while a step runs can
            # be ahead of the steps the batch hooks saw.
            samples = self._reported_samples = max(samples, self._reported_samples)
            skipped = self._reported_skipped = max(skipped, self._reported_skipped)
            self._seq += 1
            cumulative, running = [], 0
            for count in self.step_buckets:
                running += count
                cumulative.append(running)
            return {
                "v": SCHEMA_VERSION, "job": self.job, "worker": self.worker, "pid": self.pid, "seq": self._seq,
                "time": time.time(), "process_start": self.process_start, "phase": self.phase, "epoch": self.epoch,
                "steps": steps, "samples": samples, "skipped_steps": skipped, "batch_size": self.batch_size,
                "step_seconds": {"count": self.steps, "sum": self.step_time_sum, "buckets": cumulative},
                "first_step_seconds": self.first_step_seconds, "profiler": self.profiler_address,
                **({"outlier": True} if outlier else {}), **({"unsent": self._unsent} if self._unsent else {}),
            }

    def flush(self, fold: bool = True, outlier: bool = False) -> bool:
        """Send one report now; never raises and never blocks on the agent. ``outlier``: it ends with a step far
        longer than the ones before (the agent samples at once)."""
        with self._send_lock:
            return self._send(fold, outlier)

    def _send(self, fold: bool = True, outlier: bool = False) -> bool:
        try:
            payload = json.dumps(self.report(fold, outlier), separators=(",", ":")).encode()
            self._sock.sendto(payload, self._dest)
        except OSError:  # the agent's socket full or absent: counted, and the next report sent tells it
            self._unsent += 1
            return False
        except ValueError:
            return False
        self._unsent = 0  # told
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


def _trace_api() -> tuple[Any, Callable[[], bool]]:
    """TensorFlow's step-marker class and its test of whether a profiling session is recording (the
    module function ``Trace`` itself asks; a build without it gets a marker object on every step)."""
    from tensorflow.profiler.experimental import Trace

    return Trace, getattr(sys.modules[Trace.__module__], "enabled", lambda: True)


class _SampleCounter:
    """Counts in the graph the samples a Keras model trains on, per worker, where Keras keeps no count the
    hook can use (tf_keras, a custom ``train_step``, a count near its float limit: see _LossTrackerCount).

    The model's train step is wrapped once. Where the batch dimension is known when TensorFlow traces the
    step (``drop_remainder=True``, fixed-size inputs), every step has that many samples per replica and
    the graph gets no extra op. Otherwise the step adds its real batch size, and a count of replica-steps,
    to a sum-on-read variable; the agent-facing thread reads only this worker's own components of it
    (``experimental_local_results``), so no cross-worker all-reduce is ever issued by the hook.
    """

    def __init__(self, model: Any, tf: Any):
        self.tf = tf
        strategy = model.distribute_strategy
        self.strategy = strategy
        try:
            self.local_replicas = len(strategy.extended.worker_devices)
        except (AttributeError, RuntimeError, NotImplementedError):  # the default strategy has no devices list
            self.local_replicas = 1
        with strategy.scope():
            self.variable = tf.Variable([0, 0], dtype=tf.int64, trainable=False, name="tfprofd_samples",
                                        synchronization=tf.VariableSynchronization.ON_READ,
                                        aggregation=tf.VariableAggregation.SUM)
        self.static_batch: int | None = None  # per-replica batch of the traces that need no op
        original = model.train_step

        def train_step(data: Any) -> Any:
            batch = tf.nest.flatten(data)[0].shape[0]  # at trace time: an int if static, else None
            if batch is not None and self.static_batch in (None, batch):
                self.static_batch = batch
            else:  # a batch size only known when the step runs: count it in the graph
                first = tf.nest.flatten(data)[0]
                self.variable.assign_add(tf.stack([tf.shape(first, out_type=tf.int64)[0],
                                                   tf.constant(1, tf.int64)]))
            return original(data)

        model.train_step = train_step
        model.make_train_function(force=True)

    @classmethod
    def of(cls, model: Any, tf: Any) -> _SampleCounter:
        """The model's counter, made (and its train step wrapped) on first use."""
        counter = getattr(model, "_tfprofd_counter", None)
        if counter is None:
            counter = cls(model, tf)
            model._tfprofd_counter = counter
        return counter

    def read(self) -> tuple[int, int]:
        """(samples, replica-steps) counted in the graph on this worker, its local replicas summed."""
        samples = replica_steps = 0
        for component in self.strategy.experimental_local_results(self.variable):
            a, b = component.numpy()
            samples += int(a)
            replica_steps += int(b)
        return samples, replica_steps

    def samples(self, counted: tuple[int, int], steps: int) -> int:
        """Samples of ``steps`` executed steps, given what the graph counted over them."""
        samples, replica_steps = counted
        uncounted = max(0, steps * self.local_replicas - replica_steps)  # replica-steps of static traces
        return samples + uncounted * (self.static_batch or 0)


class _LossTrackerCount:
    """Counts the samples a Keras 3 model trains on from what its own train step already adds up, so the
    train step gets no op of the hook's and keeps the train function Keras built.

    Keras 3's default ``train_step`` adds every step's batch size (``tf.shape(x)[0]``, per replica, into a
    sum-on-read variable) to its loss tracker's ``count``. That count is reset by ``reset_metrics()`` (at
    every epoch and every ``evaluate``) and also adds evaluation batches, so the hook counts it in segments:
    one opens at the first training batch after a reset, and closes when anything resets the metrics (the
    model's ``reset_metrics`` is wrapped) or training ends. The count is a float: exact for whole numbers
    below 2**24 (float32). When an open segment nears that, the training thread switches the model to the
    in-graph count (``_SampleCounter``) at its next batch; ``exhausted`` then says so.
    """

    EXACT_BELOW: ClassVar[dict[str, int]] = {"float32": 2**24, "float64": 2**53}

    @classmethod
    def of(cls, model: Any, keras: Any) -> _LossTrackerCount | None:
        """The model's count, or None where its train step is not Keras 3's own (tf_keras, a custom
        ``train_step``, one the hook wrapped once its count neared the limit) or its count cannot be exact."""
        model_class = getattr(keras, "Model", None)
        if (model_class is None or not isinstance(model, model_class) or "train_step" in vars(model)
                or getattr(type(model), "train_step", None) is not getattr(model_class, "train_step", None)):
            return None
        variable = getattr(getattr(model, "_loss_tracker", None), "count", None)
        limit = cls.EXACT_BELOW.get(str(getattr(variable, "dtype", "")))
        if limit is None:
            return None
        count = getattr(model, "_tfprofd_tracker", None)
        if count is None or count.variable is not variable:  # first use, or compile() made a new tracker
            count = model._tfprofd_tracker = cls(model, variable, limit)
        return count

    def __init__(self, model: Any, variable: Any, limit: int):
        if "reset_metrics" not in vars(model):  # once per model: the wrapper closes whichever count is current
            reset = model.reset_metrics

            def reset_metrics() -> None:
                current = model._tfprofd_tracker
                try:
                    current.close()
                except Exception as exc:  # never break training
                    current.give_up(exc)
                reset()

            model.reset_metrics = reset_metrics
        self.strategy = model.distribute_strategy
        self.variable = variable
        self.limit = limit
        self.lock = threading.Lock()
        self.closed = 0  # samples of the segments closed so far
        self.base = 0  # the count when the open segment began
        self.live = False  # a segment is open
        self.ok = False  # open and not near the limit: the training thread has nothing to do
        self.exhausted = False  # near the limit once: the in-graph count takes over for good
        self._last = 0

    def _read(self) -> int:
        return int(sum(float(c.numpy()) for c in self.strategy.experimental_local_results(self.variable)))

    def open(self) -> None:
        """Begin a segment at a training batch (training thread, between steps)."""
        with self.lock:
            self._close_locked()
            if not self.exhausted:
                self.base = self._last = self._read()
                self.live = self.ok = True

    def close(self) -> None:
        with self.lock:
            self._close_locked()

    def give_up(self, exc: Exception) -> None:
        """The count could not be read: its open segment is lost, and the graph counts from the next batch."""
        self.exhausted, self.live, self.ok = True, False, False
        print(f"tfprofd hook: sample count unreadable, counting in the graph: {exc}", file=sys.stderr)

    def _close_locked(self) -> None:
        if self.live:
            self.closed += self._read() - self.base
            self.live = self.ok = False

    def samples(self) -> int:
        """Samples counted so far; marks the count exhausted when the open segment nears its limit."""
        with self.lock:
            if not self.live:
                return self.closed
            value = self._read()
            # A second of steps at the rate just seen, twice, must stay exact until the training thread switches.
            if value >= self.limit // 2 or value + 2 * (value - self._last) >= self.limit:
                self.exhausted, self.ok = True, False
            self._last = value
            return self.closed + value - self.base


def _steps_per_execution(model: Any) -> int:
    value = getattr(model, "steps_per_execution", 1) or 1  # an int in Keras 3, a variable in tf_keras
    return int(value.numpy()) if hasattr(value, "numpy") else int(value)


def _loss_scaled(optimizer: Any) -> bool:
    """Whether the optimizer may skip a step (a mixed-precision loss-scale optimizer)."""
    return any(c.__name__.startswith("LossScaleOptimizer") for c in type(optimizer).__mro__)


def _make_callback_class() -> type:
    try:
        import keras
    except ImportError:  # tf_keras alone
        try:
            import tf_keras as keras
        except ImportError:
            raise ImportError("TfprofdCallback needs Keras (Keras 3 or tf_keras) with TensorFlow: pip install "
                              "tensorflow") from None
    try:
        import tensorflow as tf
    except ImportError:
        raise ImportError("TfprofdCallback needs TensorFlow (Keras alone is not enough): pip install tensorflow") \
            from None

    class TfprofdCallback(keras.callbacks.Callback):
        """Keras callback reporting exact steps, samples, step times and phase to the tfprofd agent.

        Works with Keras 3 and with tf_keras (Keras 2, ``TF_USE_LEGACY_KERAS=1``), on one process or
        every worker of a multi-worker strategy (each reports its own counts). Steps are the batches the
        train step executed (steps_per_execution > 1 included); ``skipped_steps`` are those whose update a
        mixed-precision loss-scale optimizer skipped after an overflow (Keras 3). Samples are
        ``steps * batch_size`` when ``batch_size`` is given, else the real batch sizes (_LossTrackerCount with
        Keras 3's own train step, _SampleCounter otherwise).
        """

        # tf_keras's CallbackList asks its callbacks these; Keras 3's base class has none of them.
        _supports_tf_logs = True  # logs are never read: tf_keras need not turn them into numbers each batch
        _chief_worker_only = False  # every worker reports its own counts

        def _implements_train_batch_hooks(self) -> bool:
            return True

        def _implements_test_batch_hooks(self) -> bool:
            return False

        def _implements_predict_batch_hooks(self) -> bool:
            return False

        def __init__(self, job: str | None = None, batch_size: int | None = None, worker: str | None = None,
                     addr: str | None = None, profiler: bool | None = None, profiler_port: int | None = None,
                     step_markers: bool = True, interval: float = 1.0):
            super().__init__()
            self.reporter = Reporter.shared(job=job, worker=worker, batch_size=batch_size, addr=addr,
                                            interval=interval, profiler=profiler, profiler_port=profiler_port,
                                            step_markers=step_markers)
            self._tracker: _LossTrackerCount | None = None  # counts samples where Keras 3 already does
            self._watch: _LossTrackerCount | None = None  # the tracker, while its segments need opening
            self._counter: _SampleCounter | None = None  # counts samples in the graph elsewhere
            self._base = (0, 0, 0)  # steps, samples, skipped reported before this fit()
            self._tracker_base = 0
            self._counted_base = (0, 0)
            self._counter_steps = 0  # steps of this fit() run before the in-graph count began
            self._iterations_base = 0
            self._loss_scaled = False
            self._execution = 1
            self._epoch_steps: int | None = None
            self._open_steps = 0  # steps of the execution running now (begun, not yet ended)
            self._in_fit = False
            # Report from now on, before the first step: the agent sees slow initialization.
            self.reporter.start()

        def _iterations(self) -> int:
            return int(self.model.optimizer.iterations.numpy())

        def _exact(self) -> tuple[int, int, int]:
            """(steps, samples, skipped) so far; called on the reporter's thread."""
            r, (steps_before, samples_before, skipped_before) = self.reporter, self._base
            steps = r.steps - steps_before  # executed in this fit(), counted by the batch hooks
            if r.batch_size is not None:
                samples = steps * r.batch_size
            else:
                samples = 0 if self._tracker is None else self._tracker.samples() - self._tracker_base
                if self._counter is not None:
                    counted = self._counter.read()
                    delta = (counted[0] - self._counted_base[0], counted[1] - self._counted_base[1])
                    samples += self._counter.samples(delta, steps - self._counter_steps)
            skipped = max(0, steps - (self._iterations() - self._iterations_base)) if self._loss_scaled else 0
            return r.steps, samples_before + samples, skipped_before + skipped

        def on_train_begin(self, logs: Any = None) -> None:
            r = self.reporter
            r.exact_counts = None
            self._base = r.report_counts()  # earlier fit() calls carry over
            self._tracker = self._watch = self._counter = None
            if r.batch_size is None:
                self._tracker = self._watch = _LossTrackerCount.of(self.model, keras)
                if self._tracker is None:
                    self._counter = _SampleCounter.of(self.model, tf)
            self._tracker_base = self._tracker.samples() if self._tracker is not None else 0
            self._counted_base = self._counter.read() if self._counter is not None else (0, 0)
            self._counter_steps = 0
            optimizer = getattr(self.model, "optimizer", None)
            self._loss_scaled = optimizer is not None and _loss_scaled(optimizer)
            self._iterations_base = self._iterations() if self._loss_scaled else 0
            self._execution = _steps_per_execution(self.model)
            r.exact_counts = self._exact
            r.phase = "train"
            self._in_fit = True
            self._open_steps = 0
            r.start()

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.reporter.epoch = epoch
            self._epoch_steps = (self.params or {}).get("steps")

        def _steps_in(self, batch: int) -> int:
            """Steps one execution starting at ``batch`` runs (the last of an epoch may run fewer)."""
            if self._epoch_steps:
                return max(1, min(self._execution, self._epoch_steps - batch))
            return self._execution

        # A step's time runs from its batch-begin hook to the next one's (or to the end of the epoch's steps);
        # its profiler marker only to its batch-end hook, so callbacks' work shows between steps in a profile.

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            steps = self._steps_in(batch) if self._execution > 1 else 1
            self.reporter.next_step(self._open_steps, steps)
            self._open_steps = steps
            watch = self._watch
            if watch is not None and not watch.ok:  # after a reset of the metrics, or near the count's limit
                self._count_from_here(watch)

        def _count_from_here(self, tracker: _LossTrackerCount) -> None:
            """Open the loss tracker's next segment or, once it nears its limit, count in the graph from the
            execution about to run on (the train function is rebuilt, once)."""
            try:
                tracker.open()
            except Exception as exc:  # never break training: the graph counts from here on
                tracker.give_up(exc)
            if tracker.ok:
                return
            r = self.reporter
            with r._fold_lock:  # the reporter thread sees the count before or after the switch, never between
                r._fold()
                self._counter = _SampleCounter.of(self.model, tf)
                self._counted_base = self._counter.read()
                self._counter_steps = r.steps - self._base[0]
                self._watch = None

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.reporter.end_marker()

        def _end_open_step(self) -> None:
            self.reporter.next_step(self._open_steps, 0)
            self._open_steps = 0

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self._end_open_step()

        def on_test_begin(self, logs: Any = None) -> None:
            self._end_open_step()  # validation runs after the epoch's last step
            self.reporter.phase = "evaluate"

        def on_test_end(self, logs: Any = None) -> None:
            self.reporter.phase = "train" if self._in_fit else "idle"

        def on_predict_begin(self, logs: Any = None) -> None:
            self.reporter.phase = "predict"

        def on_predict_end(self, logs: Any = None) -> None:
            self.reporter.phase = "idle"

        def on_train_end(self, logs: Any = None) -> None:
            self._end_open_step()
            if self._tracker is not None:
                self._tracker.close()
            self._in_fit = False
            r = self.reporter
            r.phase = "idle"
            _, r.samples, r.skipped = r.report_counts()  # the exact totals, kept after this fit()
            r.exact_counts = None
            r.flush()  # the exact final counts, not the last periodic report

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
