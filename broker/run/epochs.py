"""The epochs of one run (PROTOCOL.md 2.3): those with reports that have not closed yet
(:class:`PendingEpochs`), and what owns them with the rules that close them (:class:`RunEpochs`).

Kept apart from the sink because it is the closing *bookkeeping* alone: which ranks
reported which open epoch, and how many of those reporters are still active, so that the
close test is one comparison per frame. What a close produces (the record) is
:mod:`broker.run.aggregate`'s; when it goes out (events, header order) is the sink's.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Tuple

from broker.run import aggregate
from broker.run.aggregate import EpochReports
from broker.run.events import Rejected
from rank_agent.protocol import Metrics

if TYPE_CHECKING:
    from broker.run.rankstate import RankSamples, RankState
    from broker.run.steps.line import EpochLine
    from broker.run.topology import Topology

__all__ = ["PendingEpochs", "RunEpochs", "MAX_OPEN_EPOCHS"]

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


class RunEpochs:
    """The run's epochs (PROTOCOL.md 2.3) and their rules: what is open (``pending``), what
    closed (``records``, the seq of each one's ``epoch`` event in ``record_seqs``, the
    durations the ETA reads) and how many reports came late. Handed the sink's ``emit``
    (which flushes a coalesced header first: the web must never show a record under a
    stale header) and ``raise`` as :class:`broker.stacks.feed.StackFeed` is; what a close
    reads of the run (world size, samples, hosts, the attempt, the line) is passed in."""

    def __init__(self, emit: Callable[[str, Any], int],
                 raise_: Callable[[str, int | None, str, float], None]) -> None:
        self._emit = emit
        self._raise = raise_
        self.pending = PendingEpochs()
        #: Closed epoch records, ascending epoch, and the seq of each one's "epoch" event.
        self.records: List[Dict[str, Any]] = []
        self.record_seqs: List[int] = []
        #: the closed epochs' durations of this attempt, for the ETA
        self.durations: List[float] = []
        #: reports of an epoch that had already closed (dropped, counted)
        self.late = 0

    def report(self, frame: Metrics, st: RankState) -> int | None:
        """A ``metrics`` frame's report (its sample applied before): how many ranks
        reported its epoch now, or None when the epoch had closed (late, counted)."""
        epoch = frame.epoch
        if epoch <= self.pending.last_closed:
            self.late += 1
            return None
        st.epoch = epoch
        st.loss = frame.avg_loss
        return self.pending.put(st.rank, frame, not st.finished)

    def new_attempt(self) -> int:
        """A new attempt (8.1) closes its own epochs: the open ones are dropped; returns the
        last epoch the previous attempt closed."""
        last_epoch = self.pending.last_closed
        self.pending = PendingEpochs()
        self.pending.last_closed = -1  # each attempt closes its own epochs (8.1 rewind)
        self.durations = []
        return last_epoch

    def close_through(self, epoch: int, *, world_size: int, now: float, started_at: float,
                      samples: RankSamples, topology: Topology, total_epochs: int,
                      attempt: int, line: EpochLine) -> None:
        """Close every pending epoch <= ``epoch`` in ascending order: each record is built
        (:func:`broker.run.aggregate.epoch_record`), kept and emitted."""
        for e, reports in self.pending.take_through(epoch):
            record = aggregate.epoch_record(
                epoch=e,
                world_size=world_size,
                reports=reports,
                samples=samples.latest,
                hosts=[entry["ranks"] for entry in topology.ordered()],
                gpus=samples.gpus(),
                total_epochs=total_epochs or None,
                past_durations=self.durations,
                elapsed_secs=now - started_at,
            )
            self.durations.append(record["duration_secs"])
            del self.durations[: -aggregate.ETA_WINDOW]
            record["attempt"] = attempt  # 8.1: the attempt that closed it
            if self.records and self.records[-1]["epoch"] >= e:  # a new attempt rewinds
                line.rewind(self.records, self.record_seqs, e)
            line.closed_one(record)
            self.records.append(record)
            self.record_seqs.append(self._emit("epoch", record))
            loss = record["metrics"]["loss"]
            if not math.isfinite(loss):
                self._raise("nonfinite_loss", None, f"epoch {e}: loss is {loss}", now)
