"""A run's stack dumps on their way to the feed: kept, coalesced into ``stacks`` events.

Split from :class:`broker.run.sink.RunSink`, which owns the rank states and the alerts: this
module holds what the sink does with a ``stacks`` frame (section 2.5) besides marking the
rank ``stalled``: keep the dump in the run's :class:`~broker.stacks.store.RunStacks`, note it
as pending, and emit at most one ``stacks`` event per :data:`STACKS_INTERVAL` (the rest wait
for the sink's tick); and the ``stalled`` alert's text (:func:`stall_message`). The same
events carry the run's ``collectives`` frames and its collective verdict (section 7.2;
:mod:`broker.stacks.collectives`; the verdict is formed here, its alerts raised by the sink). Pure: no
clock, no I/O.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

from broker.stacks.collectives import RunCollectives, collective_verdict
from broker.stacks.groups import main_frames
from broker.stacks.store import RunStacks
from rank_agent.protocol import Collectives, Stacks
from rank_agent.ratelimit import RateLimitedLog

__all__ = ["STACKS_INTERVAL", "StackFeed", "stall_message"]

log = logging.getLogger(__name__)
_rlog = RateLimitedLog(log)

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

    def __init__(self, stacks: RunStacks, emit: Callable[[str, Any], int],
                 run: str = "") -> None:
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
        #: the run's id, for the log lines of a verdict that fails
        self.run = run

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

    # ------------------------------------------------- collectives and their verdict (7.2)
    def put_collectives(self, frame: Collectives) -> None:
        """Keep a ``collectives`` frame; kept or not (the cap), the web learns it: the
        frame, or that the rank has none. The verdict is due again."""
        self.collectives.put(frame)
        self.coll_pending[(frame.rank, frame.reason)] = None
        self.coll_changed = True

    def take_gone(self) -> bool:
        """Frames the byte budget dropped: the web learns their ranks have none and the
        verdict is redone. True when there is a verdict to look at (frames kept, or a
        verdict standing that may have to empty)."""
        for key in self.collectives.take_gone():
            self.coll_pending[key] = None
            self.coll_changed = True
        return bool(self.collectives.latest or self.verdict)

    def refresh_verdict(self, is_current: Callable[[int], bool], ws: Optional[int]
                        ) -> Optional[Tuple[List[Dict[str, Any]], List[Dict[str, Any]], bool]]:
        """Form the verdict again if a frame came or the set of current ranks changed since
        the last one; it is kept, and due in the next event when it differs. Returns
        ``(previous, verdict, any_current)`` when one was formed, None when nothing changed
        (or it could not be formed at all). Frames of ranks past the world size go first."""
        coll = self.collectives
        if ws is not None:
            for r in [r for r in coll.latest if r >= ws]:
                coll.discard(r)
        current = frozenset(r for r in coll.latest if is_current(r))
        if current == self.coll_current and not self.coll_changed:
            return None
        self.coll_current, self.coll_changed = current, False
        try:
            verdict = collective_verdict(coll.digests(current), ws)
        except Exception:
            again = self._verdict_without_suspects(current, ws)
            if again is None:
                return None
            verdict = again
        previous = self.verdict
        if verdict != previous:
            self.verdict, self.verdict_due = verdict, True
        return previous, verdict, bool(current)

    def _verdict_without_suspects(self, current: frozenset[int], ws: Optional[int]
                                  ) -> Optional[List[Dict[str, Any]]]:
        """The verdict raised: a frame the rules cannot read (a bug, as a group id of
        Unicode digits was, issue 38). The frames kept since the last ``stacks`` event are
        the suspects (the verdict before them was computed): they are dropped, the web
        learns their ranks have none, and the verdict is computed once more without them.

        Why drop rather than only log: the frames are kept, and every later frame redoes
        the verdict over all kept frames, so one unreadable frame made every later
        ``collectives`` frame of the run fail as ``internal`` (and go unjournaled) and froze
        the verdict on its last culprit. None: it still raises (logged; the verdict stays)."""
        coll = self.collectives
        suspects = [key for key in self.coll_pending if key in coll]
        for key in suspects:
            coll.remove(key)
        _rlog.error("verdict", "run %s: the collective verdict failed; %d frames kept since "
                    "the last stacks event dropped (ranks %s)", self.run,
                    len(suspects), sorted({k[0] for k in suspects})[:10], exc_info=True)
        current = frozenset(r for r in current if r in coll.latest)
        self.coll_current = current
        try:
            return collective_verdict(coll.digests(current), ws)
        except Exception:
            _rlog.error("verdict_again", "run %s: the collective verdict fails without them "
                        "too; it stays as it was", self.run, exc_info=True)
            return None

    def settle(self) -> bool:
        """End of a replay: the verdict is formed again at the next look, whatever the rate
        limit let through while replaying. True when frames are kept to form it from."""
        self.coll_changed = True
        return bool(self.collectives.latest)

    def view(self) -> Dict[str, Any]:
        """The collectives as a snapshot carries them: ``{"groups": verdict, "ranks": [frames]}``."""
        return {"groups": self.verdict, "ranks": self.collectives.wire()}
