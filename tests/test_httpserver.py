"""The agent's HTTP server as a client meets it on a raw socket: pipelined requests, a client that never reads
its answer, trickled headers, idle keep-alive, Expect: 100-continue, a request cut short, a handler or a loop
callback that raises, and a stop with connections open."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tfprofd.daemon.httpserver import EventLoop, HttpServer, Request, Response, Router, json_response

from helpers import wait_for

BIG = 32 * 1024 * 1024  # more than loopback's socket buffers hold: the server must wait for the reader


@contextlib.contextmanager
def serving(**settings: Any) -> Iterator[tuple[HttpServer, int, list[bytes], EventLoop]]:
    """A server with a few routes on its own loop: (server, port, the POST bodies acted on, loop)."""
    calls: list[bytes] = []
    router = Router()
    router.add("GET", "/small", lambda r: Response(200, b"small\n", "text/plain"), inline=True)
    router.add("GET", "/big", lambda r: Response(200, b"x" * BIG, "text/plain"))
    router.add("GET", "/boom", lambda r: 1 / 0)
    router.add("GET", "/unsendable", lambda r: Response(200, b"", headers={"X-Name": "\u2019"}))
    router.add("POST", "/act", lambda r: (calls.append(r.body), json_response(200, {"got": len(r.body)}))[1])
    loop = EventLoop()
    server = HttpServer("test", ("127.0.0.1", 0), router, max_body=lambda: 1024,
                        **{"idle_timeout": 1.0, "request_timeout": 1.0, **settings})
    loop.start()
    server.start(loop)
    try:
        yield server, server.address[1], calls, loop
    finally:
        server.stop(loop)
        loop.stop()


@pytest.fixture
def served():
    with serving() as running:
        yield running


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """``count`` whole responses (status, body) read from the socket."""
    data, out = b"", []
    while len(out) < count:
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            head = data[:end].decode("latin-1").split("\r\n")
            length = int(next(h.split(":", 1)[1] for h in head if h.lower().startswith("content-length")))
            if len(data) >= end + 4 + length:
                out.append((int(head[0].split()[1]), data[end + 4:end + 4 + length]))
                data = data[end + 4 + length:]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"closed after {len(out)} answers: {data[:200]!r}"
        data += chunk
    return out


def closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (read to its end; a reset counts)."""
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    return True


def served_as(server: HttpServer) -> dict[int, str]:
    """The server's connections: the client's port -> what the server does with it."""
    return server._loop.call(lambda: {c.sock.getpeername()[1]: c.state for c in server._conns.values()})


def test_pipelined_requests_are_answered_in_order_on_one_connection(served):
    _, port, calls, _ = served
    with connect(port) as sock:
        sock.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"POST /act HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                     b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
        got = answers(sock, 3)
    assert [status for status, _ in got] == [200, 200, 404]
    assert got[0][1] == b"small\n" and b'"got": 3' in got[1][1] and calls == [b"abc"]


def test_a_client_that_never_reads_its_large_answer_is_closed_and_others_are_served_meanwhile(served):
    """At the request timeout the connection is closed and what was not sent is dropped: an asyncio server closed
    it gracefully, still holding the rest of the answer to send, outside the connection bound."""
    _, port, _, _ = served
    stalled = connect(port)
    stalled.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    for _ in range(3):  # the loop is not stuck writing to it
        with connect(port) as other:
            other.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert answers(other, 1) == [(200, b"small\n")]
    received = 0
    stalled.settimeout(30)
    wait_for(lambda: len(served[0]._conns) == 0, 30, message="the stalled connection to be closed at its timeout")
    try:
        while chunk := stalled.recv(1 << 20):
            received += len(chunk)
    except ConnectionResetError:
        pass
    stalled.close()
    assert received < BIG  # the server gave up on it, and its answer was never completed


def test_headers_that_trickle_in_are_cut_off_at_the_request_timeout(served):
    server, port, _, _ = served
    with connect(port) as sock:
        sock.sendall(b"GET /small HTTP/1.1\r\n")
        started = time.monotonic()
        assert closed(sock)
        assert time.monotonic() - started >= 0.9
    wait_for(lambda: not server._conns, 10, message="no connection left")


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(served):
    _, port, _, _ = served
    with connect(port) as sock:
        sock.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answers(sock, 1)[0][0] == 200
        assert closed(sock)


def test_expect_100_continue_gets_continue_before_the_body_is_sent(served):
    _, port, calls, _ = served
    with connect(port) as sock:
        sock.sendall(b"POST /act HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"hello")
        assert answers(sock, 1)[0][0] == 200
    assert calls == [b"hello"]


def test_a_request_whose_body_is_cut_short_is_never_acted_on(served):
    server, port, calls, _ = served
    with connect(port) as sock:
        sock.sendall(b"POST /act HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly ten..")
    wait_for(lambda: not server._conns, 10, message="the connection to end")
    with connect(port) as sock:  # the server goes on
        sock.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answers(sock, 1)[0][0] == 200
    assert calls == []


def test_a_body_over_the_limit_gets_413_without_being_read(served):
    _, port, calls, _ = served
    with connect(port) as sock:
        sock.sendall(b"POST /act HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"y" * 5000)
        [(status, body)] = answers(sock, 1)
        assert status == 413 and b"larger than 1024" in body
        assert closed(sock)
    assert calls == []


def test_a_handler_that_raises_answers_500_and_a_failing_loop_callback_stops_nothing(served):
    _, port, _, loop = served
    loop.call_soon_threadsafe(lambda: 1 / 0)
    with connect(port) as sock:
        sock.sendall(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\nGET /small HTTP/1.1\r\nHost: x\r\n\r\n")
        got = answers(sock, 2)
    assert [status for status, _ in got] == [500, 200] and b"internal error" in got[0][1]


def test_stop_closes_open_connections_and_the_port(served):
    server, port, _, loop = served
    socks = [connect(port) for _ in range(5)]
    wait_for(lambda: len(server._conns) == 5, 10, message="the connections to be accepted")
    server.stop(loop)
    for sock in socks:
        assert closed(sock)
        sock.close()
    with pytest.raises(ConnectionRefusedError):
        connect(port)


def test_requests_from_many_threads_at_once_are_all_answered(served):
    _, port, _, _ = served
    failures: list[BaseException] = []

    def client() -> None:
        try:
            with connect(port) as sock:
                for _ in range(20):
                    sock.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
                    assert answers(sock, 1) == [(200, b"small\n")]
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=client) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures[:3]


def test_a_request_handler_sees_the_request_as_sent(served):
    server, port, _, _ = served
    seen: list[Request] = []
    server.router.add("PUT", "/echo/{name}", lambda r: (seen.append(r), Response(204, b""))[1])
    with connect(port) as sock:
        sock.sendall(b"PUT /echo/abc?x=1&x=2 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nX-Thing:  v \r\n\r\nok")
        assert answers(sock, 1)[0][0] == 204
    [r] = seen
    assert (r.method, r.path, r.params, r.query, r.body) == ("PUT", "/echo/abc", {"name": "abc"}, {"x": ["1", "2"]},
                                                             b"ok")
    assert r.headers["x-thing"] == "v" and r.peer == "127.0.0.1"


def test_hundreds_of_pipelined_requests_are_all_answered(served):
    """Answered one after another at the loop's turns: nested, 400 small answers ran out of stack at 197."""
    _, port, _, _ = served
    with connect(port) as sock:
        sock.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n" * 400)
        assert answers(sock, 400) == [(200, b"small\n")] * 400


def test_at_the_bound_a_new_client_waits_for_a_free_slot_rather_than_being_reset():
    """Every slot busy sending an answer: a new connection is accepted (none is evicted: none waits for a request,
    and the one just accepted has not waited at all) when a slot frees."""
    with serving(max_connections=4, request_timeout=30.0) as (server, port, _, _):
        readers = [connect(port) for _ in range(3)]
        for sock in readers:
            sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        wait_for(lambda: sum(c.state == "sending" for c in list(server._conns.values())) == 3, 30,
                 message="three slow readers being answered")
        with connect(port) as fourth:  # within the bound: served at once
            fourth.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert answers(fourth, 1) == [(200, b"small\n")]
        blocker = connect(port)
        blocker.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        mine = blocker.getsockname()[1]  # the fourth may still be closing: wait for this one, by its port
        wait_for(lambda: served_as(server) == {**{r.getsockname()[1]: "sending" for r in readers}, mine: "sending"},
                 30, message="four slow readers: every slot busy")
        with connect(port) as fifth:  # waits in the backlog
            fifth.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert closed(readers[0])  # it reads its answer to the end: its slot frees
            assert answers(fifth, 1) == [(200, b"small\n")]
        assert server.evicted == 0
        for sock in [*readers, blocker]:
            sock.close()


def test_an_answer_that_cannot_be_sent_closes_its_connection(served):
    server, port, _, _ = served
    with connect(port) as sock:
        sock.sendall(b"GET /unsendable HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(1024) == b""  # closed, not left busy past every timeout
    wait_for(lambda: not server._conns, 10, message="no connection held")


def test_a_malformed_request_target_gets_400(served):
    _, port, _, _ = served
    with connect(port) as sock:
        sock.sendall(b"GET http://[::1/small HTTP/1.1\r\nHost: x\r\n\r\n")
        [(status, body)] = answers(sock, 1)
    assert status == 400 and b"malformed request target" in body


def test_the_deadlines_of_many_requests_do_not_pile_up(served):
    """Each request books and cancels a few deadlines; the cancelled ones do not stay in the loop's heap for the
    idle timeout (20,000 requests held 3.7 MB) while an earlier deadline still waits."""
    _, port, _, loop = served
    idle = connect(port)
    idle.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
    answers(idle, 1)
    with connect(port) as sock:
        for _ in range(20):
            sock.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n" * 100)
            answers(sock, 100)
        assert loop.call(lambda: len(loop._timers)) < 300
    idle.close()


def test_at_the_bound_a_client_that_never_asks_is_evicted_for_a_scrape_accepted_with_it():
    """Both connect while the loop is busy, so one turn accepts both: the idle one (accepted first, not read yet)
    cannot be evicted in that turn, but is at the next, and the scrape is answered (it waited for the idle one's
    request timeout, 30 s here)."""
    with serving(max_connections=2, request_timeout=30.0) as (server, port, _, loop):
        reader = connect(port)
        reader.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        wait_for(lambda: [c.state for c in list(server._conns.values())] == ["sending"], 30,
                 message="one slot busy sending")
        gate = threading.Event()
        loop.call_soon_threadsafe(lambda: gate.wait(30))  # the loop is busy: both wait in the backlog
        idle, scrape = connect(port), connect(port)
        scrape.settimeout(10)
        scrape.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        gate.set()
        assert answers(scrape, 1) == [(200, b"small\n")]
        assert server.evicted == 1 and closed(idle)
        for sock in (reader, idle, scrape):
            sock.close()
