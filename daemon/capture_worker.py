"""One profile capture, run as a short-lived process so a stuck or crashing capture never hurts the agent.

Reads a JSON request on stdin, writes one JSON result line on stdout. Never imports TensorFlow.

Two modes:
- ``server``: the training process's profiler server writes the trace into ``logdir`` (the request
  TensorBoard's Capture Profile button sends, through xprof's client). Its errors all arrive as one
  generic RuntimeError, so the cause is worked out: port closed → ``no_server``; a tiny trace file →
  ``empty_trace``; a fast failure on an open port → ``busy`` (another session active); a slow one with
  no file → ``not_a_profiler``.
- ``agent``: the same ProfileRequest with ``emit_xspace`` set, sent over raw gRPC; the server returns the
  trace and this process writes it (for hosts where the two cannot share a directory). gRPC status
  codes tell the causes apart directly.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

EMPTY_TRACE_BYTES = 1024  # an idle process leaves a ~200-byte .xplane.pb


def _probe(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at host:port."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _traces(logdir: Path) -> list[Path]:
    return sorted(logdir.glob("plugins/profile/*/*.xplane.pb"))


def _result(status: str, reason: str | None, detail: str, logdir: Path, rpc_sent_at: float,
            files: list[Path] | None = None) -> dict[str, Any]:
    files = files or []
    return {"status": status, "reason": reason, "detail": detail, "rpc_sent_at": rpc_sent_at,
            "files": [str(f.relative_to(logdir)) for f in files], "bytes": sum(f.stat().st_size for f in files)}


def _drop_empty(files: list[Path]) -> None:
    for f in files:
        f.unlink(missing_ok=True)
        try:
            f.parent.rmdir()
        except OSError:
            pass


def capture_server_mode(request: dict[str, Any], logdir: Path) -> dict[str, Any]:
    from xprof.convert import _pywrap_profiler_plugin

    targets = request["targets"]
    options = {"host_tracer_level": request["host_tracer_level"],
               "device_tracer_level": request["device_tracer_level"],
               "python_tracer_level": request["python_tracer_level"], "delay_ms": request["delay_ms"]}
    started = time.time()
    try:
        _pywrap_profiler_plugin.trace(targets[0], str(logdir), ",".join(targets) if len(targets) > 1 else "",
                                      True, request["duration_ms"], 1, options)
        error = None
    except RuntimeError as exc:
        error = str(exc).strip()
    elapsed = time.time() - started
    files = _traces(logdir)
    real = [f for f in files if f.stat().st_size >= EMPTY_TRACE_BYTES]
    if real:
        return _result("done", None, f"{len(real)} trace file(s)", logdir, started, real)
    if files:
        _drop_empty(files)
        return _result("failed", "empty_trace", "the profiler server collected no events: was the process "
                       "idle (no training steps) during the capture?", logdir, started)
    closed = [t for t in targets if not _probe(t)]
    if closed:
        return _result("failed", "no_server", f"nothing listens at {', '.join(closed)}: the training process "
                       "has no profiler server (or exited)", logdir, started)
    if elapsed < max(2.0, request["duration_ms"] / 1000 / 2):
        return _result("failed", "busy", "the profiler server refused at once: another profiling session is "
                       f"probably active in that process (client said: {error})", logdir, started)
    return _result("failed", "not_a_profiler", f"the port is open but no trace came back in {elapsed:.0f}s: "
                   f"is it a TensorFlow profiler server? (client said: {error})", logdir, started)


# ---- emit_xspace over raw gRPC: field numbers from tsl/profiler/protobuf/profiler_service.proto ----


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, wire: int, payload: bytes | int) -> bytes:
    key = _varint(number << 3 | wire)
    if wire == 0:
        return key + _varint(int(payload))
    assert isinstance(payload, bytes)
    return key + _varint(len(payload)) + payload


def encode_profile_request(request: dict[str, Any], host: str, session_id: str) -> bytes:
    """ProfileRequest{duration_ms=1, opts=4, repository_root=5, session_id=6, host_name=7, emit_xspace=9}."""
    options = (_field(5, 0, 1)  # ProfileOptions.version
               + _field(1, 0, 1)  # include_dataset_ops
               + _field(2, 0, request["host_tracer_level"])
               + _field(3, 0, request["device_tracer_level"])
               + _field(4, 0, request["python_tracer_level"])
               + _field(9, 0, request["duration_ms"]))
    if request["delay_ms"]:
        options += _field(8, 0, time.time_ns() + request["delay_ms"] * 1_000_000)  # start_timestamp_ns
    return (_field(1, 0, request["duration_ms"]) + _field(4, 2, options) + _field(6, 2, session_id.encode())
            + _field(7, 2, host.encode()) + _field(9, 0, 1))


def decode_profile_response(data: bytes) -> tuple[bool, bytes]:
    """(empty_trace=7, xspace=8 as raw bytes) from a ProfileResponse."""
    empty, xspace, i = False, b"", 0
    while i < len(data):
        key, i = _read_varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(data, i)
            if number == 7:
                empty = bool(value)
        elif wire == 2:
            length, i = _read_varint(data, i)
            if number == 8:
                xspace = data[i:i + length]
            i += length
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unexpected wire type {wire}")
    return empty, xspace


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        byte = data[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i
        shift += 7


def capture_agent_mode(request: dict[str, Any], logdir: Path) -> dict[str, Any]:
    import grpc

    session = time.strftime("%Y_%m_%d_%H_%M_%S", time.gmtime())
    files: list[Path] = []
    started = time.time()
    deadline = max(60.0, 2 * request["duration_ms"] / 1000) + request["delay_ms"] / 1000
    for target in request["targets"]:
        host, _, port = target.rpartition(":")
        channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 1 << 30)])
        call = channel.unary_unary("/tensorflow.ProfilerService/Profile")
        try:
            response = call(encode_profile_request(request, host, session), timeout=deadline)
        except grpc.RpcError as exc:
            code, detail = exc.code(), exc.details() or ""
            reason = {grpc.StatusCode.UNAVAILABLE: "no_server", grpc.StatusCode.ALREADY_EXISTS: "busy",
                      grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
                      grpc.StatusCode.UNIMPLEMENTED: "not_a_profiler"}.get(code, "error")
            if reason == "error" and "Another profiling session" in detail:
                reason = "busy"
            return _result("failed", reason, f"{target}: {code.name}: {detail}", logdir, started, files)
        finally:
            channel.close()
        empty, xspace = decode_profile_response(response)
        if empty or len(xspace) < EMPTY_TRACE_BYTES:
            return _result("failed", "empty_trace", f"{target}: the profiler server collected no events: was the "
                           "process idle during the capture?", logdir, started, files)
        path = logdir / "plugins" / "profile" / session / f"{host.strip('[]')}_{port}.xplane.pb"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(xspace)
        files.append(path)
    return _result("done", None, f"{len(files)} trace file(s)", logdir, started, files)


def main() -> int:
    request = json.load(sys.stdin)
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
