"""The open SSE streams of runs the broker evicted, kept for a while without the runs' state.

The broker evicts the least recently active run past ``--max-runs`` (PROTOCOL 6) and the web
drops it too (its records and steps freed), but a run that is still training comes back on
its next frame, and its streams should resume where they were (the hub's catch-up in
:meth:`web.hub.Hub._replace`) instead of ending and reconnecting to a 404. Why it matters:
under a flood of new runs past ``--max-runs``, a live run whose ranks pause longer than the
flood takes to pass it is evicted every such pause (the hostile soak: 17-19 times a minute).
"""
from __future__ import annotations

import logging

from web.runstate import RunState, Subscriber

log = logging.getLogger(__name__)

#: Seconds the SSE streams of a run the broker evicted stay open waiting for it to come back
#: (its next frame reloads it from the journal); then they end, as at once before.
PARK_S = 30.0
#: Evicted runs whose streams are kept open at once; the oldest beyond it end first.
MAX_PARKED_RUNS = 1024


class Parked:
    """One evicted run's open streams and what they have seen (the last id and closed step,
    the header), which the catch-up compares the returning run against."""

    __slots__ = ("subscribers", "seq", "last_step", "header", "since")

    def __init__(self, state: RunState, since: float) -> None:
        self.subscribers = state.subscribers
        self.seq = state.seq
        self.last_step = state.steps.last_step
        self.header = state.header
        self.since = since


class ParkedStreams:
    """Parked runs, oldest first, bounded in time (:data:`PARK_S`) and number
    (:data:`MAX_PARKED_RUNS`). Pure: the hub passes its clock's time."""

    def __init__(self, park_s: float = PARK_S, max_runs: int = MAX_PARKED_RUNS) -> None:
        self.park_s = park_s
        self.max_runs = max_runs
        self._runs: dict[str, Parked] = {}

    def __bool__(self) -> bool:
        return bool(self._runs)

    def __len__(self) -> int:
        return len(self._runs)

    def park(self, state: RunState, now: float) -> None:
        """Keep ``state``'s streams open (newest last), then end what is past the bounds."""
        self._runs.pop(state.run, None)
        self._runs[state.run] = Parked(state, now)
        self.expire(now)

    def take(self, run: str) -> Parked | None:
        """The run came back: its parked streams, no longer parked (None: none)."""
        return self._runs.pop(run, None)

    def forget(self, sub: Subscriber) -> None:
        """A parked stream's client went away (or was dropped)."""
        parked = self._runs.get(sub.run)
        if parked is not None:
            parked.subscribers.discard(sub)

    def expire(self, now: float) -> None:
        """End the streams of runs parked more than ``park_s`` ago, and of the oldest beyond
        ``max_runs``."""
        runs = self._runs
        before = now - self.park_s
        while runs:
            run, parked = next(iter(runs.items()))
            if parked.since > before and len(runs) <= self.max_runs:
                return
            del runs[run]
            for sub in list(parked.subscribers):
                sub.close()
            log.info("run %s did not come back; its %d streams end", run,
                     len(parked.subscribers))

    def close_all(self) -> None:
        """End every parked stream (server shutdown)."""
        for parked in self._runs.values():
            for sub in list(parked.subscribers):
                sub.close()
        self._runs.clear()
