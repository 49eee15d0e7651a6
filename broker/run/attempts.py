"""Attempts (PROTOCOL.md 8.1): a restarted or resumed job is one run.

A job restarted by its launcher (torchrun ``--max-restarts``, Slurm ``--requeue``, the same
``RANKBOARD_RUN`` resubmitted) comes back in new processes under the same run id. The agent
sends a random id of its process in every ``register`` (``proc``); the broker tells a new
process of a rank from the same one registering again by it, and starts a new **attempt**:

* a ``register`` with a non-empty ``proc`` starts attempt k+1 when its rank already has a
  process in attempt k and the ``proc`` differs, or its rank is >= the run's world size and
  its ``world_size`` is larger (a job that came back larger); its ``world_size`` becomes the
  run's;
* a ``register`` whose ``proc`` was a process of attempt k-1 has no effect but its counter
  (``old_proc``: an old process still shutting down), as has a frame other than ``register``
  from a rank that has not registered in the current attempt (past attempt 0);
* at most :data:`MAX_ATTEMPTS_PER_MINUTE` attempts start a minute (``attempt_rate``): a
  crash loop must not churn the run's state at the rate of its registers.

:class:`Attempts` is the bookkeeping (the current attempt's processes, the header's
``attempts`` list, bounded); the attempt rules (methods of :class:`broker.run.sink.RunSink`)
decides on a frame before anything changes (a rejection stays side-effect free) and, when an
attempt starts, ends the previous one: its pending steps close as at a run end, its
incomplete epochs are dropped, and what belongs to processes starts afresh. Rewinds (a new
attempt closing steps an older one closed) are :mod:`broker.run.steps.line`'s.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Deque, Dict, List, Optional, Set

from broker.run.events import Rejected
from rank_agent.protocol import Register

__all__ = ["Attempts", "MAX_ATTEMPTS_PER_MINUTE", "MAX_LISTED_ATTEMPTS",
           "restart_message"]

#: Attempts a run may start in any 60 s (8.1); past it a starting register is ``attempt_rate``.
MAX_ATTEMPTS_PER_MINUTE = 10
#: The header's ``attempts`` lists the first and the latest ``MAX_LISTED_ATTEMPTS - 1``.
MAX_LISTED_ATTEMPTS = 1000


def restart_message(k1: int, prev: Dict[str, Any]) -> str:
    """The ``restart`` alert's message (8.1) for attempt ``k1`` (1-based as the wire's k+1),
    from the previous attempt's entry."""
    if prev["last_step"] is not None:
        return f"restart {k1}: the previous attempt reached step {prev['last_step']}"
    if prev["last_epoch"] is not None:
        return f"restart {k1}: the previous attempt reached epoch {prev['last_epoch']}"
    return f"restart {k1}: the previous attempt closed nothing"


def new_entry(attempt: int, started_at: Optional[float],
              world_size: Optional[int]) -> Dict[str, Any]:
    """One ``attempts`` entry as the header lists it, for an attempt that just began."""
    return {"attempt": attempt, "started_at": started_at, "ended_at": None,
            "world_size": world_size, "first_step": None, "last_step": None,
            "first_epoch": None, "last_epoch": None, "superseded_steps": 0,
            "superseded_epochs": 0, "cause": None}


class Attempts:
    """One run's attempts: the current one's processes and registered ranks, the previous
    one's processes (``old_proc``), the start times of the last minute (``attempt_rate``)
    and the listed entries (the first, then the latest ``MAX_LISTED_ATTEMPTS - 1``; an entry
    is a dict, the header's form, updated in place while its attempt is listed)."""

    __slots__ = ("current", "procs", "registered", "previous", "starts", "first", "latest")

    def __init__(self) -> None:
        self.current = 0
        #: rank -> its process in the current attempt (first non-empty ``proc``)
        self.procs: Dict[int, str] = {}
        #: ranks that sent a ``register`` in the current attempt
        self.registered: Set[int] = set()
        #: processes of the previous attempt
        self.previous: Set[str] = set()
        #: receive times of the attempts started in the last minute
        self.starts: Deque[float] = deque()
        self.first = new_entry(0, None, None)
        self.latest: Deque[Dict[str, Any]] = deque(maxlen=MAX_LISTED_ATTEMPTS - 1)

    def entry(self, attempt: int) -> Optional[Dict[str, Any]]:
        """The listed entry of ``attempt`` (None: never was, or no longer listed)."""
        if attempt == 0:
            return self.first
        latest = self.latest
        if latest and latest[0]["attempt"] <= attempt <= latest[-1]["attempt"]:
            return latest[attempt - latest[0]["attempt"]]
        return None

    @property
    def now(self) -> Dict[str, Any]:
        """The current attempt's entry."""
        return self.latest[-1] if self.latest else self.first

    def listed_entries(self) -> List[Dict[str, Any]]:
        """The listed entries themselves (to update in place)."""
        return [self.first, *self.latest]

    def listed(self) -> List[Dict[str, Any]]:
        """The header's ``attempts``: copies (an event's data must not change later)."""
        out = [dict(self.first)]
        out.extend(dict(e) for e in self.latest)
        return out

    def decide(self, frame: Register, world_size: Optional[int], now: float) -> bool:
        """True when ``frame`` starts an attempt; raises :class:`Rejected` (``old_proc``,
        ``attempt_rate``) for one that has no effect but its counter. Changes nothing."""
        proc = frame.proc
        if not proc:
            return False
        if proc in self.previous:
            raise Rejected("old_proc", f"rank {frame.rank}: a process of attempt "
                                       f"{self.current - 1} registers again")
        mine = self.procs.get(frame.rank)
        start = (mine is not None and mine != proc) or (
            world_size is not None and frame.rank >= world_size and frame.world_size > world_size)
        if not start:
            return False
        starts = self.starts
        while starts and starts[0] <= now - 60.0:
            starts.popleft()
        if len(starts) >= MAX_ATTEMPTS_PER_MINUTE:
            raise Rejected("attempt_rate", f"rank {frame.rank}: more than "
                                           f"{MAX_ATTEMPTS_PER_MINUTE} attempts a minute")
        return True

    def registered_now(self, frame: Register) -> None:
        """An accepted register of the current attempt."""
        self.registered.add(frame.rank)
        if frame.proc and frame.rank not in self.procs:
            self.procs[frame.rank] = frame.proc

    def begin(self, now: float, world_size: int) -> Dict[str, Any]:
        """Attempt k+1 begins at ``now``; returns the entry of attempt k (ended now)."""
        prev = self.now
        prev["ended_at"] = now
        self.previous = set(self.procs.values())
        self.procs = {}
        self.registered = set()
        self.current += 1
        self.starts.append(now)
        self.latest.append(new_entry(self.current, now, world_size))
        return prev
