"""The scrape: content negotiation and gzip as prometheus_client does them, and a scrape that survives a
part of the agent whose metrics fail."""

from __future__ import annotations

import gzip
import http.client

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
