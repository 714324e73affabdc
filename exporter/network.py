"""Network collector: per-interface bytes, packets, errors and drops, and link speed."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import psutil
from prometheus_client.core import Metric

from .base import Collector, Signals, counter, gauge
from .options import option, parse_bool, parse_regex

DEFAULT_EXCLUDE = r"^(lo|veth.*|cali.*|flannel.*|cni.*|docker\d+|br-.*|virbr.*)$"

_COLUMNS = (
    ("bytes_recv", "network_receive_bytes", "Total bytes received on the interface."),
    ("bytes_sent", "network_transmit_bytes", "Total bytes transmitted on the interface."),
    ("packets_recv", "network_receive_packets", "Total packets received on the interface."),
    ("packets_sent", "network_transmit_packets", "Total packets transmitted on the interface."),
    ("errin", "network_receive_errors", "Total receive errors on the interface."),
    ("errout", "network_transmit_errors", "Total transmit errors on the interface."),
    ("dropin", "network_receive_drops", "Total received packets dropped on the interface."),
    ("dropout", "network_transmit_drops", "Total transmitted packets dropped on the interface."),
)


def parse_speed(text: str) -> float | None:
    """Link speed in bytes/s from /sys/class/net/<if>/speed (Mbit/s; -1 or empty when unknown)."""
    try:
        mbits = int(text.strip())
    except ValueError:
        return None
    return mbits * 1_000_000 / 8 if mbits > 0 else None


@dataclass
class NetworkSample:
    counters: dict[str, dict[str, int]]
    speed: dict[str, float]
    monotonic: float
    utilization: dict[str, tuple[float, float]]  # receive, transmit as fractions of the link speed


def link_utilization(previous: NetworkSample, counters: dict[str, dict[str, int]], speed: dict[str, float],
                     now: float) -> dict[str, tuple[float, float]]:
    """(receive, transmit) bytes/s over the link speed between two samples, for interfaces with a speed."""
    elapsed = now - previous.monotonic
    if elapsed <= 0:
        return previous.utilization
    out = {}
    for dev, c in counters.items():
        before = previous.counters.get(dev)
        if before is None or dev not in speed:
            continue
        rx = max(c["bytes_recv"] - before["bytes_recv"], 0) / elapsed
        tx = max(c["bytes_sent"] - before["bytes_sent"], 0) / elapsed
        out[dev] = (rx / speed[dev], tx / speed[dev])
    return out


@dataclass(frozen=True)
class NetworkSettings:
    enabled: bool = option(True, parse_bool, "Export per-interface network traffic.")
    device_exclude: re.Pattern[str] = option(re.compile(DEFAULT_EXCLUDE), parse_regex,
                                             "Interfaces to skip (loopback and container veths by default).")


class NetworkCollector(Collector):
    name = "network"
    never_blocks = True
    section = "collectors.network"
    Settings = NetworkSettings
    signals: ClassVar[dict[str, tuple[str, ...]]] = {
        "network_receive_utilization": ("device",),
        "network_transmit_utilization": ("device",),
    }
    latest: NetworkSample | None = None

    def clear(self) -> None:
        self.latest = None

    def rule_signals(self) -> Signals:
        s = self.latest
        if s is None:
            return {}
        return {"network_receive_utilization": [({"device": d}, u[0]) for d, u in s.utilization.items()],
                "network_transmit_utilization": [({"device": d}, u[1]) for d, u in s.utilization.items()]}

    def sample(self) -> bool:
        counters = {
            name: c._asdict() for name, c in sorted(psutil.net_io_counters(pernic=True, nowrap=True).items())
            if not self.settings.device_exclude.match(name)
        }
        speed = {}
        for name in counters:
            text = self.env.paths.read_sys(f"class/net/{name}/speed")
            value = parse_speed(text) if text else None
            if value:
                speed[name] = value
        now = self.env.clock.monotonic()
        utilization = link_utilization(self.latest, counters, speed, now) if self.latest else {}
        self.latest = NetworkSample(counters, speed, now, utilization)
        return True

    def collect(self) -> Iterator[Metric]:
        s = self.latest
        if s is None:
            return
        for field, name, documentation in _COLUMNS:
            yield counter(name, documentation, ["device"],
                          (((dev,), c[field]) for dev, c in s.counters.items()))
        yield gauge("network_speed_bytes", "Link speed of the interface in bytes per second.", ["device"],
                    (((dev,), v) for dev, v in s.speed.items()))
