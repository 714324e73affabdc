"""One profile capture, run as a short-lived process so a stuck or crashing capture never hurts the agent.

Started ahead of its request (daemon/workers.py keeps one waiting): it loads gRPC and the protobufs first,
then reads one JSON request line on stdin and writes one JSON result line on stdout. Never imports TensorFlow.
A request with ``"ring": true`` is a continuous-profiling ring instead (daemon/snapshot_worker.py: it then
talks with the agent line by line), so arming one on a pending rule is an RPC, not a process start.

Two modes:
- ``agent`` (default): a ProfileRequest with ``emit_xspace`` over gRPC to every target at once, all
  told to start at the same instant (``start_timestamp_ns``), so a multi-worker capture covers one
  time window on every worker; each server answers with its trace and this process writes it. gRPC
  status codes tell the causes apart. One target needs no common start; for several, the start lead
  is measured: the slowest connection to them, doubled, within ``MIN_LEAD_S``..``MAX_LEAD_S``.
- ``server``: the request TensorBoard's Capture Profile button sends (xprof's client); the training
  processes' profiler servers write the traces into ``logdir`` (several workers go in one
  comma-separated service address, which traces them over one window). Its errors all arrive as one
  generic RuntimeError, so the cause is worked out from what is left behind.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from .protos import profiler_pb2, xplane_pb2
from .workers import PR_SET_PDEATHSIG, die_with_parent, signal_ready

EMPTY_TRACE_BYTES = 1024  # an idle process leaves a ~200-byte .xplane.pb
MIN_LEAD_S = 0.02  # several targets: at least this long for every one to receive the request before the start
MAX_LEAD_S = 0.3  # ... and at most this long
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
WATCHED_OUTCOMES = ("empty_trace", "error")  # answers after which a GPU host watches the process (_watched)
CONNECT_WAIT_S = 1.0  # how long a target may take to connect before the start (slower: it counts as MAX_LEAD_S)


def _probe(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at host:port."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _still_listening(address: str, within: float = 1.0, interval: float = 0.1) -> bool:
    """Whether host:port keeps accepting connections for ``within`` seconds, probed every ``interval`` (each
    probe bounded by the time left): a process that is exiting may have reset one connection and not yet
    closed its listening socket, and one that crashes after answering closes it a little later."""
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        if not _probe(address, timeout=min(1.0, left)):
            return False
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
    return True


def _speaks_grpc(address: str, timeout: float = 5.0) -> bool:
    """Whether what listens at host:port answers a gRPC call as a gRPC server does (any status of its own,
    UNIMPLEMENTED for the made-up method asked here), rather than failing the connection (not HTTP/2)."""
    import grpc

    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        try:
            channel.unary_unary("/tfprofd.Probe/SpeaksGrpc")(b"", timeout=timeout)
        except grpc.RpcError as exc:
            detail = exc.details() or ""
            return not (exc.code() == grpc.StatusCode.UNAVAILABLE or "HTTP/2" in detail or "http1" in detail.lower())
    return True


def training_events(data: bytes) -> int:
    """How many events of a serialized XSpace show the process training: step markers, TensorFlow ops on
    its executor threads, anything on a device. A process that did nothing (or only answered the hook's
    reads of its counters) has none, whatever else its trace holds."""
    space = xplane_pb2.XSpace.FromString(data)
    count = 0
    for plane in space.planes:
        if plane.name.startswith("/device:"):
            count += sum(len(line.events) for line in plane.lines)
            continue
        if not plane.name.startswith("/host:"):
            continue
        ops = {i for i, m in plane.event_metadata.items() if ":" in m.name}  # "name:Type", "Iterator::..."
        markers = {i for i, m in plane.stat_metadata.items() if m.name == "step_num"}
        for line in plane.lines:
            executor = line.name.startswith(("tf_Compute", "tf_inter_op", "tf_numa", "tf_data"))
            count += sum(1 for event in line.events if (executor and event.metadata_id in ops)
                         or any(st.metadata_id in markers for st in event.stats))
    return count


def _is_empty(data: bytes) -> bool:
    try:
        return len(data) < EMPTY_TRACE_BYTES or training_events(data) == 0
    except Exception:  # not parseable as a trace: let the analysis say what is wrong with it
        return False


def _result(status: str, reason: str | None, detail: str, rpc_sent_at: float | None,
            files: list[Trace] | None = None) -> dict[str, Any]:
    files = files or []
    return {"status": status, "reason": reason, "detail": detail, "rpc_sent_at": rpc_sent_at,
            "files": [str(f.path) for f in files], "bytes": sum(f.size for f in files)}


class Trace(NamedTuple):
    path: Path  # relative to the capture's directory
    size: int
    empty: bool = False  # no training events (an idle process): left out, and deleted if no trace has any


def _server_traces(logdir: Path, limit: int) -> list[Trace]:
    """The traces xprof's client wrote (``plugins/profile/<run>/*.xplane.pb``), each opened from its directory's
    descriptor, never through a link, and read only if it is a regular file (at most ``limit`` bytes: a larger
    one is a trace, and the analysis says it is too large). In server mode the capture's directory is writable
    by the training processes' group (``captures.dir_mode``): a member could put a link there, to a file that
    would be deleted as an empty trace or to /dev/zero, read without end."""
    found = []
    with contextlib.ExitStack() as opened:
        def open_dir(name: str | Path, parent: int | None) -> int:
            fd = os.open(name, _DIR, dir_fd=parent)
            opened.callback(os.close, fd)
            return fd

        try:
            profile = open_dir("profile", open_dir("plugins", open_dir(logdir, None)))
            runs = sorted(os.listdir(profile))
        except OSError:
            return []
        for run in runs:
            try:  # one run's directory open at a time: a group member may make thousands
                run_fd = os.open(run, _DIR, dir_fd=profile)
            except OSError:  # a link, or not a directory: not the client's
                continue
            try:
                names = sorted(os.listdir(run_fd))
            except OSError:
                names = []
            for name in names:
                read = _read_regular(run_fd, name, limit) if name.endswith(".xplane.pb") else None
                if read is not None:
                    data, size = read
                    found.append(Trace(Path("plugins", "profile", run, name), size,
                                       len(data) <= limit and _is_empty(data)))
            os.close(run_fd)
    return found


def _read_regular(dir_fd: int, name: str, limit: int) -> tuple[bytes, int] | None:
    """(up to ``limit`` + 1 bytes, its size) of a regular file in the directory ``dir_fd``; None for anything
    else (a link is not opened, a FIFO not waited on)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a directory opens too (and os.fdopen would refuse it, fd left open)
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1), st.st_size
    except OSError:  # a read error: not a trace this worker can read
        return None
    finally:
        os.close(fd)


def _drop(logdir: Path, traces: list[Trace]) -> None:
    """Delete empty traces and their run directory if nothing else is left in it, from descriptors (an entry
    is removed, never followed)."""
    for trace in traces:
        with contextlib.suppress(OSError), contextlib.ExitStack() as opened:
            fd = None
            for part in (logdir, *trace.path.parts[:-2]):
                fd = os.open(part, _DIR, dir_fd=fd)
                opened.callback(os.close, fd)
            run = os.open(trace.path.parts[-2], _DIR, dir_fd=fd)
            opened.callback(os.close, run)
            os.unlink(trace.path.name, dir_fd=run)
            os.rmdir(trace.path.parts[-2], dir_fd=fd)


class ClientCrashed(Exception):
    """xprof's client died of a signal (it does on some answers that are no profile)."""


def _xprof_trace(service: str, logdir: Path, duration_ms: int, options: dict[str, int]) -> str | None:
    """TensorFlow's own capture (xprof's client) in a child process, so that a crash of the client ends the
    capture and not this worker; xprof's error message, or None."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python threads here yet, so fork is safe
        os.close(read)
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # killed with the worker
        code = 0
        try:
            from xprof.convert import _pywrap_profiler_plugin

            _pywrap_profiler_plugin.trace(service, str(logdir), "", True, duration_ms, 1, options)
        except BaseException as exc:
            os.write(write, str(exc).strip().encode()[:4096])
            code = 1
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        message = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        raise ClientCrashed(signal.Signals(os.WTERMSIG(status)).name)
    return message or None


def capture_server_mode(request: dict[str, Any], logdir: Path) -> dict[str, Any]:
    targets = request["targets"]
    options = {"host_tracer_level": request["host_tracer_level"],
               "device_tracer_level": request["device_tracer_level"],
               "python_tracer_level": request["python_tracer_level"], "delay_ms": request["delay_ms"]}
    answering = [t for t in targets if _probe(t)]
    started = time.time()
    crashed = None
    try:
        error = _xprof_trace(",".join(targets), logdir, request["duration_ms"], options)
    except ClientCrashed as exc:
        error, crashed = None, str(exc)
    elapsed = time.time() - started
    files = _server_traces(logdir, request["max_trace_bytes"])
    real = [f for f in files if not f.empty]
    died = [t for t in answering if not _probe(t)] if len(real) < len(targets) else []
    if died:
        gone = f"{', '.join(died)}: {_REASON_WORDS['died']}"
        reason = "partial" if real else "died"
        detail = f"{len(real)} of {len(targets)} workers traced; {gone}" if real else gone
        return {**_result("failed", reason, detail, started, real), "died": died}
    if real:
        status, reason = ("done", None) if len(real) >= len(targets) else ("failed", "partial")
        detail = f"{len(real)} trace file(s)" + ("" if status == "done" else f" for {len(targets)} targets")
        return _result(status, reason, detail, started, real)
    if files:
        _drop(logdir, files)
        return _result("failed", "empty_trace", "the profiler server collected no events: was the process "
                       "idle (no training steps) during the capture?", started)
    closed = [t for t in targets if not _probe(t)]
    if closed:
        return _result("failed", "no_server", f"nothing listens at {', '.join(closed)}: the training process "
                       "has no profiler server (or exited)", started)
    if crashed and not real:
        return _result("failed", "not_a_profiler", f"{', '.join(targets)}: {_REASON_WORDS['not_a_profiler']} "
                       f"(TensorFlow's profiler client died of {crashed} on the answer)", started)
    strangers = [t for t in targets if not _speaks_grpc(t)]
    if strangers:
        return _result("failed", "not_a_profiler", "; ".join(f"{t}: {_REASON_WORDS['not_a_profiler']} (it does not "
                                                            "speak gRPC)" for t in strangers), started)
    if elapsed < max(2.0, request["duration_ms"] / 1000 / 2):
        return _result("failed", "busy", "the profiler server refused at once: another profiling session is "
                       "probably active in that process (TensorFlow allows one at a time: a Keras TensorBoard "
                       "callback with profile_batch, or another capture)", started)
    return _result("failed", "not_a_profiler", f"the port is open but no trace came back in {elapsed:.0f}s: "
                   f"is it a TensorFlow profiler server? (client said: {error})", started)


# ---- agent mode: ProfileRequest with emit_xspace over gRPC ----

def profile_request(request: dict[str, Any], host: str, session: str, start_ns: int) -> bytes:
    options = profiler_pb2.ProfileOptions(
        version=1, include_dataset_ops=True, host_tracer_level=request["host_tracer_level"],
        device_tracer_level=request["device_tracer_level"], python_tracer_level=request["python_tracer_level"],
        duration_ms=request["duration_ms"], start_timestamp_ns=start_ns)
    return profiler_pb2.ProfileRequest(duration_ms=request["duration_ms"], opts=options, session_id=session,
                                       host_name=host, emit_xspace=True).SerializeToString()


def failure_reason(code_name: str, detail: str, answered_before: bool, answers_now: Callable[[], bool]) -> str:
    """The reason a gRPC failure stands for, from its status code, the server's words and whether the port
    accepted TCP connections before the call and (asked only when it matters) after it."""
    if "Another profil" in detail or code_name == "ALREADY_EXISTS":
        return "busy"  # TensorFlow allows one profiling session per process
    if code_name == "UNAVAILABLE" or "HTTP/2" in detail or "http1" in detail.lower():  # the connection failed
        # a stream that was set up and then removed reached a server, whatever the probe before the call saw (on a
        # loaded host its connect can time out while the server is there)
        if not answered_before and "Stream removed" not in detail:
            return "no_server"
        # Closed now: the process went away during the call. Still open: what listens does not speak gRPC
        # (an HTTP server, random bytes, broken HTTP/2 frames), so it is no profiler, alive or not.
        return "not_a_profiler" if answers_now() else "died"
    return {"DEADLINE_EXCEEDED": "timeout", "UNIMPLEMENTED": "not_a_profiler",
            "RESOURCE_EXHAUSTED": "too_large"}.get(code_name, "error")


_REASON_WORDS = {
    "busy": "another profiling session is active in that process (TensorFlow allows one at a time: a Keras "
            "TensorBoard callback with profile_batch, or another capture)",
    "no_server": "nothing answers there: the process has no profiler server or exited",
    "died": "the process stopped answering during the capture: it exited or crashed (TensorFlow's profiler can "
            "crash the non-chief workers of a MultiWorkerMirroredStrategy job: README, Known issues)",
    "died_after": "the process stopped answering within seconds of a capture that came back with no trace or an "
                  "error: it exited or crashed (a profiling session whose GPU tracer failed to start has killed "
                  "jobs on a GPU: README, Known issues)",
    "timeout": "no answer before the deadline",
    "not_a_profiler": "something answers at that port, but it is no TensorFlow profiler server: check the job's "
                      "profiler address (tfprofd_training_info{profiler_address}; the hook's profiler_port or "
                      "TFPROFD_PROFILER_PORT) and what else listens there (ss -ltnp)",
    "too_large": "the trace is larger than captures.max_trace_bytes",
}


def _not_a_profile(target: str, why: str) -> tuple[str, str]:
    return "not_a_profiler", f"{target}: {_REASON_WORDS['not_a_profiler']} ({why})"


def _channel_options(max_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", max_bytes), ("grpc.enable_http_proxy", 0)]


def _profile_one(target: str, payload: bytes, deadline: float, max_bytes: int) -> tuple[str, bytes | str]:
    """("ok", xspace bytes) or (reason, detail) for one target."""
    import grpc
    from google.protobuf.message import DecodeError

    answered_before = _probe(target)
    with grpc.insecure_channel(target, options=_channel_options(max_bytes)) as channel:
        call = channel.unary_unary("/tensorflow.ProfilerService/Profile")
        try:
            answer = call(payload, timeout=deadline)
        except grpc.RpcError as exc:
            code, detail = exc.code(), (exc.details() or "").strip()
            reason = failure_reason(code.name, detail, answered_before, lambda: _still_listening(target))
            return reason, f"{target}: {_REASON_WORDS.get(reason, code.name)} (gRPC {code.name}: {detail[:300]})"
    try:
        response = profiler_pb2.ProfileResponse.FromString(answer)
    except DecodeError:
        return _not_a_profile(target, f"its {len(answer)}-byte answer to ProfilerService/Profile is no ProfileResponse")
    if response.empty_trace:
        return "empty_trace", f"{target}: the profiler server collected no events: was the process idle?"
    if not response.xspace:
        return _not_a_profile(target, "its answer holds no trace; a TensorFlow that cannot send traces over gRPC "
                              "(emit_xspace) needs captures.mode: server")
    try:
        events = training_events(response.xspace)
    except DecodeError:
        return _not_a_profile(target, f"the {len(response.xspace)}-byte trace in its answer is no XSpace")
    if len(response.xspace) < EMPTY_TRACE_BYTES or events == 0:
        return "empty_trace", f"{target}: the profiler server collected no events: was the process idle?"
    return "ok", response.xspace


def _write_new(path: Path, data: bytes) -> None:
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def capture_agent_mode(request: dict[str, Any], logdir: Path) -> dict[str, Any]:
    targets = request["targets"]
    session = time.strftime("%Y_%m_%d_%H_%M_%S", time.gmtime())
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(targets))
    with pool, _connections(targets, request["max_trace_bytes"]) as ready:
        def each(call: Callable[[str], Any]) -> list[Any]:  # one target: no thread to start and hand over to
            return [call(targets[0])] if len(targets) == 1 else list(pool.map(call, targets))

        if request.get("start_at_ns"):  # a job-wide capture: the coordinating agent chose the instant
            start_ns = request["start_at_ns"]
            lead = max(0.0, start_ns / 1e9 - time.time())
        else:
            lead = max(start_lead(each(ready)), request["delay_ms"] / 1000)
            start_ns = time.time_ns() + int(lead * 1e9) if lead else 0  # 0: start at once
        deadline = max(60.0, 2 * request["duration_ms"] / 1000) + lead
        started = time.time()
        answers = each(lambda t: _profile_one(t, profile_request(request, t.rpartition(":")[0], session, start_ns),
                                              deadline, request["max_trace_bytes"]))
        watch_s = request.get("watch_s", 0.0)
        if watch_s > 0 and any(outcome in WATCHED_OUTCOMES for outcome, _ in answers):
            answers = list(pool.map(lambda i: _watched(targets[i], answers[i], watch_s), range(len(targets))))
    files: list[Trace] = []
    failures = []
    for target, (outcome, data) in zip(targets, answers, strict=True):
        if outcome != "ok":
            failures.append((outcome, data))
            continue
        host, _, port = target.rpartition(":")
        name = re.sub(r"[^A-Za-z0-9.-]", "_", host.strip("[]")) + f"_{port}.xplane.pb"
        path = Path("plugins", "profile", session, name)
        _write_new(logdir / path, data)  # type: ignore[arg-type]
        files.append(Trace(path, len(data)))  # type: ignore[arg-type]
    if not failures:
        window = f"one window from {start_ns / 1e9:.3f}" if start_ns else "started at once"
        return _result("done", None, f"{len(files)} trace file(s), {window}", started, files)
    reason = failures[0][0] if len(failures) == len(targets) else "partial"
    detail = "; ".join(str(d) for _, d in failures)
    if reason == "partial":
        detail = f"{len(files)} of {len(targets)} workers traced; {detail}"
    died = [t for t, (outcome, _) in zip(targets, answers, strict=True) if outcome == "died"]
    return {**_result("failed", reason, detail, started, files), "died": died}


def _watched(target: str, answer: tuple[str, bytes | str], watch_s: float) -> tuple[str, bytes | str]:
    """The answer, or ``died`` where it held no trace (or was a gRPC error) and the process stopped listening
    within ``watch_s``: on an H100 a JAX job whose session failed to start its GPU tracer answered with no
    events and crashed 1-3 s later."""
    outcome, detail = answer
    if outcome in WATCHED_OUTCOMES and not _still_listening(target, within=watch_s):
        return "died", f"{target}: {_REASON_WORDS['died_after']} ({detail})"
    return answer


def start_lead(connect_s: list[float | None]) -> float:
    """Seconds between sending the requests and the common start: none for one target (nothing to line up);
    for several, twice the slowest connection (None: it did not connect, its call fails anyway), bounded."""
    if len(connect_s) < 2:
        return 0.0
    slowest = max((t for t in connect_s if t is not None), default=MAX_LEAD_S)
    return min(MAX_LEAD_S, max(MIN_LEAD_S, 2 * slowest))


@contextlib.contextmanager
def _connections(targets: list[str], max_bytes: int) -> Iterator[Callable[[str], float | None]]:
    """For several targets: connect to each and time it, with the profile call's channel options (so gRPC
    can share the connection with it). One target: nothing to measure."""
    import grpc

    channels: list[grpc.Channel] = []

    def ready(target: str) -> float | None:
        if len(targets) < 2:
            return None
        channel = grpc.insecure_channel(target, options=_channel_options(max_bytes))
        channels.append(channel)
        began = time.monotonic()
        try:
            grpc.channel_ready_future(channel).result(timeout=CONNECT_WAIT_S)
        except grpc.FutureTimeoutError:
            return None
        return time.monotonic() - began

    try:
        yield ready
    finally:
        for channel in channels:
            channel.close()


def _warm_up() -> None:
    """What a capture needs, done before its request arrives (a pre-started worker then waits, ready): gRPC
    loaded and its core started (its threads, the name resolver), the thread pool's module imported."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: F401  (loaded lazily by concurrent.futures)

    import grpc

    from . import snapshot_worker  # noqa: F401  (a ring request needs it)

    with grpc.insecure_channel("localhost:1", options=[("grpc.enable_http_proxy", 0)]) as channel:
        with contextlib.suppress(grpc.FutureTimeoutError):
            grpc.channel_ready_future(channel).result(timeout=0.05)  # port 1: refused at once, nothing sent


def main() -> int:
    die_with_parent()
    _warm_up()
    signal_ready()

    request = json.loads(sys.stdin.readline())
    if request.get("ring"):
        from .snapshot_worker import serve

        return serve(request)
    logdir = Path(request["logdir"])
    try:
        if request["mode"] == "agent":
            result = capture_agent_mode(request, logdir)
        else:
            result = capture_server_mode(request, logdir)
    except Exception as exc:  # report, don't crash: the agent records the reason
        result = {"status": "failed", "reason": "error", "detail": f"{type(exc).__name__}: {exc}",
                  "files": [], "bytes": 0, "rpc_sent_at": None}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
