"""The scrape survives a collector whose collect() raises."""

from __future__ import annotations

from tfprofd.daemon import config
from tfprofd.daemon.agent import Agent


def test_a_failing_rules_collector_leaves_the_rest_of_the_scrape(caplog):
    agent = Agent(config.load(None, env={}))

    def broken():
        raise RuntimeError("boom")

    agent.rules.collect = broken
    text = agent.exposition().decode()
    assert "tfprofd_build_info" in text
    assert "tfprofd_rule_active" not in text
    assert "collector rules failed to render metrics" in caplog.text
