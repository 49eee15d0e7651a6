"""The sink's rules for ``collectives`` frames (PROTOCOL.md section 7.2), mixed into
:class:`broker.run.sink.RunSink` as :class:`broker.run.epochs.EpochRules` is.

What a frame does: it is kept (:class:`broker.stacks.collectives.RunCollectives`, held by the
run's :class:`broker.stacks.feed.StackFeed`), it makes its rank's latest frame **current**
(``RankState.collective``; the rank's next ``steps``/``metrics`` frame clears it, as it clears
``stalled``), and the verdict is due. The verdict is computed when a ``stacks`` event may go
out (at most 4 a second, :data:`broker.stacks.feed.STACKS_INTERVAL`) and only when a frame
came or the set of current ranks changed since: a verdict over 1,024 ranks is milliseconds,
so it is not redone per frame (1,024 frames of a hang would be quadratic). A new verdict
raises its alerts through the sink's ``_raise`` and goes out in the next ``stacks`` event.

Why currency lives in ``RankState`` rather than here: the ``steps`` path is the broker's
hottest, and clearing a slot it already writes (``st.stalled = st.collective = False``) costs
one store, where asking this module would cost a call per frame.

Each verdict formed is offered to the run's :class:`broker.run.collectivelast.LastVerdict`, the
header's ``collectives_last`` (8.5), which keeps the answer to a hang after its frames stop
being current.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict

from broker.run.collectivelast import LastVerdict
from broker.stacks.collectives import collective_verdict, verdict_alerts
from rank_agent.protocol import Collectives
from rank_agent.ratelimit import RateLimitedLog

if TYPE_CHECKING:
    from broker.run.rankstate import RankState
    from broker.stacks.feed import StackFeed

__all__ = ["CollectiveRules"]

log = logging.getLogger(__name__)
_rlog = RateLimitedLog(log)


class CollectiveRules:
    """Mixed into :class:`broker.run.sink.RunSink`: uses its ``_stack_feed``, ``_ranks``,
    ``world_size`` and ``_raise``."""

    if TYPE_CHECKING:
        run: str
        _stack_feed: StackFeed
        _ranks: Dict[int, RankState]
        world_size: int | None
        collectives_last: LastVerdict
        _header_pending: bool
        replaying: bool

        def _raise(self, kind: str, rank: int | None, message: str, now: float,
                   notify: bool = True) -> None: ...

    def _on_collectives(self, frame: Collectives, st: RankState, now: float) -> None:
        """Keep the frame; the rank's latest is current until its loop moves (7.2)."""
        feed = self._stack_feed
        feed.collectives.put(frame)
        # kept or not (the cap), the web learns it: the frame, or that the rank has none
        feed.coll_pending[(frame.rank, frame.reason)] = None
        feed.coll_changed = True
        st.collective = True
        self._stacks_due(now)

    def _stacks_due(self, now: float) -> None:
        """The run's ``stacks`` event, if one may go out now: the verdict first, when
        something it reads changed (the sink's tick calls this while anything is pending
        or any ``collectives`` frame is kept)."""
        feed = self._stack_feed
        if not feed.due(now):
            return
        for key in feed.collectives.take_gone():  # dropped by the byte budget: the web
            feed.coll_pending[key] = None  # learns the rank has none, the verdict is redone
            feed.coll_changed = True
        if feed.collectives.latest or feed.verdict:
            self._refresh_verdict(now)
        feed.publish_due(now)

    def _refresh_verdict(self, now: float) -> None:
        feed = self._stack_feed
        ranks, ws = self._ranks, self.world_size
        if ws is not None:  # frames of ranks that turned out to be past the world size
            for r in [r for r in feed.collectives.latest if r >= ws]:
                feed.collectives.discard(r)
        current = frozenset(
            r for r in feed.collectives.latest
            if (st := ranks.get(r)) is not None and st.collective)
        if current == feed.coll_current and not feed.coll_changed:
            return
        feed.coll_current, feed.coll_changed = current, False
        try:
            verdict = collective_verdict(feed.collectives.digests(current), ws)
        except Exception:
            again = self._verdict_without_suspects(current, ws)
            if again is None:
                return
            verdict = again
        if self.collectives_last.offer(verdict, bool(current), now):
            self._header_pending = True  # the header's collectives_last (8.5)
        if verdict == feed.verdict:
            return
        if not self.replaying:  # a replay's verdicts are formed at other times than live ones were:
            # the alerts they raised come back from the journal as they were (8.5)
            for kind, rank, message in verdict_alerts(feed.verdict, verdict):
                self._raise(kind, rank, message, now)
        feed.verdict, feed.verdict_due = verdict, True

    def settle_verdict(self, now: float) -> None:
        """End of a journal replay that held no ``collectives_last`` (a data dir an earlier
        version wrote): form the verdict over the replayed frames once more, whatever the
        rate limit let through while replaying, so the header keeps the answer they give."""
        self._stack_feed.coll_changed = True
        if self._stack_feed.collectives.latest:
            self._refresh_verdict(now)

    def _verdict_without_suspects(self, current: frozenset[int], ws: int | None
                                  ) -> list[Dict[str, Any]] | None:
        """The verdict raised: a frame the rules cannot read (a bug, as a group id of
        Unicode digits was, issue 38). The frames kept since the last ``stacks`` event are
        the suspects (the verdict before them was computed): they are dropped, the web
        learns their ranks have none, and the verdict is computed once more without them.

        Why drop rather than only log: the frames are kept, and every later frame redoes
        the verdict over all kept frames, so one unreadable frame made every later
        ``collectives`` frame of the run fail as ``internal`` (and go unjournaled) and froze
        the verdict on its last culprit. None: it still raises (logged; the verdict stays)."""
        feed = self._stack_feed
        coll = feed.collectives
        suspects = [key for key in feed.coll_pending if key in coll]
        for key in suspects:
            coll.remove(key)
        _rlog.error("verdict", "run %s: the collective verdict failed; %d frames kept since "
                    "the last stacks event dropped (ranks %s)", self.run,
                    len(suspects), sorted({k[0] for k in suspects})[:10], exc_info=True)
        current = frozenset(r for r in current if r in coll.latest)
        feed.coll_current = current
        try:
            return collective_verdict(coll.digests(current), ws)
        except Exception:
            _rlog.error("verdict_again", "run %s: the collective verdict fails without them "
                        "too; it stays as it was", self.run, exc_info=True)
            return None

    def close_collectives(self) -> None:
        """The run leaves memory: its frames leave the process's byte budget."""
        self._stack_feed.collectives.close()

    def collectives_view(self) -> Dict[str, Any]:
        """``GET /api/runs/<run>/collectives`` as the broker has it, and what a run snapshot
        carries: ``{"groups": verdict, "ranks": [frames]}``."""
        feed = self._stack_feed
        return {"groups": feed.verdict, "ranks": feed.collectives.wire()}
