"""The read-only endpoints: /metrics, /healthz and the landing page, and tfprofd's own metrics.

Health is red (503) when any collector is unhealthy: its sampling thread died, a background thread of
its own died, or its sample is overdue (blocked in a library call); the same collector then reads
``tfprofd_collector_success 0`` and its last values are not served.
"""

from __future__ import annotations

import html
import platform
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import Metric

from tfprofd.exporter.base import counter, gauge

from .exposition import Exposition, Part
from .httpserver import HttpServer, Request, Response, Router, json_response
from .sampler import CollectorRunner, Snapshot, states

AGENT_PART = " agent"  # the exposition part of the agent's own families (no collector has this name)


class Endpoints:
    def __init__(self, router: Router, version: str, runners: Callable[[], Mapping[str, CollectorRunner]],
                 live: Callable[[], Iterable[Metric]], servers: Callable[[], Iterable[HttpServer]],
                 stopping: Callable[[], bool], interval: Callable[[], float],
                 storage_problem: Callable[[], str | None] = lambda: None):
        self.version = version
        self.storage_problem = storage_problem
        self.interval = interval
        self.runners = runners
        self.live = live
        self.servers = servers
        self.stopping = stopping
        self.exposition = Exposition(reusing=(AGENT_PART,))
        self.workers: Callable[[], dict[str, Any]] = dict  # the worker pools' state, shown (not judged) by /healthz
        self._agent_changed = False  # a rule changed state: the next sample renders the agent's part, however young
        router.add("GET", "/", self.landing, inline=True)
        router.add("GET", "/metrics", self.metrics, inline=True)
        router.add("GET", "/healthz", self.healthz, inline=True)

    def collect(self) -> Iterator[Metric]:
        statuses = sorted(states(self.runners()).items())
        yield gauge("build_info", "tfprofd build information; the value is 1.", ["version", "python_version"],
                    [((self.version, platform.python_version()), 1)])
        yield gauge("collector_success", "Whether the collector's latest sample succeeded and it is healthy (1) or "
                    "not (0).", ["collector"], (((name,), float(s.success)) for name, s in statuses))
        yield gauge("collector_duration_seconds", "How long the collector's latest sample took, in seconds.",
                    ["collector"], (((name,), s.duration) for name, s in statuses))
        yield gauge("collector_last_sample_timestamp_seconds", "Unix time of the collector's latest sample.",
                    ["collector"], (((name,), s.last_sample_wall) for name, s in statuses if s.last_sample_wall))
        yield counter("http_connections_evicted", "Connections waiting for a request (or its body) closed to make "
                      "room for new ones, by server.",
                      ["server"], (((s.name,), s.evicted) for s in self.servers()))

    def _agent_families(self) -> list[Metric]:
        return [*self.collect(), *self.live()]

    def agent_changed(self) -> None:
        """A rule went pending, fired or cleared on the sample being published: its scrape must say so at once
        (the agent's part is otherwise rendered at most every half interval, and a rule that fired just after
        a rendering read quiet until the next one)."""
        self._agent_changed = True

    def after_sample(self, snapshot: Snapshot) -> None:
        """Subscribed to every runner: render the collector, and the agent's own state (rules, captures,
        health) that its sample changed, ahead of a scrape that is due."""
        interval = self.interval()
        self.exposition.after_sample(snapshot.collector, snapshot.families, interval)
        changed, self._agent_changed = self._agent_changed, False
        min_gap = 0.0 if changed else interval / 2
        self.exposition.after_sample(AGENT_PART, self._agent_families, interval, min_gap=min_gap)

    def _parts(self, fmt: str) -> list[Part]:
        max_age = 2 * self.interval() + 0.5
        parts = [self.exposition.part(name, fmt, snap.families, max_age)
                 for name, runner in sorted(self.runners().items()) if (snap := runner.serving())]
        # The agent's own state at most one interval old; unhealthy collectors show in it at once anyway,
        # since the healthy ones keep sampling and rendering it.
        parts.append(self.exposition.part(AGENT_PART, fmt, self._agent_families, max_age))
        return parts

    def metrics(self, request: Request) -> Response:
        body, content_type, encoding = self.exposition.body(
            self._parts, request.headers.get("accept", ""), request.headers.get("accept-encoding", ""), request.peer)
        return Response(200, body, content_type, {"Content-Encoding": encoding} if encoding else {})

    def healthz(self, request: Request) -> Response:
        collectors = {name: {"success": s.success, "healthy": s.healthy, "problem": s.problem,
                             "last_sample_timestamp_seconds": s.last_sample_wall}
                      for name, s in sorted(states(self.runners()).items())}
        healthy = not self.stopping() and all(c["healthy"] for c in collectors.values())
        body = {"status": "ok" if healthy else "unhealthy", "collectors": collectors, "workers": self.workers()}
        problem = self.storage_problem()
        if problem:  # captures cannot be stored; restarting the agent would not help, so it stays 200
            body["storage_problem"] = problem
        return json_response(200 if healthy else 503, body)

    def landing(self, request: Request) -> Response:
        body = f"""<!doctype html><html><head><title>tfprofd</title></head><body>
<h1>tfprofd {html.escape(self.version)}</h1>
<p>GPU, host and training-throughput metrics for Prometheus, with profile captures when utilization drops.</p>
<ul><li><a href="/metrics">/metrics</a>: Prometheus metrics</li>
<li><a href="/healthz">/healthz</a>: health of the sampling threads</li></ul>
</body></html>
"""
        return Response(200, body.encode(), "text/html; charset=utf-8")
