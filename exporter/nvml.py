"""GPU collector through NVML (``pynvml`` from nvidia-ml-py): one series set per GPU, labelled gpu and uuid.

A host without a driver is not an error for the agent: the collector says so once, exports
``tfprofd_gpus 0`` and retries initialization now and then. A GPU that fails or disappears is
skipped (and the collector's success reads 0) while the others keep being exported.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar, TypeVar

from prometheus_client.core import Metric

from .base import Collector, Environment, Signals, counter, gauge
from .options import option, parse_bool, parse_duration

log = logging.getLogger("tfprofd.nvml")
T = TypeVar("T")

# nvmlClocksEventReasons bits (nvml.h), named as node_exporter-style label values.
CLOCK_EVENT_REASONS = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1
NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
NVML_AGGREGATE_ECC = 1
NVML_ERROR_UNINITIALIZED, NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_SUPPORTED = 1, 2, 3
NVML_ERROR_NOT_FOUND, NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_TIMEOUT = 6, 9, 10
NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_GPU_IS_LOST = 13, 15
XID_CRITICAL_ERROR_EVENT = 0x8
# Errors that mean NVML itself must be initialized again (a driver reload invalidates every handle).
REINIT_ERRORS = (NVML_ERROR_UNINITIALIZED, NVML_ERROR_DRIVER_NOT_LOADED)
# Errors that take a whole GPU down: its handle no longer answers anything.
GPU_ERRORS = (*REINIT_ERRORS, NVML_ERROR_GPU_IS_LOST)
ABSENT = (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND)

# GPM metrics (nvmlGpmMetricId_t), Hopper and newer: our name and the metric id; values are percent. Not
# NVML_GPM_METRIC_GRAPHICS_UTIL (1): on an H100 it cost 1.94 ms of CPU per GPU and sample, these four together
# 0.09 ms, and it says what gpu_utilization_ratio says (an engine was busy).
GPM_METRICS = (("sm_activity", 2), ("sm_occupancy", 3), ("tensor_activity", 5), ("dram_bandwidth_utilization", 10))
GPM_METRICS_GET_VERSION = 1
# Field ids (nvmlFieldValue_t) read in one nvmlDeviceGetFieldValues call per GPU.
FI_NVLINK_ERRORS = (("crc_flit", 38), ("crc_data", 45), ("replay", 52), ("recovery", 59))
FI_NVLINK_THROUGHPUT_DATA_TX, FI_NVLINK_THROUGHPUT_DATA_RX = 138, 139  # KiB, scope: the link
FI_GPU_RECOVERY_ACTION = 230
NVLINK_MAX_LINKS = 36
RECOVERY_ACTIONS = ("none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset")
MIG_NO_INSTANCE = 0xFFFFFFFF


@dataclass
class GpuSample:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    minor: int | None = None  # of /dev/nvidiaN, which Kubernetes DRA drivers name GPUs by
    utilization: float | None = None
    memory_utilization: float | None = None
    memory_used: int | None = None
    memory_total: int | None = None
    temperature: float | None = None
    power_watts: float | None = None
    energy_joules: float | None = None
    sm_clock_hz: float | None = None
    memory_clock_hz: float | None = None
    clock_event_reasons: int | None = None
    pcie_tx: float | None = None
    pcie_rx: float | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    processes: list[tuple[int, int, int | None]] = field(default_factory=list)  # pid, bytes, MIG GPU instance
    gpm: dict[str, float] = field(default_factory=dict)  # GPM metric -> ratio over the last interval
    mig_mode: int | None = None
    migs: list[MigSample] = field(default_factory=list)
    remapped_rows: tuple[int, int, int, int] | None = None  # correctable, uncorrectable, pending, failed
    retired_pages: tuple[int, int, int] | None = None  # single-bit, double-bit, pending
    recovery_action: int | None = None
    nvlinks: list[tuple[int, bool, float | None, float | None]] = field(default_factory=list)  # link, up, tx, rx
    nvlink_errors: dict[str, int] = field(default_factory=dict)


@dataclass
class MigSample:
    """One MIG device (a compute instance inside a GPU instance) of a GPU in MIG mode."""

    gpu_instance_id: int
    compute_instance_id: int
    uuid: str
    profile: str
    memory_used: int | None = None
    memory_total: int | None = None
    gpm: dict[str, float] = field(default_factory=dict)  # of its GPU instance


@dataclass(frozen=True)
class GpuProcesses:
    """The processes NVML lists on each GPU: (gpu label, uuid, pids) per GPU it could read, the GPU
    each MIG device belongs to: (MIG UUID, gpu label), and each GPU's minor number: (minor, gpu label)."""

    gpus: tuple[tuple[str, str, frozenset[int]], ...]
    mig_parents: tuple[tuple[str, str], ...] = ()
    minors: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class NvmlSettings:
    enabled: bool = option(True, parse_bool, "Export GPU metrics through NVML.")
    pcie_interval: float = option(10.0, parse_duration, "How often to sample PCIe throughput (each read costs "
                                  "~20 ms per GPU and direction).", minimum=1, maximum=3600)
    slow_interval: float = option(10.0, parse_duration, "How often to re-read the GPU's total energy (each read "
                                  "costs 3-4 ms of CPU per GPU on an H100; the counter keeps its last value in "
                                  "between) and its MIG mode (0.5 ms).", minimum=1, maximum=3600)
    retry_interval: float = option(60.0, parse_duration, "How often to retry NVML initialization when no "
                                   "driver was found.", minimum=1, maximum=86400)


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class NvmlCollector(Collector):
    name = "nvml"
    section = "collectors.nvml"
    Settings = NvmlSettings
    signals: ClassVar[dict[str, tuple[str, ...]]] = {
        "gpu_utilization": ("gpu",), "gpu_memory_used_ratio": ("gpu",),
        "sm_activity": ("gpu", "gpu_instance_id"),  # GPM; gpu_instance_id "" for a whole GPU
    }

    def __init__(self, settings: NvmlSettings, env: Environment):
        super().__init__(settings, env)
        self.clock = env.clock
        self._nvml: ModuleType | None = env.nvml
        self._initialized = False
        self._next_init_attempt = 0.0
        self._last_reinit = float("-inf")
        self._unavailable_reason: str | None = None
        self._slow: dict[tuple[str, str], tuple[float, Any]] = {}  # (uuid, reading) -> (when read, value)
        self._xid = XidWatcher(self)
        self._failing_gpus: set[int] = set()
        self._uuids: dict[int, str] = {}  # the last UUID each index answered with: gpu_up outlives the GPU
        self._gpm = GpmSampler(self)
        self._nvlinks: dict[str, tuple[int, ...]] = {}  # uuid -> the links NVML knows on it
        self._errors: dict[tuple[str, str], int] = {}  # (call, error) -> optional reads that failed
        self.error_counts: tuple[tuple[tuple[str, str], int], ...] = ()  # _errors as the last sample left it
        self._logged: set[tuple[int, str, str]] = set()
        self._mig_warned: set[str] = set()
        self._gpu = -1  # the GPU being sampled, for messages
        self.driver_version = ""
        self.count = 0
        self.gpus: list[GpuSample] = []
        self.down: list[tuple[int, str]] = []  # GPUs that did not answer this sample: (index, last uuid)

    @property
    def nvml(self) -> ModuleType:
        if self._nvml is None:
            import pynvml

            self._nvml = pynvml
        return self._nvml

    def _ensure_initialized(self) -> bool:
        if self._initialized:
            return True
        now = self.clock.monotonic()
        if now < self._next_init_attempt:
            return False
        self._next_init_attempt = now + self.settings.retry_interval
        try:
            self.nvml.nvmlInit()
            self.driver_version = _text(self.nvml.nvmlSystemGetDriverVersion())
        except self.nvml.NVMLError as exc:
            reason = f"{exc}"
            if reason != self._unavailable_reason:
                log.warning("no GPU metrics: NVML unavailable (%s); is the NVIDIA driver installed? "
                            "Retrying every %gs; every other collector keeps working", reason,
                            self.settings.retry_interval)
                self._unavailable_reason = reason
            return False
        self._initialized = True
        self._unavailable_reason = None
        log.info("NVML initialized, driver %s", self.driver_version)
        self._xid.start()
        return True

    def _reinitialize(self, why: str) -> None:
        """Drop NVML and every handle or sample made through it; the next sample initializes it again (at
        once, unless the last re-initialization was under retry_interval ago and did not help)."""
        log.warning("NVML re-initialized: %s", why)
        self._release()
        now = self.clock.monotonic()
        recent = now - self._last_reinit < self.settings.retry_interval
        self._next_init_attempt = now + self.settings.retry_interval if recent else now
        self._last_reinit = now

    def _release(self) -> None:
        self._xid.stop()
        self._gpm.free()
        self._nvlinks.clear()
        if self._initialized:
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError:
                pass
            self._initialized = False

    def sample(self) -> bool:
        if not self._ensure_initialized():
            self.count, self.gpus, self.down = 0, [], []
            return False
        nvml = self.nvml
        try:
            self.count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            self.count, self.gpus, self.down = 0, [], []
            self._reinitialize(f"NVML could not count GPUs: {exc}")
            return False
        gpus, down, reinit = [], [], None
        for index in range(self.count):
            self._gpu = index
            try:
                gpu = self._sample_gpu(index)
            except nvml.NVMLError as exc:
                down.append((index, self._uuids.get(index, "")))
                if getattr(exc, "value", None) in REINIT_ERRORS:
                    reinit = f"GPU {index}: {exc}"
                if index not in self._failing_gpus:
                    self._failing_gpus.add(index)
                    log.warning("GPU %d (%s) does not answer: NVML error: %s; its series are not exported and "
                                "tfprofd_gpu_up reads 0", index, self._uuids.get(index, "uuid unknown"), exc)
                continue
            gpus.append(gpu)
            self._uuids[index] = gpu.uuid
            if index in self._failing_gpus:
                self._failing_gpus.discard(index)
                log.info("GPU %d answers again", index)
        self.gpus, self.down = gpus, down
        self.error_counts = tuple(sorted(self._errors.items()))  # a scrape never iterates a dict being changed
        if reinit is None and down and not gpus:
            reinit = "no GPU answers"
        if reinit is not None:
            self._reinitialize(reinit)
        return not down

    def _optional(self, call: str, read: Callable[[], T]) -> T | None:
        """A reading the GPU may not have: None where NVML does not support it, or where it fails in a way
        that leaves the GPU working (e.g. NO_PERMISSION in a container), counted and logged once."""
        try:
            return read()
        except self.nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in ABSENT:
                return None
            if code in GPU_ERRORS:
                raise
            error = _error_name(self.nvml, code)
            self._errors[(call, error)] = self._errors.get((call, error), 0) + 1
            if (self._gpu, call, error) not in self._logged:
                self._logged.add((self._gpu, call, error))
                log.warning("GPU %d: %s failed (%s); that reading is left out, the GPU's others are exported",
                            self._gpu, call, exc)
            return None

    def _sample_gpu(self, index: int) -> GpuSample:
        nvml = self.nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        gpu = GpuSample(
            index=index,
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            name=_text(nvml.nvmlDeviceGetName(handle)),
            pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(handle).busId),
        )
        opt = self._optional
        gpu.minor = opt("minor_number", lambda: nvml.nvmlDeviceGetMinorNumber(handle))
        rates = opt("utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        if rates is not None:
            gpu.utilization, gpu.memory_utilization = rates.gpu / 100.0, rates.memory / 100.0
        memory = opt("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        if memory is not None:
            gpu.memory_used, gpu.memory_total = memory.used, memory.total
        gpu.temperature = opt("temperature", lambda: nvml.nvmlDeviceGetTemperature(handle, NVML_TEMPERATURE_GPU))
        gpu.power_watts = opt("power", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
        gpu.energy_joules = self._slowly(gpu.uuid, "energy", self.settings.slow_interval, lambda: opt(
            "energy", lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0))
        gpu.sm_clock_hz = opt("clocks", lambda: nvml.nvmlDeviceGetClockInfo(handle, NVML_CLOCK_SM) * 1e6)
        gpu.memory_clock_hz = opt("clocks", lambda: nvml.nvmlDeviceGetClockInfo(handle, NVML_CLOCK_MEM) * 1e6)
        gpu.clock_event_reasons = opt("clocks_event_reasons",
                                      lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
        gpu.ecc_corrected = opt("ecc", lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_AGGREGATE_ECC))
        gpu.ecc_uncorrected = opt("ecc", lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_AGGREGATE_ECC))
        gpu.pcie_tx, gpu.pcie_rx = self._pcie(gpu.uuid, handle)
        processes = opt("processes", lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle)) or []
        gpu.processes = [(p.pid, p.usedGpuMemory or 0, _instance(getattr(p, "gpuInstanceId", None)))
                         for p in processes]
        gpu.remapped_rows = opt("remapped_rows", lambda: nvml.nvmlDeviceGetRemappedRows(handle))
        if gpu.remapped_rows is None:  # before Ampere: pages are retired instead
            gpu.retired_pages = self._retired_pages(handle)
        self._sample_mig(gpu, handle)
        self._sample_fields(gpu, handle)
        gpu.gpm = self._gpm.read((gpu.uuid, None), handle) or {}
        for gi, mig in _first_of_instances(gpu).items():
            mig.gpm = self._gpm.read((gpu.uuid, gi), handle) or {}
        if gpu.mig_mode == 1 and not self._gpm.supported(gpu.uuid) and gpu.uuid not in self._mig_warned:
            self._mig_warned.add(gpu.uuid)
            log.warning("GPU %d is in MIG mode: NVML reports no utilization for it or its instances and this GPU "
                        "has no GPM (Hopper and newer), so the gpu_utilization and sm_activity rules cannot watch "
                        "it; its MIG instances' memory is exported", index)
        return gpu

    def _retired_pages(self, handle: object) -> tuple[int, int, int] | None:
        nvml = self.nvml
        single = self._optional("retired_pages", lambda: len(nvml.nvmlDeviceGetRetiredPages(handle, 0)))
        double = self._optional("retired_pages", lambda: len(nvml.nvmlDeviceGetRetiredPages(handle, 1)))
        pending = self._optional("retired_pages", lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
        if single is None or double is None:
            return None
        return single, double, int(pending or 0)

    def _sample_mig(self, gpu: GpuSample, handle: object) -> None:
        """The GPU's MIG mode and, in MIG mode, its MIG devices."""
        nvml = self.nvml
        mode = self._slowly(gpu.uuid, "mig_mode", self.settings.slow_interval,
                            lambda: self._optional("mig", lambda: nvml.nvmlDeviceGetMigMode(handle)))
        gpu.mig_mode = mode[0] if mode is not None else None
        if gpu.mig_mode != 1:
            return
        for slot in range(self._optional("mig", lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(handle)) or 0):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) in GPU_ERRORS:
                    raise
                continue  # an empty slot answers NOT_FOUND
            sample = self._optional("mig", lambda m=mig: MigSample(
                nvml.nvmlDeviceGetGpuInstanceId(m), nvml.nvmlDeviceGetComputeInstanceId(m),
                _text(nvml.nvmlDeviceGetUUID(m)), _mig_profile(_text(nvml.nvmlDeviceGetName(m)))))
            if sample is None:
                continue
            memory = self._optional("memory", lambda m=mig: nvml.nvmlDeviceGetMemoryInfo(m))
            if memory is not None:
                sample.memory_used, sample.memory_total = memory.used, memory.total
            gpu.migs.append(sample)

    def _sample_fields(self, gpu: GpuSample, handle: object) -> None:
        """NVLink state, throughput and errors, and the recovery action, in one field-values call."""
        nvml = self.nvml
        links = self._nvlinks.get(gpu.uuid)
        if links is None:
            links = self._nvlinks[gpu.uuid] = self._discover_links(handle)
        up = {link: self._optional("nvlink", lambda lk=link: nvml.nvmlDeviceGetNvLinkState(handle, lk))
              for link in links}
        ids: list[int | tuple[int, int]] = [FI_GPU_RECOVERY_ACTION]
        if links:
            ids += [fid for _, fid in FI_NVLINK_ERRORS]
            ids += [(fid, link) for link in links for fid in (FI_NVLINK_THROUGHPUT_DATA_TX,
                                                              FI_NVLINK_THROUGHPUT_DATA_RX)]
        values = self._optional("field_values", lambda: nvml.nvmlDeviceGetFieldValues(handle, ids))
        read = dict(zip(ids, _field_values(values), strict=True)) if values is not None else {}
        action = read.get(FI_GPU_RECOVERY_ACTION)
        gpu.recovery_action = int(action) if action is not None else None
        gpu.nvlink_errors = {name: int(read[fid]) for name, fid in FI_NVLINK_ERRORS if read.get(fid) is not None}
        for link in links:
            tx, rx = read.get((FI_NVLINK_THROUGHPUT_DATA_TX, link)), read.get((FI_NVLINK_THROUGHPUT_DATA_RX, link))
            gpu.nvlinks.append((link, bool(up[link]), tx * 1024.0 if tx is not None else None,
                                rx * 1024.0 if rx is not None else None))

    def _discover_links(self, handle: object) -> tuple[int, ...]:
        """The NVLinks the GPU has (read once per GPU and initialization: links do not come and go)."""
        found = []
        for link in range(NVLINK_MAX_LINKS):
            try:
                self.nvml.nvmlDeviceGetNvLinkState(handle, link)
            except self.nvml.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code in GPU_ERRORS:
                    raise
                if link == 0 and code in ABSENT:
                    break  # no NVLink on this GPU
                continue
            found.append(link)
        return tuple(found)

    def _pcie(self, uuid: str, handle: object) -> tuple[float | None, float | None]:
        """PCIe throughput in bytes/s, re-read only every pcie_interval: each read blocks ~20 ms."""
        nvml = self.nvml

        def read() -> tuple[float | None, float | None]:
            opt = self._optional
            return (opt("pcie", lambda: nvml.nvmlDeviceGetPcieThroughput(handle, NVML_PCIE_UTIL_TX_BYTES) * 1024.0),
                    opt("pcie", lambda: nvml.nvmlDeviceGetPcieThroughput(handle, NVML_PCIE_UTIL_RX_BYTES) * 1024.0))

        return self._slowly(uuid, "pcie", self.settings.pcie_interval, read)

    def _slowly(self, uuid: str, reading: str, interval: float, read: Callable[[], T]) -> T:
        """``read()`` for this GPU and reading at most every ``interval`` seconds; its last value in between."""
        now = self.clock.monotonic()
        last = self._slow.get((uuid, reading))
        if last is not None and now - last[0] < interval:
            return last[1]
        value = read()
        self._slow[(uuid, reading)] = (now, value)
        return value

    def clear(self) -> None:
        self.gpus, self.down = [], []

    def rule_signals(self) -> Signals:
        sm = [({"gpu": str(g.index), "gpu_instance_id": ""}, g.gpm["sm_activity"]) for g in self.gpus
              if "sm_activity" in g.gpm]
        sm += [({"gpu": str(g.index), "gpu_instance_id": str(gi)}, gpm["sm_activity"]) for g in self.gpus
               for gi, gpm in _instances(g).items() if "sm_activity" in gpm]
        return {"gpu_utilization": [({"gpu": str(g.index)}, g.utilization) for g in self.gpus
                                    if g.utilization is not None],
                "gpu_memory_used_ratio": [({"gpu": str(g.index)}, g.memory_used / g.memory_total) for g in self.gpus
                                          if g.memory_used is not None and g.memory_total],
                "sm_activity": sm}

    def facts(self) -> tuple[GpuProcesses, ...]:
        return (GpuProcesses(tuple((str(g.index), g.uuid, frozenset(pid for pid, _, _ in g.processes))
                                   for g in self.gpus),
                             tuple((m.uuid, str(g.index)) for g in self.gpus for m in g.migs),
                             tuple((g.minor, str(g.index)) for g in self.gpus if g.minor is not None)),)

    def problem(self) -> str | None:
        return self._xid.problem

    def close(self) -> None:
        self._release()

    def collect(self) -> Iterator[Metric]:
        gpus = self.gpus
        yield gauge("gpus", "Number of GPUs NVML reports on this host (0 without a driver).", [],
                    [((), self.count)])
        labels = ["gpu", "uuid"]

        def ids(g: GpuSample) -> list[str]:
            return [str(g.index), g.uuid]

        def per_gpu(attr: str) -> Iterator[tuple[list[str], float]]:
            for g in gpus:
                value = getattr(g, attr)
                if value is not None:
                    yield ids(g), value

        yield gauge("gpu_up", "Whether the GPU answered NVML in the last sample (1) or stopped answering (0); "
                    "a GPU that does not answer has no other series.", labels,
                    [*((ids(g), 1) for g in gpus), *(([str(i), uuid], 0) for i, uuid in self.down)])
        yield counter("nvml_errors", "Total NVML readings left out because the call failed with an error other "
                      "than not supported (the GPU's other readings were exported), by call and error.",
                      ["call", "error"], ((list(key), n) for key, n in self.error_counts))
        yield gauge("gpu_info", "GPU metadata: model, PCI bus id and driver version; the value is 1.",
                    [*labels, "name", "pci_bus_id", "driver_version"],
                    (([*ids(g), g.name, g.pci_bus_id, self.driver_version], 1) for g in gpus))
        for attr, name, documentation in _GAUGES:
            yield gauge(name, documentation, labels, per_gpu(attr))
        for attr, name, documentation in _COUNTERS:
            yield counter(name, documentation, labels, per_gpu(attr))
        for metric, documentation in GPM_HELP:
            yield gauge(f"gpu_{metric}_ratio", documentation + " (GPM, Hopper and newer).", labels,
                        ((ids(g), g.gpm[metric]) for g in gpus if metric in g.gpm))
        yield gauge("gpu_clock_event_reason_active",
                    "Whether a reason is currently holding the GPU's clocks down (1) or not (0).",
                    [*labels, "reason"],
                    (([*ids(g), reason], 1.0 if g.clock_event_reasons & bit else 0.0)
                     for g in gpus if g.clock_event_reasons is not None
                     for bit, reason in CLOCK_EVENT_REASONS))
        yield gauge("gpu_pcie_throughput_bytes_per_second",
                    "PCIe throughput of the GPU in bytes per second by direction (sampled less often).",
                    [*labels, "direction"],
                    (([*ids(g), direction], value) for g in gpus
                     for direction, value in (("tx", g.pcie_tx), ("rx", g.pcie_rx)) if value is not None))
        yield counter("gpu_ecc_errors", "Total ECC memory errors of the GPU by type (aggregate counter).",
                      [*labels, "type"],
                      (([*ids(g), kind], value) for g in gpus
                       for kind, value in (("corrected", g.ecc_corrected), ("uncorrected", g.ecc_uncorrected))
                       if value is not None))
        yield gauge("gpu_processes", "Number of compute processes running on the GPU.", labels,
                    ((ids(g), len(g.processes)) for g in gpus))
        yield counter("gpu_xid_errors", "Total XID critical errors reported by NVML events, by XID code.",
                      [*labels, "xid"], self._xid.counts())
        yield from self._collect_health(gpus, ids)
        yield from self._collect_mig(gpus, ids)
        yield from self._collect_nvlink(gpus, ids)

    def _collect_health(self, gpus: list[GpuSample], ids: Callable[[GpuSample], list[str]]) -> Iterator[Metric]:
        labels = ["gpu", "uuid"]
        remapped = [g for g in gpus if g.remapped_rows is not None]
        yield gauge("gpu_remapped_rows", "Memory rows the GPU remapped, by the kind of error that caused it "
                    "(Ampere and newer).", [*labels, "cause"],
                    (([*ids(g), cause], g.remapped_rows[i]) for g in remapped  # type: ignore[index]
                     for i, cause in ((0, "correctable"), (1, "uncorrectable"))))
        yield gauge("gpu_row_remap_pending", "Whether a row remapping waits for the GPU to be reset (1) or not (0).",
                    labels, ((ids(g), min(g.remapped_rows[2], 1)) for g in remapped))  # type: ignore[index]
        yield gauge("gpu_row_remap_failed", "Whether a row remapping failed (1: the GPU needs service) or not (0).",
                    labels, ((ids(g), min(g.remapped_rows[3], 1)) for g in remapped))  # type: ignore[index]
        retired = [g for g in gpus if g.retired_pages is not None]
        yield gauge("gpu_retired_pages", "Memory pages the GPU retired, by cause (before Ampere).",
                    [*labels, "cause"],
                    (([*ids(g), cause], g.retired_pages[i]) for g in retired  # type: ignore[index]
                     for i, cause in ((0, "multiple_single_bit_ecc"), (1, "double_bit_ecc"))))
        yield gauge("gpu_retired_pages_pending", "Whether a page retirement waits for the next driver load (1) "
                    "or not (0).", labels, ((ids(g), min(g.retired_pages[2], 1)) for g in retired))  # type: ignore[index]
        yield gauge("gpu_recovery_action", "The action NVML says the GPU needs: 1 on the current one "
                    "(none, gpu_reset, node_reboot, drain_p2p, drain_and_reset).", [*labels, "action"],
                    (([*ids(g), action], float(g.recovery_action == i)) for g in gpus
                     if g.recovery_action is not None for i, action in enumerate(RECOVERY_ACTIONS)))

    def _collect_mig(self, gpus: list[GpuSample], ids: Callable[[GpuSample], list[str]]) -> Iterator[Metric]:
        labels = ["gpu", "uuid", "gpu_instance_id"]
        yield gauge("gpu_mig_mode", "Whether MIG mode is on for the GPU (1) or off (0), where the GPU has it.",
                    ["gpu", "uuid"], ((ids(g), g.mig_mode) for g in gpus if g.mig_mode is not None))
        yield gauge("mig_info", "A MIG device (compute instance) of a GPU in MIG mode: its UUID and profile; "
                    "the value is 1.", [*labels, "compute_instance_id", "mig_uuid", "profile"],
                    (([*ids(g), str(m.gpu_instance_id), str(m.compute_instance_id), m.uuid, m.profile], 1)
                     for g in gpus for m in g.migs))
        instances = [(g, gi, mig) for g in gpus for gi, mig in _first_of_instances(g).items()]
        yield gauge("mig_memory_used_bytes", "Memory in use in the MIG GPU instance in bytes.", labels,
                    (([*ids(g), str(gi)], m.memory_used) for g, gi, m in instances if m.memory_used is not None))
        yield gauge("mig_memory_total_bytes", "Memory of the MIG GPU instance in bytes.", labels,
                    (([*ids(g), str(gi)], m.memory_total) for g, gi, m in instances if m.memory_total is not None))
        yield gauge("mig_processes", "Number of compute processes running in the MIG GPU instance.", labels,
                    (([*ids(g), str(gi)], sum(1 for p in g.processes if p[2] == gi)) for g, gi, _ in instances))
        for metric, documentation in GPM_HELP:
            yield gauge(f"mig_{metric}_ratio", documentation + " in the MIG GPU instance (GPM, Hopper and newer).",
                        labels, (([*ids(g), str(gi)], m.gpm[metric]) for g, gi, m in instances if metric in m.gpm))

    def _collect_nvlink(self, gpus: list[GpuSample], ids: Callable[[GpuSample], list[str]]) -> Iterator[Metric]:
        labels = ["gpu", "uuid", "link"]
        yield gauge("gpu_nvlink_up", "Whether the NVLink is active (1) or not (0).", labels,
                    (([*ids(g), str(link)], float(up)) for g in gpus for link, up, _, _ in g.nvlinks))
        yield counter("gpu_nvlink_data_bytes", "Total data bytes (payload, no protocol overhead) through the "
                      "NVLink by direction.", [*labels, "direction"],
                      (([*ids(g), str(link), direction], value) for g in gpus for link, _, tx, rx in g.nvlinks
                       for direction, value in (("tx", tx), ("rx", rx)) if value is not None))
        yield counter("gpu_nvlink_errors", "Total NVLink errors over all the GPU's links, by type.",
                      ["gpu", "uuid", "type"],
                      (([*ids(g), kind], n) for g in gpus for kind, n in sorted(g.nvlink_errors.items())))


GPM_HELP = (
    ("sm_activity", "Fraction of SMs that were busy over the last sample period"),
    ("sm_occupancy", "Fraction of the SMs' warp slots that held an active warp over the last sample period"),
    ("tensor_activity", "Fraction of time the SMs ran tensor-core instructions over the last sample period"),
    ("dram_bandwidth_utilization", "Fraction of peak DRAM bandwidth used over the last sample period"),
)


def _instance(value: int | None) -> int | None:
    """A process's MIG GPU instance id, None outside MIG."""
    return None if value is None or value == MIG_NO_INSTANCE else int(value)


def _mig_profile(name: str) -> str:
    """The MIG profile from a MIG device's name ("NVIDIA H100 80GB HBM3 MIG 1g.10gb" -> "1g.10gb")."""
    _, found, profile = name.rpartition(" MIG ")
    return profile.strip() if found else ""


def _first_of_instances(gpu: GpuSample) -> dict[int, MigSample]:
    """One MIG device per GPU instance: memory and GPM belong to the GPU instance, shared by its devices."""
    out: dict[int, MigSample] = {}
    for mig in gpu.migs:
        out.setdefault(mig.gpu_instance_id, mig)
    return out


def _instances(gpu: GpuSample) -> dict[int, dict[str, float]]:
    return {gi: mig.gpm for gi, mig in _first_of_instances(gpu).items()}


_VALUE_FIELDS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")  # by nvmlValueType_t


def _field_values(values: Sequence[object]) -> Iterator[float | None]:
    """Each nvmlFieldValue_t's value, None where its own nvmlReturn is an error."""
    for v in values:
        kind = getattr(v, "valueType", 3)
        if getattr(v, "nvmlReturn", 0) != 0 or not 0 <= kind < len(_VALUE_FIELDS):
            yield None
        else:
            yield float(getattr(v.value, _VALUE_FIELDS[kind]))  # type: ignore[attr-defined]


def _error_name(nvml: ModuleType, code: object) -> str:
    """NVML's name of an error code ("NO_PERMISSION"), bounded to the codes NVML defines."""
    return _error_names(nvml).get(code, "UNKNOWN")  # type: ignore[call-overload]


@functools.cache
def _error_names(nvml: ModuleType) -> dict[object, str]:
    """Every NVML_ERROR_* code of the module, named: built once, not on each failed call of each sample."""
    return {getattr(nvml, name): name.removeprefix("NVML_ERROR_") for name in reversed(dir(nvml))
            if name.startswith("NVML_ERROR_")}


class GpmSampler:
    """GPM metrics per GPU or MIG GPU instance: NVML computes them between two samples taken an interval
    apart, so each keeps its previous sample; the first read of each gives nothing."""

    def __init__(self, collector: NvmlCollector):
        self.collector = collector
        self._supported: dict[str, bool] = {}
        self._previous: dict[tuple[str, int | None], object] = {}

    def supported(self, uuid: str) -> bool:
        return self._supported.get(uuid, False)

    def read(self, key: tuple[str, int | None], handle: object) -> dict[str, float] | None:
        nvml, uuid, instance = self.collector.nvml, key[0], key[1]
        opt = self.collector._optional
        if uuid not in self._supported:
            support = opt("gpm", lambda: nvml.nvmlGpmQueryDeviceSupport(handle))
            self._supported[uuid] = bool(support is not None and support.isSupportedDevice)
        if not self._supported[uuid]:
            return None
        sample = opt("gpm", nvml.nvmlGpmSampleAlloc)
        if sample is None:
            return None
        try:
            taken = opt("gpm", lambda: nvml.nvmlGpmSampleGet(handle, sample) if instance is None
                        else nvml.nvmlGpmMigSampleGet(handle, instance, sample))
        except nvml.NVMLError:  # the GPU is gone: nothing may keep its sample
            nvml.nvmlGpmSampleFree(sample)
            raise
        if taken is None:
            nvml.nvmlGpmSampleFree(sample)
            return None
        previous = self._previous.get(key)
        self._previous[key] = sample
        if previous is None:
            return None
        try:
            return self._metrics(previous, sample)
        finally:
            nvml.nvmlGpmSampleFree(previous)

    def _metrics(self, first: object, second: object) -> dict[str, float] | None:
        nvml = self.collector.nvml
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1, request.sample2 = first, second
        for i, (_, metric_id) in enumerate(GPM_METRICS):
            request.metrics[i].metricId = metric_id
        if self.collector._optional("gpm", lambda: nvml.nvmlGpmMetricsGet(request)) is None:
            return None
        return {name: min(max(request.metrics[i].value / 100.0, 0.0), 1.0)
                for i, (name, _) in enumerate(GPM_METRICS) if request.metrics[i].nvmlReturn == 0}

    def free(self) -> None:
        """Free every kept sample (NVML is being shut down or re-initialized)."""
        for sample in self._previous.values():
            try:
                self.collector.nvml.nvmlGpmSampleFree(sample)
            except self.collector.nvml.NVMLError:
                pass
        self._previous.clear()
        self._supported.clear()


_GAUGES = (
    ("utilization", "gpu_utilization_ratio",
     "Fraction of the last sample period during which a kernel ran on the GPU."),
    ("memory_utilization", "gpu_memory_utilization_ratio",
     "Fraction of the last sample period during which GPU memory was read or written."),
    ("memory_used", "gpu_memory_used_bytes", "GPU memory in use in bytes."),
    ("memory_total", "gpu_memory_total_bytes", "Total GPU memory in bytes."),
    ("temperature", "gpu_temperature_celsius", "GPU core temperature in degrees Celsius."),
    ("power_watts", "gpu_power_watts", "GPU power draw in watts."),
    ("sm_clock_hz", "gpu_sm_clock_hertz", "Current SM clock of the GPU in hertz."),
    ("memory_clock_hz", "gpu_memory_clock_hertz", "Current memory clock of the GPU in hertz."),
)
_COUNTERS = (
    ("energy_joules", "gpu_energy_joules", "Total energy consumed by the GPU in joules since the driver loaded."),
)


class XidWatcher:
    """Counts XID critical errors delivered by NVML events on a background thread."""

    def __init__(self, collector: NvmlCollector):
        self.collector = collector
        self._counts: dict[tuple[str, str, str], int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.problem: str | None = None  # set if the thread died

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._guarded, name="tfprofd-xid", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def counts(self) -> list[tuple[list[str], int]]:
        with self._lock:
            return [(list(key), value) for key, value in sorted(self._counts.items())]

    def _register(self) -> tuple[object, dict[int | None, tuple[int, str]]]:
        nvml = self.collector.nvml
        event_set = nvml.nvmlEventSetCreate()
        devices: dict[int | None, tuple[int, str]] = {}
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    nvml.nvmlDeviceRegisterEvents(handle, XID_CRITICAL_ERROR_EVENT, event_set)
                    devices[ctypes.cast(handle, ctypes.c_void_p).value] = (index,
                                                                         _text(nvml.nvmlDeviceGetUUID(handle)))
                except nvml.NVMLError as exc:
                    log.debug("GPU %d: no XID events: %s", index, exc)
        except BaseException:  # no GPUs to count (a driver going away): the set is freed, not left to each retry
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlEventSetFree(event_set)
            raise
        return event_set, devices

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # a dead watcher must turn health red, whatever killed it
            self.problem = f"XID event thread died: {type(exc).__name__}: {exc}"
            log.exception("XID event thread died; XID errors are no longer counted")

    def _run(self) -> None:
        nvml = self.collector.nvml
        while not self._stop.is_set():
            try:
                event_set, devices = self._register()
            except nvml.NVMLError as exc:
                log.debug("XID events unavailable: %s", exc)
                self._stop.wait(5)
                continue
            try:
                while not self._stop.is_set():
                    try:
                        data = nvml.nvmlEventSetWait(event_set, 500)
                    except nvml.NVMLError as exc:
                        if getattr(exc, "value", None) == NVML_ERROR_TIMEOUT:
                            continue
                        log.debug("XID event wait failed: %s", exc)
                        break
                    index, uuid = devices.get(ctypes.cast(data.device, ctypes.c_void_p).value, (-1, ""))
                    log.warning("XID %d on GPU %d (%s)", data.eventData, index, uuid)
                    with self._lock:
                        key = (str(index), uuid, str(data.eventData))
                        self._counts[key] = self._counts.get(key, 0) + 1
            finally:
                try:
                    nvml.nvmlEventSetFree(event_set)
                except nvml.NVMLError:
                    pass
            self._stop.wait(2)
