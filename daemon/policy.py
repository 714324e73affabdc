"""The capture policy: the one place that says whether a capture may start now.

It owns the processes being captured (one capture per process at a time), the cooldown of each
(rule, target), the hourly budget, the jobs held from automatic captures after a process died during
one, and the alerts already handled (persisted, so an agent restart does not capture an alert twice).
All times are monotonic, except the alert ledger's, which must survive a restart.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tfprofd.exporter.base import Clock

from .errors import BudgetSpent, CaptureBusy, CaptureHeld, CoolingDown
from .jobs import Target
from .records import read_nofollow, set_aside, write_private

log = logging.getLogger("tfprofd.policy")

ALERTS_KEPT = 1000
HOUR = 3600.0


@dataclass(eq=False)
class Admission:
    """Leave to run one capture; hand it back with ``release`` (once: a second release is a no-op, so it can
    never clear the busy mark of a later capture of the same processes)."""

    addresses: frozenset[str]
    started: float
    released: bool = False


class CapturePolicy:
    def __init__(self, clock: Clock, alerts_path: Path):
        self.clock = clock
        self._busy: set[str] = set()
        self._started: deque[float] = deque()
        self._cooldown_until: dict[tuple[str, frozenset[str]], float] = {}
        self._lifted_until: dict[tuple[str, frozenset[str]], float] = {}  # a lifted cooldown's own end
        self._held_until: dict[str, float] = {}  # job -> monotonic end of its hold
        self._lock = threading.Lock()
        self._alerts_path = alerts_path
        self._alerts: OrderedDict[str, float] = self._load_alerts()

    def admit(self, targets: Sequence[Target], max_per_hour: int | None, rule: str | None = None,
              cooldown: float = 0.0, automatic: bool = False) -> Admission:
        """Raises CaptureBusy, CaptureHeld, CoolingDown or BudgetSpent; checks and books in one step.
        ``max_per_hour`` None: outside the hourly budget (baselines, which keep a schedule of their own).
        ``automatic``: asked by a rule, an alert or the baseline schedule, not by a person."""
        addresses = frozenset(t.address for t in targets)
        job = targets[0].job if targets else ""
        now = self.clock.monotonic()
        with self._lock:
            busy = sorted(addresses & self._busy)
            if busy:
                raise CaptureBusy(f"a capture of {', '.join(busy)} is already running")
            held = self._held_until.get(job, -math.inf) - now
            if automatic and held > 0:
                raise CaptureHeld(f"a process of job {job} died during its last capture (or just after it): no "
                                  f"automatic capture of it for {held:.0f}s more (captures.hold); a manual capture "
                                  "still runs")
            key = (rule, addresses) if rule else None
            if key is not None and now < self._cooldown_until.get(key, -math.inf):
                raise CoolingDown(f"rule {rule} captured {', '.join(sorted(addresses))} less than its cooldown "
                                  f"ago ({self._cooldown_until[key] - now:.0f}s left)")
            while self._started and now - self._started[0] >= HOUR:
                self._started.popleft()
            if max_per_hour is not None and len(self._started) >= max_per_hour:
                raise BudgetSpent(f"capture limit reached: {max_per_hour} per hour (captures.max_per_hour)")
            if max_per_hour is not None:
                self._started.append(now)
            self._busy |= addresses
            if key is not None:
                self._cooldown_until[key] = now + cooldown
                self._cooldown_until = {k: t for k, t in self._cooldown_until.items() if t > now}
            return Admission(addresses, now)

    def release(self, admission: Admission, refund: bool = False) -> None:
        """The capture ended (or never started: ``refund`` gives its place in the hourly budget back)."""
        with self._lock:
            if admission.released:
                return
            admission.released = True
            self._busy -= admission.addresses
            if refund:
                try:
                    self._started.remove(admission.started)
                except ValueError:
                    pass

    def forgive(self, rule: str, addresses: frozenset[str]) -> bool:
        """Lift the cooldown a rule's capture booked: it found other processes starving the job (host
        contention), not the job's own cause, which the rule may capture when it next fires; or, taken when the
        rule went pending, it failed, and the firing may capture on its own. Once per cooldown:
        a second contended capture within the span of the lifted one keeps its cooldown, so a host that stays
        busy gets at most two captures a cooldown from the rule, and noise cannot spend the hourly budget that
        the other rules share. Whether a cooldown was lifted."""
        key = (rule, addresses)
        now = self.clock.monotonic()
        with self._lock:
            self._lifted_until = {k: t for k, t in self._lifted_until.items() if t > now}
            if key in self._lifted_until:
                return False
            until = self._cooldown_until.pop(key, None)
            if until is None:
                return False
            self._lifted_until[key] = until
            return True

    def hold(self, job: str, seconds: float) -> None:
        """No automatic capture of ``job`` for ``seconds`` (a process of it died during or just after a capture)."""
        with self._lock:
            now = self.clock.monotonic()
            self._held_until = {j: t for j, t in self._held_until.items() if t > now}
            if seconds > 0:
                self._held_until[job] = now + seconds

    def held(self) -> dict[str, float]:
        """Jobs held from automatic captures, with the seconds left."""
        now = self.clock.monotonic()
        with self._lock:
            return {job: until - now for job, until in self._held_until.items() if until > now}

    def busy(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._busy)

    # ---- alerts handled (fingerprint + startsAt), persisted ----

    def _load_alerts(self) -> OrderedDict[str, float]:
        try:
            data = json.loads(read_nofollow(self._alerts_path))
        except FileNotFoundError:
            return OrderedDict()
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
            set_aside(self._alerts_path, f"unreadable alert ledger: {exc}")
            return OrderedDict()
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                                 and not isinstance(v, bool) for k, v in data.items()):
            set_aside(self._alerts_path, "alert ledger is not an object of alert keys to times")
            return OrderedDict()
        return OrderedDict(sorted(data.items(), key=lambda kv: kv[1])[-ALERTS_KEPT:])

    def alert_handled(self, key: str) -> bool:
        with self._lock:
            return key in self._alerts

    def remember_alert(self, key: str) -> None:
        """Record an alert as handled (a capture for it started, or it was deliberately let go)."""
        with self._lock:
            self._alerts[key] = self.clock.time()
            self._alerts.move_to_end(key)
            while len(self._alerts) > ALERTS_KEPT:
                self._alerts.popitem(last=False)
            data = json.dumps(self._alerts).encode()
        try:
            write_private(self._alerts_path, data)
        except OSError as exc:  # dedupe still holds in memory; after a restart a retry may capture again
            log.error("cannot save the alert ledger %s: %s", self._alerts_path, exc)
