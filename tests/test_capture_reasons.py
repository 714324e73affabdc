"""Captures of things that are no TensorFlow profiler: real small servers on loopback, the real agent.

Each must end with the reason README documents (``not_a_profiler``) and a detail that says what to check,
and must not hold the job's automatic captures; only a process that really exits mid-capture is ``died``."""

from __future__ import annotations

import http.server
import random
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

from tfprofd.exporter.hook import Reporter

from helpers import AgentProcess, job_reporting, metric_value, wait_capture, wait_for

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _frame(kind: int, payload: bytes, stream: int = 0) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, 0]) + struct.pack(">I", stream) + payload


def _tcp_server(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A TCP server on loopback that hands every connection to ``answer`` (in a thread of its own)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_answer_and_close, args=(answer, conn), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def _answer_and_close(answer: Callable[[socket.socket], None], conn: socket.socket) -> None:
    with conn:
        try:
            answer(conn)
        except OSError:
            pass


def _random_bytes(conn: socket.socket) -> None:
    conn.recv(65536)
    conn.sendall(random.Random(22).randbytes(8192))  # seeded: the same bytes every run
    conn.recv(65536)


def _oversized_frame(conn: socket.socket) -> None:
    """Speaks HTTP/2 (empty SETTINGS), then sends a 1 MiB frame where at most 16 KiB may come."""
    conn.recv(65536)
    conn.sendall(_frame(4, b"") + _frame(0, b"\0" * (1 << 20), stream=1))
    conn.recv(65536)


def _closes_at_once(conn: socket.socket) -> None:
    conn.recv(65536)  # and closes: a port forwarder whose backend is down, a TLS-only server


def _http_server() -> Iterator[str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _grpc_profile_server(answer: bytes) -> Iterator[str]:
    """A real gRPC server whose /tensorflow.ProfilerService/Profile answers ``answer`` (raw bytes)."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.method_handlers_generic_handler("tensorflow.ProfilerService", {
        "Profile": grpc.unary_unary_rpc_method_handler(lambda request, context: answer)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


DIES_MID_CALL = textwrap.dedent("""
    import os
    from concurrent import futures
    import grpc

    def profile(request, context):
        os._exit(1)  # as a training process that crashes mid-capture: every socket closes with it

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "tensorflow.ProfilerService", {"Profile": grpc.unary_unary_rpc_method_handler(profile)}),))
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    server.start()
    server.wait_for_termination()
""")


def _dies_mid_call() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-c", DIES_MID_CALL], stdout=subprocess.PIPE, text=True)
    try:
        yield f"127.0.0.1:{proc.stdout.readline().strip()}"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


SERVERS: dict[str, Callable[[], Iterator[str]]] = {
    "http": _http_server,
    "random-bytes": lambda: _tcp_server(_random_bytes),
    "oversized-http2-frame": lambda: _tcp_server(_oversized_frame),
    "closes-at-once": lambda: _tcp_server(_closes_at_once),
    "grpc-garbage": lambda: _grpc_profile_server(b"\xff\xfe not a protobuf " * 64),
    "grpc-no-trace": lambda: _grpc_profile_server(b""),
    "grpc-trace-not-xspace": lambda: _grpc_profile_server(b"\x42\x82\x10" + b"\xff" * 2050),  # field 8, 2050 B
}


def _agent(tmp_path_factory, *args: str) -> Iterator[AgentProcess]:
    agent = AgentProcess(tmp_path_factory.mktemp("reasons"), args=[
        "--captures.max-per-hour", "100", "--captures.baseline", "false", "--alerts.host-value", "127.0.0.1",
        *args]).start()
    yield agent
    agent.stop()


@pytest.fixture(scope="module")
def agent(tmp_path_factory) -> Iterator[AgentProcess]:
    yield from _agent(tmp_path_factory)


@pytest.fixture(scope="module")
def server_mode_agent(tmp_path_factory) -> Iterator[AgentProcess]:
    """captures.mode server: TensorFlow's own client (xprof) asks, and says only that no trace came back."""
    yield from _agent(tmp_path_factory, "--captures.mode", "server")


def _capture_of(agent: AgentProcess, job: str, address: str) -> tuple[dict, Reporter]:
    reporter = Reporter(job=job, profiler=False, addr=f"127.0.0.1:{agent.hook_port}")
    reporter.profiler_address = address
    reporter.phase = "train"
    reporter.start()
    wait_for(lambda: job_reporting(agent, job), 10, message=f"job {job} to report")
    status, answer = agent.call("POST", "/captures", {"job": job, "duration_ms": 500})
    assert status == 202, answer
    return wait_capture(agent, answer["id"]), reporter


def _alert_capture(agent: AgentProcess, job: str) -> dict:
    alert = {"status": "firing", "labels": {"alertname": "LowThroughput", "training_job": job,
                                            "instance": "127.0.0.1"},
             "startsAt": "2026-11-24T10:00:00Z", "fingerprint": f"reasons-{job}"}
    status, outcome = agent.call("POST", "/alerts", {"version": "4", "status": "firing", "alerts": [alert]})
    assert status == 200, outcome
    return outcome


@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_a_port_that_is_no_profiler_fails_not_a_profiler_and_holds_nothing(agent, kind):
    job = f"np-{kind}"
    server = SERVERS[kind]()
    address = next(server)
    try:
        record, reporter = _capture_of(agent, job, address)
        try:
            assert (record["status"], record["reason"]) == ("failed", "not_a_profiler"), record
            assert address in record["detail"] and "no TensorFlow profiler server" in record["detail"], record
            assert "profiler address" in record["detail"], record  # what to check
            assert metric_value(agent.scrape(), "tfprofd_capture_held_seconds", training_job=job) is None
            assert f"of job {job} died" not in agent.log()
            outcome = _alert_capture(agent, job)  # an automatic capture of the job still runs
            assert len(outcome["captures"]) == 1, outcome
            wait_capture(agent, outcome["captures"][0])
        finally:
            reporter.close()
    finally:
        server.close()


@pytest.mark.parametrize("kind", ["closes-at-once", "http", "oversized-http2-frame", "random-bytes", "grpc-garbage",
                                  "grpc-trace-not-xspace"])
def test_in_server_mode_a_port_that_is_no_profiler_fails_not_a_profiler(server_mode_agent, kind):
    """xprof's client says only that no trace came back (the agent called that busy), and dies of SIGSEGV
    on an answer that is no profile (the record said the worker exited -11)."""
    server = SERVERS[kind]()
    address = next(server)
    try:
        record, reporter = _capture_of(server_mode_agent, f"sm-{kind}", address)
        reporter.close()
        assert (record["status"], record["reason"]) == ("failed", "not_a_profiler"), record
        assert address in record["detail"] and "profiler address" in record["detail"], record
    finally:
        server.close()


def test_a_stream_removed_mid_call_is_a_death_even_where_the_probe_before_it_timed_out():
    """The probe before a call can time out on a loaded host while the server is there: a call whose stream was
    set up and then removed (the process killed mid-capture) reached a server, so it is ``died``, not
    ``no_server`` (seen in the full suite beside a CPU hog, test_multi_worker)."""
    from tfprofd.daemon.capture_worker import failure_reason

    gone = "Stream removed (Socket closed)"
    assert failure_reason("UNAVAILABLE", gone, False, lambda: False) == "died"
    assert failure_reason("UNAVAILABLE", gone, False, lambda: True) == "not_a_profiler"
    refused = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9: Connection refused"
    assert failure_reason("UNAVAILABLE", refused, False, lambda: False) == "no_server"


def test_a_process_that_exits_mid_capture_is_died_and_holds_automatic_captures(agent):
    server = _dies_mid_call()
    address = next(server)
    try:
        record, reporter = _capture_of(agent, "crashes", address)
        try:
            assert (record["status"], record["reason"]) == ("failed", "died"), record
            assert "stopped answering during the capture" in record["detail"], record
            held = metric_value(agent.scrape(), "tfprofd_capture_held_seconds", training_job="crashes")
            assert held is not None and held > 3600
            outcome = _alert_capture(agent, "crashes")
            assert not outcome["captures"] and "died during its last capture" in outcome["ignored"][0]["why"]
        finally:
            reporter.close()
    finally:
        server.close()

