"""The registry of training jobs: the processes the hook reports, joined with NVML's per-GPU process list
and, on Kubernetes, with the pods the kubelet gave each GPU.

It answers the two questions the rest of the agent asks: "is a job training here?" (rules gate on it)
and "which processes do I capture for this job or GPU?" (captures target them). It learns from the
training and NVML snapshots (it subscribes to both) and never reaches into a collector.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from tfprofd.exporter.base import gauge
from tfprofd.exporter.kubernetes import PodDevice, PodDevices
from tfprofd.exporter.nvml import GpuProcesses
from tfprofd.exporter.training import ProcessView, TrainingProcesses

from .errors import NoProfiler, NoTrainingJob
from .sampler import Snapshot


@dataclass(frozen=True)
class Target:
    """One training process to profile."""

    job: str
    worker: str
    address: str  # the profiler server's host:port, checked by the training collector


class JobRegistry:
    def __init__(self) -> None:
        self._facts: dict[str, tuple[Any, ...]] = {}  # collector -> the facts of its latest sample
        self._processes: tuple[ProcessView, ...] = ()
        self._gpus: tuple[tuple[str, str, frozenset[int]], ...] = ()
        self._pods: tuple[PodDevice, ...] = ()
        self._mig_parents: dict[str, str] = {}  # MIG UUID -> its GPU's index
        self._minors: dict[int, str] = {}  # GPU minor number (/dev/nvidiaN) -> its index
        # what is_training asks, derived once per snapshot: the rules ask it for every series they
        # evaluate, and a scan of 1,000 jobs per series made each sample O(jobs²) (issue 24)
        self._training: set[tuple[str, str]] = set()  # (job, worker) of every training process
        self._training_jobs: frozenset[str] = frozenset()
        self._gpus_mapped = False  # NVML lists a reporting process on some GPU
        self._training_gpus: set[str] = set()  # GPUs where NVML lists a training process
        self._pids: set[int] = set()  # of every reporting process
        self._training_pids: set[int] = set()
        self._derived_from: list[TrainingProcesses] = []  # the facts the sets above were derived from
        self._lock = threading.Lock()

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """A collector's new sample replaces everything it said before (a failed sample says nothing)."""
        with self._lock:
            if not snapshot.facts and not self._facts.get(snapshot.collector, ()):
                self._facts[snapshot.collector] = ()
                return  # a collector with no facts (cpu, disk...) changes nothing: no need to derive again
            self._facts[snapshot.collector] = snapshot.facts
            self._derive()

    def forget(self, collector: str) -> None:
        """Drop what a collector said: it was disabled, and its jobs, GPUs or pods are no longer known."""
        with self._lock:
            self._facts.pop(collector, None)
            self._derive()

    def _derive(self) -> None:
        facts = [f for source in self._facts.values() for f in source]
        reported = [f for f in facts if isinstance(f, TrainingProcesses)]
        if list(map(id, reported)) != list(map(id, self._derived_from)):  # the same objects (kept: ids stay theirs)
            # the processes' sets only when the training facts are new: NVML's sample each interval found them
            # as they were, and 1,000 jobs' were made again for it (issue 24)
            self._derived_from = reported
            self._processes = tuple(p for f in reported for p in f.processes)
            training = [p for p in self._processes if p.training]
            self._training = {(p.job, p.worker) for p in training}
            self._training_jobs = frozenset(job for job, _ in self._training)
            self._pids = {p.pid for p in self._processes}
            self._training_pids = {p.pid for p in training}
        self._gpus = tuple(g for f in facts if isinstance(f, GpuProcesses) for g in f.gpus)
        self._pods = tuple(d for f in facts if isinstance(f, PodDevices) for d in f.devices)
        self._mig_parents = {m: g for f in facts if isinstance(f, GpuProcesses) for m, g in f.mig_parents}
        self._minors = {minor: g for f in facts if isinstance(f, GpuProcesses) for minor, g in f.minors}
        self._gpus_mapped = any(self._pids & ids for _, _, ids in self._gpus)
        self._training_gpus = {gpu for gpu, _, ids in self._gpus if self._training_pids & ids}

    def _job_gpus(self) -> list[tuple[str, str, ProcessView]]:
        """(gpu, uuid, process) for every reporting process NVML lists on a GPU (joined on pid; only a pid
        the training collector verified is this process's in the agent's namespace, never a pod's own)."""
        with self._lock:
            processes, gpus = self._processes, self._gpus
        by_pid: dict[int, list[ProcessView]] = {}
        for p in processes:
            if not p.pid_verified:
                continue
            by_pid.setdefault(p.pid, []).append(p)
        return [(gpu, uuid, p) for gpu, uuid, pids in gpus for pid in sorted(pids) for p in by_pid.get(pid, ())]

    def gpus_listed(self) -> bool:
        """Whether NVML lists any GPU on this host (False where it cannot be read)."""
        with self._lock:
            return bool(self._gpus)

    def is_training(self, labels: dict[str, str]) -> bool:
        """Whether a job trains where a signal's series is: its job, its GPU, or anywhere on the host."""
        with self._lock:
            if "training_job" in labels:
                if "worker" in labels:
                    return (labels["training_job"], labels["worker"]) in self._training
                return labels["training_job"] in self._training_jobs
            if "gpu" in labels and self._gpus_mapped:  # NVML lists reporting processes: only a job on this GPU
                return labels["gpu"] in self._training_gpus
            return bool(self._training)

    def targets(self, job: str | None, gpu: str | None) -> list[list[Target]]:
        """The captures to start for a job, a GPU, or (neither) every job: one list of targets per job.

        Raises NoTrainingJob when no reporting job matches, NoProfiler when none has a profiler server.
        """
        with self._lock:
            processes = list(self._processes)
        if gpu is not None:
            on_gpu = {(p.job, p.worker, p.pid) for g, _, p in self._job_gpus() if g == str(gpu)}
            if on_gpu:
                processes = [p for p in processes if (p.job, p.worker, p.pid) in on_gpu]
        if job is not None:
            processes = [p for p in processes if p.job == job]
            if not processes:
                raise NoTrainingJob(f"no training job {job!r} is reporting to this agent")
        if not processes:
            raise NoTrainingJob("no training job is reporting to this agent")
        groups: dict[str, dict[str, Target]] = {}
        for p in sorted(processes, key=lambda p: (p.job, p.worker, p.pid)):
            if p.profiler:
                groups.setdefault(p.job, {})[p.profiler] = Target(p.job, p.worker, p.profiler)
        if not groups:
            raise NoProfiler("the training job has no profiler server the agent may use (hook started with "
                             "profiler=False, or its reports were not trusted)")
        return [list(g.values()) for _, g in sorted(groups.items())]

    def processes(self, job: str) -> list[ProcessView]:
        """The job's reporting processes (pid, whether the kernel vouched for it, its profiler)."""
        with self._lock:
            return [p for p in self._processes if p.job == job]

    def local_pids(self) -> dict[str, list[int]]:
        """Each job's pids that reported over the local socket (the kernel vouched for them), sorted; jobs with
        none are left out. One pass: asking ``processes`` job by job scanned every process for every job."""
        with self._lock:
            processes = self._processes
        pids: dict[str, list[int]] = {}
        for p in processes:
            if p.local:
                pids.setdefault(p.job, []).append(p.pid)
        return {job: sorted(found) for job, found in pids.items()}

    def jobs(self) -> set[str]:
        with self._lock:
            return {p.job for p in self._processes}

    def throughput(self, job: str) -> tuple[float | None, float | None]:
        """(samples/s of the job's training processes summed, their mean declared batch size), if known."""
        with self._lock:
            processes = [p for p in self._processes if p.job == job and p.training]
        rates = [p.samples_per_second for p in processes if p.samples_per_second is not None]
        batches = [p.batch_size for p in processes if p.batch_size]
        return (sum(rates) if rates else None), (sum(batches) / len(batches) if batches else None)

    def training_jobs(self) -> frozenset[str]:
        """The jobs with a process that trains (as derived from the latest sample, not made again per call)."""
        with self._lock:
            return self._training_jobs

    def _gpu_pods(self) -> list[tuple[str, str, PodDevice]]:
        """(gpu, uuid, pod device) for every GPU device the kubelet assigned, with NVML's index for its UUID
        (or its UUID for an index, where the device plugin or CDI names GPUs by index, or for a minor number,
        where a DRA driver does; a MIG device gets its GPU's index, and its own UUID or none); unknown parts
        are ""."""
        with self._lock:
            gpus, pods, mig_parents, minors = self._gpus, self._pods, self._mig_parents, self._minors
        index_of = {**mig_parents, **{uuid: gpu for gpu, uuid, _ in gpus}}
        uuid_of = {gpu: uuid for gpu, uuid, _ in gpus}
        located = []
        for d in pods:
            if d.minor is not None or d.device_id.isdigit():
                gpu = minors.get(d.minor, "") if d.minor is not None else d.device_id
                located.append((gpu, "" if d.mig else uuid_of.get(gpu, ""), d))
            else:
                located.append((index_of.get(d.device_id, ""), d.device_id, d))
        return located

    def collect(self) -> Iterator[Metric]:
        rows = sorted({(gpu, uuid, p.job, p.worker) for gpu, uuid, p in self._job_gpus()})
        yield gauge("gpu_job_info", "Which training job runs on which GPU (by NVML process list); the value is 1.",
                    ["gpu", "uuid", "training_job", "worker"], ((row, 1) for row in rows))
        gpu_pods = self._gpu_pods()
        if not gpu_pods:
            return
        yield gauge("gpu_pod_info", "Which Kubernetes pod and container holds which GPU (kubelet PodResources); "
                    "the value is 1.", ["gpu", "uuid", "namespace", "pod", "container"],
                    (((gpu, uuid, d.namespace, d.pod, d.container), 1) for gpu, uuid, d in gpu_pods))
        pods_by_uuid: dict[str, set[tuple[str, str, str]]] = {}
        for _, uuid, d in gpu_pods:
            pods_by_uuid.setdefault(uuid, set()).add((d.namespace, d.pod, d.container))
        job_pods = sorted({(p.job, p.worker, *pod) for _, uuid, p in self._job_gpus()
                           for pod in pods_by_uuid.get(uuid, ())})
        yield gauge("training_pod_info", "Which Kubernetes pod a training job's worker runs in (the pod holding "
                    "the GPU its process uses); the value is 1.",
                    ["training_job", "worker", "namespace", "pod", "container"], ((row, 1) for row in job_pods))
