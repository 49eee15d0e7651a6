"""The epochs of one run (PROTOCOL.md 2.3): those with reports that have not closed yet
(:class:`PendingEpochs`), and the sink's rules that close them (:class:`EpochRules`).

Kept apart from the sink because it is the closing *bookkeeping* alone: which ranks
reported which open epoch, and how many of those reporters are still active, so that the
close test is one comparison per frame. What a close produces (the record) is
:mod:`broker.run.aggregate`'s; when it goes out (events, header order) is the sink's.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

from broker.run import aggregate
from broker.run.aggregate import EpochReports
from broker.run.events import Rejected
from rank_agent.protocol import Metrics

if TYPE_CHECKING:
    from broker.run.attempts import Attempts
    from broker.run.rankstate import RankSamples, RankState
    from broker.run.steps.line import EpochLine
    from broker.run.topology import Topology
    from rank_agent.protocol import ResourceSample

__all__ = ["PendingEpochs", "EpochRules", "MAX_OPEN_EPOCHS"]

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


class EpochRules:
    """The sink's epoch rules (PROTOCOL.md 2.3), mixed into :class:`broker.run.sink.RunSink`:
    a ``metrics`` frame's report, when the open epochs close, and the order of what a close
    emits. Apart from the rest of the sink because it is the one per-epoch path, read on
    its own; the state it uses is the sink's (declared below for the type checker)."""

    if TYPE_CHECKING:
        world_size: int | None
        started_at: float | None
        updated_at: float | None
        total_epochs: int
        status: str
        late_metrics: int
        records: List[Dict[str, Any]]
        record_seqs: List[int]
        topology: Topology
        _samples: RankSamples
        _pending: PendingEpochs
        _durations: List[float]
        _n_finished: int
        _header_changed: bool
        _header_pending: bool
        attempts: Attempts
        epoch_line: EpochLine

        def gpu_health(self, rank: int, sample: ResourceSample, now: float) -> None: ...
        def _raise(self, kind: str, rank: int | None, message: str, now: float,
                   notify: bool = True) -> None: ...
        def _emit(self, kind: str, data: Any) -> int: ...
        def _emit_header(self) -> None: ...

    def _on_metrics(self, frame: Metrics, st: RankState, now: float) -> None:
        rank = st.rank
        st.stalled = st.collective = False  # the loop moves (sections 3, 7.2)
        sample = frame.resources
        if sample is not None:  # applied first, exactly as a resources frame
            self._samples.put(rank, sample)
            st.sample_json = None
            self.gpu_health(rank, sample, now)
        epoch = frame.epoch
        if epoch <= self._pending.last_closed:
            self.late_metrics += 1
            return
        st.epoch = epoch
        st.loss = frame.avg_loss
        reported = self._pending.put(rank, frame, not st.finished)
        ws = self.world_size
        if ws is not None and reported == ws - self._n_finished:
            self._close_through(epoch)

    def _close_ready(self) -> None:
        """Close the highest pending epoch that is complete, and every one below it."""
        ws = self.world_size
        if ws is None or not self._pending:
            return
        epoch = self._pending.highest_complete(ws - self._n_finished)
        if epoch is not None:
            self._close_through(epoch)

    def _close_through(self, epoch: int) -> None:
        """Close every pending epoch <= ``epoch`` in ascending order."""
        for e, reports in self._pending.take_through(epoch):
            self._close(e, reports)

    def _close(self, epoch: int, reports: aggregate.EpochReports) -> None:
        now = self.updated_at
        assert self.world_size is not None and now is not None and self.started_at is not None
        record = aggregate.epoch_record(
            epoch=epoch,
            world_size=self.world_size,
            reports=reports,
            samples=self._samples.latest,
            hosts=[entry["ranks"] for entry in self.topology.ordered()],
            gpus=self._samples.gpus(),
            total_epochs=self.total_epochs or None,
            past_durations=self._durations,
            elapsed_secs=now - self.started_at,
        )
        self._durations.append(record["duration_secs"])
        del self._durations[: -aggregate.ETA_WINDOW]
        record["attempt"] = self.attempts.current  # 8.1: the attempt that closed it
        if self.records and self.records[-1]["epoch"] >= epoch:  # a new attempt rewinds
            self.epoch_line.rewind(self.records, self.record_seqs, epoch)
        self.epoch_line.closed_one(record)
        self.records.append(record)
        if self._header_pending:
            # The web must never show a record under a stale header: a coalesced header
            # change goes out first.
            self._emit_header()
        self.record_seqs.append(self._emit("epoch", record))
        if self.status == "waiting":
            self.status = "training"
            self._header_changed = True
        loss = record["metrics"]["loss"]
        if not math.isfinite(loss):
            self._raise("nonfinite_loss", None, f"epoch {epoch}: loss is {loss}", now)

