"""The agent's own HTTP requests: to the other agents' control API (a job-wide capture, a forwarded alert) and to
Prometheus (where a job's workers are). One way for all of them, held against whatever answers:

- never through a proxy from the environment, and never after a redirect: the shared token goes only to the
  address that was configured or allowed, not to one a peer names (urllib followed a 302 with the token);
- one deadline for the whole answer: a peer that sends a byte now and then cannot hold a request (and a job
  record ``running``) past it, as it could with a timeout per read;
- at most ``max_bytes`` read, and every failure of the other end (not HTTP, a broken answer) an ``OutboundError``
  that says why, never an exception from inside http.client;
- ``strict_json``: JSON as the agents write it, without NaN or Infinity (which the agent's own API would then
  pass on to strict parsers) and without nesting that exhausts the stack.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import urllib.parse
from collections.abc import Mapping
from typing import Any, NamedTuple


class OutboundError(Exception):
    """The other end gave no usable answer: unreachable, not HTTP, or not within the deadline."""


class Answer(NamedTuple):
    status: int
    body: bytes  # at most max_bytes + 1: longer than max_bytes means the answer was cut
    location: str | None  # where a redirect points (never followed)


class _Deadline:
    """Cuts the connection's socket ``seconds`` after it connected (a blocked read then returns at once);
    ``close`` stops it and closes the connection and its response, so a cut never reaches a socket closed
    meanwhile."""

    def __init__(self, connection: http.client.HTTPConnection, seconds: float):
        self._connection = connection
        self._socket: socket.socket | None = None  # the connection drops it when the answer says it will close
        self.response: http.client.HTTPResponse | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.passed = False
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True

    def watch(self, sock: socket.socket | None) -> None:
        """Start counting, on the connected socket."""
        with self._lock:
            self._socket = sock
        self._timer.start()

    def _cut(self) -> None:
        with self._lock:
            self.passed = True
            if not self._closed and self._socket is not None:
                with contextlib.suppress(OSError):  # the plain socket's: SSLSocket.shutdown drops the SSL object
                    socket.socket.shutdown(self._socket, socket.SHUT_RDWR)  # under a read (AttributeError)

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._closed = True
            if self.response is not None:
                self.response.close()
            self._connection.close()


def request(url: str, *, method: str = "GET", body: bytes | None = None, headers: Mapping[str, str] | None = None,
            timeout: float, max_bytes: int) -> Answer:
    """One request and its answer, all of the answer within ``timeout`` seconds of the connection. Raises
    OutboundError."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OutboundError(f"not an http(s) URL: {url!r}")
    timeout = max(timeout, 0.05)
    try:
        # always a port: without one, http.client reads an IPv6 address's last part as the port
        port = parts.port if parts.port is not None else 443 if parts.scheme == "https" else 80
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.hostname, port, timeout=timeout)
    except (ValueError, http.client.HTTPException) as exc:  # a bad port, a host with spaces
        raise OutboundError(f"not a URL that can be asked: {url!r}: {exc}") from None
    deadline = _Deadline(connection, timeout)
    try:
        # each address a name resolves to gets the timeout to connect (one that drops packets, then one that
        # answers, as urllib did); the answer then gets all of it
        connection.connect()
        deadline.watch(connection.sock)
        target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        connection.request(method, target, body=body, headers=dict(headers or {}))
        response = deadline.response = connection.getresponse()
        data = response.read(max_bytes + 1)
        if deadline.passed:  # the cut ended the read early: what came is not the answer
            raise TimeoutError
        if len(data) <= max_bytes and response.length:  # the connection ended before the body it announced
            raise http.client.IncompleteRead(data, response.length)
        return Answer(response.status, data, response.getheader("Location"))
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if deadline.passed or isinstance(exc, TimeoutError):
            raise OutboundError(f"no answer within {timeout:.1f}s") from None
        if isinstance(exc, http.client.HTTPException):
            raise OutboundError(f"not an HTTP answer ({type(exc).__name__}: {str(exc)[:200]})") from None
        raise OutboundError(f"unreachable: {str(exc)[:200]}") from None
    finally:
        deadline.close()


def _not_a_number(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def strict_json(data: bytes | str) -> Any:
    """``json.loads`` that refuses NaN and Infinity and raises ValueError for nesting too deep to parse."""
    try:
        return json.loads(data, parse_constant=_not_a_number)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def said(answer: Any, limit: int = 300) -> str:
    """What an error answer says (its ``error``, else the whole answer), cut to ``limit`` characters: an answer
    ends up in records and logs, and its size is the other end's choice."""
    text = str(answer.get("error", answer)) if isinstance(answer, dict) else str(answer)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
