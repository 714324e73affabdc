"""A small HTTP/1.1 server on one selector loop: strict parsing, bounded connections, timeouts.

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

import concurrent.futures
import contextlib
import errno
import heapq
import itertools
import json
import logging
import re
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("tfprofd.http")

MAX_HEADER_BYTES = 16 * 1024
ACCEPT_RETRY_S = 0.5  # out of descriptors with no connection to evict: the next try to accept
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
    """The one thread every HTTP server of the agent runs on: a selector over their sockets, the connections'
    deadlines, and calls handed in from other threads (woken through a socket pair).

    Not asyncio: importing it costs 1.5 MiB of the agent's ~35 MiB resident (README, Performance), for what one
    selector and a heap of deadlines do here."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._woken)
        self._calls: deque[Callable[[], None]] = deque()
        self._timers: list[tuple[float, int, Timer]] = []  # a heap; cancelled ones leave at their time or a compaction
        self.cancelled = 0  # timers in the heap that were cancelled
        self._order = itertools.count()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="tfprofd-http", daemon=True)

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

        self.call_soon_threadsafe(run)
        return future.result(timeout)

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        self._calls.append(fn)
        with contextlib.suppress(OSError):  # full: a wake is pending anyway
            self._wake_w.send(b"\0")

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread at its next turn, not within the caller (loop thread only)."""
        self._calls.append(fn)

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        """Run ``fn`` on the loop thread in ``delay`` seconds unless the timer is cancelled (loop thread only).
        A connection books 3–4 timers a request and cancels most: once over half the heap is cancelled ones, the
        heap is rebuilt without them (as asyncio does), so it follows the timers that can still run."""
        if self.cancelled > 64 and 2 * self.cancelled > len(self._timers):
            self._timers = [entry for entry in self._timers if not entry[2].cancelled]
            heapq.heapify(self._timers)
            self.cancelled = 0
        timer = Timer(fn, self)
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._order), timer))
        return timer

    def watch(self, sock: socket.socket, events: int, on_ready: Callable[[], None]) -> None:
        """Call ``on_ready`` while ``sock`` is ready for ``events``; replaces what it was watched for (loop thread)."""
        try:
            self._selector.modify(sock, events, on_ready)
        except KeyError:
            self._selector.register(sock, events, on_ready)

    def unwatch(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.call_soon_threadsafe(self._halt)
            self._thread.join(timeout=1)

    def _halt(self) -> None:
        self._running = False

    def _woken(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass

    def _run(self) -> None:
        try:
            self._turns()
        except BaseException:  # never expected: say so, as /metrics and the control API stop answering
            log.exception("the HTTP loop died: /metrics and the control API no longer answer")
            raise

    def _turns(self) -> None:
        while self._running:
            while self._timers and self._timers[0][2].cancelled:
                heapq.heappop(self._timers)
                self.cancelled -= 1
            timeout = 0.0 if self._calls else (
                max(0.0, self._timers[0][0] - time.monotonic()) if self._timers else None)
            for key, _ in self._selector.select(timeout):
                self._safely(key.data)
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                timer = heapq.heappop(self._timers)[2]
                if timer.cancelled:
                    self.cancelled -= 1
                else:
                    timer.done = True
                    self._safely(timer.fn)
            while self._calls:
                self._safely(self._calls.popleft())
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    @staticmethod
    def _safely(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # one connection's fault must not stop the loop every server runs on
            log.exception("HTTP loop: a callback failed")


class Timer:
    """A call the loop makes at a time, unless cancelled first."""

    __slots__ = ("cancelled", "done", "fn", "loop")

    def __init__(self, fn: Callable[[], None], loop: EventLoop):
        self.fn = fn
        self.loop = loop
        self.cancelled = self.done = False

    def cancel(self) -> None:
        if self.cancelled or self.done:
            return
        self.cancelled = True
        self.loop.cancelled += 1
        self.fn = _nothing  # what it would have run (a connection, its answer) is not held until its time comes


def _nothing() -> None:
    pass


HEAD, BODY, BUSY, SENDING, CLOSED = "head", "body", "busy", "sending", "closed"


class _Conn:
    """One accepted connection, counted against the bound from the moment it is accepted: reading a request's
    head, then its body, then busy while a handler runs, then sending the response; then the next request."""

    __slots__ = ("body_length", "buffer", "deadline", "keep", "out", "peer", "request", "route", "sock", "state")

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self.buffer = bytearray()
        self.state = HEAD
        self.deadline: Timer | None = None
        self.request: Request | None = None
        self.route: Route | None = None
        self.body_length = 0
        self.keep = False
        self.out: list[memoryview] = []  # what is left to send of the answer: its head, its body

    @property
    def waiting(self) -> bool:
        """Waiting for (the rest of) a request: may be evicted."""
        return self.state in (HEAD, BODY)


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
        self._conns: OrderedDict[int, _Conn] = OrderedDict()  # the longest waiting first
        self._loop: EventLoop | None = None
        self._accepting = False
        self._errors_logged: set[str] = set()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def start(self, loop: EventLoop) -> None:
        self._loop = loop
        loop.call(lambda: self._accept(True))

    def stop(self, loop: EventLoop) -> None:
        def close() -> None:
            loop.unwatch(self._sock)
            self._sock.close()
            for conn in list(self._conns.values()):
                self._close(conn)

        try:
            loop.call(close)
        except (RuntimeError, concurrent.futures.TimeoutError):
            self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- connections (on the loop thread) ----

    def _accept(self, on: bool) -> None:
        """Watch the listening socket for connections, or stop watching it: every slot is busy, or descriptors ran
        out (new connections wait in the backlog; the readable socket would otherwise wake the loop without end)."""
        if on == self._accepting or self._sock.fileno() < 0:
            return
        self._accepting = on
        assert self._loop is not None
        if on:
            self._loop.watch(self._sock, selectors.EVENT_READ, self._on_accept)
        else:
            self._loop.unwatch(self._sock)

    def _on_accept(self) -> None:
        fresh: set[int] = set()  # accepted just now: not read yet, so not waiting either
        for _ in range(64):
            if len(self._conns) >= self.max_connections and not self._evict(fresh):
                if not self._fresh_waiting(fresh):  # every slot is busy serving: watched again when one is free
                    self._accept(False)  # or waits
                return  # else one of those just accepted is evicted at the loop's next turn
            try:
                sock, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self._evict(fresh):
                        continue
                    if self._fresh_waiting(fresh):
                        return  # one of them is evicted at the loop's next turn
                    log.warning("%s: accept failed: %s; trying again in %.1fs", self.name, exc, ACCEPT_RETRY_S)
                    self._accept(False)
                    assert self._loop is not None
                    self._loop.call_later(ACCEPT_RETRY_S, lambda: self._accept(True))
                elif exc.errno not in (errno.ECONNABORTED, errno.EPROTO):
                    log.warning("%s: accept failed: %s", self.name, exc)
                return
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = self._conns[id(sock)] = _Conn(sock, str(peer[0]) if isinstance(peer, tuple) else "")
            fresh.add(id(sock))
            self._await_request(conn, self.request_timeout)

    def _fresh_waiting(self, fresh: set[int]) -> bool:
        return any(self._conns[key].waiting for key in fresh if key in self._conns)

    def _evict(self, fresh: set[int]) -> bool:
        """Close the connection that has waited longest for a request (not one of ``fresh``); False if none waits."""
        conn = next((c for key, c in self._conns.items() if c.waiting and key not in fresh), None)
        if conn is None:
            return False
        self._close(conn)
        self.evicted += 1
        return True

    def _close(self, conn: _Conn) -> None:
        if conn.state == CLOSED:
            return
        conn.state, conn.out, conn.buffer = CLOSED, [], bytearray()
        if conn.deadline is not None:
            conn.deadline.cancel()
        self._conns.pop(id(conn.sock), None)
        assert self._loop is not None
        self._loop.unwatch(conn.sock)
        conn.sock.close()
        self._accept(True)  # a slot is free

    def _expire(self, conn: _Conn) -> None:
        log.debug("%s: connection from %s ended: timed out (%s)", self.name, conn.peer, conn.state)
        self._close(conn)

    def _limit(self, conn: _Conn, seconds: float) -> None:
        """The connection is closed unless what it does now ends within ``seconds``."""
        assert self._loop is not None
        if conn.deadline is not None:
            conn.deadline.cancel()
        conn.deadline = self._loop.call_later(seconds, lambda: self._expire(conn))

    def _await_request(self, conn: _Conn, timeout: float) -> None:
        assert self._loop is not None
        conn.state, conn.request, conn.route = HEAD, None, None
        self._conns.move_to_end(id(conn.sock))
        self._limit(conn, timeout)
        self._loop.watch(conn.sock, selectors.EVENT_READ, lambda: self._on_readable(conn))
        self._accept(True)  # it waits: it may be evicted for a new one
        if conn.buffer:  # a request sent before the last answer (pipelined): at the loop's next turn, not nested
            self._loop.call_soon(lambda: self._advance(conn))

    def _on_readable(self, conn: _Conn) -> None:
        if not conn.waiting:  # closed by another event of the same turn (an eviction)
            return
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.debug("%s: connection from %s ended: %s", self.name, conn.peer, type(exc).__name__)
            self._close(conn)
            return
        if not data:  # the client hung up: a request cut short is never acted on
            self._close(conn)
            return
        conn.buffer += data
        self._advance(conn)

    def _advance(self, conn: _Conn) -> None:
        """Act on what the connection has sent: a whole head, then (once it has come whole) the body."""
        if conn.state == HEAD:
            end = conn.buffer.find(b"\r\n\r\n")
            if end < 0 or end + 4 > MAX_HEADER_BYTES:
                if end >= 0 or len(conn.buffer) > MAX_HEADER_BYTES:
                    self._refuse(conn, 431, "request headers too large")
                return
            head = bytes(conn.buffer[:end + 4])
            del conn.buffer[:end + 4]
            try:
                request, version = self._parse(head, conn.peer)
                conn.keep = self._keep_alive(request, version)
                if self.authenticate is not None:
                    self.authenticate(request)
                conn.route, request.params = self.router.resolve(request.method, request.path)
                conn.body_length = self._body_length(request)
            except HttpError as exc:
                self._refuse(conn, exc.status, exc.reason, **exc.extra)
                return
            if conn.body_length and not conn.buffer and request.headers.get("expect", "").lower() == "100-continue":
                try:  # 25 bytes to a socket that has sent only a head: its buffer is empty
                    sent = conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
                except OSError:
                    sent = 0
                if sent != 25:  # a part of it would break the answer's framing
                    self._close(conn)
                    return
            conn.request, conn.state = request, BODY
            self._limit(conn, self.request_timeout)  # evictable while it waits for the body
        if conn.state == BODY and len(conn.buffer) >= conn.body_length:
            assert conn.request is not None and conn.route is not None
            conn.request.body = bytes(conn.buffer[:conn.body_length])
            del conn.buffer[:conn.body_length]
            self._dispatch(conn, conn.route, conn.request)

    def _refuse(self, conn: _Conn, status: int, reason: str, **extra: Any) -> None:
        """Answer with the error and close: the rest of what the client sent is never read."""
        self._send(conn, "GET", json_response(status, {"error": reason, **extra}), keep=False)

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
        try:
            parts = urlsplit(match.group(2).decode("ascii"))
            query = parse_qs(parts.query)
        except ValueError as exc:  # an IPv6 host without its bracket, ...
            raise HttpError(400, f"malformed request target: {exc}") from None
        return Request(match.group(1).decode(), parts.path, query, headers, peer=peer), match.group(3).decode()

    @staticmethod
    def _keep_alive(request: Request, version: str) -> bool:
        connection = request.headers.get("connection", "").lower()
        return "close" not in connection and (version == "1.1" or "keep-alive" in connection)

    def _body_length(self, request: Request) -> int:
        raw = request.headers.get("content-length")
        if raw is None:
            return 0
        if not re.fullmatch(r"\d{1,12}", raw):
            raise HttpError(400, "invalid Content-Length")
        length = int(raw)
        if length and request.method in ("GET", "HEAD"):
            raise HttpError(400, f"a {request.method} request takes no body (got Content-Length: {length})")
        if length > self.max_body():
            raise HttpError(413, f"body larger than {self.max_body()} bytes")
        return length

    def _dispatch(self, conn: _Conn, route: Route, request: Request) -> None:
        """Run the handler (on the loop if inline, else in the pool); the connection is not read meanwhile."""
        assert self._loop is not None
        conn.state = BUSY
        if conn.deadline is not None:
            conn.deadline.cancel()
        self._loop.unwatch(conn.sock)
        if route.inline:
            self._answer(conn, request.method, self._handle(route, request))
            return
        loop = self._loop
        try:
            future = self._pool.submit(self._handle, route, request)
        except RuntimeError:  # the server is stopping
            self._close(conn)
            return
        future.add_done_callback(lambda f: loop.call_soon_threadsafe(lambda: self._handled(conn, request, f)))

    def _handled(self, conn: _Conn, request: Request, future: concurrent.futures.Future) -> None:
        if conn.state != BUSY:
            return  # closed meanwhile (the server stopped)
        if future.cancelled():
            self._close(conn)
            return
        self._answer(conn, request.method, future.result())

    def _answer(self, conn: _Conn, method: str, response: Response) -> None:
        """Send a handler's response; one that cannot be sent (not a Response, a header that is not latin-1) closes
        the connection rather than leave it busy, unwatched and past every timeout."""
        try:
            self._send(conn, method, response, conn.keep)
        except Exception:
            log.exception("%s: the answer to %s could not be sent", self.name, conn.peer)
            self._close(conn)

    def _handle(self, route: Route, request: Request) -> Response:
        started = time.monotonic()
        try:
            response = route.handler(request)
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

    def _send(self, conn: _Conn, method: str, response: Response, keep: bool) -> None:
        reason = HTTPStatus(response.status).phrase if response.status in HTTPStatus._value2member_map_ else ""
        lines = [f"HTTP/1.1 {response.status} {reason}", f"Content-Type: {response.content_type}",
                 f"Content-Length: {len(response.body)}", "Server: tfprofd"]
        lines += [f"{k}: {v}" for k, v in response.headers.items()]
        if not keep:
            lines.append("Connection: close")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        conn.out = [memoryview(head)] if method == "HEAD" or not response.body else [
            memoryview(head), memoryview(response.body)]  # one write of both, no copy: no Nagle stall
        conn.keep, conn.state = keep, SENDING
        self._limit(conn, self.request_timeout)
        self._on_writable(conn)

    def _on_writable(self, conn: _Conn) -> None:
        assert self._loop is not None
        if conn.state != SENDING:  # closed meanwhile
            return
        try:
            while conn.out:
                sent = conn.sock.sendmsg(conn.out)
                while conn.out and sent >= len(conn.out[0]):
                    sent -= len(conn.out.pop(0))
                if sent:
                    conn.out[0] = conn.out[0][sent:]
        except (BlockingIOError, InterruptedError):
            self._loop.watch(conn.sock, selectors.EVENT_WRITE, lambda: self._on_writable(conn))
            return
        except OSError as exc:
            log.debug("%s: connection from %s ended: %s", self.name, conn.peer, type(exc).__name__)
            self._close(conn)
            return
        if not conn.keep:
            self._linger(conn)
        else:
            self._await_request(conn, self.idle_timeout)

    def _linger(self, conn: _Conn) -> None:
        """Close after an answer: what the client sent and was not read is read and dropped first, so the close
        is a FIN that lets the client read the answer, not a reset that may discard it."""
        with contextlib.suppress(OSError):
            for _ in range(16):
                if not conn.sock.recv(65536):
                    break
        self._close(conn)
