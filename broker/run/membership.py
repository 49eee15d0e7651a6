"""Which ranks are in a run (PROTOCOL.md 2, 2.1, 3): the sink's membership rules, mixed
into :class:`broker.run.sink.RunSink`.

A ``register`` places a rank and latches the run-wide settings it carries (world size,
port, total epochs, the first label); a ``finish`` ends a rank (an error raises
``rank_error``); a register from a finished rank brings it, and an ended run, back; and
the first world size forgets every rank past it. Apart from the sink's dispatch because
these are the rules that change who counts for an epoch's or a step's close; the state they
use is the sink's (declared below for the type checker).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from broker.run.failure import alert_message, error_at
from rank_agent.protocol import Finish, Register

if TYPE_CHECKING:
    from broker.run.alerts import RunAlerts
    from broker.run.attempts import Attempts
    from broker.run.epochs import PendingEpochs
    from broker.run.failure import ErrorStore, FailureIndex
    from broker.run.gpualerts import GpuAlertRules
    from broker.run.rankstate import RankSamples, RankState
    from broker.run.steps.closer import RunSteps, StepCloser
    from broker.run.steps.store import StepStore
    from broker.run.topology import HardwareString, Topology
    from broker.stacks.store import RunStacks
    from rank_agent.ratelimit import RateLimitedLog

__all__ = ["MembershipRules"]


class MembershipRules:
    """Register, finish and the world size's cut, for :class:`broker.run.sink.RunSink`."""

    if TYPE_CHECKING:
        run: str
        world_size: Optional[int]
        port: int
        port_conflicts: int
        total_epochs: int
        total_steps: int
        label: Optional[str]
        svg: Optional[str]
        status: str
        complete: Optional[Tuple[int, str]]
        records: List[Dict[str, Any]]
        steps: StepStore
        stacks: RunStacks
        alerts: RunAlerts
        gpu_rules: GpuAlertRules
        topology: Topology
        _register_label: Optional[str]
        _ranks: Dict[int, RankState]
        _samples: RankSamples
        _closer: StepCloser
        _steps: RunSteps
        _pending: PendingEpochs
        _hw: HardwareString
        _port_log: RateLimitedLog
        _n_finished: int
        _n_error: int
        _header_pending: bool
        _errors: ErrorStore
        _failures: FailureIndex
        _failure_dirty: bool
        attempts: Attempts

        @property
        def finished(self) -> bool: ...
        def _raise(self, kind: str, rank: int | None, message: str, now: float,
                   notify: bool = True) -> None: ...
        def _close_ready(self) -> None: ...
        def _close_steps(self, now: float) -> None: ...

    def _on_register(self, frame: Register, st: RankState, now: float) -> None:
        # Header changes from registers (and hardware) are coalesced: see _header_pending.
        self.attempts.registered_now(frame)  # 8.1: the rank's process in this attempt
        if self.world_size is None:
            self.world_size = frame.world_size
            self._header_pending = True
            self._discard_out_of_range()
        touched = self.topology.set(frame.rank, frame.host, frame.local_rank)
        if touched:
            self._header_pending = True
            self._hw.hosts_changed(touched)
            self._samples.placed(frame.rank)  # its GPU name carries its host
        if frame.port:
            if not self.port:
                self.port = frame.port
                self._header_pending = True
            elif frame.port != self.port:
                self.port_conflicts += 1
                self._port_log.warning(
                    "port", "run %s: rank %d asks for port %d, already %d; ignored (%d so far)",
                    self.run, frame.rank, frame.port, self.port, self.port_conflicts, now=now)
        if frame.label and self._register_label is None:  # section 7.5: first non-empty
            self._register_label = frame.label
            if self.svg is None or not self.label:
                self.label = frame.label
                self._header_pending = True
        if frame.total_epochs and not self.total_epochs:
            self.total_epochs = frame.total_epochs
            self._header_pending = True
        if frame.total_steps and not self.total_steps:  # 8.5: first non-zero arrival wins
            self.total_steps = frame.total_steps
            self._header_pending = True
        if frame.replicated:  # 8.3: the run's set is the union of its registers' lists
            self._steps.numbers.declare(frame.replicated)
        if st.finished:
            self._reactivate(st)
        self._close_ready()

    def _reactivate(self, st: RankState) -> None:
        """A register from a finished rank: it trains again, and so does an ended run."""
        if st.status == "error":
            self._n_error -= 1
        self._n_finished -= 1
        st.status = "ok"
        self._failures.unfailed(st.rank)
        self._failure_dirty = True
        rank = st.rank
        self._closer.set_active(rank, True)
        self._pending.rank_active(rank, True)
        if self.finished:
            self.status = "training" if self.records or self.steps.rows else "waiting"
            self.complete = None
            self._header_pending = True  # coalesced: a finish/register loop is not a
            # header (of O(world) bytes) per frame

    def _on_finish(self, frame: Finish, st: RankState, now: float) -> None:
        if st.finished:
            return  # a repeated finish is a no-op: the first one decided the rank's status
        error = frame.status == "error"
        st.status = "error" if error else "finished"
        self._n_finished += 1
        rank = st.rank
        self._pending.rank_active(rank, False)
        self._failure_dirty = True
        # 8.2: the error of the rank's latest finish is kept (an ok finish's is ignored)
        info = frame.error if error else None
        self._errors.release(st.error)
        st.error = None if info is None else self._errors.admit(info)
        st.error_at = error_at(info, now)
        if error:
            self._n_error += 1
            self._failures.failed(rank, "" if info is None else info.type, st.error_at)
            self._raise("rank_error", rank, f"rank {rank} finished with error" if info is None
                        else alert_message(info), now)
        self._closer.set_active(rank, False)
        self._close_ready()
        self._close_steps(now)

    def _discard_out_of_range(self) -> None:
        """Forget per-rank state of ranks that turned out to be >= the world size."""
        ws = self.world_size
        assert ws is not None
        gone = [r for r in self._ranks if r >= ws]
        touched: List[str] = []
        for rank in gone:
            st = self._ranks.pop(rank)
            self._errors.release(st.error)
            self._failures.forget(rank)
            self._failure_dirty = True
            if st.finished:
                self._n_finished -= 1
                if st.status == "error":
                    self._n_error -= 1
            self._samples.discard(rank)
            self.stacks.discard(rank)
            self._closer.discard(rank)
            host = self.topology.remove(rank)
            if host is not None and host not in touched:
                touched.append(host)
            self._pending.discard(rank, not st.finished)
        if gone:
            self.alerts.forget_ranks_from(ws)
        self.gpu_rules.forget_from(ws)
        if touched:
            self._hw.hosts_changed(touched)
