"""Servers that answer as the agents' peers, forward targets or Prometheus must not: redirects, trickles,
things that are not HTTP, JSON a strict parser refuses. Each records what reached it (requests and their
Authorization headers), for the tests that show where the shared token went."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = Callable[[BaseHTTPRequestHandler], None]


class HostileServer:
    """An HTTP server on loopback whose every request (any method) is answered by ``answer(handler)``."""

    def __init__(self, answer: Answer, host: str = "127.0.0.1"):
        self.seen: list[tuple[str, str, str]] = []  # (method, path, Authorization header)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                server.seen.append((self.command, self.path, self.headers.get("Authorization", "")))
                length = int(self.headers.get("Content-Length", "0") or 0)
                if length:
                    self.rfile.read(length)
                answer(self)

            do_GET = do_POST = _any

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # the answers end connections abruptly on purpose

        self.httpd = Quiet((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.address = f"{host}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def send(handler: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(body)


def redirect_to(target: str) -> Answer:
    """Answers 302 to the same path at ``target`` (urllib followed it, Authorization header included)."""
    return lambda h: send(h, 302, b"", {"Location": f"http://{target}{h.path}"})


def trickle(seconds_per_byte: float, size: int = 10_000) -> Answer:
    """A 200 whose body comes a byte at a time: each read answers within any per-read timeout."""
    def answer(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(size))
        h.end_headers()
        try:
            for _ in range(size):
                h.wfile.write(b" ")
                h.wfile.flush()
                time.sleep(seconds_per_byte)
        except OSError:  # the client gave up
            pass
    return answer


def not_http(banner: bytes = b"SSH-2.0-OpenSSH_9.6\r\n") -> Answer:
    """What a port that is not an HTTP server says (an ssh daemon's banner), then the connection ends."""
    def answer(h: BaseHTTPRequestHandler) -> None:
        h.wfile.write(banner)
        h.wfile.flush()
        h.close_connection = True
        h.connection.shutdown(socket.SHUT_RDWR)
    return answer


def json_body(status: int, body: bytes) -> Answer:
    return lambda h: send(h, status, body)


NESTED = b"[" * 100_000  # json.loads raises RecursionError on it, which is neither OSError nor ValueError
