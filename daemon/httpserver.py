"""A small threaded HTTP server with a route table, JSON errors, a body-size limit and bearer-token auth."""

from __future__ import annotations

import hmac
import json
import logging
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("tfprofd.http")


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    params: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        """The body as JSON (None when empty); raises HttpError 400 with the reason otherwise."""
        if not self.body.strip():
            return None
        try:
            return json.loads(self.body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HttpError(400, f"body is not valid JSON: {exc}") from None


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


class HttpError(Exception):
    def __init__(self, status: int, reason: str, **extra: Any):
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.extra = extra


def json_response(status: int, payload: Any) -> Response:
    return Response(status, (json.dumps(payload, indent=1, sort_keys=True) + "\n").encode())


Handler = Callable[[Request], Response]


class Router:
    """Maps (method, path pattern) to handlers; ``{name}`` in a pattern matches one path segment."""

    def __init__(self) -> None:
        self._routes: list[tuple[str, re.Pattern[str], Handler]] = []

    def add(self, method: str, pattern: str, handler: Handler) -> None:
        regex = re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", pattern) + "$")
        self._routes.append((method, regex, handler))

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        allowed = []
        for route_method, regex, handler in self._routes:
            match = regex.match(path)
            if match:
                if route_method == method or (method == "HEAD" and route_method == "GET"):
                    return handler, match.groupdict()
                allowed.append(route_method)
        if allowed:
            raise HttpError(405, f"method {method} not allowed here; use {', '.join(sorted(set(allowed)))}")
        raise HttpError(404, f"no such endpoint: {path}")


class HttpServer:
    """Serves a Router on one address in background threads."""

    def __init__(self, address: tuple[str, int], router: Router, max_body: int = 65536,
                 token: Callable[[], str] | None = None, name: str = "http"):
        self.router = router
        self.max_body = max_body
        self.token = token or (lambda: "")
        self.name = name
        host, port = address
        server_class = _server_class(host)
        self._server = server_class((host, port), _make_handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"tfprofd-{name}", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def handle(self, request: Request) -> Response:
        try:
            handler, request.params = self.router.resolve(request.method, request.path)
            expected = self.token()
            if expected:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {expected}".encode()):
                    raise HttpError(401, "missing or wrong bearer token")
            return handler(request)
        except HttpError as exc:
            return json_response(exc.status, {"error": exc.reason, **exc.extra})
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return json_response(500, {"error": "internal error; see the agent's log"})


def _server_class(host: str) -> type[ThreadingHTTPServer]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Server(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True
        allow_reuse_address = True

    return Server


def _make_handler(server: HttpServer) -> type[BaseHTTPRequestHandler]:
    class RequestHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "tfprofd"

        def _serve(self) -> None:
            parts = urlsplit(self.path)
            headers = {k.lower(): v for k, v in self.headers.items()}
            try:
                length = int(headers.get("content-length", "0") or 0)
            except ValueError:
                length = -1
            if length < 0:
                self._send(json_response(400, {"error": "invalid Content-Length"}), close=True)
                return
            if length > server.max_body:
                self._send(json_response(413, {"error": f"body larger than {server.max_body} bytes"}), close=True)
                return
            body = self.rfile.read(length) if length else b""
            request = Request(self.command, parts.path, parse_qs(parts.query), headers, body)
            self._send(server.handle(request))

        def _send(self, response: Response, close: bool = False) -> None:
            self.send_response(response.status)
            self.send_header("Content-Type", response.content_type)
            self.send_header("Content-Length", str(len(response.body)))
            for key, value in response.headers.items():
                self.send_header(key, value)
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(response.body)

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _serve

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

    return RequestHandler
