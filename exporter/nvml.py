"""GPU collector through NVML (``pynvml`` from nvidia-ml-py): one series set per GPU, labelled gpu and uuid.

A host without a driver is not an error for the agent: the collector says so once, exports
``tfprofd_gpus 0`` and retries initialization now and then. A GPU that fails or disappears is
skipped (and the collector's success reads 0) while the others keep being exported.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import ClassVar

from prometheus_client.core import Metric

from .base import Collector, Environment, Signals, counter, gauge
from .options import option, parse_bool, parse_duration

log = logging.getLogger("tfprofd.nvml")

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
NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_TIMEOUT, NVML_ERROR_FUNCTION_NOT_FOUND = 3, 10, 13
XID_CRITICAL_ERROR_EVENT = 0x8


@dataclass
class GpuSample:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
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
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, used GPU memory bytes)


@dataclass(frozen=True)
class GpuProcesses:
    """The processes NVML lists on each GPU: (gpu label, uuid, pids) per GPU it could read."""

    gpus: tuple[tuple[str, str, frozenset[int]], ...]


@dataclass(frozen=True)
class NvmlSettings:
    enabled: bool = option(True, parse_bool, "Export GPU metrics through NVML.")
    pcie_interval: float = option(10.0, parse_duration, "How often to sample PCIe throughput (each read costs "
                                  "~20 ms per GPU and direction).", minimum=1, maximum=3600)
    retry_interval: float = option(60.0, parse_duration, "How often to retry NVML initialization when no "
                                   "driver was found.", minimum=1, maximum=86400)


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class NvmlCollector(Collector):
    name = "nvml"
    section = "collectors.nvml"
    Settings = NvmlSettings
    signals: ClassVar[dict[str, tuple[str, ...]]] = {"gpu_utilization": ("gpu",), "gpu_memory_used_ratio": ("gpu",)}

    def __init__(self, settings: NvmlSettings, env: Environment):
        super().__init__(settings, env)
        self.clock = env.clock
        self._nvml: ModuleType | None = env.nvml
        self._initialized = False
        self._next_init_attempt = 0.0
        self._unavailable_reason: str | None = None
        self._pcie_last: dict[str, tuple[float, float | None, float | None]] = {}
        self._xid = XidWatcher(self)
        self._failing_gpus: set[int] = set()
        self.driver_version = ""
        self.count = 0
        self.gpus: list[GpuSample] = []

    @property
    def nvml(self) -> ModuleType:
        if self._nvml is None:
            import pynvml

            self._nvml = pynvml
        return self._nvml

    def is_not_supported(self, exc: Exception) -> bool:
        return getattr(exc, "value", None) in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND)

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

    def sample(self) -> bool:
        if not self._ensure_initialized():
            self.count, self.gpus = 0, []
            return False
        nvml = self.nvml
        try:
            self.count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            if -1 not in self._failing_gpus:
                self._failing_gpus.add(-1)
                log.warning("NVML could not count GPUs: %s", exc)
            self.count, self.gpus = 0, []
            return False
        self._failing_gpus.discard(-1)
        gpus, ok = [], True
        for index in range(self.count):
            try:
                gpus.append(self._sample_gpu(index))
                if index in self._failing_gpus:
                    self._failing_gpus.discard(index)
                    log.info("GPU %d answers again", index)
            except nvml.NVMLError as exc:
                ok = False
                if index not in self._failing_gpus:
                    self._failing_gpus.add(index)
                    log.warning("GPU %d skipped: NVML error: %s", index, exc)
        self.gpus = gpus
        return ok

    def _optional(self, read: Callable[[], float]) -> float | None:
        try:
            return read()
        except self.nvml.NVMLError as exc:
            if self.is_not_supported(exc):
                return None
            raise

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
        rates = opt(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        if rates is not None:
            gpu.utilization, gpu.memory_utilization = rates.gpu / 100.0, rates.memory / 100.0
        memory = opt(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        if memory is not None:
            gpu.memory_used, gpu.memory_total = memory.used, memory.total
        gpu.temperature = opt(lambda: nvml.nvmlDeviceGetTemperature(handle, NVML_TEMPERATURE_GPU))
        gpu.power_watts = opt(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
        gpu.energy_joules = opt(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0)
        gpu.sm_clock_hz = opt(lambda: nvml.nvmlDeviceGetClockInfo(handle, NVML_CLOCK_SM) * 1e6)
        gpu.memory_clock_hz = opt(lambda: nvml.nvmlDeviceGetClockInfo(handle, NVML_CLOCK_MEM) * 1e6)
        gpu.clock_event_reasons = opt(lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
        gpu.ecc_corrected = opt(lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_AGGREGATE_ECC))
        gpu.ecc_uncorrected = opt(lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_AGGREGATE_ECC))
        gpu.pcie_tx, gpu.pcie_rx = self._pcie(gpu.uuid, handle)
        processes = opt(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle)) or []
        gpu.processes = [(p.pid, p.usedGpuMemory or 0) for p in processes]
        return gpu

    def _pcie(self, uuid: str, handle: object) -> tuple[float | None, float | None]:
        """PCIe throughput in bytes/s, re-read only every pcie_interval: each read blocks ~20 ms."""
        now = self.clock.monotonic()
        last = self._pcie_last.get(uuid)
        if last and now - last[0] < self.settings.pcie_interval:
            return last[1], last[2]
        nvml = self.nvml
        tx = self._optional(lambda: nvml.nvmlDeviceGetPcieThroughput(handle, NVML_PCIE_UTIL_TX_BYTES) * 1024.0)
        rx = self._optional(lambda: nvml.nvmlDeviceGetPcieThroughput(handle, NVML_PCIE_UTIL_RX_BYTES) * 1024.0)
        self._pcie_last[uuid] = (now, tx, rx)
        return tx, rx

    def clear(self) -> None:
        self.gpus = []

    def rule_signals(self) -> Signals:
        return {"gpu_utilization": [({"gpu": str(g.index)}, g.utilization) for g in self.gpus
                                    if g.utilization is not None],
                "gpu_memory_used_ratio": [({"gpu": str(g.index)}, g.memory_used / g.memory_total) for g in self.gpus
                                          if g.memory_used is not None and g.memory_total]}

    def facts(self) -> tuple[GpuProcesses, ...]:
        return (GpuProcesses(tuple((str(g.index), g.uuid, frozenset(pid for pid, _ in g.processes))
                                   for g in self.gpus)),)

    def problem(self) -> str | None:
        return self._xid.problem

    def close(self) -> None:
        self._xid.stop()
        if self._initialized:
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError:
                pass
            self._initialized = False

    def collect(self) -> Iterator[Metric]:
        gpus = self.gpus
        yield gauge("gpus", "Number of GPUs NVML reports on this host (0 without a driver).", [],
                    [((), self.count)])
        labels = ["gpu", "uuid"]

        def per_gpu(attr: str) -> Iterator[tuple[list[str], float]]:
            for g in gpus:
                value = getattr(g, attr)
                if value is not None:
                    yield [str(g.index), g.uuid], value

        yield gauge("gpu_info", "GPU metadata: model, PCI bus id and driver version; the value is 1.",
                    [*labels, "name", "pci_bus_id", "driver_version"],
                    (([str(g.index), g.uuid, g.name, g.pci_bus_id, self.driver_version], 1) for g in gpus))
        for attr, name, documentation in _GAUGES:
            yield gauge(name, documentation, labels, per_gpu(attr))
        for attr, name, documentation in _COUNTERS:
            yield counter(name, documentation, labels, per_gpu(attr))
        yield gauge("gpu_clock_event_reason_active",
                    "Whether a reason is currently holding the GPU's clocks down (1) or not (0).",
                    [*labels, "reason"],
                    (([str(g.index), g.uuid, reason], 1.0 if g.clock_event_reasons & bit else 0.0)
                     for g in gpus if g.clock_event_reasons is not None
                     for bit, reason in CLOCK_EVENT_REASONS))
        yield gauge("gpu_pcie_throughput_bytes_per_second",
                    "PCIe throughput of the GPU in bytes per second by direction (sampled less often).",
                    [*labels, "direction"],
                    (([str(g.index), g.uuid, direction], value) for g in gpus
                     for direction, value in (("tx", g.pcie_tx), ("rx", g.pcie_rx)) if value is not None))
        yield counter("gpu_ecc_errors", "Total ECC memory errors of the GPU by type (aggregate counter).",
                      [*labels, "type"],
                      (([str(g.index), g.uuid, kind], value) for g in gpus
                       for kind, value in (("corrected", g.ecc_corrected), ("uncorrected", g.ecc_uncorrected))
                       if value is not None))
        yield gauge("gpu_processes", "Number of compute processes running on the GPU.", labels,
                    (([str(g.index), g.uuid], len(g.processes)) for g in gpus))
        yield counter("gpu_xid_errors", "Total XID critical errors reported by NVML events, by XID code.",
                      [*labels, "xid"], self._xid.counts())


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
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                nvml.nvmlDeviceRegisterEvents(handle, XID_CRITICAL_ERROR_EVENT, event_set)
                devices[ctypes.cast(handle, ctypes.c_void_p).value] = (index, _text(nvml.nvmlDeviceGetUUID(handle)))
            except nvml.NVMLError as exc:
                log.debug("GPU %d: no XID events: %s", index, exc)
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
