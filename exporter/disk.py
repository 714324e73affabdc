"""Disk collector: per-disk bytes read and written, operations, busy time, and I/O pressure."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
from prometheus_client.core import Metric

from .base import Collector, counter, emit_pressure, pressure_families
from .options import option, parse_bool, parse_regex

DEFAULT_EXCLUDE = r"^(z?ram|loop|fd|(h|s|v|xv)d[a-z]|nvme\d+n\d+p)\d+$"


@dataclass
class DiskSample:
    devices: dict[str, tuple[int, int, int, int, float]]  # read bytes, written bytes, reads, writes, busy s
    pressure: list[tuple[str, float]]


@dataclass(frozen=True)
class DiskSettings:
    enabled: bool = option(True, parse_bool, "Export per-disk I/O and I/O pressure.")
    device_exclude: re.Pattern[str] = option(re.compile(DEFAULT_EXCLUDE), parse_regex,
                                             "Disks to skip (partitions and loop devices by default, as "
                                             "node_exporter).")


class DiskCollector(Collector):
    name = "disk"
    never_blocks = True
    section = "collectors.disk"
    Settings = DiskSettings
    latest: DiskSample | None = None

    def clear(self) -> None:
        self.latest = None

    def sample(self) -> bool:
        counters = psutil.disk_io_counters(perdisk=True, nowrap=True) or {}
        devices = {
            name: (c.read_bytes, c.write_bytes, c.read_count, c.write_count, c.busy_time / 1000.0)
            for name, c in sorted(counters.items())
            if not self.settings.device_exclude.match(name)
        }
        self.latest = DiskSample(devices, pressure_families(self.env.paths, "io"))
        return True

    def collect(self) -> Iterator[Metric]:
        s = self.latest
        if s is None:
            return
        columns = (
            ("disk_read_bytes", "Total bytes read from the disk."),
            ("disk_written_bytes", "Total bytes written to the disk."),
            ("disk_reads_completed", "Total reads completed on the disk."),
            ("disk_writes_completed", "Total writes completed on the disk."),
            ("disk_io_time_seconds", "Total seconds the disk spent doing I/O (busy time)."),
        )
        for index, (name, documentation) in enumerate(columns):
            yield counter(name, documentation, ["device"],
                          (((dev,), values[index]) for dev, values in s.devices.items()))
        yield from emit_pressure("io", s.pressure)
