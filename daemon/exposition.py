"""Exposition: prometheus_client renders each snapshot's families once, in the formats scrapers ask for,
and a scrape joins the rendered parts; content type and gzip are negotiated as prometheus_client does.

Rendering happens on the sampling thread right after a sample, so its cost never reaches a scrape.
Only formats asked for in the last ``DEMAND_SECONDS`` are rendered ahead (Prometheus asks for
OpenMetrics, curl for the text format); a format asked for the first time is rendered on demand once.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterable, Sequence

from prometheus_client import exposition as text_format
from prometheus_client.core import Metric
from prometheus_client.openmetrics import exposition as openmetrics

TEXT, OPENMETRICS = "text", "openmetrics"
_RENDERERS = {TEXT: text_format.generate_latest, OPENMETRICS: openmetrics.generate_latest}
_EOF = b"# EOF\n"
DEMAND_SECONDS = 600.0
GZIP_LEVEL = 1  # a scrape is latency-bound: level 1 is several times faster than 9 for a few % more bytes


class _Families:
    """The minimal registry prometheus_client's renderers take."""

    def __init__(self, families: Iterable[Metric]):
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def render(families: Iterable[Metric], fmt: str) -> bytes:
    """Families in one format, without OpenMetrics' closing ``# EOF`` (a scrape adds it once)."""
    body = _RENDERERS[fmt](_Families(families))
    return body[:-len(_EOF)] if fmt == OPENMETRICS and body.endswith(_EOF) else body


class Rendering:
    """One snapshot's families, rendered at most once per format."""

    __slots__ = ("_families", "_lock", "_parts")

    def __init__(self, families: Sequence[Metric]):
        self._families = families
        self._parts: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, fmt: str) -> bytes:
        part = self._parts.get(fmt)
        if part is None:
            with self._lock:
                part = self._parts.get(fmt)
                if part is None:
                    part = self._parts[fmt] = render(self._families, fmt)
        return part


def negotiate(accept: str) -> tuple[str, str]:
    """(format, content type) for an Accept header, as prometheus_client chooses them."""
    _, content_type = text_format.choose_encoder(accept)
    return (OPENMETRICS if content_type.startswith("application/openmetrics-text") else TEXT), content_type


class Exposition:
    """Joins rendered snapshots and live families into one scrape body; remembers which formats are asked for."""

    def __init__(self) -> None:
        self._asked: dict[str, float] = {}

    def on_snapshot(self, snapshot: object) -> None:
        """Render a new snapshot in every format scrapers asked for lately (subscribed to every runner)."""
        now = time.monotonic()
        for fmt, asked in list(self._asked.items()):
            if now - asked <= DEMAND_SECONDS:
                snapshot.rendering.get(fmt)  # type: ignore[attr-defined]

    def body(self, renderings: Iterable[Rendering], live: Iterable[Metric], accept: str,
             accept_encoding: str) -> tuple[bytes, str, str | None]:
        """(body, content type, content encoding) of a scrape."""
        fmt, content_type = negotiate(accept)
        self._asked[fmt] = time.monotonic()
        parts = [r.get(fmt) for r in renderings]
        parts.append(render(live, fmt))
        if fmt == OPENMETRICS:
            parts.append(_EOF)
        body = b"".join(parts)
        if text_format.gzip_accepted(accept_encoding):
            return gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0), content_type, "gzip"
        return body, content_type, None
