"""The scrape: content negotiation and gzip as prometheus_client does them, and a scrape that survives a
part of the agent whose metrics fail."""

from __future__ import annotations

import gzip
import http.client
import shutil
import subprocess
import zlib

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import metric_value, wait_for


def get(agent, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=10)
    conn.request("GET", "/metrics", headers=headers)
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, body


def test_openmetrics_and_text_and_gzip_are_negotiated(agents):
    agent = agents()
    status, headers, body = get(agent, {"Accept": "application/openmetrics-text; version=1.0.0,text/plain;q=0.5"})
    assert status == 200 and headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith(b"# EOF\n") and body.count(b"# EOF") == 1
    assert b"# TYPE tfprofd_cpu_seconds counter" in body  # OpenMetrics names a counter without _total
    status, headers, body = get(agent, {})
    assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert b"# TYPE tfprofd_cpu_seconds_total counter" in body and b"# EOF" not in body
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert "tfprofd_collector_success" in names
    status, headers, zipped = get(agent, {"Accept-Encoding": "gzip"})
    assert headers["content-encoding"] == "gzip"
    assert metric_value(gzip.decompress(zipped).decode(), "tfprofd_collector_success", collector="cpu") == 1


def test_a_gzip_scrape_is_one_member_that_curl_reads_whole(agents):
    """Each part is deflated once and the scrape joins them into one gzip member: every reader gets the whole
    body, curl --compressed included (it reads a stream's first member only)."""
    agent = agents()
    for accept in ("application/openmetrics-text; version=1.0.0", ""):
        status, headers, zipped = get(agent, {"Accept": accept, "Accept-Encoding": "gzip"})
        assert status == 200 and headers["content-encoding"] == "gzip"
        member = zlib.decompressobj(31)
        body = member.decompress(zipped)
        assert member.eof and member.unused_data == b""  # one member, nothing after it
        assert body == gzip.decompress(zipped)
        assert body.endswith(b"# EOF\n") == bool(accept)
        assert metric_value(body.decode(), "tfprofd_collector_success", collector="cpu") == 1
    if shutil.which("curl"):
        shown = subprocess.run(["curl", "-sf", "--compressed", "-H", "Accept: application/openmetrics-text",
                                f"http://127.0.0.1:{agent.port}/metrics"], capture_output=True, timeout=30)
        assert shown.returncode == 0 and shown.stdout.endswith(b"# EOF\n")
        assert b"# TYPE tfprofd_cpu_seconds counter" in shown.stdout


@pytest.mark.parametrize("isal", [True, False])
def test_small_and_large_parts_join_into_one_gzip_member_of_their_bytes(monkeypatch, isal):
    """Parts from LARGE_PART on are deflated by ISA-L where its wheel is installed, smaller ones (and all of them
    where it is not) by zlib: the segments join into one gzip member of exactly the parts' bytes, its CRC and
    size right, an empty part and a part of one byte included."""
    import zlib as standard

    from tfprofd.daemon import exposition as module
    from tfprofd.daemon.exposition import LARGE_PART, Part, deflater, gzip_body

    if isal:
        large_parts = pytest.importorskip("isal.isal_zlib")
    else:  # a machine without the wheel
        monkeypatch.setattr(module, "_isal", lambda: standard)
        large_parts = standard
    assert deflater(LARGE_PART - 1) is standard and deflater(LARGE_PART) is large_parts
    large = b"".join(b'tfprofd_training_up{training_job="job%04d",worker="0"} 1.0\n' % i for i in range(5000))
    assert len(large) >= LARGE_PART
    data = [b"", b"a", large, bytes(range(256)) * 64, large[::-1], b"# EOF\n"]
    zipped = gzip_body([Part(d, 0.0) for d in data])
    member = zlib.decompressobj(31)
    assert member.decompress(zipped) == b"".join(data)
    assert member.eof and member.unused_data == b""
    assert gzip.decompress(zipped) == b"".join(data)  # the trailer's CRC and size checked too


def test_a_rendering_is_deflated_once_ahead_of_the_gzip_scrapes_that_read_it(monkeypatch):
    """With 1,000 jobs a sample renders 2.7 MB, which every gzip scrape deflated again (~4 ms each, in the
    scrape): a part is deflated once, on the sampling thread when gzip scrapes are due, and a scrape only joins
    the segments, however many scrapers (an HA pair of Prometheus servers) and whatever plain scrapers of the same
    format come in between."""
    from prometheus_client.core import GaugeMetricFamily

    from tfprofd.daemon import exposition as module
    from tfprofd.daemon.exposition import OPENMETRICS, Exposition, render

    now, value = [100.0], [0.0]
    exposition = Exposition(clock=lambda: now[0])

    def collect():
        return [GaugeMetricFamily("tfprofd_test", "A gauge.", value=value[0])]

    def scrape(encoding: str = "gzip") -> bytes:
        body, _, used = exposition.body(lambda fmt: [exposition.part("x", fmt, collect, 2.5)],
                                        "application/openmetrics-text", encoding)
        assert used == (encoding or None)
        return gzip.decompress(body) if used else body

    for _ in range(3):  # Prometheus every second, and curl (no gzip) in between: the cadence is learned
        assert scrape() == render(collect(), OPENMETRICS) + b"# EOF\n"
        now[0] += 0.5
        assert scrape("") == render(collect(), OPENMETRICS) + b"# EOF\n"
        now[0] += 0.5
    deflated = []
    compressobj = module.zlib.compressobj
    monkeypatch.setattr(module.zlib, "compressobj", lambda *a: deflated.append(now[0]) or compressobj(*a))
    value[0] = 7.0
    exposition.after_sample("x", collect, interval=1.0)  # the sampling thread renders, and deflates
    assert deflated == [now[0]]
    for _ in range(4):  # two scrapers, twice: nothing deflated again
        assert scrape() == render(collect(), OPENMETRICS) + b"# EOF\n"
    assert deflated == [now[0]]


def test_a_failing_part_leaves_the_rest_of_the_scrape(caplog):
    from tfprofd.daemon import config
    from tfprofd.daemon.agent import Agent

    agent = Agent(config.load(None, env={}))

    def broken():
        raise RuntimeError("boom")

    agent.engine.collect = broken
    families = agent._live()
    assert "tfprofd_gpu_job_info" in {f.name for f in families}
    assert "tfprofd_rule_active" not in {f.name for f in families}
    agent._live()
    assert caplog.text.count("the rules metrics failed") == 1


def _tricky_families():
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily

    gauge = GaugeMetricFamily("tfprofd_test_ratio", 'Help with "quotes", a \\ backslash\nand a newline.',
                              labels=["a", "b"])
    for value in (0, 1, -1, 0.5, 1e-9, 123456789012.0, 2**53, float("inf"), float("-inf"), float("nan"), 3.14e21):
        gauge.add_metric(['x"y\\z\nw', "ünïcode ✓"], value)
    counter = CounterMetricFamily("tfprofd_test", "A counter.", labels=["z", "a"])
    counter.add_metric(["1", "2"], 7)
    histogram = HistogramMetricFamily("tfprofd_test_seconds", "A histogram.", labels=["job"])
    histogram.add_metric(["j"], [("0.001", 1), ("1.0", 5), ("+Inf", 9)], 12.5)
    info = InfoMetricFamily("tfprofd_test_build", "Falls back to the library.", value={"version": "1"})
    return [gauge, counter, histogram, info, GaugeMetricFamily("tfprofd_empty", "No samples.")]


def test_the_fast_renderer_writes_what_prometheus_client_writes(agents, gpus):
    """render() must equal prometheus_client's generate_latest for every family the agent exports."""
    from prometheus_client.parser import text_string_to_metric_families

    from tfprofd.daemon.exposition import OPENMETRICS, TEXT, render, render_library

    agent = agents(env=gpus.env())
    wait_for(lambda: metric_value(agent.scrape(), "tfprofd_rule_active", rule="low_gpu_utilization", gpu="0")
             is not None, 10, message="every collector sampled")
    exported = list(text_string_to_metric_families(agent.scrape()))
    for families in (exported, _tricky_families()):
        for fmt in (TEXT, OPENMETRICS):
            assert render(families, fmt) == render_library(families, fmt), fmt


def test_training_jobs_rendered_job_by_job_read_as_a_full_rendering_through_every_change():
    """The training family is rendered one job at a time and a job's lines kept while it does not change:
    what a scrape reads must stay what prometheus_client writes for the whole state, through reports, a
    job going quiet (no rate), going down, coming back, a new job and an expired one."""
    import json

    from test_core_units import FakeClock

    from tfprofd.daemon.exposition import OPENMETRICS, TEXT, render, render_library
    from tfprofd.exporter.base import Environment
    from tfprofd.exporter.hook import Reporter
    from tfprofd.exporter.training import HookSettings, Sender, TrainingCollector

    clock = FakeClock()
    collector = TrainingCollector(HookSettings(socket="", listen=None, down_after=30, expire_after=100),
                                  Environment(clock=clock))
    reporters = {job: Reporter(job=job, worker="0", profiler=False, addr="127.0.0.1:9") for job in ("a", "b", "c")}
    for r in reporters.values():
        r.phase, r.batch_size = "train", 32
    caches: dict = {TEXT: {}, OPENMETRICS: {}}

    def report(*jobs: str) -> None:
        for job in jobs:
            r = reporters[job]
            r.record(10, 320, 0.2)
            data = r.report()
            data["time"] = clock.wall
            assert collector.receive(json.dumps(data).encode(), Sender(local=False, address="127.0.0.1"))

    def scrape(advance: float) -> str:
        clock.mono += advance
        clock.wall += advance
        collector.sample()
        full = list(collector.collect())
        for fmt in (TEXT, OPENMETRICS):
            assert render(collector.collect(), fmt, caches[fmt]).decode() == render_library(full, fmt).decode(), fmt
        return render_library(full, TEXT).decode()

    try:
        report("a", "b")
        scrape(1)
        report("a", "b")
        text = scrape(1)
        assert metric_value(text, "tfprofd_training_samples_per_second", training_job="b") == 320 / 1
        report("a")
        text = scrape(6)  # b went quiet: no rate, still up
        assert metric_value(text, "tfprofd_training_samples_per_second", training_job="b") is None
        assert metric_value(text, "tfprofd_training_up", training_job="b") == 1
        report("a", "c")
        text = scrape(30)  # b down, c new
        assert metric_value(text, "tfprofd_training_up", training_job="b") == 0
        assert metric_value(text, "tfprofd_training_up", training_job="c") == 1
        report("b")
        text = scrape(1)  # b is back, its counters go on
        assert metric_value(text, "tfprofd_training_steps_total", training_job="b") == 30
        text = scrape(200)  # all quiet past expire_after: every job's series gone
        assert "training_job=" not in text
    finally:
        collector.close()


class _CountedPart:
    """An exposition on a clock of the test's (``now``) with one part, "x", of one gauge, that notes when it is
    rendered (``rendered``): sampled every second, scraped in the text format without gzip."""

    def __init__(self, now: float):
        from tfprofd.daemon.exposition import Exposition

        self.now = now
        self.rendered: list[float] = []
        self.exposition = Exposition(clock=lambda: self.now)

    def collect(self) -> list:
        from prometheus_client.core import GaugeMetricFamily

        self.rendered.append(self.now)
        return [GaugeMetricFamily("tfprofd_test", "A gauge.", value=1)]

    def sample(self) -> None:
        self.exposition.after_sample("x", self.collect, interval=1.0)

    def scrape(self, scraper: str = "10.0.0.1", accept: str = "") -> bool:
        """Scrape as ``scraper``; whether the scrape rendered the part itself."""
        count = len(self.rendered)
        self.exposition.body(lambda fmt: [self.exposition.part("x", fmt, self.collect, 2.5)], accept, "", scraper)
        return len(self.rendered) > count

    def replay(self, events: list[tuple[float, str, str]], watched: set[str], since: float) -> list[tuple[float, str]]:
        """Run (time, scraper, Accept) events in time order, a sample where the scraper is empty: the scrapes by the
        ``watched`` scrapers from ``since`` on that rendered the part themselves."""
        rendered_themselves = []
        for when, scraper, accept in sorted(events):
            self.now = when
            if not scraper:
                self.sample()
            elif self.scrape(scraper, accept) and scraper in watched and when >= since:
                rendered_themselves.append((when, scraper))
        return rendered_themselves


def test_a_burst_of_polls_that_stopped_does_not_keep_the_agent_rendering():
    """A script polling /metrics until the agent answers teaches the exposition a 0.1 s cadence; once the
    polls stop, samples must stop rendering ahead of scrapes that will not come (CPU with nobody scraping)."""
    x = _CountedPart(100.0)
    for _ in range(5):  # polled every 0.1 s
        x.scrape()
        x.now += 0.1
    x.sample()
    assert x.rendered[-1] == x.now  # a poll may still come: rendered ahead
    count = len(x.rendered)
    for _ in range(30):  # nobody polls any more
        x.now += 1.0
        x.sample()
    assert len(x.rendered) - count <= 3  # the cadence lapsed after two periods and 2.5 intervals
    x.scrape()
    assert x.rendered[-1] == x.now  # a scrape that does come still gets a fresh rendering


def test_a_rendering_that_forget_overtook_is_not_served_again():
    """A reload that disables a collector forgets the agent's part while another collector's thread may be
    rendering it from the collectors as they were: that rendering must not be kept, or scrapes serve the gone
    collector's collector_success series for up to an interval more."""
    from prometheus_client.core import GaugeMetricFamily

    from tfprofd.daemon.exposition import TEXT, Exposition

    exposition = Exposition(clock=lambda: 100.0)
    collectors = ["cpu", "disk"]

    def collect():
        family = GaugeMetricFamily("tfprofd_collector_success", "Success.", labels=["collector"])
        for name in list(collectors):
            family.add_metric([name], 1.0)
            if name == "disk" and len(collectors) == 2:  # the reload lands while this rendering runs
                collectors.remove("disk")
                exposition.forget("agent")
        return [family]

    assert b'collector="disk"' in exposition.part("agent", TEXT, collect, 10.0).bytes  # this scrape's own snapshot
    assert b'collector="disk"' not in exposition.part("agent", TEXT, collect, 10.0).bytes


@pytest.mark.parametrize("phase", [i / 20 for i in range(20)])
@pytest.mark.parametrize("early", [0.0, 1.0])
def test_a_scrape_on_its_cadence_or_an_interval_early_finds_a_part_rendered_ahead(early, phase):
    """Prometheus every 15 s, sampling every second: whatever the samples' phase against the scrapes, a scrape that
    comes on time or up to an interval early (jitter, a replica of an HA pair, a late sample) is served what a sample
    rendered ahead of it, not made to render 1,000 jobs itself (~20 ms), and the samples render at most three times
    for it (rendering every sample would cost 15)."""
    x = _CountedPart(1000.0)
    for _ in range(4):  # the cadence is learned
        x.scrape()
        x.now += 15.0
    start, count = x.now - 15.0, len(x.rendered)
    for second in range(15):  # the samples up to the scrape
        if second + phase < 15.0 - early:
            x.now = start + second + phase
            x.sample()
    x.now = start + 15.0 - early
    ahead = len(x.rendered) - count
    x.scrape()
    assert len(x.rendered) - count == ahead, x.rendered[count:]  # served what a sample rendered
    assert 1 <= ahead <= 3, x.rendered[count:]


@pytest.mark.parametrize("phase", [0.0, 0.3, 0.7])
@pytest.mark.parametrize("offset", [0.5, 1.0, 2.0, 4.0, 6.0, 7.5, 9.0, 11.0, 13.0, 14.5])
def test_each_replica_of_an_ha_pair_finds_a_part_rendered_ahead(offset, phase):
    """Two Prometheus replicas scrape every 15 s, ``offset`` seconds apart, sampling every second: each replica's
    scrapes are served what a sample rendered ahead of them (none renders 1,000 jobs itself, ~20 ms), and the samples
    render at most three times a replica (a cadence learned from both replicas' scrapes at once made half of one
    replica's scrapes render themselves where they came close together, and rendered up to 11 times in 15 s)."""
    x = _CountedPart(1000.0)
    known = x.now + 15.0 * 4  # after four scrapes each, the cadences are known
    events = ([(x.now + 15.0 * k, "10.0.0.1", "") for k in range(14)]
              + [(x.now + 15.0 * k + offset, "10.0.0.2", "") for k in range(14)]
              + [(x.now + second + phase, "", "") for second in range(14 * 15)])
    assert not x.replay(events, {"10.0.0.1", "10.0.0.2"}, since=known)
    assert sum(when > known for when in x.rendered) <= 2 * 3 * 10  # ten periods of 15 s after the first four


def _every(period: float, first: float, count: int) -> list[float]:
    return [first + period * k for k in range(count)]


@pytest.mark.parametrize("arrives", [0.0, 15.0])
@pytest.mark.parametrize("crowd", ["20 pollers every 15 s", "15 health checks every 5 s", "1,000 one-off polls"])
def test_a_crowd_of_other_scrapers_does_not_push_prometheus_out(crowd, arrives):
    """Past MAX_SCRAPERS (16) addresses, the cadences learned must not push each other out: an HA pair of Prometheus
    (OpenMetrics every 15 s, 6 s apart, from the start or after the crowd) keeps finding parts rendered ahead beside a
    crowd of other scrapers (load balancers' health checks, people's curls, a hostile network; text). Evicting the
    least recent made each new address push out one that had not scraped twice yet: 17 scrapers taking turns, and
    every scrape rendered itself; evicting the newest with no cadence yet did so for a pair that came last."""
    om = "application/openmetrics-text;version=1.0.0"
    x = _CountedPart(1000.0)
    start, seconds = x.now, 40 * 15
    if crowd == "20 pollers every 15 s":
        others = [(f"35.191.0.{i}", t) for i in range(20) for t in _every(15.0, 0.7 * i, 40)]
    elif crowd == "15 health checks every 5 s":
        others = [(f"35.191.0.{i}", t) for i in range(15) for t in _every(5.0, 0.3 * i, 120)]
    else:
        others = [(f"198.51.{i // 256}.{i % 256}", 5.0 + 0.5 * i) for i in range(1000)]
    events = ([(start + t, scraper, "") for scraper, t in others if t < seconds]
              + [(start + t, "10.0.0.1", om) for t in _every(15.0, arrives, 38)]
              + [(start + t, "10.0.0.2", om) for t in _every(15.0, arrives + 6.0, 38)]
              + [(start + second + 0.3, "", "") for second in range(seconds)])
    assert not x.replay(events, {"10.0.0.1", "10.0.0.2"}, since=start + arrives + 60.0)
