"""A run's stack dumps on their way to the feed: kept, coalesced into ``stacks`` events.

Split from :class:`broker.run.sink.RunSink`, which owns the rank states and the alerts: this
module holds what the sink does with a ``stacks`` frame (section 2.5) besides marking the
rank ``stalled``: keep the dump in the run's :class:`~broker.stacks.store.RunStacks`, note it
as pending, and emit at most one ``stacks`` event per :data:`STACKS_INTERVAL` (the rest wait
for the sink's tick); and the ``stalled`` alert's text (:func:`stall_message`). The same
events carry the run's ``collectives`` frames and its collective verdict (section 7.2;
:mod:`broker.stacks.collectives`, the rules in :mod:`broker.run.collectiverules`). Pure: no
clock, no I/O.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Tuple

from broker.stacks.collectives import RunCollectives
from broker.stacks.groups import main_frames
from broker.stacks.store import RunStacks
from rank_agent.protocol import Stacks

__all__ = ["STACKS_INTERVAL", "StackFeed", "stall_message"]

#: Seconds between two ``stacks`` events of a run (PROTOCOL 4: SSE ``stacks`` at most 4 a
#: second per run; the broker coalesces, so every web streams one per feed event).
STACKS_INTERVAL = 0.25


def stall_message(frame: Stacks) -> str:
    """The ``stalled`` alert's message for a ``stall`` dump: how long, and where the main
    thread's innermost frame is."""
    frames = main_frames(frame)
    where = ""
    if frames:
        inner = frames[-1]
        where = f" in {inner.function} ({inner.file}:{inner.line})"
    idle = frame.idle_s
    if not math.isfinite(idle):  # the schema takes inf (never "stalled infs")
        return f"stalled for an unknown time{where}"
    return f"stalled {round(idle)}s{where}"


class StackFeed:
    """Dumps kept since the last ``stacks`` event, published through ``emit(kind, data)``
    (the sink's ``_emit``) at most once per :data:`STACKS_INTERVAL`."""

    def __init__(self, stacks: RunStacks, emit: Callable[[str, Any], int]) -> None:
        self.stacks = stacks
        self._emit = emit
        #: (rank, reason) kept since the last ``stacks`` event, in arrival order
        self.pending: Dict[Tuple[int, str], None] = {}
        self._sent_at: float | None = None
        #: each rank's latest ``collectives`` frame per reason (section 7.2)
        self.collectives = RunCollectives()
        #: (rank, reason) of the ``collectives`` frames kept since the last event
        self.coll_pending: Dict[Tuple[int, str], None] = {}
        #: the collective verdict last computed (the listed groups), and whether an event
        #: has yet to carry it
        self.verdict: List[Dict[str, Any]] = []
        self.verdict_due = False
        #: the ranks whose frame was current at the last verdict, and whether a frame came
        #: since (both decide whether the verdict is computed again)
        self.coll_current: frozenset[int] = frozenset()
        self.coll_changed = False

    def due(self, now: float) -> bool:
        """True when an event may go out now (none in the last STACKS_INTERVAL)."""
        sent = self._sent_at
        return sent is None or now - sent >= STACKS_INTERVAL or now < sent

    def forget_pending(self) -> None:
        """After a journal replay: nothing replayed is published, no replayed frame counts."""
        self.pending.clear()
        self.coll_pending.clear()
        self.coll_changed = True
        self.verdict, self.verdict_due = [], False

    def put(self, frame: Stacks, now: float) -> None:
        """Keep the dump (section 2.5) and publish it if one is due."""
        self.stacks.put(frame)
        # kept or not (the cap), the web learns it: the dump, or that the rank has none
        self.pending[(frame.rank, frame.reason)] = None
        self.publish_due(now)

    def publish_due(self, now: float) -> None:
        """One ``stacks`` event with the dumps kept since the last one, at most one per
        STACKS_INTERVAL (the rest wait for the sink's tick)."""
        if not self.due(now):
            return
        keys, self.pending = self.pending, {}
        if keys or self.coll_pending or self.verdict_due:
            stacks = self.stacks
            self._sent_at = now
            data: Dict[str, Any] = {"dumps": stacks.wire(keys),
                                    "gone": [list(k) for k in keys if k not in stacks]}
            if self.coll_pending or self.verdict_due:
                coll, ckeys, self.coll_pending = self.collectives, self.coll_pending, {}
                data["collectives"] = coll.wire(ckeys)
                data["collectives_gone"] = [list(k) for k in ckeys if k not in coll]
                data["verdict"] = self.verdict
                self.verdict_due = False
            self._emit("stacks", data)
