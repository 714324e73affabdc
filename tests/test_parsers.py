"""Pure parsers and the host collectors, on the fixture files under tests/fixtures."""

from __future__ import annotations

import re
from ipaddress import ip_address
from pathlib import Path

import psutil
import pytest

from tfprofd.exporter.base import Environment, HostPaths, parse_pressure
from tfprofd.exporter.cpu import CpuCollector, CpuSettings, busy_ratios, parse_loadavg
from tfprofd.exporter.disk import DiskCollector, DiskSettings
from tfprofd.exporter.memory import MemoryCollector, MemorySettings
from tfprofd.exporter.network import NetworkCollector, NetworkSettings, parse_speed
from tfprofd.exporter.training import listener_uids, parse_proc_net, pid_uids, sender_uids

from helpers import FIXTURES

ENV = Environment(HostPaths(FIXTURES / "proc", FIXTURES / "sys"))


@pytest.fixture(autouse=True)
def fixture_procfs(monkeypatch):
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(FIXTURES / "proc"))


def families(collector) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in collector.collect():
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_parse_pressure_reads_totals_in_seconds():
    text = (FIXTURES / "proc/pressure/io").read_text()
    assert parse_pressure(text) == {"some": 98.765432, "full": 87.654321}


def test_parse_pressure_ignores_kernels_without_full_line():
    assert parse_pressure("some avg10=0.00 avg60=0.00 avg300=0.00 total=5000000\n") == {"some": 5.0}


def test_parse_loadavg():
    assert parse_loadavg((FIXTURES / "proc/loadavg").read_text()) == (1.25, 0.98, 0.77)


def test_busy_ratios_counts_all_but_idle_and_iowait():
    before = dict.fromkeys(("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"), 0.0)
    after = {**before, "user": 3.0, "system": 1.0, "idle": 4.0, "iowait": 2.0}
    assert busy_ratios(before, after) == (0.4, 0.2)
    assert busy_ratios(after, after) is None


@pytest.mark.parametrize(("text", "expected"), [("25000\n", 25e9 / 8), ("-1\n", None), ("", None)])
def test_parse_speed(text, expected):
    assert parse_speed(text) == expected


def test_cpu_collector_sums_modes_over_cpus():
    cpu = CpuCollector(CpuSettings(), ENV)
    assert cpu.sample()
    got = families(cpu)
    ticks = psutil._pslinux.CLOCK_TICKS
    assert got["tfprofd_cpu_seconds_total"][(("mode", "user"),)] == pytest.approx(
        (1393280 + 1335257 + 3713845 + 3689771) / ticks)
    assert got["tfprofd_cpus"][()] == 4
    assert got["tfprofd_load1"][()] == 1.25
    assert got["tfprofd_pressure_cpu_waiting_seconds_total"][()] == pytest.approx(123.456789)
    # One sample gives no interval yet, so no utilization ratio rather than a made-up one.
    assert "tfprofd_cpu_utilization_ratio" not in got


def test_memory_collector_follows_free():
    mem = MemoryCollector(MemorySettings(), ENV)
    mem.sample()
    got = families(mem)
    assert got["tfprofd_memory_total_bytes"][()] == 65773892 * 1024
    assert got["tfprofd_memory_available_bytes"][()] == 40214876 * 1024
    assert got["tfprofd_pressure_memory_stalled_seconds_total"][()] == pytest.approx(1.234567)


def test_disk_collector_skips_partitions_and_loop_devices():
    disk = DiskCollector(DiskSettings(), ENV)
    disk.sample()
    got = families(disk)
    read = got["tfprofd_disk_read_bytes_total"]
    assert {dict(k)["device"] for k in read} == {"nvme0n1", "sda"}
    assert read[(("device", "nvme0n1"),)] == 987654321 * 512
    assert got["tfprofd_disk_io_time_seconds_total"][(("device", "sda"),)] == 34.567


def test_network_collector_excludes_loopback_and_veth_and_reads_speed():
    net = NetworkCollector(NetworkSettings(device_exclude=re.compile(r"^(lo|veth.*)$")), ENV)
    net.sample()
    got = families(net)
    rx = got["tfprofd_network_receive_bytes_total"]
    assert {dict(k)["device"] for k in rx} == {"eth0", "ib0"}
    assert rx[(("device", "eth0"),)] == 98765432109
    assert got["tfprofd_network_receive_drops_total"][(("device", "eth0"),)] == 12
    assert got["tfprofd_network_speed_bytes"][(("device", "ib0"),)] == 100000 * 1e6 / 8


def test_missing_pressure_files_mean_no_pressure_series(tmp_path: Path):
    (tmp_path / "loadavg").write_text("0.5 0.4 0.3 1/2 3\n")
    cpu = CpuCollector(CpuSettings(), Environment(HostPaths(tmp_path, tmp_path)))
    cpu.sample()
    assert "tfprofd_pressure_cpu_waiting_seconds_total" not in families(cpu)


# ---- /proc/net/{udp,tcp}: who owns a hook report's source port and a profiler's port ----

def _proc_net(name: str) -> list:
    return parse_proc_net((FIXTURES / "proc" / "net" / name).read_text())


def test_proc_net_udp_names_each_sending_sockets_owner():
    udp = _proc_net("udp") + _proc_net("udp6")
    assert len(udp) == 5
    loopback = ip_address("127.0.0.1")
    assert sender_uids(udp, loopback, 38272) == {65534}  # nobody's unbound socket that sent (0.0.0.0)
    assert sender_uids(udp, loopback, 41000) == {0}  # bound to 127.0.0.1
    assert sender_uids(udp, ip_address("10.0.0.5"), 41000) == set()  # bound to loopback only
    assert sender_uids(udp, ip_address("10.0.0.5"), 41002) == {0}  # [::] has every address
    assert sender_uids(udp, ip_address("::1"), 41003) == {0}
    assert sender_uids(udp, loopback, 41003) == set()
    assert sender_uids(udp, loopback, 1) == set()
    text = (FIXTURES / "proc" / "net" / "udp").read_text()
    assert [(str(s.address), s.port, s.uid) for s in parse_proc_net(text, 41000)] == [("127.0.0.1", 41000, 0)]


def test_proc_net_tcp_names_each_listening_ports_owner():
    tcp = _proc_net("tcp") + _proc_net("tcp6")
    loopback = ip_address("127.0.0.1")
    assert len(tcp) == 7  # the line that is not a socket is skipped
    assert listener_uids(tcp, loopback, 41010) == {0}  # listening; its connected sockets do not count
    assert listener_uids(tcp, loopback, 41011) == {0}  # [::]
    assert listener_uids(tcp, loopback, 41012) == {65534}  # 0.0.0.0
    assert listener_uids(tcp, loopback, 41013) == set() and listener_uids(tcp, ip_address("::1"), 41013) == {65534}
    assert listener_uids(tcp, loopback, 41014) == {1000}  # ::ffff:127.0.0.1
    assert listener_uids(tcp, loopback, 47198) == set()  # 0xB85E: a connection's port, not a listener


def test_proc_pid_status_gives_real_and_effective_uid():
    assert pid_uids("Name:\tpython\nUid:\t1000\t0\t0\t0\nGid:\t1000\t1000\t1000\t1000\n") == {1000, 0}
    assert pid_uids("Name:\tpython\n") is None and pid_uids(None) is None
