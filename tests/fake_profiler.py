"""A TensorFlow profiler server as the capture worker meets it (``tensorflow.ProfilerService/Profile`` over gRPC):
it starts at the request's ``start_timestamp_ns`` (or at once), traces for ``duration_ms`` and answers with a
recorded trace, for capture tests that need no TensorFlow."""

from __future__ import annotations

import lzma
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from tfprofd.daemon.protos import profiler_pb2

TRACE = Path(__file__).parent / "fixtures" / "traces" / "plain-baseline.xplane.pb.xz"


class FakeProfiler:
    """``dies_after``: answer as a session whose GPU tracer failed to start does (no events), then stop
    listening that many seconds later, as the process it ran in crashed (README, Known issues)."""

    def __init__(self, dies_after: float | None = None) -> None:
        trace = lzma.decompress(TRACE.read_bytes())
        self.requests: list[profiler_pb2.ProfileRequest] = []

        def profile(data: bytes, context: grpc.ServicerContext) -> bytes:
            request = profiler_pb2.ProfileRequest.FromString(data)
            self.requests.append(request)
            start = request.opts.start_timestamp_ns / 1e9 or time.time()
            time.sleep(max(0.0, start - time.time()) + request.opts.duration_ms / 1000)
            if dies_after is not None:
                threading.Timer(dies_after, self.stop).start()
                return profiler_pb2.ProfileResponse(empty_trace=True).SerializeToString()
            return profiler_pb2.ProfileResponse(xspace=trace).SerializeToString()

        self.server = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_send_message_length", 1 << 28)])
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tensorflow.ProfilerService", {
            "Profile": grpc.unary_unary_rpc_method_handler(profile)}),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None)
