"""Continuous profiling while a rule is pending: a capture worker that keeps a bounded ring of snapshots.

TensorFlow 2.21's profiler server implements ``StartContinuousProfiling``, ``GetSnapshot`` and
``StopContinuousProfiling`` (openxla/xla ``xla/tsl/profiler/rpc/profiler_service_impl.cc``): a snapshot
returns the XSpace in the response (never a file), covering everything since the session started or the
last snapshot, and the server starts a new session. The server keeps no ring, so this process snapshots
every ``interval`` seconds and keeps the newest (at most ``keep`` snapshots and ``max_bytes``).

It runs in the capture worker started ahead of time (daemon/capture_worker.py, a request with ``"ring": true``).
Protocol: one JSON request line on stdin; this process answers one line (``{"armed": true}``, or a final
result: ``unimplemented`` when the server has no such RPCs, ``failed`` otherwise), then reads commands:
``keep`` (take a last snapshot, write the ring as consecutive run directories, stop profiling, answer the
result) or ``drop`` (stop profiling, write nothing). End of input or the request's deadline is ``drop``.
Never imports TensorFlow; the gRPC stays in this process, never in the agent.
"""

from __future__ import annotations

import json
import re
import select
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .capture_worker import _REASON_WORDS, _is_empty, _probe, _write_new, failure_reason
from .protos import profiler_pb2, xplane_pb2

SERVICE = "/tensorflow.ProfilerService/"


@dataclass(frozen=True)
class Snapshot:
    data: bytes
    begin_ns: int  # the profiling window, Unix ns (Task Environment plane; 0 if absent)
    end_ns: int


def window_of(data: bytes) -> tuple[int, int]:
    """A snapshot's profiling window (Unix ns) from its Task Environment plane, (0, 0) if it has none."""
    for plane in xplane_pb2.XSpace.FromString(data).planes:
        if plane.name == "Task Environment":
            stats = {plane.stat_metadata[s.metadata_id].name: s.int64_value or s.uint64_value for s in plane.stats}
            return stats.get("profile_start_time", 0), stats.get("profile_stop_time", 0)
    return 0, 0


class Ring:
    """The newest snapshots, at most ``keep`` of them and ``max_bytes`` in all (oldest dropped first)."""

    def __init__(self, keep: int, max_bytes: int):
        self.keep, self.max_bytes = keep, max_bytes
        self.items: deque[Snapshot] = deque()
        self.bytes = 0
        self.dropped = 0

    def add(self, snapshot: Snapshot) -> None:
        self.items.append(snapshot)
        self.bytes += len(snapshot.data)
        while len(self.items) > self.keep or (self.bytes > self.max_bytes and len(self.items) > 1):
            self.bytes -= len(self.items.popleft().data)
            self.dropped += 1
        if self.bytes > self.max_bytes:  # one snapshot alone over the bound: not kept either
            self.bytes -= len(self.items.popleft().data)
            self.dropped += 1


class Session:
    """Continuous profiling of one profiler server, over one gRPC channel."""

    def __init__(self, target: str, request: dict[str, Any]):
        import grpc

        self.grpc = grpc
        self.target = target
        self.timeout = request.get("rpc_timeout", 30.0)
        self.answered = True  # whether the port accepted connections before the first call
        self.channel = grpc.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", request["max_trace_bytes"]), ("grpc.enable_http_proxy", 0)])
        opts = profiler_pb2.ProfileOptions(
            version=1, include_dataset_ops=True, host_tracer_level=request["host_tracer_level"],
            device_tracer_level=request["device_tracer_level"], python_tracer_level=request["python_tracer_level"])
        self.start_request = profiler_pb2.ProfileRequest(
            opts=opts, session_id=time.strftime("%Y_%m_%d_%H_%M_%S", time.gmtime()),
            host_name=target.rpartition(":")[0], emit_xspace=True).SerializeToString()

    def _call(self, method: str, payload: bytes) -> bytes:
        return self.channel.unary_unary(SERVICE + method)(payload, timeout=self.timeout)

    def start(self) -> None:
        self.answered = _probe(self.target)
        self._call("StartContinuousProfiling", self.start_request)

    def snapshot(self) -> Snapshot | None:
        """The profile since the last snapshot; None if the process did nothing in it."""
        response = profiler_pb2.ProfileResponse.FromString(self._call("GetSnapshot", b""))
        if response.empty_trace or _is_empty(response.xspace):
            return None
        return Snapshot(response.xspace, *window_of(response.xspace))

    def stop(self) -> None:
        try:
            self._call("StopContinuousProfiling", b"")
        except self.grpc.RpcError:
            pass  # the process went away: nothing left to stop
        self.channel.close()

    def error(self, exc: Exception) -> dict[str, Any]:
        code, detail = exc.code(), (exc.details() or "").strip()  # type: ignore[attr-defined]
        reason = "unimplemented" if code.name == "UNIMPLEMENTED" else failure_reason(
            code.name, detail, self.answered, lambda: _probe(self.target))
        words = _REASON_WORDS.get(reason, "the profiler server has no continuous profiling (TensorFlow < 2.21)"
                                  if reason == "unimplemented" else code.name)
        return {"status": "failed" if reason != "unimplemented" else "unimplemented", "reason": reason,
                "detail": f"{self.target}: {words} (gRPC {code.name}: {detail[:300]})",
                "died": [self.target] if reason == "died" else []}  # as capture_worker's: the addresses that died


def write_ring(ring: Ring, target: str, logdir: Path) -> list[dict[str, Any]]:
    """Each snapshot as its own run directory (``<n>-<session>``), in time order; what was written."""
    host, _, port = target.rpartition(":")
    name = re.sub(r"[^A-Za-z0-9.-]", "_", host.strip("[]")) + f"_{port}.xplane.pb"
    stamp = time.strftime("%Y_%m_%d_%H_%M_%S", time.gmtime())
    written = []
    for n, snap in enumerate(ring.items):
        path = logdir / "plugins" / "profile" / f"{stamp}_{n:02d}" / name
        _write_new(path, snap.data)
        written.append({"file": str(path.relative_to(logdir)), "bytes": len(snap.data), "begin_ns": snap.begin_ns,
                        "end_ns": snap.end_ns})
    return written


def _command(timeout: float) -> str | None:
    """The next command on stdin within ``timeout`` s ("keep", "drop", "" at end of input), or None."""
    ready, _, _ = select.select([sys.stdin], [], [], max(0.0, timeout))
    if not ready:
        return None
    return sys.stdin.readline().strip()


def say(data: dict[str, Any]) -> None:
    print(json.dumps(data), flush=True)


def run(request: dict[str, Any]) -> dict[str, Any]:
    target = request["targets"][0]
    session = Session(target, request)
    grpc = session.grpc
    try:
        session.start()
    except grpc.RpcError as exc:
        session.channel.close()
        return session.error(exc)
    say({"armed": True, "at": time.time()})
    ring = Ring(request["keep"], request["max_bytes"])
    armed = time.monotonic()
    deadline = armed + request["deadline_s"]
    next_at = armed + request["interval"]
    keep_at = None  # once told to keep: when the ring covers at least min_s since arming
    failures = 0
    try:
        while True:
            now = time.monotonic()
            if keep_at is not None and now >= keep_at:
                break
            if now >= deadline:
                return {"status": "discarded", "reason": "expired", "detail": "no decision before the deadline"}
            wake = min(next_at, deadline, keep_at if keep_at is not None else deadline)
            if keep_at is None:
                command = _command(wake - now)
            else:
                time.sleep(max(0.0, wake - now))
                command = None
            if command is None:
                if time.monotonic() < next_at:
                    continue
                next_at += request["interval"]
                try:
                    snap = session.snapshot()
                    failures = 0
                except grpc.RpcError as exc:
                    failures += 1
                    if failures >= 3:
                        return session.error(exc)
                    continue
                if snap is not None:
                    ring.add(snap)
                continue
            if command != "keep":
                return {"status": "discarded", "reason": "dropped", "detail": "the rule did not fire"}
            keep_at = max(time.monotonic(), armed + request.get("min_s", 0.0))
        try:
            snap = session.snapshot()
        except grpc.RpcError as exc:
            if not ring.items:
                return session.error(exc)
            snap = None
        if snap is not None:
            ring.add(snap)
        if not ring.items:
            return {"status": "failed", "reason": "empty_trace", "detail": f"{target}: the profiler server "
                    "collected no events: was the process idle?"}
        logdir = Path(request["logdir"])
        written = write_ring(ring, target, logdir)
        return {"status": "done", "reason": None, "rpc_sent_at": written[0]["begin_ns"] / 1e9 or None,
                "detail": f"{len(written)} snapshot(s) of {target}" + (
                    f" ({ring.dropped} older ones dropped by the ring's bounds)" if ring.dropped else ""),
                "files": [w["file"] for w in written], "snapshots": written, "dropped": ring.dropped,
                "bytes": sum(w["bytes"] for w in written)}
    finally:
        session.stop()


def serve(request: dict[str, Any]) -> int:
    """Run a ring for the agent (the capture worker's ``main`` read its request line)."""
    try:
        result = run(request)
    except Exception as exc:  # report, don't crash: the agent records the reason
        result = {"status": "failed", "reason": "error", "detail": f"{type(exc).__name__}: {exc}"}
    say(result)
    return 0
