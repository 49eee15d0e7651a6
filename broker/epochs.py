"""The epochs of one run that have reports but have not closed yet (PROTOCOL.md 2.3).

Kept apart from the sink because it is the closing *bookkeeping* alone: which ranks
reported which open epoch, and how many of those reporters are still active, so that the
close test is one comparison per frame. What a close produces (the record) is
:mod:`broker.aggregate`'s; when it goes out (events, header order) is the sink's.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from broker.aggregate import EpochReports
from broker.events import Rejected
from rank_agent.protocol import Metrics

__all__ = ["PendingEpochs", "MAX_OPEN_EPOCHS"]

#: Most epochs one run holds open (reported, not closed). Open epochs close only when every
#: rank reported (or a later one closed), so a silent rank, or a run whose world size is
#: not known yet, kept every epoch a rank reported in memory: a flood of metrics frames for
#: new epochs grew the run without end. A frame that would open one more is rejected
#: (``open_epochs``); a training run is never that far ahead of its slowest rank.
MAX_OPEN_EPOCHS = 1024


class PendingEpochs:
    """Open epochs: epoch -> its reports, and how many of its reporters are not finished."""

    def __init__(self) -> None:
        self._reports: Dict[int, EpochReports] = {}
        self._active: Dict[int, int] = {}
        #: the last closed epoch (-1: none); a report at or below it is late
        self.last_closed = -1

    def __bool__(self) -> bool:
        return bool(self._reports)

    def admit(self, epoch: int) -> None:
        """Raise :class:`Rejected` (``open_epochs``) when a report for ``epoch`` would open
        an epoch past :data:`MAX_OPEN_EPOCHS` (a late report, or one for an open epoch,
        is fine). O(1)."""
        reports = self._reports
        if (len(reports) >= MAX_OPEN_EPOCHS and epoch > self.last_closed
                and epoch not in reports):
            raise Rejected("open_epochs", f"epoch {epoch}: {len(reports)} epochs open")

    def put(self, rank: int, frame: Metrics, active: bool) -> int:
        """Store ``rank``'s report for ``frame.epoch`` (last write wins; the caller has
        checked it is not late); returns how many active ranks have reported that epoch.
        ``active``: the rank has not finished (a finished rank's report counts for nothing
        in the close test)."""
        epoch = frame.epoch
        reports = self._reports.get(epoch)
        if reports is None:
            reports = self._reports[epoch] = EpochReports()
            self._active[epoch] = 0
        if reports.put(rank, frame) and active:
            self._active[epoch] += 1
        return self._active[epoch]

    def rank_active(self, rank: int, active: bool) -> None:
        """``rank`` finished (``active`` False) or trains again (True): every open epoch it
        reported counts it accordingly."""
        step = 1 if active else -1
        for epoch, reports in self._reports.items():
            if rank in reports.frames:
                self._active[epoch] += step

    def discard(self, rank: int, active: bool) -> None:
        """Forget ``rank``'s reports (it turned out to be >= the world size)."""
        for epoch in list(self._reports):
            reports = self._reports[epoch]
            if reports.pop(rank) is not None:
                if active:
                    self._active[epoch] -= 1
                if not reports:
                    del self._reports[epoch]
                    del self._active[epoch]

    def highest_complete(self, need: int) -> int | None:
        """The highest open epoch that ``need`` active ranks have reported (None: none)."""
        active = self._active
        for epoch in sorted(self._reports, reverse=True):
            if active[epoch] == need:
                return epoch
        return None

    def take_through(self, epoch: int) -> List[Tuple[int, EpochReports]]:
        """Remove and return every open epoch <= ``epoch``, ascending (they close now)."""
        out = []
        for e in sorted(e for e in self._reports if e <= epoch):
            del self._active[e]
            out.append((e, self._reports.pop(e)))
            self.last_closed = e
        return out
