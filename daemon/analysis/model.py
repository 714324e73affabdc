"""The analysis record: what one capture's analysis found, as typed values.

This is the project's central record: the analysis worker prints it (``to_json``), the agent reads it back
(``from_json``), stores it in the capture's record, exports it as metrics, compares it with the job's
baseline and prints it for people. Stdlib only: the agent imports it without xprof.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

# The parts of a step, with xprof's EventType numbers (xprof/utils/event_span.h) as its input-pipeline
# analysis groups them. Types it leaves out of every part (pre/post-processing, batching, runtime,
# host-to-host) count in "other", with the time no event covers.
PART_TYPES: dict[str, tuple[int, ...]] = {
    "input_wait": (110,), "host_to_device": (80, 170), "device_compute": (140, 150), "device_to_device": (120, 160),
    "device_collectives": (100,), "host_compute": (10,), "kernel_launch": (90,), "compile": (60,),
    "output": (130,), "other": (0,)}
PART_WORDS = {"input_wait": "waiting for input", "host_to_device": "copying to the device",
              "device_compute": "device compute", "device_to_device": "device-to-device copies",
              "device_collectives": "collectives (all-reduce)", "host_compute": "host compute",
              "kernel_launch": "kernel launches", "compile": "compilation", "output": "output to the host",
              "other": "all others (untraced host time: Python, I/O, waiting)",
              "between_steps_input": "between steps fetching the next batch",
              "between_steps_other": "between steps (callbacks, post-processing)"}
DEVICE_PARTS = ("device_compute", "device_to_device", "device_collectives", "host_to_device", "output")
ONE_WINDOW = 0.5  # workers traced over one window: every session covers half the shortest one at least


def _float(data: dict[str, Any], key: str, default: float | None = None) -> float | None:
    value = data.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"analysis field {key!r} is not a number ({type(value).__name__})")
    return float(value)


def _num(data: dict[str, Any], key: str, default: float = 0.0) -> float:
    value = _float(data, key, default)
    return default if value is None else value


def _str(data: dict[str, Any], key: str, default: str = "") -> str:
    value = data.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ValueError(f"analysis field {key!r} is not a string ({type(value).__name__})")
    return value


def _obj(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"analysis {what} is not an object ({type(data).__name__})")
    return data


def _list(data: dict[str, Any], key: str) -> list[Any]:
    value = data.get(key) or []
    if not isinstance(value, list):
        raise ValueError(f"analysis field {key!r} is not a list ({type(value).__name__})")
    return value


@dataclass(frozen=True)
class StepParts:
    """Mean time per step in each part of the step (ms), or each part's share of the step; they add up."""

    input_wait: float = 0.0
    host_to_device: float = 0.0
    device_compute: float = 0.0
    device_to_device: float = 0.0
    device_collectives: float = 0.0
    host_compute: float = 0.0
    kernel_launch: float = 0.0
    compile: float = 0.0
    output: float = 0.0
    other: float = 0.0

    def __getitem__(self, part: str) -> float:
        if part not in PART_TYPES:
            raise KeyError(part)
        return float(getattr(self, part))

    def items(self) -> list[tuple[str, float]]:
        return [(part, self[part]) for part in PART_TYPES]

    def total(self) -> float:
        return sum(v for _, v in self.items())

    def scaled(self, by: float) -> StepParts:
        return StepParts(**{p: v * by for p, v in self.items()})

    def to_json(self) -> dict[str, float]:
        return dict(self.items())

    @classmethod
    def from_json(cls, data: Any) -> StepParts:
        data = _obj(data, "step parts")
        return cls(**{p: _num(data, p) for p in PART_TYPES})


@dataclass(frozen=True)
class StepTime:
    """Step time statistics over the steps seen (ms)."""

    mean: float
    stdev: float
    min: float
    max: float

    def to_json(self) -> dict[str, float]:
        return {"mean": self.mean, "stdev": self.stdev, "min": self.min, "max": self.max}

    @classmethod
    def from_json(cls, data: Any) -> StepTime:
        data = _obj(data, "step time")
        return cls(*(_num(data, k) for k in ("mean", "stdev", "min", "max")))


@dataclass(frozen=True)
class Ratios:
    """Ratios that are not parts of the step (None where the trace cannot tell)."""

    between_steps: float | None = None  # of the span from the first step to the last
    between_steps_input: float = 0.0  # of the time between steps, fetching the next batch
    steps_cover: float | None = None  # of the capture
    device_idle: float | None = None  # of the step, on a GPU
    ops_busy: float | None = None  # of the step, the framework's ops running (CPU)

    def to_json(self) -> dict[str, float | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Any) -> Ratios:
        data = _obj(data or {}, "ratios")
        return cls(between_steps=_float(data, "between_steps"), between_steps_input=_num(data, "between_steps_input"),
                   steps_cover=_float(data, "steps_cover"), device_idle=_float(data, "device_idle"),
                   ops_busy=_float(data, "ops_busy"))


@dataclass(frozen=True)
class BetweenSteps:
    """Mean time after each step until the next (ms): fetching the next batch, and the rest."""

    between_steps_input: float = 0.0
    between_steps_other: float = 0.0

    def to_json(self) -> dict[str, float]:
        return {"between_steps_input": self.between_steps_input, "between_steps_other": self.between_steps_other}

    @classmethod
    def from_json(cls, data: Any) -> BetweenSteps:
        data = _obj(data, "between-steps times")
        return cls(_num(data, "between_steps_input"), _num(data, "between_steps_other"))


@dataclass(frozen=True)
class KernelTime:
    """A GPU kernel an op launched, and its time."""

    kernel: str
    ms_per_step: float
    ms_total: float

    def to_json(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "ms_per_step": self.ms_per_step, "ms_total": self.ms_total}

    @classmethod
    def from_json(cls, data: Any) -> KernelTime:
        data = _obj(data, "kernel")
        return cls(_str(data, "kernel"), _num(data, "ms_per_step"), _num(data, "ms_total"))


@dataclass(frozen=True)
class OpTime:
    """An op (or op type on a device) by self time: per step, and in the whole capture."""

    name: str
    ms_per_step: float
    ms_total: float
    category: str | None = None  # input ops: tf.data's iterator category, or "tf.data function"
    type: str | None = None  # host ops: the TF op type
    op: str | None = None  # device kernels without device ops: the op that launched it
    tensor_core: bool | None = None
    instances: int = 1  # device op types: how many ops of the type ran
    kernels: tuple[KernelTime, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "ms_per_step": self.ms_per_step, "ms_total": self.ms_total}
        for key in ("category", "type", "op", "tensor_core"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.instances != 1:
            out["instances"] = self.instances
        out["kernels"] = [k.to_json() for k in self.kernels]
        return out

    @classmethod
    def from_json(cls, data: Any) -> OpTime:
        data = _obj(data, "op")
        core = data.get("tensor_core")
        instances = data.get("instances", 1)
        return cls(name=_str(data, "name"), ms_per_step=_num(data, "ms_per_step"), ms_total=_num(data, "ms_total"),
                   category=data.get("category") if isinstance(data.get("category"), str) else None,
                   type=data.get("type") if isinstance(data.get("type"), str) else None,
                   op=data.get("op") if isinstance(data.get("op"), str) else None,
                   tensor_core=core if isinstance(core, bool) else None,
                   instances=instances if isinstance(instances, int) and not isinstance(instances, bool) else 1,
                   kernels=tuple(KernelTime.from_json(k) for k in _list(data, "kernels")))


OP_KINDS = ("input", "host", "device")


@dataclass(frozen=True)
class Ops:
    """The top ops by self time: input pipeline, host, and device ops (with their kernels)."""

    input: tuple[OpTime, ...] = ()
    host: tuple[OpTime, ...] = ()
    device: tuple[OpTime, ...] = ()

    def of(self, kind: str) -> tuple[OpTime, ...]:
        if kind not in OP_KINDS:
            raise KeyError(kind)
        return tuple(getattr(self, kind))

    def to_json(self) -> dict[str, list[dict[str, Any]]]:
        return {kind: [o.to_json() for o in self.of(kind)] for kind in OP_KINDS}

    @classmethod
    def from_json(cls, data: Any) -> Ops:
        data = _obj(data or {}, "ops")
        return cls(**{kind: tuple(OpTime.from_json(o) for o in _list(data, kind)) for kind in OP_KINDS})


def _strs(data: dict[str, Any], key: str) -> tuple[str, ...]:
    return tuple(str(v) for v in _list(data, key))


@dataclass(frozen=True)
class Evidence:
    """How much the verdict rests on: the steps seen and the share of the capture they span."""

    steps: int
    span_share: float | None  # of the capture, from the first step's start to the last one's end
    capture_seconds: float
    sufficient: bool  # enough to conclude (classify.MIN_STEPS steps over classify.MIN_SPAN of the capture)

    def sentence(self) -> str:
        steps = f"{self.steps} step{'' if self.steps == 1 else 's'}"
        if self.span_share is None:
            return f"{steps} in a {self.capture_seconds:.2f} s capture"
        return f"{steps} spanning {self.span_share:.0%} of a {self.capture_seconds:.2f} s capture"

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "span_share": self.span_share, "capture_seconds": self.capture_seconds,
                "sufficient": self.sufficient, "sentence": self.sentence()}

    @classmethod
    def from_json(cls, data: Any) -> Evidence:
        data = _obj(data, "evidence")
        steps = data.get("steps", 0)
        return cls(steps=steps if isinstance(steps, int) and not isinstance(steps, bool) else 0,
                   span_share=_float(data, "span_share"), capture_seconds=_num(data, "capture_seconds"),
                   sufficient=data.get("sufficient") is not False)


@dataclass(frozen=True)
class DeviceAnalysis:
    """One GPU of a worker: its steps, how busy its kernels keep it within them, its copies."""

    name: str  # "GPU:4"
    steps: int = 0  # on its own ``Steps`` line
    step_ms: float | None = None  # mean
    busy: float | None = None  # share of its steps its kernels run
    kernels: int = 0  # in the capture
    copies_ms: dict[str, float] = field(default_factory=dict)

    @property
    def idle(self) -> float | None:
        return None if self.busy is None else max(0.0, 1 - self.busy)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "steps": self.steps, "step_ms": self.step_ms, "busy": self.busy,
                "idle": self.idle, "kernels": self.kernels, "copies_ms": dict(self.copies_ms)}

    @classmethod
    def from_json(cls, data: Any) -> DeviceAnalysis:
        data = _obj(data, "device")
        copies = _obj(data.get("copies_ms") or {}, "copies")
        steps, kernels = data.get("steps", 0), data.get("kernels", 0)
        return cls(name=_str(data, "name"), steps=steps if isinstance(steps, int) else 0,
                   step_ms=_float(data, "step_ms"), busy=_float(data, "busy"),
                   kernels=kernels if isinstance(kernels, int) else 0,
                   copies_ms={str(k): _num(copies, k) for k in copies})


@dataclass(frozen=True)
class LaunchFacts:
    """The host thread that launches a GPU's work, within that GPU's steps."""

    device: str  # the GPU it launches for
    thread: str  # its line name in the trace (``tf_gpu_private_6/1085868292``)
    thread_busy: float  # share of the GPU's steps the thread runs
    kernels_per_step: float
    mean_kernel_us: float
    gpu_private: bool  # TF_GPU_THREAD_MODE=gpu_private is set: the trace has tf_gpu_private threads

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "thread": self.thread, "thread_busy": self.thread_busy,
                "kernels_per_step": self.kernels_per_step, "mean_kernel_us": self.mean_kernel_us,
                "gpu_private": self.gpu_private}

    @classmethod
    def from_json(cls, data: Any) -> LaunchFacts:
        data = _obj(data, "launch")
        return cls(device=_str(data, "device"), thread=_str(data, "thread"), thread_busy=_num(data, "thread_busy"),
                   kernels_per_step=_num(data, "kernels_per_step"), mean_kernel_us=_num(data, "mean_kernel_us"),
                   gpu_private=data.get("gpu_private") is True)


@dataclass(frozen=True)
class WorkerAnalysis:
    """One worker's trace: its steps, their parts, its ops, and what bound its steps."""

    host: str
    trace: str
    bottleneck: str
    why: str
    summary: str
    recommendation: str
    hardware: str = ""
    steps: int = 0
    capture_seconds: float = 0.0
    window: tuple[int, int] | None = None  # the profiling session's (start, stop) in Unix ns
    xprof_conclusion: str = ""
    xprof_differs: str | None = None
    executions: int | None = None  # steps_per_execution > 1: how many executions held the steps
    loops_hidden: bool = False
    steps_found: str = ""  # how the steps were found, in words (timeline.Steps.found)
    steps_inferred: bool = False  # no step markers: the steps are repeated executions of one tf.function
    ops: Ops = field(default_factory=Ops)
    copies_ms: dict[str, float] = field(default_factory=dict)
    ratios: Ratios = field(default_factory=Ratios)
    step_time_ms: StepTime | None = None
    breakdown_ms: StepParts | None = None
    breakdown: StepParts | None = None
    input_bound_ratio: float | None = None
    cycle_ms: float | None = None  # a step and the time after it until the next
    between_ms: BetweenSteps | None = None
    evidence: Evidence | None = None
    devices: tuple[DeviceAnalysis, ...] = ()  # every GPU of the worker, busiest first
    idle_devices: tuple[str, ...] = ()  # GPUs that ran no kernel
    straggling_device: str | None = None
    devices_summary: str | None = None  # one sentence on the GPUs, where the worker has several
    launch: LaunchFacts | None = None
    timeline_error: str | None = None  # why the trace's timeline could not be read: xprof's tables alone speak

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "host": self.host, "trace": self.trace, "hardware": self.hardware, "steps": self.steps,
            "capture_seconds": self.capture_seconds, "window": list(self.window) if self.window else None,
            "xprof_conclusion": self.xprof_conclusion, "ops": self.ops.to_json(), "copies_ms": dict(self.copies_ms),
            "ratios": self.ratios.to_json(), "bottleneck": self.bottleneck, "why": self.why, "summary": self.summary,
            "recommendation": self.recommendation, "xprof_differs": self.xprof_differs}
        if self.executions is not None:
            out["executions"] = self.executions
        if self.loops_hidden:
            out["loops_hidden"] = True
        out["steps_found"], out["steps_inferred"] = self.steps_found, self.steps_inferred
        if self.step_time_ms is not None:
            out["step_time_ms"] = self.step_time_ms.to_json()
        if self.breakdown_ms is not None and self.breakdown is not None:
            out["breakdown_ms"], out["breakdown"] = self.breakdown_ms.to_json(), self.breakdown.to_json()
            out["input_bound_ratio"] = self.input_bound_ratio
        if self.cycle_ms is not None and self.between_ms is not None:
            out["cycle_ms"], out["between_ms"] = self.cycle_ms, self.between_ms.to_json()
        out["evidence"] = self.evidence.to_json() if self.evidence else None
        out.update({"devices": [d.to_json() for d in self.devices], "idle_devices": list(self.idle_devices),
                    "straggling_device": self.straggling_device, "devices_summary": self.devices_summary,
                    "launch": self.launch.to_json() if self.launch else None})
        if self.timeline_error is not None:
            out["timeline_error"] = self.timeline_error
        return out

    @classmethod
    def from_json(cls, data: Any) -> WorkerAnalysis:
        """A worker's analysis from its JSON; raises ValueError naming what is wrong."""
        data = _obj(data, "worker")
        window = data.get("window")
        if window is not None and not (isinstance(window, list) and len(window) == 2
                                       and all(isinstance(t, int) and not isinstance(t, bool) for t in window)):
            raise ValueError("analysis field 'window' is not a pair of integers")
        steps = data.get("steps", 0)
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise ValueError("analysis field 'steps' is not an integer")
        executions = data.get("executions")
        copies = _obj(data.get("copies_ms") or {}, "copies")
        has_parts = data.get("breakdown_ms") is not None and data.get("breakdown") is not None
        has_between = data.get("cycle_ms") is not None and data.get("between_ms") is not None
        return cls(
            host=_str(data, "host"), trace=_str(data, "trace"), bottleneck=_str(data, "bottleneck", "unknown"),
            why=_str(data, "why"), summary=_str(data, "summary"), recommendation=_str(data, "recommendation"),
            hardware=_str(data, "hardware"), steps=steps, capture_seconds=_num(data, "capture_seconds"),
            window=(window[0], window[1]) if window else None, xprof_conclusion=_str(data, "xprof_conclusion"),
            xprof_differs=data.get("xprof_differs") if isinstance(data.get("xprof_differs"), str) else None,
            executions=executions if isinstance(executions, int) and not isinstance(executions, bool) else None,
            loops_hidden=data.get("loops_hidden") is True, steps_found=_str(data, "steps_found"),
            steps_inferred=data.get("steps_inferred") is True, ops=Ops.from_json(data.get("ops")),
            copies_ms={str(k): _num(copies, k) for k in copies}, ratios=Ratios.from_json(data.get("ratios")),
            step_time_ms=StepTime.from_json(data["step_time_ms"]) if data.get("step_time_ms") is not None else None,
            breakdown_ms=StepParts.from_json(data["breakdown_ms"]) if has_parts else None,
            breakdown=StepParts.from_json(data["breakdown"]) if has_parts else None,
            input_bound_ratio=_float(data, "input_bound_ratio") if has_parts else None,
            cycle_ms=_float(data, "cycle_ms") if has_between else None,
            between_ms=BetweenSteps.from_json(data["between_ms"]) if has_between else None,
            evidence=Evidence.from_json(data["evidence"]) if data.get("evidence") else None,
            devices=tuple(DeviceAnalysis.from_json(d) for d in _list(data, "devices")),
            idle_devices=_strs(data, "idle_devices"),
            straggling_device=data.get("straggling_device") if isinstance(data.get("straggling_device"), str) else None,
            devices_summary=data.get("devices_summary") if isinstance(data.get("devices_summary"), str) else None,
            launch=LaunchFacts.from_json(data["launch"]) if data.get("launch") else None,
            timeline_error=data.get("timeline_error") if isinstance(data.get("timeline_error"), str) else None)


@dataclass(frozen=True)
class Straggler:
    """A worker whose steps are slower than the others', and the part of the step that makes it so."""

    host: str
    part: str
    delta_ms: float
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "part": self.part, "delta_ms": self.delta_ms, "why": self.why}

    @classmethod
    def from_json(cls, data: Any) -> Straggler:
        data = _obj(data, "straggler")
        return cls(_str(data, "host"), _str(data, "part"), _num(data, "delta_ms"), _str(data, "why"))


@dataclass(frozen=True)
class PartChange:
    """A part of the step from the baseline to the incident (ms per step)."""

    part: str
    before_ms: float
    after_ms: float
    delta_ms: float

    def to_json(self) -> dict[str, Any]:
        return {"part": self.part, "before_ms": self.before_ms, "after_ms": self.after_ms, "delta_ms": self.delta_ms}

    @classmethod
    def from_json(cls, data: Any) -> PartChange:
        data = _obj(data, "part change")
        return cls(_str(data, "part"), _num(data, "before_ms"), _num(data, "after_ms"), _num(data, "delta_ms"))


@dataclass(frozen=True)
class OpChange:
    """An op whose self time per step changed from the baseline to the incident."""

    name: str
    kind: str
    before_ms: float
    after_ms: float
    delta_ms: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "before_ms": self.before_ms, "after_ms": self.after_ms,
                "delta_ms": self.delta_ms}

    @classmethod
    def from_json(cls, data: Any) -> OpChange:
        data = _obj(data, "op change")
        return cls(_str(data, "name"), _str(data, "kind"), _num(data, "before_ms"), _num(data, "after_ms"),
                   _num(data, "delta_ms"))


Pair = tuple[float | None, float | None]


def _pair(data: dict[str, Any], key: str) -> Pair:
    value = data.get(key) or [None, None]
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"analysis field {key!r} is not a pair")
    before, after = (_float({"v": v}, "v") for v in value)
    return before, after


@dataclass(frozen=True)
class Comparison:
    """What changed from the job's baseline capture to this one."""

    summary: str
    step_ms: tuple[float, float, float]  # before, after, change
    parts: tuple[PartChange, ...] = ()
    ops: tuple[OpChange, ...] = ()
    samples_per_second: Pair = (None, None)
    batch_size: Pair = (None, None)
    ops_busy: Pair = (None, None)
    between_steps: Pair = (None, None)
    baseline_trace: str | None = None
    baseline_id: str | None = None
    gone: tuple[OpChange, ...] = ()  # top ops of the baseline no longer among the incident's
    faster: bool = False  # the incident's steps are faster than the baseline's

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "summary": self.summary, "step_ms": list(self.step_ms), "parts": [p.to_json() for p in self.parts],
            "ops": [o.to_json() for o in self.ops], "gone": [o.to_json() for o in self.gone], "faster": self.faster,
            "samples_per_second": list(self.samples_per_second),
            "batch_size": list(self.batch_size), "ops_busy": list(self.ops_busy),
            "between_steps": list(self.between_steps), "baseline_trace": self.baseline_trace}
        if self.baseline_id is not None:
            out["baseline_id"] = self.baseline_id
        return out

    @classmethod
    def from_json(cls, data: Any) -> Comparison:
        data = _obj(data, "comparison")
        step = data.get("step_ms")
        if not isinstance(step, list) or len(step) != 3:
            raise ValueError("analysis field 'step_ms' is not a triple")
        before, after, delta = (_num({"v": v}, "v") for v in step)
        return cls(summary=_str(data, "summary"), step_ms=(before, after, delta),
                   parts=tuple(PartChange.from_json(p) for p in _list(data, "parts")),
                   ops=tuple(OpChange.from_json(o) for o in _list(data, "ops")),
                   gone=tuple(OpChange.from_json(o) for o in _list(data, "gone")), faster=data.get("faster") is True,
                   samples_per_second=_pair(data, "samples_per_second"), batch_size=_pair(data, "batch_size"),
                   ops_busy=_pair(data, "ops_busy"), between_steps=_pair(data, "between_steps"),
                   baseline_trace=data.get("baseline_trace") if isinstance(data.get("baseline_trace"), str) else None,
                   baseline_id=data.get("baseline_id") if isinstance(data.get("baseline_id"), str) else None)


@dataclass(frozen=True)
class HostVerdict:
    """The capture's cause where what the host was doing explains the step better than the trace alone
    (``hostcontext.join``): it leads, and the trace's own verdict stays on the lead worker."""

    kind: str
    why: str
    recommendation: str


@dataclass(frozen=True)
class OnsetWindow:
    """One snapshot of a capture taken on pending: its window (Unix ns), steps and what bound them."""

    run: str
    window: tuple[int, int] | None
    steps: int
    cycle_ms: float | None
    bottleneck: str

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "window": list(self.window) if self.window else None, "steps": self.steps,
                "cycle_ms": self.cycle_ms, "bottleneck": self.bottleneck}

    @classmethod
    def from_json(cls, data: Any) -> OnsetWindow:
        data = _obj(data, "onset window")
        window = data.get("window")
        steps = data.get("steps", 0)
        return cls(run=_str(data, "run"), window=(int(window[0]), int(window[1])) if isinstance(window, list)
                   and len(window) == 2 else None, steps=steps if isinstance(steps, int) else 0,
                   cycle_ms=_float(data, "cycle_ms"), bottleneck=_str(data, "bottleneck", "unknown"))


@dataclass(frozen=True)
class Onset:
    """Where a capture taken on pending stands against the drop (daemon/analysis/onset.py): whether it holds the
    drop, when it begins, and the steps before against the steps after."""

    snapshots: int
    holds_drop: bool
    trace_begins_at: float | None = None  # Unix s
    drop_at: float | None = None  # Unix s: in the trace, or the hook's step times' estimate
    first_slow_step_after_drop_s: float | None = None
    summary: str | None = None
    comparison: Comparison | None = None  # the last snapshot before the drop against the slowest after
    windows: tuple[OnsetWindow, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"snapshots": self.snapshots, "holds_drop": self.holds_drop, "trace_begins_at": self.trace_begins_at,
                "drop_at": self.drop_at, "first_slow_step_after_drop_s": self.first_slow_step_after_drop_s,
                "summary": self.summary, "comparison": self.comparison.to_json() if self.comparison else None,
                "windows": [w.to_json() for w in self.windows]}

    @classmethod
    def from_json(cls, data: Any) -> Onset:
        data = _obj(data, "onset")
        snapshots = data.get("snapshots", 0)
        return cls(snapshots=snapshots if isinstance(snapshots, int) else 0, holds_drop=data.get("holds_drop") is True,
                   trace_begins_at=_float(data, "trace_begins_at"), drop_at=_float(data, "drop_at"),
                   first_slow_step_after_drop_s=_float(data, "first_slow_step_after_drop_s"),
                   summary=data.get("summary") if isinstance(data.get("summary"), str) else None,
                   comparison=Comparison.from_json(data["comparison"]) if data.get("comparison") else None,
                   windows=tuple(OnsetWindow.from_json(w) for w in _list(data, "windows")))


@dataclass(frozen=True)
class CaptureAnalysis:
    """A capture's analysis: every worker, the one whose facts lead (the slowest), a straggler, a comparison.

    Its JSON is the lead worker's facts with the capture's own beside them (``workers``, ``straggler``,
    ``window_skew_ms``, ``comparison``) and the capture's summary, which names the straggler and what
    changed from the baseline before the lead's own.
    """

    lead: WorkerAnalysis
    workers: tuple[WorkerAnalysis, ...]
    summary: str
    straggler: Straggler | None = None
    window_skew_ms: float | None = None  # how far apart the workers' profiling sessions started
    window_overlap: float | None = None  # the share of the shortest session that every session covers
    comparison: Comparison | None = None
    host_verdict: HostVerdict | None = None
    onset: Onset | None = None  # a capture taken on pending: where it stands against the drop

    @property
    def one_window(self) -> bool | None:
        """Whether the workers were traced over one window (None if the traces do not say)."""
        return None if self.window_overlap is None else self.window_overlap >= ONE_WINDOW

    @property
    def bottleneck(self) -> str:
        return self.host_verdict.kind if self.host_verdict else self.lead.bottleneck

    @property
    def recommendation(self) -> str:
        return self.host_verdict.recommendation if self.host_verdict else self.lead.recommendation

    @property
    def steps(self) -> int:
        return self.lead.steps

    @property
    def trace(self) -> str:
        return self.lead.trace

    def to_json(self) -> dict[str, Any]:
        out = self.lead.to_json()
        out.update({"summary": self.summary, "workers": [w.to_json() for w in self.workers],
                    "straggler": self.straggler.to_json() if self.straggler else None})
        if self.window_skew_ms is not None:
            out["window_skew_ms"] = self.window_skew_ms
        if self.window_overlap is not None:
            out["window_overlap"], out["one_window"] = self.window_overlap, self.one_window
        if self.comparison is not None:
            out["comparison"] = self.comparison.to_json()
        if self.onset is not None:
            out["onset"] = self.onset.to_json()
        if self.host_verdict is not None:
            out.update({"trace_bottleneck": self.lead.bottleneck, "trace_why": self.lead.why,
                        "trace_summary": self.lead.summary, "trace_recommendation": self.lead.recommendation,
                        "bottleneck": self.host_verdict.kind, "why": self.host_verdict.why,
                        "recommendation": self.host_verdict.recommendation})
        return out

    @classmethod
    def from_json(cls, data: Any) -> CaptureAnalysis:
        """A capture's analysis from its JSON (as printed by the worker or stored in a record); raises
        ValueError naming what is wrong."""
        data = _obj(data, "capture")
        summary, verdict = _str(data, "summary"), None
        if data.get("trace_bottleneck") is not None:  # the host's verdict leads; the trace's is kept beside it
            verdict = HostVerdict(_str(data, "bottleneck"), _str(data, "why"), _str(data, "recommendation"))
            data = {**data, "bottleneck": _str(data, "trace_bottleneck"), "why": _str(data, "trace_why"),
                    "summary": _str(data, "trace_summary"), "recommendation": _str(data, "trace_recommendation")}
        lead = WorkerAnalysis.from_json(data)
        workers = tuple(WorkerAnalysis.from_json(w) for w in _list(data, "workers"))
        lead = next((w for w in workers if w.trace == lead.trace), None) or lead
        return cls(lead=lead, workers=workers or (lead,), summary=summary,
                   straggler=Straggler.from_json(data["straggler"]) if data.get("straggler") else None,
                   window_skew_ms=_float(data, "window_skew_ms"), window_overlap=_float(data, "window_overlap"),
                   comparison=Comparison.from_json(data["comparison"]) if data.get("comparison") else None,
                   host_verdict=verdict, onset=Onset.from_json(data["onset"]) if data.get("onset") else None)
