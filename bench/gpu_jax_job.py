"""A JAX training job for ``make gpu-check``'s capture part: the agent captures it over gRPC and analyses it.

The GPU machine has JAX with CUDA but no TensorFlow. JAX's profiler server is the same ``ProfilerService`` as
TensorFlow's (both are tsl's), so the agent captures it exactly as it captures a TensorFlow job, and the trace
holds the GPU's kernels and copies as CUPTI recorded them. The job is a two-layer MLP trained by SGD (one jitted
step), its steps marked as TensorFlow's are (``StepTraceAnnotation``) and counted by the hook's ``Reporter``.
Two phases of ``--seconds`` each: ``compute``, every step on a batch already on the GPU (the GPU bounds the
step); ``input``, each batch made on the host by NumPy before its step and copied to the GPU (the input bounds
it: the GPU waits between steps). It prints one JSON line per phase start so the checker can time its captures.
On a machine without a GPU it runs on the CPU with small sizes (the checker's own test).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", required=True, help="the agent's hook socket, unix:/path")
    parser.add_argument("--site", required=True, help="where tfprofd is installed (.gpu-check/site)")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--profiler-port", type=int, required=True)
    parser.add_argument("--job", default="gpu-check-jax")
    parser.add_argument("--worker", default="worker-0")
    parser.add_argument("--selftest", metavar="DIR", help="only trace 1 s of steps with JAX's own profiler into DIR "
                        "and print the trace's planes (does JAX's profiler work on this machine?)")
    options = parser.parse_args()
    sys.path.append(options.site)  # after the framework's own packages: only the hook is taken from there
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tfprofd.exporter.hook import Reporter

    gpu = jax.default_backend() == "gpu"
    batch, width = (4096, 8192) if gpu else (64, 256)
    dtype = jnp.bfloat16 if gpu else jnp.float32
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = (jax.random.normal(keys[0], (width, width), dtype) / width ** 0.5,
              jax.random.normal(keys[1], (width, width), dtype) / width ** 0.5)
    on_device = jax.random.normal(keys[2], (batch, width), dtype)

    def loss(params, x):
        hidden = jax.nn.relu(x @ params[0])
        return jnp.mean(jnp.square((hidden @ params[1]).astype(jnp.float32)))

    @jax.jit
    def train_step(params, x):
        grads = jax.grad(loss)(params, x)
        return tuple(p - 1e-3 * g.astype(p.dtype) for p, g in zip(params, grads, strict=True))

    rng = np.random.default_rng(0)

    def host_batch():
        """The input pipeline: a batch decoded on the host (NumPy) and copied to the GPU."""
        return jax.device_put(rng.standard_normal((batch, width), dtype=np.float32).astype(dtype))

    params = train_step(params, on_device)  # compiled before the phases
    jax.block_until_ready(params)
    if options.selftest:
        with jax.profiler.trace(options.selftest):
            ends = time.monotonic() + 1
            while time.monotonic() < ends:
                params = train_step(params, on_device)
                jax.block_until_ready(params)
        from tfprofd.daemon.protos import xplane_pb2

        for path in Path(options.selftest).rglob("*.xplane.pb"):
            space = xplane_pb2.XSpace.FromString(path.read_bytes())
            print(json.dumps({"selftest": path.stat().st_size, "planes": {
                plane.name: sum(len(line.events) for line in plane.lines) for plane in space.planes}}))
        return 0
    jax.profiler.start_server(options.profiler_port)
    reporter = Reporter(job=options.job, worker=options.worker, addr=options.addr, profiler=False)
    reporter.profiler_address = f"localhost:{options.profiler_port}"
    step = 0
    with reporter:
        for phase in ("compute", "input"):
            print(json.dumps({"phase": phase, "time": time.time(), "backend": jax.default_backend(),
                              "device": str(jax.devices()[0])}), flush=True)
            ends = time.monotonic() + options.seconds
            while time.monotonic() < ends:
                with reporter.step(batch_size=batch):
                    x = host_batch() if phase == "input" else on_device
                    step += 1
                    with jax.profiler.StepTraceAnnotation("train", step_num=step):
                        params = train_step(params, x)
                        jax.block_until_ready(params)
        print(json.dumps({"phase": "end", "time": time.time()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
