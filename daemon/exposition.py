"""Exposition: collectors are rendered ahead of the scrapes that read them, in the formats scrapers ask
for, and a scrape joins the rendered parts; content type and gzip are negotiated as prometheus_client
does (Prometheus asks for OpenMetrics, curl for the text format).

The rendering itself is ``render_fast``: prometheus_client's ``generate_latest`` costs 6 µs (text) and
12 µs (OpenMetrics) per series here, ~7 ms per sample for 8 GPUs and 20 jobs, which alone would spend
the agent's CPU budget (< 1% of a core) at a 1 s interval. ``render_fast`` writes the same bytes for the
families tfprofd makes (legacy names; gauges, counters, histograms) in a fraction of that, and hands
anything else to prometheus_client. tests/test_exposition.py holds it byte-identical to
prometheus_client on every family the agent exports, in both formats.
"""

from __future__ import annotations

import functools
import operator
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from types import ModuleType
from typing import TypeVar

from prometheus_client import exposition as text_format
from prometheus_client.core import Metric
from prometheus_client.openmetrics import exposition as openmetrics

from tfprofd.exporter.base import Sectioned, go_float, label_value

TEXT, OPENMETRICS = "text", "openmetrics"
_LIBRARY = {TEXT: text_format.generate_latest, OPENMETRICS: openmetrics.generate_latest}
_EOF = b"# EOF\n"
DEMAND_SECONDS = 600.0
# how many sampling intervals before a scrape is due a sample renders for it: 2-3 renderings a scrape, of which a scrape
# reads one, but a scrape up to 1.5 intervals early or a sample up to that late still find a part rendered ahead; 1.5
# intervals took 0.97x the CPU at 1,000 jobs scraped every 15 s, and made such scrapes render themselves far more often
RENDER_LEAD = 2.5
# scrapers whose cadence is learned apart, by address and format: an HA pair of Prometheus replicas is two, whose
# scrapes rendered themselves when one cadence was learned from both. Past that many, a new scraper takes the place of
# one that is gone (``_Cadence.lapsed``), else it shares one cadence a format with the others left over, as every
# scraper did before: evicting the least recent, or the newest with no cadence yet, let 17 scrapers taking turns push
# each other out before any learned a cadence, and every Prometheus scrape render itself
MAX_SCRAPERS = 16
MAX_LABEL_SETS = 16384  # label strings a part keeps for its next rendering
GZIP_LEVEL = 1  # a scrape is latency-bound: level 1 is several times faster than 9 for a few % more bytes
# parts from this size on are deflated by ISA-L: a 1,000-job rendering (2.8 MB) in 0.57 ms against zlib's 2.81, 7%
# larger there, and its CRC in 0.04 ms against 0.37 (issue 24). Below it, by zlib: importing ISA-L costs 0.4-0.7 MiB
# resident, which 20 jobs' parts (~60 KB) do not earn back (README targets 35 MiB with them)
LARGE_PART = 256 * 1024
_LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_FAST_TYPES = frozenset({"gauge", "counter", "histogram"})
# one collector's sections: key -> (token, sample lines per family, label sets written)
SectionCache = dict[Hashable, tuple[object, Sequence[str], dict[tuple, str]]]
# a part's plain families as last rendered: name -> (the family object, its sample lines)
KeptFamilies = dict[str, tuple[Metric, str]]
_NONE_WRITTEN: dict[tuple, str] = {}  # hand-written sections (Sectioned.lines) keep no label cache


class _Families:
    """The minimal registry prometheus_client's renderers take."""

    def __init__(self, families: Iterable[Metric]):
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def render_library(families: Iterable[Metric], fmt: str) -> bytes:
    """prometheus_client's own rendering, without OpenMetrics' closing ``# EOF`` (a scrape adds it once)."""
    body = _LIBRARY[fmt](_Families(families))
    return body[:-len(_EOF)] if fmt == OPENMETRICS and body.endswith(_EOF) else body


class _Unusual(Exception):
    """A sample render_fast does not write (timestamp, exemplar, native histogram, OpenMetrics-only suffix)."""


def _fast(family: Metric) -> bool:
    return family.type in _FAST_TYPES and not family.unit and bool(_LEGACY_NAME.match(family.name))


def _header(family: Metric, fmt: str) -> str:
    name = family.name
    if fmt == TEXT:
        shown = name + "_total" if family.type == "counter" else name
        doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    else:
        shown, doc = name, label_value(family.documentation)
    return f"# HELP {shown} {doc}\n# TYPE {shown} {family.type}\n"


def _label_text(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{label_value(v)}"' for k, v in sorted(labels.items()))


def _render_samples(family: Metric, out: list[str], written: dict[tuple, str] | None = None) -> None:
    """The family's sample lines; ``written`` remembers label sets already written (a section's labels
    stay the same from one rendering to the next while its values change: half the cost of a line)."""
    lines = []
    for s in family.samples:
        if s.timestamp is not None or s.exemplar is not None or s.native_histogram is not None:
            raise _Unusual
        if s.labels:
            if written is None:
                labels = _label_text(s.labels)
            else:
                key = tuple(s.labels.items())
                labels = written.get(key)
                if labels is None:
                    labels = written[key] = _label_text(s.labels)
            lines.append(f"{s.name}{{{labels}}} {go_float(s.value)}\n")
        else:
            lines.append(f"{s.name} {go_float(s.value)}\n")
    out.extend(lines)


def render(families: Iterable[Metric], fmt: str, sections: SectionCache | None = None,
           labels: dict[tuple, str] | None = None, kept: KeptFamilies | None = None) -> bytes:
    """Families in one format, as prometheus_client writes them (without OpenMetrics' ``# EOF``).

    ``Sectioned`` families are rendered section by section: with a ``sections`` cache (one per collector),
    only the sections whose token changed since the last rendering. Other families' label sets are written
    once into ``labels`` (one per part) and reused: the agent's own part holds a ``rule_active`` series per
    rule and job, 3,000 with 1,000 jobs, whose labels stay while their values change. With ``kept`` (one
    per part), a family that is the very object rendered last time is not rendered again: its sample lines
    are reused (the rules engine hands out the same families while no state changed; a family is never
    changed once collected)."""
    out: list[str] = []
    if isinstance(families, Sectioned):
        try:
            _render_sectioned(families, fmt, {} if sections is None else sections, out)
            return "".join(out).encode()
        except _Unusual:
            out = []
    if labels is not None and len(labels) > MAX_LABEL_SETS:
        labels.clear()  # bounded where label sets churn
    fresh: KeptFamilies = {}
    for family in families:
        part: list[str] = []
        try:
            if not _fast(family):
                raise _Unusual
            part.append(_header(family, fmt))
            entry = None if kept is None else kept.get(family.name)
            if entry is None or entry[0] is not family:
                lines: list[str] = []
                _render_samples(family, lines, labels)
                entry = (family, "".join(lines))
            if kept is not None:  # without, each family is freed once written: one at a time, not all at once
                fresh[family.name] = entry
            part.append(entry[1])
        except _Unusual:
            part = [render_library([family], fmt).decode()]
        out.extend(part)
    if kept is not None:
        kept.clear()
        kept.update(fresh)  # families that are gone are dropped
    return "".join(out).encode()


def _render_sectioned(families: Sectioned, fmt: str, cache: SectionCache, out: list[str]) -> None:
    """At 1,000 training jobs (34,000 lines) rendering everything each sample took 63% of the agent's busy
    time (issue 24): a job's lines are rendered when its row changes and reused while it does not. Sample
    lines are the same in both formats (only headers differ), so one cache serves both."""
    templates = list(families.build([]))
    if not all(_fast(f) for f in templates):
        raise _Unusual
    for family in families.head:
        if not _fast(family):
            raise _Unusual
        out.append(_header(family, fmt))
        _render_samples(family, out)
    chunks = []
    fresh = {}
    for key, token in families.sections:
        entry = cache.get(key)
        if entry is None or entry[0] is not token:
            if families.lines is not None:
                entry = (token, families.lines(token, None if entry is None else entry[1]), _NONE_WRITTEN)
            else:
                written = {} if entry is None or len(entry[2]) > 1024 else entry[2]  # bounded if labels churn
                lines = []
                for family in families.build([token]):
                    part: list[str] = []
                    _render_samples(family, part, written)
                    lines.append("".join(part))
                entry = (token, lines, written)
        fresh[key] = entry
        chunks.append(entry[1])
    cache.clear()
    cache.update(fresh)  # sections that are gone (expired jobs) are dropped
    for i, template in enumerate(templates):
        out.append(_header(template, fmt))
        out.extend(map(operator.itemgetter(i), chunks))


@functools.cache
def _isal() -> ModuleType:
    """ISA-L's zlib-compatible module, imported on first use; the standard library's zlib where there is no wheel
    for this machine (pyproject's marker): both write the same deflate format."""
    try:
        from isal import isal_zlib
    except ImportError:
        return zlib
    return isal_zlib


def deflater(size: int) -> ModuleType:
    """The zlib-compatible module that deflates (and sums) ``size`` bytes: ISA-L's from ``LARGE_PART`` on."""
    return zlib if size < LARGE_PART else _isal()


class Part:
    """One collector's latest rendering per format, when it was made (monotonic), and the same bytes deflated
    once for every gzip scrape that reads this rendering (``deflated``)."""

    __slots__ = ("_deflated", "bytes", "made")

    def __init__(self, data: bytes, made: float):
        self.bytes = data
        self.made = made
        self._deflated: bytes | None = None

    def deflated(self) -> bytes:
        """The rendering as a raw deflate segment that ends on a byte boundary and refers to nothing before it:
        segments in a row are one deflate stream (``gzip_body``). Made once (two scrapes racing may both make
        it; either is kept)."""
        if self._deflated is None:
            library = deflater(len(self.bytes))
            compressor = library.compressobj(GZIP_LEVEL, library.DEFLATED, -library.MAX_WBITS)
            self._deflated = compressor.compress(self.bytes) + compressor.flush(library.Z_SYNC_FLUSH)
        return self._deflated


# gzip.compress(data, GZIP_LEVEL, mtime=0)'s header (no name, no time; XFL 4: the fastest level; OS 3, Unix) and
# the deflate stream's last block (final, empty)
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x04\x03"
_LAST_BLOCK = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS).flush()
_EOF_PART = Part(_EOF, 0.0)


def gzip_body(parts: Sequence[Part]) -> bytes:
    """The parts joined, as one gzip member (what ``gzip.compress`` makes of the joined bytes, in a few more
    bytes): each part's deflate segment is made once, so a scrape deflates only what was rendered since the
    last one (1,000 jobs: 2.7 MB a sample, ~4 ms, was deflated again for every scrape). One member, not one per
    part: curl --compressed reads only a gzip stream's first member."""
    crc, size = 0, 0
    for part in parts:
        crc, size = deflater(len(part.bytes)).crc32(part.bytes, crc), size + len(part.bytes)
    return b"".join([_GZIP_HEADER, *(part.deflated() for part in parts), _LAST_BLOCK,
                     struct.pack("<II", crc, size & 0xFFFFFFFF)])


def cadence_kept(period: float, interval: float) -> float:
    """How long after its last scrape a cadence is still kept: past two periods without a scrape it is gone (a
    burst of polls that stopped), since rendering every sample for it would cost as much as being scraped (a
    scrape that does come renders itself); 2.5 intervals more for the age a part may have."""
    return 2 * period + 2.5 * interval


def negotiate(accept: str) -> tuple[str, str]:
    """(format, content type) for an Accept header, as prometheus_client chooses them."""
    _, content_type = text_format.choose_encoder(accept)
    return (OPENMETRICS if content_type.startswith("application/openmetrics-text") else TEXT), content_type


class _Cadence:
    """How often one scraper (an address, a format) asks: its last scrape, the period learned from its gaps, and
    when it last took the body gzipped (a plain scrape from the same address, curl beside a Prometheus, may come in
    between)."""

    __slots__ = ("gzipped", "last", "period")

    def __init__(self, now: float, gzipped: bool):
        self.last = now
        self.period: float | None = None
        self.gzipped: float | None = now if gzipped else None

    def asked(self, now: float, gzipped: bool) -> None:
        gap = now - self.last
        if gap < DEMAND_SECONDS:
            self.period = gap if self.period is None else 0.7 * self.period + 0.3 * gap
        self.last = now
        if gzipped:
            self.gzipped = now

    def lapsed(self, now: float) -> bool:
        """Whether this scraper is gone: it let its cadence lapse (no scrape for two of its periods), or made
        no second scrape for ``DEMAND_SECONDS``."""
        return now - self.last > (DEMAND_SECONDS if self.period is None else min(2 * self.period, DEMAND_SECONDS))

    def due(self, now: float, interval: float) -> bool | None:
        """None where this scraper's next scrape is not due within ``RENDER_LEAD`` intervals (nor a little late),
        else whether it will take the body gzipped."""
        period = self.period
        if period is None or now - self.last > DEMAND_SECONDS:
            return None  # no cadence known yet (one curl), or it scrapes no more
        if not period - RENDER_LEAD * interval <= now - self.last <= cadence_kept(period, interval):
            return None
        return self.gzipped is not None and now - self.gzipped <= cadence_kept(period, interval)


K = TypeVar("K")


def _note(cadences: dict[K, _Cadence], key: K, now: float, gzipped: bool) -> None:
    """A scrape by the scraper(s) ``key`` stands for: its cadence learns from it, or starts with it."""
    cadence = cadences.get(key)
    if cadence is None:
        cadences[key] = _Cadence(now, gzipped)
    else:
        cadence.asked(now, gzipped)


class Exposition:
    """Renders collectors ahead of the scrapes that will read them, and joins the parts into a scrape body.

    Rendering happens on a collector's sampling thread right after a sample, but only when a scrape in
    that format is due within ``RENDER_LEAD`` sampling intervals: the cadence of each scraper (its address and
    format, up to ``MAX_SCRAPERS``; past them, one for the others of each format) is learned from its scrapes.
    Prometheus every 15 s with a 1 s interval costs 2-3 renderings per collector per scrape, not 15, and a scrape
    still finds a part at most one interval old; an HA pair of replicas costs that for each (two replicas behind one
    address, or among the scrapers left over, share one cadence). A scrape that finds no fresh part (a scraper's first
    two, or one off its cadence) renders it itself.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, reusing: Collection[str] = ()):
        """``reusing`` names the parts whose families can be the very objects of their last rendering (the
        agent's own part: the rules engine hands out the same families while no state changed); only theirs
        are kept from one rendering to the next. A collector's ``collect()`` makes new families every time:
        keeping them held every sample object of its last rendering for nothing (8 GPUs: ~230 KB, and twice
        that while the next rendering ran; issue 24)."""
        self.clock = clock
        self._reusing = frozenset(reusing)
        self._parts: dict[tuple[str, str], Part] = {}  # (collector, format) -> part
        self._sections: dict[str, SectionCache] = {}  # collector -> its rendered sections (render())
        self._labels: dict[str, dict[tuple, str]] = {}  # collector -> its label sets as written (render())
        self._kept: dict[str, KeptFamilies] = {}  # collector -> its families as last rendered (render())
        self._scrapers: dict[tuple[str, str], _Cadence] = {}  # (format, address) -> its cadence
        self._left_over: dict[str, _Cadence] = {}  # format -> the cadence of the scrapers past MAX_SCRAPERS
        self._forgotten: dict[str, int] = {}  # collector -> how often forget() dropped it
        self._lock = threading.Lock()

    def after_sample(self, name: str, collect: Callable[[], Iterable[Metric]], interval: float,
                     min_gap: float = 0.0) -> None:
        """On a sampling thread, after a sample changed what ``name`` renders: render it in each format a scrape is
        due in, and drop its rendering in the others (the next scrape renders it afresh). ``min_gap`` keeps a
        rendering that is younger than that (for parts that many samples touch)."""
        now = self.clock()
        scraped: set[str] = set()
        gzip: dict[str, bool] = {}  # format -> whether a scraper that is due in it takes it gzipped
        with self._lock:
            for fmt, cadence in [*((fmt, c) for (fmt, _), c in self._scrapers.items()), *self._left_over.items()]:
                scraped.add(fmt)
                if (gzipped := cadence.due(now, interval)) is not None:
                    gzip[fmt] = gzip.get(fmt, False) or gzipped
        for fmt in scraped:
            part = self._parts.get((name, fmt))
            if fmt not in gzip:
                with self._lock:  # forget() walks the parts under it
                    self._parts.pop((name, fmt), None)
            elif part is None or now - part.made >= min_gap:
                self._fresh(name, collect, fmt, now, deflate=gzip[fmt])

    def part(self, name: str, fmt: str, collect: Callable[[], Iterable[Metric]], max_age: float) -> Part:
        """The collector's rendering in ``fmt``, at most ``max_age`` old (rendered now if there is none)."""
        now = self.clock()
        part = self._parts.get((name, fmt))
        if part is None or now - part.made > max_age:
            return self._fresh(name, collect, fmt, now)
        return part

    def _fresh(self, name: str, collect: Callable[[], Iterable[Metric]], fmt: str, now: float,
               deflate: bool = False) -> Part:
        """Render the part (``deflate``: and deflate it, before a scrape can read it) and keep it, unless
        ``forget`` dropped the part meanwhile: what it collected may be what forget() was called to drop (a
        collector disabled by a reload while another collector's thread rendered the agent's part, with that
        collector's collector_success series, which scrapes then served for up to an interval more)."""
        forgotten = self._forgotten.get(name, 0)
        part = Part(self._render(name, collect, fmt), now)
        if deflate:
            part.deflated()
        with self._lock:
            if self._forgotten.get(name, 0) == forgotten:
                self._parts[(name, fmt)] = part
        return part

    def _render(self, name: str, collect: Callable[[], Iterable[Metric]], fmt: str) -> bytes:
        return render(collect(), fmt, self._sections.setdefault(name, {}), self._labels.setdefault(name, {}),
                      self._kept.setdefault(name, {}) if name in self._reusing else None)

    def forget(self, name: str) -> None:
        with self._lock:
            self._forgotten[name] = self._forgotten.get(name, 0) + 1
            for key in [k for k in self._parts if k[0] == name]:
                self._parts.pop(key, None)
        self._sections.pop(name, None)
        self._labels.pop(name, None)
        self._kept.pop(name, None)

    def _asked(self, fmt: str, scraper: str, gzipped: bool) -> None:
        now = self.clock()
        key = (fmt, scraper)
        with self._lock:
            if key not in self._scrapers and len(self._scrapers) >= MAX_SCRAPERS:  # bounded, however many scrape
                gone = self._replaceable(now)
                if gone is None:  # as many scrapers keep their cadences: this one shares its format's left-over one
                    _note(self._left_over, fmt, now, gzipped)
                    return
                del self._scrapers[gone]
            _note(self._scrapers, key, now, gzipped)

    def _replaceable(self, now: float) -> tuple[str, str] | None:
        """The scraper a new one takes the place of (``MAX_SCRAPERS``): the least recent that is gone, if any."""
        gone = [key for key, cadence in self._scrapers.items() if cadence.lapsed(now)]
        return min(gone, key=lambda key: self._scrapers[key].last) if gone else None

    def body(self, parts: Callable[[str], Iterable[Part]], accept: str, accept_encoding: str,
             scraper: str = "") -> tuple[bytes, str, str | None]:
        """(body, content type, content encoding) of a scrape by ``scraper`` (its address); ``parts(fmt)`` gives
        every rendered part."""
        fmt, content_type = negotiate(accept)
        gzipped = text_format.gzip_accepted(accept_encoding)
        self._asked(fmt, scraper, gzipped)
        body_parts = list(parts(fmt))
        if fmt == OPENMETRICS:
            body_parts.append(_EOF_PART)
        if gzipped:
            return gzip_body(body_parts), content_type, "gzip"
        return b"".join(part.bytes for part in body_parts), content_type, None
