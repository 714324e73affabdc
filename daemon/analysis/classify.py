"""Naming what bound the steps, in the order the seed guides investigate: input, time between steps,
host-side launch and overhead, transfers, the device; and why that differs from xprof's own conclusion."""

from __future__ import annotations

from dataclasses import dataclass

from .model import Evidence, WorkerAnalysis

# Thresholds, all shares of time, so no verdict hinges on the machine's speed.
INPUT_BOUND = 0.20  # xprof's "highly input-bound"
TRANSFER = 0.10  # host-to-device copies in the step
BETWEEN_STEPS = 0.30  # of the stepping span spent between steps (callbacks, post-processing)
KERNEL_LAUNCH = 0.15  # xprof's "highly kernel-launch bound"
ALL_OTHERS = 0.15  # xprof's "highly all-others bound"
DEVICE_BUSY = 0.50  # the device computes at least half the step
OPS_BUSY = 0.50  # on a CPU, the framework's ops run at least half the step
# Untraced host time inside a CPU step (Python callbacks run inside tf_keras's step marker) is a host cause from
# this share of the step, once it is longer than a framework's fixed per-step overhead (well under 1 ms): the
# Python around a small batch's step is that overhead, not a cause of its own. The time between steps likewise
# (a custom loop's own Python between inferred steps).
UNTRACED_HOST = 0.30
UNTRACED_HOST_MS = 2.0
STRAGGLER = 1.10  # a worker (or GPU) whose steps are 10% slower than the others' median
LAUNCH_THREAD_BUSY = 0.80  # the thread launching a GPU's kernels runs most of the GPU's step
SHORT_KERNEL_US = 50.0  # kernels this short on average finish before the next one is launched
# The evidence a verdict needs before tfprofd recommends a change: steps seen, and the share of the
# capture from the first step to the last.
MIN_STEPS = 3
MIN_SPAN = 0.10

RECOMMENDATIONS = {
    "input": "Make the input pipeline keep up: dataset.map(..., num_parallel_calls=tf.data.AUTOTUNE), "
             ".prefetch(tf.data.AUTOTUNE), interleave reads of several files, cache decoded data, and filter or "
             "preprocess records offline instead of reading data only to drop it.",
    "host": "Cut the host time around each step: run callbacks and post-processing every N steps or move them "
            "into the graph (tf.function, Keras metrics); for kernel-launch latency set "
            "TF_GPU_THREAD_MODE=gpu_private and fuse ops with XLA (jit_compile=True).",
    "transfer": "Overlap host-to-device copies with compute: prefetch to the GPU "
                "(tf.data.experimental.prefetch_to_device), send fewer, larger transfers, and do preprocessing on "
                "the GPU so less data crosses PCIe.",
    "device": "The device is busy computing: speed up the model itself with mixed precision "
              "(keras.mixed_precision.set_global_policy('mixed_float16')), XLA, and Tensor Core-friendly shapes "
              "(multiples of 8); the top device ops below are where to start.",
    "small_batch": "Each step is mostly fixed per-step overhead, not computation: the batch is too small to keep the "
                   "device busy. Increase the batch size (scaling the learning rate) or steps_per_execution.",
    "unknown": "Capture again while the job trains, with step markers (TfprofdCallback, or "
               "tf.profiler.experimental.Trace('train', step_num=n, _r=1) around each step of a custom loop).",
}


LAUNCH_BOUND = ("Launch fewer, longer kernels: compile the step with XLA (jit_compile=True) so its ops fuse, and "
                "raise the batch size so each kernel does more work.")
GPU_PRIVATE_SET = ("Cut the host time around each step: run callbacks and post-processing every N steps or move them "
                   "into the graph (tf.function, Keras metrics); fuse ops with XLA (jit_compile=True). "
                   "TF_GPU_THREAD_MODE=gpu_private is already set (the trace has tf_gpu_private threads).")


@dataclass(frozen=True)
class Verdict:
    """A bottleneck kind, one sentence with its numbers, and what to try."""

    kind: str
    why: str
    recommendation: str = ""

    def __post_init__(self) -> None:
        if not self.recommendation:
            object.__setattr__(self, "recommendation", RECOMMENDATIONS[self.kind])

    @property
    def summary(self) -> str:
        return f"{self.kind}: {self.why}"


def evidence(steps: int, span_share: float | None, capture_seconds: float) -> Evidence:
    """How strong the evidence of ``steps`` spanning ``span_share`` of the capture is."""
    sufficient = steps >= MIN_STEPS and (span_share is None or span_share >= MIN_SPAN)
    return Evidence(steps=steps, span_share=span_share, capture_seconds=capture_seconds, sufficient=sufficient)


def conclude(w: WorkerAnalysis) -> tuple[Verdict, str]:
    """The worker's verdict and its summary; below the evidence floor the summary says so and the
    recommendation asks for a better capture instead of a change."""
    verdict = classify(w)
    ev = w.evidence
    if verdict.kind == "unknown" or ev is None or ev.sufficient:
        return verdict, verdict.summary
    note = f"too little to conclude from {ev.sentence()}"
    advice = (f"Too little to conclude from {ev.sentence()}: capture again for longer while the job trains (at "
              f"least {MIN_STEPS} steps spanning {MIN_SPAN:.0%} of the capture) before changing anything.")
    return Verdict(verdict.kind, verdict.why, advice), f"{verdict.kind} ({note}): {verdict.why}"


def _launch_bound(w: WorkerAnalysis, step: float) -> Verdict | None:
    """A GPU waiting on the host thread that launches its kernels, that thread busy the whole step."""
    launch, b, ms = w.launch, w.breakdown, w.breakdown_ms
    if launch is None or b is None or ms is None or launch.thread_busy < LAUNCH_THREAD_BUSY \
            or launch.mean_kernel_us > SHORT_KERNEL_US:
        return None
    idle = max(0.0, 1 - b.device_compute)
    why = (f"launch-bound: the thread launching {launch.device}'s kernels ({launch.thread.split('/')[0]}) runs "
           f"{launch.thread_busy:.0%} of each {step:.1f} ms step to launch {launch.kernels_per_step:.0f} kernels of "
           f"{launch.mean_kernel_us:.0f} µs each on average, so the GPU computes {b.device_compute:.0%} "
           f"({ms.device_compute:.1f} ms) and waits {idle:.0%} ({step - ms.device_compute:.1f} ms) for the next "
           "kernel")
    if launch.gpu_private:
        why += " (TF_GPU_THREAD_MODE=gpu_private is already set: tf_gpu_private threads)"
        return Verdict("host", why, LAUNCH_BOUND)
    return Verdict("host", why, LAUNCH_BOUND + " Set TF_GPU_THREAD_MODE=gpu_private so launches get threads "
                                               "of their own.")


def classify(w: WorkerAnalysis) -> Verdict:
    """What bound the worker's steps, from its measurements (its verdict fields are not read)."""
    if not w.steps or w.step_time_ms is None or w.breakdown is None or w.breakdown_ms is None:
        return Verdict("unknown", "the profile has no training steps (no step markers, or the job did not train "
                                  "during the capture), so step time cannot be measured")
    b, ms, r = w.breakdown, w.breakdown_ms, w.ratios
    step = w.step_time_ms.mean
    input_bound = w.input_bound_ratio or 0.0
    if input_bound >= INPUT_BOUND:
        if b.host_to_device >= TRANSFER and b.host_to_device > b.input_wait:
            return Verdict("transfer", f"host-to-device copies take {b.host_to_device:.0%} of each {step:.1f} ms step "
                                       f"({ms.host_to_device:.1f} ms)")
        return Verdict("input", f"input-bound: {input_bound:.0%} of each {step:.1f} ms step waits for input "
                                f"({ms.input_wait + ms.host_to_device:.1f} ms)")
    gap = w.between_ms  # per step, the time until the next one
    gap_ms = gap.between_steps_input + gap.between_steps_other if gap is not None else 0.0
    if r.between_steps is not None and r.between_steps >= BETWEEN_STEPS and gap_ms >= UNTRACED_HOST_MS:
        if r.between_steps_input >= 0.5:
            return Verdict("input", f"input-bound outside the step markers: {r.between_steps:.0%} of the time from "
                                    f"the first step to the last is spent between steps, {r.between_steps_input:.0%} "
                                    f"of it waiting for the next batch (steps take {step:.1f} ms)")
        return Verdict("host", f"{r.between_steps:.0%} of the time between the first and last step is spent between "
                               f"steps ({gap_ms:.1f} ms after each: callbacks, post-processing, input made in Python; "
                               f"steps take {step:.1f} ms)",
                       GPU_PRIVATE_SET if w.launch is not None and w.launch.gpu_private else "")
    gpu_private = w.launch is not None and w.launch.gpu_private
    host_advice = GPU_PRIVATE_SET if gpu_private else ""
    if b.kernel_launch >= KERNEL_LAUNCH:
        return Verdict("host", f"kernel launches take {b.kernel_launch:.0%} of each {step:.1f} ms step", host_advice)
    if b.host_to_device >= TRANSFER:
        return Verdict("transfer", f"host-to-device copies take {b.host_to_device:.0%} of each {step:.1f} ms step")
    if w.hardware not in ("CPU_ONLY", ""):
        if b.other >= ALL_OTHERS and b.device_compute < 1 - ALL_OTHERS:
            return _launch_bound(w, step) or Verdict(
                "host", f"{b.other:.0%} of each {step:.1f} ms step ({ms.other:.1f} ms) is untraced host time ('all "
                        f"others': Python, I/O or waiting on other workers) while the GPU computes "
                        f"{b.device_compute:.0%} ({ms.device_compute:.1f} ms)", host_advice)
        if b.device_compute >= DEVICE_BUSY:
            return Verdict("device", f"compute-bound: the GPU computes {b.device_compute:.0%} of each {step:.1f} ms "
                                     f"step ({ms.device_compute:.1f} ms)")
        return Verdict("small_batch", f"the GPU idles {r.device_idle or 0.0:.0%} of each {step:.1f} ms step with no "
                                      "input, host or transfer cause: too little work per step")
    if b.other >= UNTRACED_HOST and ms.other >= UNTRACED_HOST_MS:
        return Verdict("host", f"{b.other:.0%} of each {step:.1f} ms step ({ms.other:.1f} ms) is untraced host time "
                               "inside the step (Python callbacks, post-processing, I/O: 'all others') while the "
                               f"framework's ops run {r.ops_busy or b.host_compute:.0%} of it", host_advice)
    busy = r.ops_busy
    if busy is not None and busy < OPS_BUSY:
        return Verdict("small_batch", f"the framework's ops run only {busy:.0%} of each {step:.2f} ms step: the rest "
                                      "is fixed per-step overhead")
    busy_text = f"ops run {busy:.0%} of the step" if busy is not None else f"host compute {b.host_compute:.0%}"
    return Verdict("device", f"compute-bound: the CPU computes most of each {step:.1f} ms step ({busy_text})")


def versus_xprof(w: WorkerAnalysis, kind: str) -> str | None:
    """Why tfprofd's verdict ``kind`` differs from xprof's own input conclusion, when it does."""
    said = w.xprof_conclusion
    if not said or not w.steps or w.breakdown is None or w.breakdown_ms is None:
        return None
    xprof_input = "input-bound" in said and "NOT input-bound" not in said and "not input-bound" not in said
    mine_input = kind in ("input", "transfer")
    if xprof_input == mine_input:
        return None
    b, ms = w.breakdown, w.breakdown_ms
    ratio = w.input_bound_ratio or 0.0
    if xprof_input and "All Others" in said:
        return (f"xprof counts the {b.other:.0%} 'All Others' time ({ms.other:.1f} ms per step) as possibly "
                f"input; the trace shows no wait for input in the step (input wait {ms.input_wait:.1f} ms, "
                f"host-to-device {ms.host_to_device:.1f} ms), so tfprofd names it {kind}")
    if xprof_input:
        return (f"xprof calls the job input-bound; tfprofd finds {ratio:.0%} of the step waiting "
                f"for input, under its {INPUT_BOUND:.0%} threshold, and names {kind}")
    return (f"xprof does not call the job input-bound; tfprofd finds {ratio:.0%} of the step "
            f"waiting for input ({ms.input_wait + ms.host_to_device:.1f} ms)")
