"""A small HTTP/1.1 server on one asyncio loop: strict parsing, bounded connections, timeouts.

Why not http.server: it spends a thread per connection with no read timeout, so idle connections
exhaust the descriptors the collectors need (~1,016 idle connections stopped /metrics and every /proc
collector under a 1024-descriptor limit), and it writes headers and body separately (Nagle against
delayed ACK: 44 ms per scrape on a kept-alive connection). Here:

- connections are bounded; at the bound the connection that has waited longest for a request (or for
  the body it promised) is closed to make room, so a flood of idle connections never locks out a scrape;
- a GET or HEAD with a body is refused (400) at once, without waiting for the body;
- headers must arrive within ``request_timeout``, an idle keep-alive connection closes after
  ``idle_timeout``; a response goes out in one write with TCP_NODELAY;
- anything ambiguous is refused and the connection closed: Transfer-Encoding (411), a malformed or
  repeated Content-Length, folded or malformed headers (400); a body larger than the limit (413) is
  never read, and a request whose body is cut short is never acted on;
- authentication (where the server has it) comes before routing and before the body is read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import logging
import re
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("tfprofd.http")

MAX_HEADER_BYTES = 16 * 1024
MAX_JSON_INT_DIGITS = 32  # far past any count or id a request carries; Python's own limit (4300) answers 500
_REQUEST_LINE = re.compile(rb"([A-Z]{1,16}) ([!-~]{1,8192}) HTTP/(1\.[01])")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
_SINGLE = ("content-length", "host", "authorization", "content-type")


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes = b""
    params: dict[str, str] = field(default_factory=dict)
    peer: str = ""

    def json(self) -> Any:
        """The body as JSON (None when empty); raises HttpError 400 with the reason otherwise."""
        if not self.body.strip():
            return None
        try:
            return json.loads(self.body, parse_int=_json_int, parse_constant=_json_constant)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HttpError(400, f"body is not valid JSON: {exc}") from None
        except RecursionError:
            raise HttpError(400, "body is nested too deeply") from None


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise HttpError(400, f"body holds an integer of {len(text.lstrip('-'))} digits; at most "
                             f"{MAX_JSON_INT_DIGITS} are accepted")
    return int(text)


def _json_constant(name: str) -> float:
    raise HttpError(400, f"body is not valid JSON: {name} is not a JSON number")


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


class HttpError(Exception):
    def __init__(self, status: int, reason: str, close: bool = False, **extra: Any):
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.close = close
        self.extra = extra


def json_response(status: int, payload: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(status, (json.dumps(payload, indent=1, sort_keys=True) + "\n").encode(), headers=headers or {})


Handler = Callable[[Request], Response]


@dataclass(frozen=True)
class Route:
    method: str
    regex: re.Pattern[str]
    handler: Handler
    inline: bool  # run on the loop thread (fast, non-blocking handlers only)


class Router:
    """Maps (method, path pattern) to handlers; ``{name}`` in a pattern matches one path segment."""

    def __init__(self) -> None:
        self._routes: list[Route] = []

    def add(self, method: str, pattern: str, handler: Handler, inline: bool = False) -> None:
        regex = re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", pattern) + "$")
        self._routes.append(Route(method, regex, handler, inline))

    def resolve(self, method: str, path: str) -> tuple[Route, dict[str, str]]:
        allowed = []
        for route in self._routes:
            match = route.regex.match(path)
            if match:
                if route.method == method or (method == "HEAD" and route.method == "GET"):
                    return route, match.groupdict()
                allowed.append(route.method)
        if allowed:
            raise HttpError(405, f"method {method} not allowed here; use {', '.join(sorted(set(allowed)))}")
        raise HttpError(404, f"no such endpoint: {path}")


class EventLoop:
    """The asyncio loop every HTTP server of the agent runs on, in one background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tfprofd-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[], Any], timeout: float = 2.0) -> Any:
        """Run ``fn`` on the loop thread and wait for its result (directly, if the loop does not run)."""
        if not self._thread.is_alive():
            return fn()
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return future.result(timeout)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=1)


@dataclass
class _Conn:
    """One accepted connection, counted against the bound from the moment it is accepted."""

    sock: socket.socket
    writer: asyncio.StreamWriter | None = None  # once its task runs
    waiting: bool = True  # waiting for (the rest of) a request: may be evicted

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()
        else:
            self.sock.close()


class HttpServer:
    """Serves a Router on one address. The socket is bound in the constructor, so a busy port fails there."""

    def __init__(self, name: str, address: tuple[str, int], router: Router, *, max_body: Callable[[], int],
                 authenticate: Callable[[Request], None] | None = None, max_connections: int = 128,
                 idle_timeout: float = 30.0, request_timeout: float = 10.0, handler_threads: int = 4):
        self.name = name
        self.router = router
        self.max_body = max_body
        self.authenticate = authenticate
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.request_timeout = request_timeout
        self.evicted = 0
        host, port = address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(socket.SOMAXCONN)
            self._sock.setblocking(False)
        except OSError as exc:
            self._sock.close()
            raise OSError(exc.errno, f"cannot listen on {host}:{port} for {name}: {exc.strerror}") from None
        self._pool = concurrent.futures.ThreadPoolExecutor(handler_threads, thread_name_prefix=f"tfprofd-{name}")
        self._conns: OrderedDict[int, _Conn] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._errors_logged: set[str] = set()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def start(self, loop: EventLoop) -> None:
        self._loop = loop.loop
        loop.call(lambda: loop.loop.add_reader(self._sock.fileno(), self._on_accept))

    def stop(self, loop: EventLoop) -> None:
        def close() -> None:
            loop.loop.remove_reader(self._sock.fileno())
            self._sock.close()
            for conn in list(self._conns.values()):
                conn.abort()
            self._conns.clear()

        try:
            loop.call(close)
        except (RuntimeError, concurrent.futures.TimeoutError):
            self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- connections ----

    def _on_accept(self) -> None:
        for _ in range(64):
            if len(self._conns) >= self.max_connections and not self._evict():
                return  # every slot is busy serving: leave the rest in the backlog for a moment
            try:
                sock, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) and self._evict():
                    continue
                if exc.errno not in (errno.ECONNABORTED, errno.EPROTO):
                    log.warning("%s: accept failed: %s", self.name, exc)
                return
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = self._conns[id(sock)] = _Conn(sock)
            self._loop.create_task(self._serve(conn, str(peer[0]) if isinstance(peer, tuple) else ""))

    def _evict(self) -> bool:
        """Close the connection that has waited longest for a request; False if every one is busy."""
        for key, conn in self._conns.items():
            if conn.waiting and conn.writer is not None:  # one not yet started has not waited at all
                del self._conns[key]
                conn.abort()
                self.evicted += 1
                return True
        return False

    async def _serve(self, conn: _Conn, peer: str) -> None:
        key = id(conn.sock)
        try:
            reader, writer = await asyncio.open_connection(sock=conn.sock, limit=MAX_HEADER_BYTES)
        except OSError:
            conn.sock.close()
            self._conns.pop(key, None)
            return
        conn.writer = writer
        try:
            timeout = self.request_timeout
            while True:
                conn.waiting = True
                self._conns.move_to_end(key)
                keep = await self._one_request(reader, writer, conn, peer, timeout)
                if not keep:
                    break
                timeout = self.idle_timeout
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError, TimeoutError, OSError) as exc:
            log.debug("%s: connection from %s ended: %s", self.name, peer, type(exc).__name__)
        finally:
            self._conns.pop(key, None)
            writer.transport.abort() if writer.transport.is_closing() else writer.close()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Conn, peer: str,
                           timeout: float) -> bool:
        """Read, handle and answer one request; whether to keep the connection."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        except asyncio.LimitOverrunError:
            await self._send(writer, "HEAD", json_response(431, {"error": "request headers too large"}), close=True)
            return False
        try:
            request, version = self._parse(head, peer)
            keep = self._keep_alive(request, version)
            if self.authenticate is not None:
                self.authenticate(request)
            route, request.params = self.router.resolve(request.method, request.path)
            request.body = await self._body(reader, writer, request)  # evictable while it waits for the body
        except HttpError as exc:
            conn.waiting = False
            await self._send(writer, "GET", json_response(exc.status, {"error": exc.reason, **exc.extra}), close=True)
            return False
        conn.waiting = False
        response = await self._handle(route, request)
        await self._send(writer, request.method, response, close=not keep)
        return keep

    def _parse(self, head: bytes, peer: str) -> tuple[Request, str]:
        lines = head[:-4].split(b"\r\n")
        match = _REQUEST_LINE.fullmatch(lines[0])
        if not match:
            raise HttpError(400, "malformed request line")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not _TOKEN.fullmatch(name):
                raise HttpError(400, "malformed header line (folded headers are not accepted)")
            key = name.decode("ascii").lower()
            if key in headers and key in _SINGLE:
                raise HttpError(400, f"repeated {key} header")
            text = value.strip(b" \t").decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        if "transfer-encoding" in headers:
            raise HttpError(411, "Transfer-Encoding is not accepted: send the body with a Content-Length")
        parts = urlsplit(match.group(2).decode("ascii"))
        return Request(match.group(1).decode(), parts.path, parse_qs(parts.query), headers, peer=peer), \
            match.group(3).decode()

    @staticmethod
    def _keep_alive(request: Request, version: str) -> bool:
        connection = request.headers.get("connection", "").lower()
        return "close" not in connection and (version == "1.1" or "keep-alive" in connection)

    async def _body(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: Request) -> bytes:
        raw = request.headers.get("content-length")
        if raw is None:
            return b""
        if not re.fullmatch(r"\d{1,12}", raw):
            raise HttpError(400, "invalid Content-Length")
        length = int(raw)
        if length and request.method in ("GET", "HEAD"):
            raise HttpError(400, f"a {request.method} request takes no body (got Content-Length: {length})")
        if length > self.max_body():
            raise HttpError(413, f"body larger than {self.max_body()} bytes")
        if length and request.headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        # A client that hangs up before the whole body raises IncompleteReadError: nothing is acted on.
        return await asyncio.wait_for(reader.readexactly(length), self.request_timeout) if length else b""

    async def _handle(self, route: Route, request: Request) -> Response:
        started = time.monotonic()
        try:
            if route.inline:
                response = route.handler(request)
            else:
                response = await asyncio.get_running_loop().run_in_executor(self._pool, route.handler, request)
        except HttpError as exc:
            response = json_response(exc.status, {"error": exc.reason, **exc.extra})
        except Exception as exc:
            signature = f"{request.method} {request.path} {type(exc).__name__}"
            if signature not in self._errors_logged:  # a repeating failure logs once, not per request
                self._errors_logged.add(signature)
                log.exception("%s: %s %s failed", self.name, request.method, request.path)
            response = json_response(500, {"error": "internal error; see the agent's log"})
        log.debug("%s: %s %s %s -> %d in %.1f ms", self.name, request.peer, request.method, request.path,
                  response.status, (time.monotonic() - started) * 1000)
        return response

    async def _send(self, writer: asyncio.StreamWriter, method: str, response: Response, close: bool) -> None:
        reason = HTTPStatus(response.status).phrase if response.status in HTTPStatus._value2member_map_ else ""
        lines = [f"HTTP/1.1 {response.status} {reason}", f"Content-Type: {response.content_type}",
                 f"Content-Length: {len(response.body)}", "Server: tfprofd"]
        lines += [f"{k}: {v}" for k, v in response.headers.items()]
        if close:
            lines.append("Connection: close")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        writer.write(head if method == "HEAD" else head + response.body)  # one write: no Nagle stall
        await asyncio.wait_for(writer.drain(), self.request_timeout)
