"""The benches' own Prometheus-like scraper (bench/scrape.py ``scrape_every``): a CPU window it reports must be one in
which the agent was scraped."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import scrape


@contextmanager
def server(status: int) -> Iterator[tuple[int, list[str]]]:
    """A /metrics server on loopback that answers ``status`` and then closes the connection without saying so, as
    the agent closes a kept-alive connection left idle: (its port, the requests it answered)."""
    answered: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            answered.append(self.path)
            body = b"tfprofd_up 1\n"
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True  # no "Connection: close": the client takes it for kept alive

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd.server_address[1], answered
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_scraper_connects_again_where_the_agent_closed_its_connection():
    """The agent closes a connection idle for 30 s: a scraper every 30 s or more met a closed connection at each
    scrape, and its thread died while the bench went on reporting a window nobody scraped."""
    with server(200) as (port, answered):
        stop = threading.Event()
        thread, errors = scrape.scraping([port], 0.05, stop, lambda rounds: rounds >= 4)
        thread.join(60)
        stop.set()
    assert not thread.is_alive()
    assert errors == []
    assert len(answered) == 4


def test_a_failed_scrape_stops_the_cpu_window_with_its_reason():
    with server(503) as (port, _), pytest.raises(RuntimeError, match=r"a scrape every 0\.05 s failed"):
        scrape.cpu_scraped_every(os.getpid(), port, 0.05)
