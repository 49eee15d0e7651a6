"""The sink's step rules (PROTOCOL.md 2.4), mixed into :class:`broker.run.sink.RunSink`: when
closed steps become ``steps`` events, what a published or restored step changes in the run
(its status, a non-finite loss alert), and the steps' counters the journal reads.

Apart from :mod:`broker.run.steps.closer` (which decides *when* a step closes, knowing nothing of
events) and from the sink's frame dispatch: this is where a closed step meets the run. The
state it uses is the sink's (declared below for the type checker).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

from broker.run.steps.datawait import DataWait, data_share

if TYPE_CHECKING:
    from broker.run.alerts import RunAlerts
    from broker.run.events import Event
    from broker.run.steps.closer import RunSteps, StepCloser
    from broker.run.steps.store import StepStore
    from broker.run.topology import Topology

__all__ = ["StepRules", "DATA_WAIT_INTERVAL"]

#: the header's data-wait figures (7.1) are worked out at most this often (seconds)
DATA_WAIT_INTERVAL = 1.0


class StepRules:
    """Step publication and restoration for :class:`broker.run.sink.RunSink`."""

    if TYPE_CHECKING:
        world_size: int | None
        updated_at: float | None
        status: str
        steps: StepStore
        _steps: RunSteps
        _closer: StepCloser
        _header_changed: bool
        _header_pending: bool
        data_wait: DataWait
        topology: Topology
        alerts: RunAlerts

        def _raise(self, kind: str, rank: int | None, message: str, now: float,
                   notify: bool = True) -> None: ...
        def _emit(self, kind: str, data: Any) -> int: ...
        def _take_events(self) -> List[Event]: ...

    @property
    def steps_published_at(self) -> float | None:
        """When the last ``steps`` event was published (None: none yet)."""
        return self._steps.sent_at

    @property
    def steps_published(self) -> int:
        """Steps published by this sink (not restored ones): the closed-step counter."""
        return self._steps.published

    def steps_named_since(self, row: int) -> List[str]:
        """Metric names that may have a point in the closed steps' rows from ``row`` on
        (:meth:`RunSteps.named_since`: the rows this sink published)."""
        return self._steps.named_since(row)

    @property
    def late_steps(self) -> int:
        """Step points dropped because their step had already closed."""
        return self._closer.late

    def restore_steps(self, block: Dict[str, Any]) -> None:
        """Journal replay: closed steps as :meth:`StepStore.to_wire` wrote them. They were
        published before the restart, so no event; what they change in the run is restored
        (its status, the closing position, the straggler window, a non-finite loss alert).
        Raises ``ValueError`` for a block that does not follow the stored ones."""
        before = self._steps.restore(block)
        if before is None:
            return
        if self.status == "waiting":
            self.status = "training"
        published = block.get("published_at")
        updated = block.get("updated_at")
        if isinstance(updated, float) and (self.updated_at is None or updated > self.updated_at):
            self.updated_at = updated  # the steps frames behind it are not journaled
        bad = self.steps.last_nonfinite("loss", since=before)
        if bad is not None:
            step, value, at = bad
            self._raise("nonfinite_loss", None, f"step {step}: loss is {value}",
                        published if isinstance(published, float) else at)
        numbers = block.get("numbers")
        if isinstance(numbers, dict):  # 8.3: the state as of this block, and its alerts
            self._restore_numbers(numbers, published if isinstance(published, float)
                                  else (self.updated_at or 0.0))
        self._update_data_wait(self.updated_at or 0.0, force=True)

    def _restore_numbers(self, wire: Dict[str, Any], at: float) -> None:
        """Journal replay of the 8.3 state (:meth:`RunNumbers.wire`): the entries, and the
        alerts they raised, raised again as they were (the newest state of the journal
        wins; a re-raised alert keeps its (kind, rank) place in the list)."""
        numbers = self._steps.numbers
        numbers.restore(wire)
        numbers.journaled = numbers.shown = numbers.version
        ws = self.world_size if self.world_size is not None else len(self._closer.ranks)
        for entry, (message, count) in zip(numbers.nonfinite, numbers.nonfinite_alerts):
            self._raise("nonfinite", None if count * 2 > ws else entry["rank"], message, at,
                        notify=False)
        messages = wire.get("messages")
        for rank, message in sorted(messages.items() if isinstance(messages, dict) else (),
                                    key=lambda item: str(item[0])):
            if isinstance(rank, int) and isinstance(message, str):
                self._raise("replica_divergence", rank, message, at, notify=False)

    def numbers_wire(self) -> Dict[str, Any] | None:
        """(8.3) The number rules' state for the journal's next STEPS block when it changed
        since the last one (None: unchanged), with each rank's latest ``replica_divergence``
        message so a restart lists the same alerts."""
        numbers = self._steps.numbers
        if numbers.version == numbers.journaled:
            return None
        # the ranks' lists and messages only when a rank joined them since the last write
        grew = numbers.raised_version > numbers.journaled
        numbers.journaled = numbers.version
        wire = numbers.wire(raised=grew)
        if grew:
            wire["messages"] = {a["rank"]: a["message"] for a in self.alerts.listed()
                                if a["kind"] == "replica_divergence" and a["rank"] is not None}
        return wire

    def settle(self, now: float) -> List[Event]:
        """The run leaves memory (``--max-runs`` eviction): every pending step closes with
        the points it has, and every closed step still waiting for its ``steps`` event
        (at most one per STEPS_INTERVAL) is published now; returns the events.

        Why: the journal keeps closed steps as they are published (STEPS blocks), not the
        points of steps in flight, so a run evicted between a step's close and its event,
        or with points of a step not every rank had reported, lost those steps for good: in
        the hostile soak, a 64-rank run evicted at each pause by a flood of junk runs lost
        a step or two each time. A later point of a step closed here is late (dropped and
        counted), as after ``--step-close-after``."""
        if self._steps.close_all():
            self._publish_steps(now, final=True)
        return self._take_events()

    def _close_steps(self, now: float) -> None:
        """Queue what the closer lets close now (watermark, grace, force close)."""
        self._steps.close(now, self.world_size)

    def _publish_steps_due(self, now: float) -> None:
        """Publish the closed steps waiting, if any, once STEPS_INTERVAL has passed."""
        if self._steps.due(now):
            self._publish_steps(now)

    def _publish_steps(self, now: float, final: bool = False) -> None:
        """One ``steps`` event with every step closed since the last one (at most one per
        STEPS_INTERVAL, or at once when the run ends). Its data is the store's wire block
        of those rows (:meth:`RunSteps.take`; records: :func:`broker.run.steps.store.wire_records`)."""
        before = self.steps.rows
        self._emit("steps", self._steps.take(now))
        if self.status == "waiting":
            self.status = "training"
            self._header_changed = True
        bad = self.steps.last_nonfinite("loss", since=before)  # array scan, not per record
        if bad is not None:
            self._raise("nonfinite_loss", None, f"step {bad[0]}: loss is {bad[1]}", now)
        self._raise_numbers(now)
        self._update_data_wait(now, force=final)  # (the run's end: its last figures)

    def _raise_numbers(self, now: float) -> None:
        """(8.3) The alerts the number rules found in the steps just published, and the
        header when their entries moved. A first non-finite value on more than half the
        world size is run-wide (``rank`` null): a NaN everywhere at once blames no rank."""
        numbers = self._steps.numbers
        if numbers.alerts:
            alerts, numbers.alerts = numbers.alerts, []
            ws = self.world_size if self.world_size is not None else len(self._closer.ranks)
            for kind, rank, message, count in alerts:
                if kind == "nonfinite" and count * 2 > ws:
                    rank = None
                self._raise(kind, rank, message, now)
        if numbers.version != numbers.shown:
            numbers.shown = numbers.version
            self._header_pending = True

    def _update_data_wait(self, now: float, force: bool = False, quiet: bool = False) -> None:
        """The header's ``data_share`` and ``data_stragglers`` (7.1, :mod:`broker.run.steps.
        datawait`), at most once per DATA_WAIT_INTERVAL; a rank entering the list raises
        ``data_straggler`` (unless ``quiet``: after a restart, whose alerts come back from
        the journal as they were); the header goes out (coalesced) when the figures moved."""
        dw = self.data_wait
        if not force and dw.at is not None and now - dw.at < DATA_WAIT_INTERVAL:
            return
        dw.at = now
        d, ms = self.steps.data_ms, self.steps.step_ms
        r0 = self._steps.line.first_row(self._steps.attempt)  # 8.1: the current attempt's
        dp = int(d.row[:d.n].searchsorted(r0)) if r0 else 0
        mp = int(ms.row[:ms.n].searchsorted(r0)) if r0 else 0
        share = data_share(d.row[dp:d.n], d.mean[dp:d.n], ms.row[mp:ms.n], ms.mean[mp:ms.n])
        figures = [(rank, rs.mean_data(), rs.mean_ms())
                   for rank, rs in self._closer.ranks.items() if rs.data]
        changed, new = dw.update(share, figures, self.topology.place.get)  # type: ignore[arg-type]
        for rank, message in ([] if quiet else new):
            self._raise("data_straggler", rank, message, now)
        if changed:
            self._header_pending = True

