"""A training job on a real GPU for ``make gpu-check``: PyTorch matrix products reported through tfprofd's hook.

The GPU machine has PyTorch but no TensorFlow, so this is the custom-loop hook (``Reporter``, standard library
only) around a step of bf16 matrix products. Three phases of ``--seconds`` each: full speed; ``slowed``, the
host idle for as long as each step computes (the straggler of a synchronous job, whose GPU waits for its host);
``waiting``, a kernel that spins as long as each step computes (its peers, whose GPUs wait in the all-reduce
for the straggler: NCCL's kernels spin like this). It prints one JSON line per phase start so the checker can
split its scrapes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", required=True, help="the agent's hook socket, unix:/path")
    parser.add_argument("--site", required=True, help="where tfprofd is installed (.gpu-check/site)")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--job", default="gpu-check")
    parser.add_argument("--worker", default="worker-0")
    options = parser.parse_args()
    sys.path.append(options.site)  # after the framework's own packages: only the hook is taken from there
    import torch

    from tfprofd.exporter.hook import Reporter

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    batch = 64
    for _ in range(50):  # clocks up before the spinning kernel is timed
        a @ b
    torch.cuda.synchronize()
    started = time.perf_counter()
    torch.cuda._sleep(100_000_000)  # cycles: how many the spinning kernel takes per second of waiting
    torch.cuda.synchronize()
    cycles_per_second = 100_000_000 / (time.perf_counter() - started)
    with Reporter(job=options.job, worker=options.worker, addr=options.addr, profiler=False) as reporter:
        for phase in ("full", "slowed", "waiting"):
            print(json.dumps({"phase": phase, "time": time.time()}), flush=True)
            ends = time.monotonic() + options.seconds
            while time.monotonic() < ends:
                with reporter.step(batch_size=batch):
                    started = time.perf_counter()
                    for _ in range(20):
                        a @ b
                    torch.cuda.synchronize()
                    computed = time.perf_counter() - started
                    if phase == "slowed":
                        time.sleep(computed)
                    elif phase == "waiting":
                        torch.cuda._sleep(int(computed * cycles_per_second))
                        torch.cuda.synchronize()
        print(json.dumps({"phase": "end", "time": time.time()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
