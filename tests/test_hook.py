"""The training hook with real TensorFlow on CPU, reporting to a real agent process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import GpuState, gpu, job_reporting, metric_value, wait_capture, wait_for

pytestmark = pytest.mark.tf


JOBS = Path(__file__).parent / "jobs"


def train(agent, *args: str, wait: bool = True, env: dict[str, str] | None = None,
          script: Path | None = None) -> subprocess.Popen | dict:
    env = {**os.environ, "TFPROFD_ADDR": f"127.0.0.1:{agent.hook_port}", "PYTHONUNBUFFERED": "1", **(env or {})}
    command = [sys.executable, str(script)] if script else [sys.executable, "-m", "tfprofd.daemon.demo_job"]
    proc = subprocess.Popen([*command, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def counts(agent, job: str) -> tuple[float | None, float | None]:
    text = agent.scrape()
    return (metric_value(text, "tfprofd_training_steps_total", training_job=job, worker="0"),
            metric_value(text, "tfprofd_training_samples_total", training_job=job, worker="0"))


@pytest.mark.parametrize("keras", ["keras3", "tf_keras"])
def test_fit_counts_exact_steps_and_samples_with_steps_per_execution(agents, keras):
    agent = agents()
    # 1000 samples in batches of 32: 31 full batches and one of 8, twice; 7 steps per execution.
    truth = train(agent, "--job", "spe7", "--steps-per-execution", "7", "--samples", "1000", "--epochs", "2",
                  env={"TF_USE_LEGACY_KERAS": "1" if keras == "tf_keras" else "0"})
    assert (truth["steps"], truth["samples"]) == (64, 2000)
    wait_for(lambda: counts(agent, "spe7") == (64, 2000), 5, message=f"exact counts, got {counts(agent, 'spe7')}")
    text = agent.scrape()
    # One histogram observation per step, the last execution of each epoch (4 of 7 steps) included.
    assert metric_value(text, "tfprofd_training_step_duration_seconds_count", training_job="spe7") == 64
    assert metric_value(text, "tfprofd_training_phase", training_job="spe7", phase="idle") == 1
    assert metric_value(text, "tfprofd_training_up", training_job="spe7") == 1
    assert metric_value(text, "tfprofd_training_first_step_seconds", training_job="spe7") > 0
    assert metric_value(text, "tfprofd_hook_reports_rejected_total", reason="invalid_field") == 0
    info = [line for line in text.splitlines() if line.startswith("tfprofd_training_info{")]
    port = truth["profiler"].rpartition(":")[2]  # the agent connects to the loopback address it checked
    assert len(info) == 1 and f'profiler_address="127.0.0.1:{port}"' in info[0]


def run_keras(code: str) -> dict:
    """Run ``code`` (after a common preamble) in a fresh Python with Keras 3; its last stdout line as JSON."""
    preamble = """
import os, json
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import keras, numpy as np, tensorflow as tf
from tfprofd.exporter import hook
x = np.ones((1000, 4), "float32"); y = np.ones((1000, 1), "float32")
"""
    out = subprocess.run([sys.executable, "-c", preamble + code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


KERAS3_FITS = """
class Seen(keras.callbacks.Callback):  # the train function fit() runs, before and after the hook's callback
    def __init__(self, seen):
        super().__init__(); self.seen = seen
    def on_train_begin(self, logs=None): self.seen.append(self.model.train_function)
    def on_train_end(self, logs=None): self.seen.append(self.model.train_function)
class EvaluateMidEpoch(keras.callbacks.Callback):  # resets the model's metrics in the middle of an epoch
    def on_train_batch_end(self, batch, logs=None):
        if batch == 9: self.model.evaluate(x[:70], y[:70], batch_size=10, verbose=0)
callback = hook.TfprofdCallback(job="k3", profiler=False, addr="127.0.0.1:9", interval=0.005)
before, after = [], []
# 1000 samples in batches of 32 (31 and one of 8, not known when traced), 3 epochs, validation, then 77 more.
model.fit(x, y, batch_size=32, epochs=3, validation_data=(x[:100], y[:100]), verbose=0,
          callbacks=[Seen(before), callback, EvaluateMidEpoch(), *extra, Seen(after)])
model.fit(x[:77], y[:77], batch_size=32, epochs=1, callbacks=[callback], verbose=0)
report = callback.reporter.report()
print(json.dumps({"steps": report["steps"], "samples": report["samples"],
                  "train_function_kept": before[0] is after[-1], "in_graph": hasattr(model, "_tfprofd_counter")}))
"""


def test_keras_3_counts_samples_exactly_with_nothing_added_to_its_train_step():
    """Keras 3's train step already adds up every batch size: the hook reads that and keeps Keras's train function."""
    out = run_keras("""
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse", steps_per_execution=3)
extra = []
""" + KERAS3_FITS)
    assert (out["steps"], out["samples"]) == (99, 3077)
    assert out["train_function_kept"] and not out["in_graph"]


def test_a_count_near_its_float_limit_moves_into_the_graph_and_stays_exact():
    """Keras's count is a float, exact below 2**24: past half of that the hook counts in the graph itself."""
    out = run_keras("""
hook._LossTrackerCount.EXACT_BELOW = {"float32": 800}  # 400 samples into an epoch is near the limit
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse", steps_per_execution=3)
class Report(keras.callbacks.Callback):  # what the reporter thread does once a second, at every batch
    def on_train_batch_end(self, batch, logs=None): callback.reporter.report()
extra = [Report()]
""" + KERAS3_FITS)
    assert (out["steps"], out["samples"]) == (99, 3077)
    assert out["in_graph"] and not out["train_function_kept"]


def test_a_count_that_cannot_be_read_never_stops_training_and_the_graph_counts_on():
    """Keras's count turns unreadable mid-epoch: training goes on, stderr says why, the graph counts from the
    next epoch's first batch (the broken epoch's samples are lost, nothing else)."""
    out = run_keras("""
import contextlib, io
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse", steps_per_execution=3)
class Unreadable:
    def numpy(self):
        raise RuntimeError("device lost")
class Break(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 5 and not hasattr(self, "done"):
            self.done = model._tfprofd_tracker.variable = Unreadable()
callback = hook.TfprofdCallback(job="broken", profiler=False, addr="127.0.0.1:9", interval=0.005)
with contextlib.redirect_stderr(io.StringIO()) as err:
    model.fit(x, y, batch_size=32, epochs=3, validation_data=(x[:100], y[:100]), verbose=0,
              callbacks=[callback, Break()])
    model.fit(x[:77], y[:77], batch_size=32, epochs=1, callbacks=[callback], verbose=0)
report = callback.reporter.report()
print(json.dumps({"steps": report["steps"], "samples": report["samples"], "stderr": err.getvalue(),
                  "in_graph": hasattr(model, "_tfprofd_counter")}))
""")
    assert "tfprofd hook: sample count unreadable, counting in the graph: device lost" in out["stderr"]
    assert (out["steps"], out["samples"], out["in_graph"]) == (99, 2 * 1000 + 77, True)


def test_static_batches_of_a_custom_train_step_are_counted_exactly_without_an_op():
    """A train step of the user's own gets the hook's in-graph count, which needs no op for static batches."""
    out = run_keras("""
class Custom(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True)  # 31 batches of 32
model = Custom([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse", steps_per_execution=3)
callback = hook.TfprofdCallback(job="static", profiler=False, addr="127.0.0.1:9")
model.fit(ds, epochs=2, callbacks=[callback], verbose=0)
model.fit(x[:77], y[:77], batch_size=32, epochs=1, callbacks=[callback], verbose=0)  # dynamic: the op counts
report = callback.reporter.report()
print(json.dumps({"steps": report["steps"], "samples": report["samples"], "in_graph": model._tfprofd_counter.read()}))
""")
    assert (out["steps"], out["samples"]) == (65, 62 * 32 + 77)
    assert out["in_graph"] == [77, 3]  # only the steps whose batch size was unknown when traced added to it


def test_mixed_precision_counts_every_batch_and_the_skipped_updates(agents):
    agent = agents()
    truth = train(agent, "--job", "amp", script=JOBS / "mixed_precision.py")
    assert truth == {"batches": 100, "applied": 94, "skipped": 6}  # optimizer.iterations alone says 94 steps

    def seen():
        text = agent.scrape()
        return (metric_value(text, "tfprofd_training_steps_total", training_job="amp"),
                metric_value(text, "tfprofd_training_skipped_steps_total", training_job="amp"),
                metric_value(text, "tfprofd_training_samples_total", training_job="amp"))

    wait_for(lambda: seen() == (100, 6, 800), 10, message=f"100 steps, 6 skipped, 800 samples; got {seen()}")


def test_a_capture_of_a_job_with_steps_per_execution_is_analysed_per_step(agents):
    agent = agents(args=["--captures.baseline", "false"])
    proc = train(agent, "--job", "spe4", "--steps-per-execution", "4", "--seconds", "60", wait=False)
    try:
        wait_for(lambda: job_reporting(agent, "spe4") and (counts(agent, "spe4")[0] or 0) > 50, 120,
                 message="the job to train")
        status, answer = agent.call("POST", "/captures", {"job": "spe4"})
        assert status == 202, answer
        record = wait_capture(agent, answer["id"], timeout=180)
    finally:
        proc.kill()
        proc.wait()
    assert record["status"] == "done", record
    analysis = record["analysis"]
    assert analysis["bottleneck"] != "unknown", analysis["summary"]  # xprof alone finds no steps in this trace
    assert analysis["executions"] > 10 and analysis["steps"] >= 3.5 * analysis["executions"], analysis
    assert analysis["loops_hidden"]


def test_a_capture_while_keras_tensorboard_profiles_is_busy_and_says_why(agents, tmp_path):
    agent = agents(args=["--captures.baseline", "false"])
    proc = train(agent, str(tmp_path / "tb"), script=JOBS / "tensorboard_profile.py", wait=False)
    try:
        wait_for(lambda: (counts(agent, "tensorboard")[0] or 0) > 5, 120, message="Keras to start profiling")
        for mode in ("agent", "server"):
            if mode == "server":
                agent.stop()
                agent.args += ["--captures.mode", "server"]
                agent.start()
                wait_for(lambda: job_reporting(agent, "tensorboard"), 30, message="the job to report again")
            status, answer = agent.call("POST", "/captures", {"job": "tensorboard", "duration_ms": 1000})
            assert status == 202, answer
            record = wait_capture(agent, answer["id"], timeout=120)
            assert (record["status"], record["reason"]) == ("failed", "busy"), record
            assert "Keras TensorBoard callback with profile_batch" in record["detail"], record["detail"]
            assert "No trace event was collected" not in record["detail"]  # xprof's client says that for anything
    finally:
        proc.kill()
        proc.wait()


def test_custom_loop_reports_the_same(agents):
    agent = agents()
    truth = train(agent, "--job", "loop", "--mode", "custom", "--samples", "500", "--epochs", "1")
    assert (truth["steps"], truth["samples"]) == (16, 500)
    wait_for(lambda: counts(agent, "loop") == (16, 500), 5, message=f"exact counts, got {counts(agent, 'loop')}")
    text = agent.scrape()
    assert metric_value(text, "tfprofd_training_step_duration_seconds_count", training_job="loop") == 16


def test_explicit_batch_size_is_exported(agents):
    agent = agents()
    train(agent, "--job", "explicit", "--explicit-batch-size", "--samples", "640", "--epochs", "1")
    wait_for(lambda: counts(agent, "explicit") == (20, 640), 5, message="exact counts")
    assert metric_value(agent.scrape(), "tfprofd_training_batch_size", training_job="explicit") == 32


def test_agent_killed_and_restarted_mid_training(agents):
    agent = agents()
    # long enough for the agent to be back before the job's last report on a busy machine (the seconds count
    # from before the first step's tracing, and the restart waits 2 s and then for the agent to serve)
    proc = train(agent, "--job", "survivor", "--seconds", "20", "--map-delay", "0.0005", wait=False)
    wait_for(lambda: (counts(agent, "survivor")[0] or 0) > 0, 60, message="training to report")
    agent.proc.kill()
    agent.proc.wait()
    time.sleep(2)
    agent.start()  # same ports: the hook finds it again
    assert proc.poll() is None, "the job ended before the agent was back: its last reports went nowhere"
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    truth = json.loads(out.strip().splitlines()[-1])
    wait_for(lambda: counts(agent, "survivor") == (truth["steps"], truth["samples"]), 5,
             message=f"counters to continue to {truth}, got {counts(agent, 'survivor')}")


def test_training_process_is_mapped_to_its_gpu(agents, tmp_path, fakenvml):
    state = GpuState(tmp_path / "nvml.json", [gpu(0), gpu(1)])
    agent = agents(env=state.env())
    proc = train(agent, "--job", "mapped", "--seconds", "20", wait=False)
    try:
        state.update_gpu(1, processes=[{"pid": proc.pid, "used_memory_bytes": 2**30}])
        wait_for(lambda: metric_value(agent.scrape(), "tfprofd_gpu_job_info", gpu="1", training_job="mapped") == 1,
                 60, message="job-to-GPU mapping")
        assert metric_value(agent.scrape(), "tfprofd_gpu_job_info", gpu="0", training_job="mapped") is None
    finally:
        proc.kill()
        proc.wait()


def test_profiler_server_started_by_the_hook_answers_a_capture(agents, tmp_path):
    from xprof.convert import _pywrap_profiler_plugin

    agent = agents()
    proc = train(agent, "--job", "profiled", "--seconds", "25", wait=False)
    try:
        wait_for(lambda: "profiled" in agent.scrape() and metric_value(
            agent.scrape(), "tfprofd_training_steps_total", training_job="profiled"), 60, message="job to report")
        line = next(ln for ln in agent.scrape().splitlines()
                    if ln.startswith("tfprofd_training_info{") and "profiled" in ln)
        address = line.split('profiler_address="')[1].split('"')[0]
        logdir = tmp_path / "profile"
        _pywrap_profiler_plugin.trace(address, str(logdir), "", True, 1000, 3,
                                      {"host_tracer_level": 2, "device_tracer_level": 1, "python_tracer_level": 0,
                                       "delay_ms": 0})
        traces = list(logdir.glob("plugins/profile/*/*.xplane.pb"))
        assert traces and traces[0].stat().st_size > 10_000, traces
    finally:
        proc.kill()
        proc.wait()


def test_hook_module_imports_only_the_standard_library():
    code = ("import sys; import tfprofd.exporter.hook as h; "
            "heavy = {'tensorflow', 'keras', 'numpy', 'prometheus_client', 'psutil', 'yaml'} & set(sys.modules); "
            "print(sorted(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
