"""Job-wide capture: every worker of a job, on every host, over one window, gathered into one job record.

The coordinating agent (any agent that got ``{"job": X, "scope": "job"}``, ``tfprofd capture --all-hosts`` or a
job-level alert) finds the agents with a worker of X (``cluster.PeerFinder``: Prometheus, only IPs inside
``alerts.forward_networks``, or the static ``cluster.peers``), measures their round trip (``GET /api/v1/peer``:
the token is checked there too, so a peer with another token is named before anything starts), picks one
start instant far enough ahead for the slowest of them to be asked, and asks each for a capture of its local
workers at that instant (``POST /api/v1/captures`` with ``start_at_ns`` and ``X-Tfprofd-Forwarded-By``: a peer
request never fans out again). Its own workers it captures itself. It then reads each peer's capture record
until it is final and gathers the per-worker results into one ``JobRecord``: every worker by name, the window
skew, the straggler and the part of its step that differs from the median worker, and every peer that
failed, refused or answered late, with why (``partial``: never a silent quarter). The straggler (the one the
``TfprofdStraggler`` alert named, else the slowest by the traces) is compared with the job's median worker over the
same window, part by part and op by op, as a capture is compared with its job's baseline (``analysis.compare``).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from . import outbound
from .analysis.compare import compare
from .analysis.model import CaptureAnalysis, Comparison, WorkerAnalysis
from .captures import CaptureService
from .cluster import JobPeers, PeerFinder
from .errors import CaptureBusy, DomainError, InvalidRequest, NoTrainingJob
from .forwarding import FORWARDED_HEADER
from .records import FINISHED, ID, RecordStore, new_id

log = logging.getLogger("tfprofd.jobcapture")

MIN_LEAD_S = 2.0  # a peer must start its capture worker (a Python process: ~1 s on a busy host) before the instant
RTT_LEADS = 3  # and the request must reach the slowest peer: its measured round trip, three times over
MAX_LEAD_S = 30.0
POLL_S = 0.5
LATE_MS = 50.0  # a worker whose window opened this long after the instant is named
STRAGGLER = 1.2  # the slowest worker's step is this much longer than the median of the others
MAX_ANSWER = 4 * 1024 * 1024
MAX_RUNNING = 8  # job-wide captures at once (each holds a thread per peer while it runs)
LOCAL = "local"


@dataclass(frozen=True)
class WorkerResult:
    """One worker of the job as its agent's capture saw it."""

    worker: str
    peer: str  # the agent's control API address, or "local"
    capture_id: str
    steps: int
    step_ms: float | None  # a step and the time after it (the cycle a synchronous job waits on)
    parts_ms: dict[str, float]  # per step: input_wait, device_compute, ..., between_steps_*
    window_start_ns: int | None


@dataclass(frozen=True)
class Straggler:
    worker: str
    step_ms: float
    median_ms: float  # of the other workers
    part: str  # the part of its step that differs most from the median worker's
    delta_ms: float
    why: str


@dataclass(frozen=True)
class WorkerComparison:
    """The straggler against the job's median worker, traced over the same window: what differs, part by part
    and op by op (``compare``, the median worker in the baseline's place)."""

    worker: str  # the straggler
    peer: str
    reference: str  # the median worker of the others, by step time
    reference_peer: str
    named_by: str  # "alert" (the worker the alert named) or "trace" (the slowest in the capture)
    summary: str
    comparison: Comparison

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerComparison:
        return cls(**{**data, "comparison": Comparison.from_json(data["comparison"])})


@dataclass(frozen=True)
class PeerFailure:
    peer: str
    why: str


@dataclass
class JobRecord:
    id: str
    job: str
    trigger: str
    requested_at: float
    scope: str = "job"
    status: str = "running"  # running, done, partial, failed
    detail: str | None = None
    suspect: str | None = None  # the worker the alert named as the straggler
    start_at_ns: int | None = None
    lead_ms: float | None = None
    peers: list[str] = field(default_factory=list)
    captures: dict[str, str] = field(default_factory=dict)  # peer -> its capture id
    workers: list[WorkerResult] = field(default_factory=list)
    window_skew_ms: float | None = None
    straggler: Straggler | None = None
    comparison: WorkerComparison | None = None  # the straggler against the median worker
    failed: list[PeerFailure] = field(default_factory=list)
    refused: list[PeerFailure] = field(default_factory=list)  # found by Prometheus, outside the allow-list
    late: list[PeerFailure] = field(default_factory=list)  # workers whose window opened after the instant
    finished_at: float | None = None
    first_start_at: float | None = None  # when the first worker's profiling was asked to start (Unix time)

    def public(self) -> dict[str, Any]:
        comparison = self.comparison  # read once: the job's thread may set it meanwhile
        out = asdict(replace(self, comparison=comparison))
        if comparison is not None:
            out["comparison"]["comparison"] = comparison.comparison.to_json()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobRecord:
        """A record from its JSON; raises ValueError (or TypeError, KeyError) if it is not one."""
        values = dict(data)
        values["workers"] = [WorkerResult(**w) for w in values.get("workers", [])]
        values["failed"] = [PeerFailure(**f) for f in values.get("failed", [])]
        values["refused"] = [PeerFailure(**f) for f in values.get("refused", [])]
        values["late"] = [PeerFailure(**f) for f in values.get("late", [])]
        values["straggler"] = Straggler(**values["straggler"]) if values.get("straggler") else None
        values["comparison"] = WorkerComparison.from_dict(values["comparison"]) if values.get("comparison") else None
        record = cls(**values)
        if not ID.fullmatch(record.id) or record.scope != "job":
            raise ValueError(f"{record.id!r} is not a job record")
        return record


class PeerError(Exception):
    """A peer could not be asked or read; the message names why."""


class PeerClient:
    """The control API of the other agents, with the shared token (``outbound``: no proxy, no redirect, one
    deadline for the whole answer)."""

    def __init__(self, token: Callable[[], str], origin: Callable[[], str]):
        self.token = token
        self.origin = origin

    def call(self, peer: str, method: str, path: str, body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
        """(status, the answer's JSON object); raises PeerError when there is none."""
        try:
            status, data, location = outbound.request(
                f"http://{peer}/api/v1{path}", method=method, timeout=timeout, max_bytes=MAX_ANSWER,
                body=json.dumps(body).encode() if body is not None else None,
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token()}",
                         FORWARDED_HEADER: self.origin()})
        except outbound.OutboundError as exc:
            raise PeerError(str(exc)) from None
        if 300 <= status < 400:
            raise PeerError(f"answered {status}, a redirect to {str(location)[:200]!r}, which is not followed: the "
                            "shared token goes only to the agents configured")
        if status == 401:
            raise PeerError("refused the shared token (401): give every agent the same api token")
        try:
            answer = outbound.strict_json(data) if len(data) <= MAX_ANSWER else None
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise PeerError(f"answered {status} with something that is not a tfprofd answer")
        return status, answer


def worker_results(peer: str, record: dict[str, Any]) -> list[tuple[WorkerResult, WorkerAnalysis]]:
    """The per-worker facts of one agent's capture record (its public JSON), each with its analysis: the
    analysis read into the typed model, each worker's trace file named after its profiler address; the record's
    ``targets`` give the worker names. Raises ValueError when the peer's analysis is malformed."""
    names = {re.sub(r"[^A-Za-z0-9.-]", "_", t["address"].rpartition(":")[0].strip("[]"))
             + "_" + t["address"].rpartition(":")[2]: t["worker"] for t in record.get("targets", [])}
    if not record.get("analysis"):
        return []
    analysis = CaptureAnalysis.from_json(record["analysis"])
    targets = record.get("targets", [])
    out = []
    for w in analysis.workers:
        stem = Path(w.trace).name.split(".xplane.pb")[0]
        name = names.get(stem) or (targets[0]["worker"] if len(targets) == 1 else stem or w.host or "?")
        parts = {**(w.breakdown_ms.to_json() if w.breakdown_ms else {}),
                 **(w.between_ms.to_json() if w.between_ms else {})}
        out.append((WorkerResult(worker=str(name), peer=peer, capture_id=str(record.get("id", "")), steps=w.steps,
                                 step_ms=w.cycle_ms if w.steps and w.cycle_ms else None, parts_ms=parts,
                                 window_start_ns=w.window[0] if w.window else None), w))
    return out


def straggler_of(workers: list[WorkerResult]) -> Straggler | None:
    """The slowest worker if its step is STRAGGLER x the others' median, with the part that differs most
    from the median worker's."""
    timed = [w for w in workers if w.step_ms]
    if len(timed) < 2:
        return None
    lead = max(timed, key=lambda w: w.step_ms or 0.0)
    others = [w for w in timed if w is not lead]
    import statistics  # at a job-wide capture only (it loads fractions and decimal: 0.5 MB resident)

    median = statistics.median(w.step_ms or 0.0 for w in others)
    assert lead.step_ms is not None
    if lead.step_ms < STRAGGLER * median:
        return None
    diffs = {p: ms - statistics.median(w.parts_ms.get(p, 0.0) for w in others) for p, ms in lead.parts_ms.items()}
    part = max(diffs, key=lambda p: diffs[p]) if diffs else "other"
    delta = diffs.get(part, lead.step_ms - median)
    why = (f"worker {lead.worker} ({lead.peer}) takes {lead.step_ms:.1f} ms per step against a median of "
           f"{median:.1f} ms on the others: +{delta:.1f} ms per step in {part}")
    return Straggler(lead.worker, lead.step_ms, median, part, delta, why)


def compare_workers(subject: WorkerResult, named_by: str, workers: list[WorkerResult],
                    analyses: dict[tuple[str, str], WorkerAnalysis]) -> WorkerComparison | None:
    """``subject`` against the median worker of the others (by step time; among equals, as in a synchronous job,
    by name), from their analyses; None without another analysed worker or steps to compare."""
    others = sorted((w for w in workers if w is not subject and w.step_ms and (w.peer, w.worker) in analyses),
                    key=lambda w: (w.step_ms or 0.0, w.worker, w.peer))
    mine = analyses.get((subject.peer, subject.worker))
    if not others or mine is None:
        return None
    reference = others[(len(others) - 1) // 2]
    theirs = analyses[(reference.peer, reference.worker)]
    comparison = compare(CaptureAnalysis(theirs, (theirs,), theirs.summary),
                         CaptureAnalysis(mine, (mine,), mine.summary), reference=f"worker {reference.worker}")
    if comparison is None:
        return None
    summary = f"worker {subject.worker} ({subject.peer}) against the median worker {reference.worker} " \
              f"({reference.peer}) over the same window: {comparison.summary}"
    return WorkerComparison(subject.worker, subject.peer, reference.worker, reference.peer, named_by, summary,
                            comparison)


def conclude(record: JobRecord, analyses: dict[tuple[str, str], WorkerAnalysis]) -> None:
    """The record's verdict from every worker traced: window skew, straggler, the comparison, late workers,
    status and detail. The alert's suspect is the worker of that name on this host where there is one (the alert
    came to the straggler's node; workers on other hosts may have the same name), else on any host."""
    record.workers.sort(key=lambda w: w.worker)
    starts = [w.window_start_ns for w in record.workers if w.window_start_ns is not None]
    record.window_skew_ms = (max(starts) - min(starts)) / 1e6 if len(starts) > 1 else None
    record.straggler = straggler_of(record.workers)
    unnamed = None
    if record.suspect is not None:
        named = [w for w in record.workers if w.worker == record.suspect]
        subject = min(named, key=lambda w: w.peer != LOCAL, default=None)
        if subject is None:
            unnamed = f"the alert's straggler, worker {record.suspect!r}, was not traced"
        else:
            record.comparison = compare_workers(subject, "alert", record.workers, analyses)
    elif record.straggler is not None:
        subject = next(w for w in record.workers if w.worker == record.straggler.worker
                       and w.step_ms == record.straggler.step_ms)
        record.comparison = compare_workers(subject, "trace", record.workers, analyses)
    for w in record.workers:
        if w.window_start_ns is not None and record.start_at_ns is not None \
                and (late := (w.window_start_ns - record.start_at_ns) / 1e6) > LATE_MS:
            record.late.append(PeerFailure(w.peer, f"worker {w.worker}'s window opened {late:.0f} ms after the "
                                                   "instant (a busy host: its capture worker started late)"))
    names = ", ".join(f.peer for f in record.failed)
    if not record.workers:
        record.status = "failed"
        record.detail = f"no worker traced; failed: {names}" if names else "no agent has a worker of the job"
    elif record.failed:
        record.status = "partial"
        record.detail = f"{len(record.workers)} worker(s) traced; failed: {names}"
    else:
        record.status = "done"
        record.detail = record.straggler.why if record.straggler else "no straggler"
    if record.comparison is not None:
        record.detail += "; " + record.comparison.summary
    elif unnamed is not None:
        record.detail += "; " + unnamed
    if record.late:
        record.detail += "; late: " + "; ".join(f.why for f in record.late)


class JobCaptures:
    """Runs job-wide captures and keeps their records (``jobs/<id>.json`` under the state directory, reached
    through its descriptor like every other record)."""

    def __init__(self, finder: Callable[[], PeerFinder], captures: CaptureService, store: RecordStore,
                 client: PeerClient, timeouts: Callable[[], tuple[float, float]], keep: Callable[[], int]):
        self.finder = finder
        self.captures = captures
        self.client = client
        self.timeouts = timeouts  # (capture timeout, analysis timeout) of the peers, as this agent's own
        self.keep = keep
        self.agent_id = secrets.token_hex(8)  # tells this agent apart when a peer list names it
        self.state = store.state
        self.state.ensure_dir("jobs", 0o700)
        self._records: dict[str, JobRecord] = {}
        self._lock = threading.Lock()
        for name in self.state.names("jobs"):
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                record = JobRecord.from_dict(json.loads(self.state.read("jobs", name)))
            except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError) as exc:
                self._set_aside(name, f"not a valid job record: {exc}")
                continue
            if record.status == "running":
                record.status, record.detail = "failed", "the agent stopped while this job capture ran"
                record.finished_at = record.finished_at or time.time()
                self._save(record)
            self._records[record.id] = record

    def get(self, record_id: str) -> JobRecord | None:
        with self._lock:
            return self._records.get(record_id)

    def list(self) -> list[JobRecord]:
        with self._lock:
            return list(self._records.values())

    def configured(self) -> bool:
        """Whether this agent can find a job's other agents (cluster.prometheus_url or cluster.peers)."""
        settings = self.finder().settings
        return bool(settings.prometheus_url or settings.peers)

    def start(self, job: str, trigger: str, duration_ms: int | None = None, suspect: str | None = None) -> JobRecord:
        """Find the job's agents and start the capture in the background; the record, ``running``. ``suspect``:
        the worker an alert named as the straggler, compared with the median worker in the record.

        Raises InvalidRequest (no cluster configured, a bad job name), DiscoveryFailed, NoTrainingJob when
        no agent (this one included) has a worker of the job that may be asked, and CaptureBusy while a job-wide
        capture of the job, or MAX_RUNNING of any, run."""
        self.captures.ensure_running()
        finder = self.finder()
        if not finder.settings.prometheus_url and not finder.settings.peers:
            raise InvalidRequest("a job-wide capture needs cluster.prometheus_url or cluster.peers to find the "
                                 "job's other agents")
        found = finder.find(job)
        if not found.peers and job not in self.captures.jobs.jobs():
            refused = "; ".join(f"{r.instance}: {r.why}" for r in found.refused)
            raise NoTrainingJob(f"no agent reports a worker of job {job!r}" + (f" that may be asked ({refused})"
                                                                             if refused else ""))
        now = time.time()
        record = JobRecord(id=new_id(now), job=job, trigger=trigger, requested_at=now, suspect=suspect,
                           refused=[PeerFailure(r.instance, r.why) for r in found.refused])
        with self._lock:
            running = [r for r in self._records.values() if r.status == "running"]
            same = next((r for r in running if r.job == job), None)
            if same is not None:
                raise CaptureBusy(f"a job-wide capture of job {job!r} is running ({same.id}); it ends within minutes")
            if len(running) >= MAX_RUNNING:
                raise CaptureBusy(f"{MAX_RUNNING} job-wide captures are running; ask again when one has ended")
            self._records[record.id] = record
        self._save(record)
        threading.Thread(target=self._run, args=(record, found, duration_ms), daemon=True,
                         name=f"tfprofd-job-{record.id}").start()
        log.info("job capture %s of %s started: %d peer(s) found, %d refused", record.id, job, len(found.peers),
                 len(found.refused))
        return record

    # ---- one job capture ----

    def _run(self, record: JobRecord, found: JobPeers, duration_ms: int | None) -> None:
        try:
            self._capture(record, found, duration_ms)
        except Exception as exc:  # the record ends whatever happens
            log.exception("job capture %s failed unexpectedly", record.id)
            record.status, record.detail = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            record.finished_at = time.time()
            self._save(record)
            self._retain()
            log.info("job capture %s of %s: %s, %d worker(s)%s", record.id, record.job, record.status,
                     len(record.workers), "; " + record.detail if record.detail else "")

    def _capture(self, record: JobRecord, found: JobPeers, duration_ms: int | None) -> None:
        peers = [p.address for p in found.peers]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(64, len(peers)))) as pool:
            pings = dict(zip(peers, pool.map(self._ping, peers), strict=True))
        workers_seen = {p.address for p in found.peers if p.workers}  # by Prometheus; none known for cluster.peers
        reachable: dict[str, float] = {}
        agents: dict[str, str] = {}  # agent id -> the address it is asked at
        seen_here = False
        for peer, (rtt, agent, why) in pings.items():
            if why is not None:
                record.failed.append(PeerFailure(peer, why))
            elif agent == self.agent_id:
                seen_here = seen_here or peer in workers_seen
            elif agent and agent in agents:  # one agent under two addresses (an IP from Prometheus, a name listed)
                log.info("job capture %s: %s is the agent at %s; asked once", record.id, peer, agents[agent])
            else:
                agents[agent] = peer
                reachable[peer] = rtt
        # its own workers: those reporting here, or those Prometheus saw here (a failure is named if they went)
        local = record.job in self.captures.jobs.jobs() or seen_here
        slowest = max(reachable.values(), default=0.0)
        lead = min(MAX_LEAD_S, MIN_LEAD_S + RTT_LEADS * slowest)
        start_at_ns = time.time_ns() + int(lead * 1e9)
        record.start_at_ns, record.lead_ms, record.peers = start_at_ns, lead * 1000, [*reachable, *([LOCAL] * local)]
        self._save(record)
        asked: dict[str, str] = {}
        if local:
            try:
                [mine] = self.captures.request(record.trigger, record.job, None, one_job=True,
                                               duration_ms=duration_ms, start_at_ns=start_at_ns)
                asked[LOCAL] = mine.id
            except DomainError as exc:
                record.failed.append(PeerFailure(LOCAL, exc.reason))
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(64, len(reachable)))) as pool:
            answers = dict(zip(reachable, pool.map(lambda p: self._ask(p, record, duration_ms, p in workers_seen),
                                                   reachable), strict=True))
        for peer, (capture_id, why) in answers.items():
            if capture_id is not None:
                asked[peer] = capture_id
            elif why is not None:
                record.failed.append(PeerFailure(peer, why))
            else:
                record.peers.remove(peer)  # a listed agent with no worker of the job: not part of it
        record.captures = asked
        if asked:
            record.first_start_at = start_at_ns / 1e9
        self._save(record)
        capture_timeout, analysis_timeout = self.timeouts()
        deadline = start_at_ns / 1e9 + (duration_ms or 2000) / 1000 + capture_timeout + analysis_timeout + 10
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(64, len(asked)))) as pool:
            results = dict(zip(asked, pool.map(lambda p: self._follow(p, asked[p], deadline), asked), strict=True))
        analyses: dict[tuple[str, str], WorkerAnalysis] = {}
        for peer, (workers, why) in results.items():
            for worker, analysis in workers:
                record.workers.append(worker)
                analyses.setdefault((worker.peer, worker.worker), analysis)
            if why is not None:
                record.failed.append(PeerFailure(peer, why))
        conclude(record, analyses)

    def _ping(self, peer: str) -> tuple[float, str, str | None]:
        """(round trip in seconds, the peer's agent id, why it cannot be asked or None)."""
        started = time.monotonic()
        try:
            status, answer = self.client.call(peer, "GET", "/peer", timeout=self.finder().settings.timeout)
        except PeerError as exc:
            return 0.0, "", str(exc)
        if status != 200:
            return 0.0, "", f"answered {status}: {outbound.said(answer)}"
        return time.monotonic() - started, str(answer.get("agent", "")), None

    def _ask(self, peer: str, record: JobRecord, duration_ms: int | None,
             workers_seen: bool) -> tuple[str | None, str | None]:
        """(the peer's capture id, or why not; both None for a peer with no worker of the job that none was
        expected on: a static ``cluster.peers`` entry, as the same list given to every agent names them all). An
        answer after the start instant is too late to be in the window. An alert's capture is one there too:
        the peer's holds (a worker died in a capture) apply."""
        assert record.start_at_ns is not None
        start_at_ns = record.start_at_ns
        body: dict[str, Any] = {"job": record.job, "start_at_ns": start_at_ns, "trigger": record.trigger}
        if duration_ms:
            body["duration_ms"] = duration_ms
        try:
            status, answer = self.client.call(peer, "POST", "/captures", body,
                                              timeout=start_at_ns / 1e9 - time.time())
        except PeerError as exc:
            return None, f"not asked in time: {exc} (the start instant came first)" if "no answer" in str(exc) \
                else str(exc)
        if status == 404 and answer.get("code") == "no_training_job" and not workers_seen:
            return None, None
        if status != 202 or not isinstance(answer.get("id"), str) or not ID.fullmatch(answer["id"]):
            return None, f"refused the capture ({status}): {outbound.said(answer)}"
        return answer["id"], None

    def _follow(self, peer: str, capture_id: str,
                deadline: float) -> tuple[list[tuple[WorkerResult, WorkerAnalysis]], str | None]:
        """Read the peer's capture record until it is final: (its workers, why it failed or None)."""
        while True:
            try:
                if peer == LOCAL:
                    mine = self.captures.get(capture_id)
                    status, answer = (200, mine.public()) if mine is not None else (404, {})
                else:
                    status, answer = self.client.call(peer, "GET", f"/captures/{capture_id}",
                                                      timeout=min(5.0, deadline - time.time()))
            except PeerError as exc:
                if time.time() > deadline:
                    return [], f"capture {capture_id}: {exc}"
                time.sleep(POLL_S)
                continue
            if status != 200:
                return [], f"capture {capture_id}: answered {status}: {outbound.said(answer)}"
            if answer.get("status") in FINISHED:
                try:
                    workers = worker_results(peer, answer)
                except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
                    return [], (f"capture {capture_id}: its record is not a capture record ({type(exc).__name__}: "
                                f"{outbound.said(str(exc))})")
                if answer["status"] == "done" and workers:
                    return workers, None
                why = (f"capture {capture_id} {answer.get('status')}: {outbound.said(answer.get('reason'), 100)}: "
                       f"{outbound.said(answer.get('detail'))}")
                return workers, why
            if time.time() > deadline:
                return [], f"capture {capture_id} still {outbound.said(answer.get('status'), 100)} at the deadline"
            time.sleep(POLL_S)

    # ---- records ----

    def _save(self, record: JobRecord) -> None:
        try:
            self.state.write("jobs", f"{record.id}.json", json.dumps(record.public(), indent=1).encode())
        except OSError as exc:
            log.error("job capture %s: cannot save its record: %s", record.id, exc)

    def _retain(self) -> None:
        with self._lock:
            done = sorted((r for r in self._records.values() if r.status != "running"), key=lambda r: r.requested_at)
            gone = done[:max(0, len(done) - self.keep())]
            for record in gone:
                self._records.pop(record.id, None)
        for record in gone:
            try:
                self.state.unlink("jobs", f"{record.id}.json")
            except OSError as exc:
                log.error("job capture %s: its record was not deleted: %s", record.id, exc)

    def _set_aside(self, name: str, why: str) -> None:
        aside = f"{name}.bad-{time.strftime('%Y%m%dT%H%M%S')}"
        try:
            self.state.rename("jobs", name, aside)
            log.error("%s: %s; set aside as %s, starting without it", self.state.path / "jobs" / name, why, aside)
        except OSError as exc:
            log.error("%s: %s; could not set it aside (%s), ignoring it", self.state.path / "jobs" / name, why, exc)
