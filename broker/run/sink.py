"""One run's pure state machine: ``apply(frame, now) -> [Event]`` (PROTOCOL.md 2, 2.1-2.3, 3).

The sink holds everything the broker knows about one run and turns accepted frames into the
events the web streams. It does no I/O and reads no clock: the caller passes ``now``. Given
the same frames and times it produces the same events and state, which is what lets the
journal rebuild a run by replaying its frames.

Rules worth knowing before reading the code:

* A rejected frame raises :class:`Rejected` *before* anything is touched, so it has no
  effect at all (no rank created, no sequence number used).
* Run-wide settings latch on first arrival (world_size, port, total_epochs, the first
  non-empty svg) or are last-write (metadata); per-rank state is last-write.
* An epoch closes when every unfinished rank in range reported it, or when a later epoch
  closes; the record itself comes from :mod:`broker.run.aggregate`.
* ``apply`` never emits ``ranks`` (the array is large and changes with every frame): it
  marks it dirty and :meth:`RunSink.tick` emits it at most once per ``ranks_interval``.
* Header changes that frames can repeat are coalesced the same way: ``tick`` emits the
  ``run`` event at most once per ``ranks_interval``. That is registers and hardware (hosts,
  hardware, world_size, port, total_epochs: a 4,096-rank start-up would otherwise publish
  ~8k growing headers), metadata, alerts and a reopened run (v3: a burst of replaced ~1 MiB
  blobs, or of ranks failing, must not be a header each: bytes out would grow with the
  frame count, quadratically for a growing alert list). What happens once per run (the
  first frame, svg, the first epoch or step, completion) is emitted by ``apply``; any
  ``run`` event carries the whole header and clears the pending change, and a pending
  change is flushed right before any ``epoch`` event. When ``tick`` sends either the
  coalesced header or the ``ranks`` array, the other goes with it (header first), so a
  status and the alert it raised are one snapshot (:meth:`RunSink._flush_snapshot`).

Cost: the work per frame is O(1), plus O(hosts) for a register that changes the topology
or O(ranks on the host) for a hardware report, and an epoch close is O(world size); headers
are built when emitted. The topology (rank -> host, local rank; hosts ordered) is maintained
as registers arrive, cached per host, and re-sorted only when the host order can change.
Event data shares structure with the sink's caches and earlier events: it is read-only.

The sink is the rules and the event policy; the state it keeps is in the modules below it:
:mod:`broker.run.events` (Event, Rejected), :mod:`broker.run.rankstate` (per-rank state, samples,
the ``ranks`` array), :mod:`broker.run.epochs` (:class:`~broker.run.epochs.RunEpochs`: open
epochs, records, and the rules that close them), :mod:`broker.run.steps.closer` (the step
pipeline and the step rules, :class:`~broker.run.steps.closer.RunSteps`),
:mod:`broker.run.alerts`, :mod:`broker.run.topology` (placement, hardware string),
:mod:`broker.run.metadata`, :mod:`broker.run.collectivelast` (the header's ``collectives_last``),
:mod:`broker.run.attempts` (8.1: the attempts; the attempt rule is here, what a new attempt starts
afresh is :meth:`RunSink._reset_processes`) and :mod:`broker.run.steps.line` (the line of closed
steps and the superseded records).

Why one file past 800 lines: it is one idea, the run's state machine. Membership (register,
finish, the world size's cut) and the attempt rule are methods here, not mixins, because
their state *is* the sink's (25 of its fields); what owns state of its own (epochs, steps,
the stack feed and its verdict, alerts, topology) is an object held here.
"""
from __future__ import annotations

import logging
import math
import sys
from typing import Any, Callable, Dict, List, Sequence, Tuple

import msgspec

from broker.run.alerts import OnAlert, RunAlerts
from broker.run.attempts import Attempts, restart_message
from broker.run.collectivelast import LastVerdict
from broker.run.epochs import RunEpochs
from broker.run.events import Event, Rejected
from broker.run.failure import ErrorStore, FailureIndex, alert_message, cause, error_at, failure
from broker.run.gpualerts import GpuAlertRules, Sampled
from broker.run.metadata import parse_metadata
from broker.run.rankstate import RankSamples, RankState, ranks_array
from broker.run.steps.closer import RunSteps
from broker.run.steps.datawait import DataWait
from broker.run.steps.eta import step_eta
from broker.run.steps.line import EpochLine
from broker.run.steps.store import StepStore
from broker.run.topology import HardwareString, Topology
from broker.stacks.collectives import verdict_alerts
from broker.stacks.feed import StackFeed, stall_message
from broker.stacks.store import RunStacks
from rank_agent.protocol import (
    Collectives,
    Finish,
    Frame,
    Hardware,
    Metadata,
    Metrics,
    Register,
    Resources,
    ResourceSample,
    Stacks,
    Steps,
    Svg,
)
from rank_agent.ratelimit import RateLimitedLog

__all__ = ["RunSink", "Event", "Rejected", "ENDED", "STEPS_INTERVAL"]

log = logging.getLogger(__name__)

#: Seconds between two warnings about a conflicting port in one run (the count is kept).
PORT_WARN_INTERVAL = 60.0
#: Header status values of a run that has ended.
ENDED = ("complete", "failed")
#: Seconds between two ``steps`` events of a run (PROTOCOL 4: at most 4 a second).
STEPS_INTERVAL = 0.25
#: ``on_end(run, status, now)``: the run ended live (``status``: complete or failed).
OnEnd = Callable[[str, str, float], None]


class RunSink:
    """The broker's state of one run; see the module docstring for the rules."""

    shard = 0  #: the broker's shard index (PROTOCOL 7.3), set by broker.runs.Runs

    def __init__(self, run: str, *, stale_after: float = 30.0, ranks_interval: float = 1.0,
                 step_close_after: float = 10.0) -> None:
        self.run = run
        self.stale_after = stale_after
        self.ranks_interval = ranks_interval
        #: Last sequence number issued (0 = none). The server may raise it (after a restart).
        self.seq = 0
        #: (seq, status) of the last "complete" event while the run is ended, else None.
        self.complete: Tuple[int, str] | None = None
        #: Closed steps that went out in ``steps`` events (PROTOCOL 2.4), columnar.
        self._steps = RunSteps(close_after=step_close_after, interval=STEPS_INTERVAL,
                               emit=self._emit, raise_=self._raise)
        self.steps: StepStore = self._steps.store
        self._closer = self._steps.closer
        #: No rank turns stale from silence before this time: set when a run is rebuilt after
        #: a restart (frames the journal does not keep, such as steps, and the downtime itself
        #: say nothing about a rank's liveness), so each rank has stale_after from then on.
        self.liveness_floor = -math.inf
        #: Registers that named a port other than the latched one (warned, ignored).
        self.port_conflicts = 0

        self.started_at: float | None = None
        self.updated_at: float | None = None
        self.status = "waiting"
        self.world_size: int | None = None
        self.total_epochs = 0  # 0 = unknown
        self.total_steps = 0  # 0 = unknown (8.5)
        self.port = 0  # 0 = none
        self.svg: str | None = None
        self.label: str | None = None
        self._register_label: str | None = None  # the first non-empty register label
        self.hash: str | None = None
        # The accepted metadata as MessagePack (see parse_metadata), and its JSON text.
        self._metadata: msgspec.Raw | None = None
        self._metadata_raw: str | None = None

        self.topology = Topology()
        self._steps.numbers.host_of = lambda rank: self.topology.place.get(rank)  # 8.3 hosts
        self._ranks: Dict[int, RankState] = {}
        # Latest sample per rank and the relabelled GPU entries (built lazily, at a close).
        self._samples = RankSamples(self.topology.place)
        self._n_finished = 0  # tracked ranks that have finished (ok or error)
        self._n_error = 0  # ... of which with status "error"
        # Epochs with reports that have not closed (the close test is one comparison).
        #: the run's epochs: open, closed (records and their seqs), late reports (2.3)
        self.epochs = RunEpochs(self._emit_record, self._raise)
        #: The alert list (PROTOCOL 3): each (kind, rank) once, in first-raised order.
        self.alerts = RunAlerts()
        # Hardware string of PROTOCOL 2.2, from each rank's last summary.
        self._hw = HardwareString(self.topology, self._summary_of)
        self._ranks_dirty = False
        self._ranks_sent_at: float | None = None
        self._port_log = RateLimitedLog(log, PORT_WARN_INTERVAL, max_keys=1)
        # Per-apply scratch.
        self._events: List[Event] = []
        # Header changed, to go out now / coalesced by tick() (see the module docstring).
        self._header_changed = False
        self._header_pending = False
        self._header_sent_at: float | None = None
        #: The GPU alert rules (PROTOCOL 3), fed every sample while ``live``.
        self.gpu_rules = GpuAlertRules()
        #: False while the journal replays frames into this sink: a replay raises no GPU
        #: alert and hands nothing to ``on_alert``/``on_end`` (PROTOCOL 3, 3.1: a restart
        #: posts nothing for what its journal replays). :class:`broker.runs.Runs` sets it
        #: on every sink it takes in, before the first live frame.
        self.live = False
        #: Hook for run ends while live (the broker's webhooks); alerts: ``on_alert``.
        self.on_end: OnEnd | None = None
        #: Each rank's latest dump per reason (section 2.5), compact and capped in bytes.
        self.stacks = RunStacks()
        self._stack_feed = StackFeed(self.stacks, self._emit, run)
        #: The header's ``collectives_last`` (8.5): the answer to the latest hang, kept.
        self.collectives_last = LastVerdict()
        #: True while the journal replays frames into this sink (broker/journal/replay.py):
        #: the collective verdicts it forms then raise no alert (their alerts come back from
        #: the journal's STATE entries, with the times they had live)
        self.replaying = False
        #: The first failure (8.2): the ranks' kept errors (bounded in bytes), the header's
        #: ``failure`` as last computed, and whether a rank's status changed since.
        self._errors = ErrorStore()
        self._failures = FailureIndex()
        self._failure: Dict[str, Any] | None = None
        self._failure_dirty = False
        #: The run's attempts (8.1, broker/run/attempts.py), the line of closed steps and the
        #: superseded epoch records (broker/run/steps/line.py)
        self.attempts = Attempts()
        self.line = self._steps.line
        self.epoch_line = EpochLine()

    # ------------------------------------------------------------------ public API

    @property
    def metadata(self) -> Any:
        """The accepted metadata, decoded (a new object each time, so a header's copy is
        freed with the header; None: none)."""
        return None if self._metadata is None else msgspec.msgpack.decode(self._metadata)

    @property
    def finished(self) -> bool:
        """True while the run has ended (status complete or failed)."""
        return self.status in ENDED

    def quiet(self) -> bool:
        """True when no rank is ``ok`` (each finished, failed or stale) and there is one:
        with :attr:`finished`, PROTOCOL 8.4's "ended" for a run in memory."""
        ranks = self._ranks
        return bool(ranks) and not any(st.status == "ok" for st in ranks.values())

    def apply(self, frame: Frame, now: float) -> List[Event]:
        """Apply one decoded frame received at ``now``; returns the events it caused (the
        ``resources`` frames a batch held back come in through :meth:`apply_held`).

        Raises :class:`Rejected` with nothing changed when the frame breaks a sink rule.

        ``resources`` and ``metrics`` frames are nearly all the traffic, so they take a
        path of their own: a bounds check, the rank touched in place, the sample stored as
        the decoded Struct (dicts are built lazily, when ``ranks()`` or a close needs them)
        and no event list unless something is emitted.
        """
        tp = type(frame)
        rank = frame.rank
        if tp is Resources or tp is Metrics or tp is Steps:
            ws = self.world_size
            if ws is not None and rank >= ws:
                raise Rejected("rank_out_of_range", f"rank {rank} >= world_size {ws}")
            if self.attempts.current and rank not in self.attempts.registered:
                self._attempt_gate(frame)  # (8.1: an old process's frame)
            if tp is Metrics:
                self.epochs.pending.admit(frame.epoch)  # type: ignore[union-attr]
            elif tp is Steps:
                metrics = frame.metrics  # type: ignore[union-attr]
                # only a new name needs the cap's check (issue 17: a call per frame saved)
                if metrics and not self._steps.names.issuperset(metrics):
                    self._steps.admit(frame)  # type: ignore[arg-type]
            parsed = None
        elif tp is Register and self.attempts.decide(frame, self.world_size, now):  # type: ignore[arg-type]
            if frame.rank >= frame.world_size:  # type: ignore[union-attr]
                raise Rejected("rank_out_of_range",
                               f"rank {rank} >= world_size {frame.world_size}")  # type: ignore[union-attr]
            parsed = None
            self._start_attempt(frame, now)  # type: ignore[arg-type]
        else:
            parsed = self._check(frame)
        if self.started_at is None:
            self.started_at = now
            self._header_changed = True
        self.updated_at = now
        st = self._seen(rank, now)
        self._ranks_dirty = True
        if tp is Resources:
            self._samples.put(rank, frame.sample)  # type: ignore[union-attr]
            st.sample_json = None
            self.gpu_health(rank, frame.sample, now)  # type: ignore[union-attr]
            # A sample changes nothing in the header and cannot complete the run.
            return self._take_events() if self._header_changed else []
        try:
            if tp is Steps:  # (inline: the per-frame path of a step flood)
                st.stalled = st.collective = False  # the loop moves (sections 3, 7.2)
                # (grace and force close also run in tick)
                if self._steps.add(frame, now, not st.finished, self.world_size):  # type: ignore[arg-type]
                    self._publish_steps(now)
            elif tp is Metrics:
                self._on_metrics(frame, st, now)  # type: ignore[arg-type]
            elif tp is Register:
                self._on_register(frame, st, now)  # type: ignore[arg-type]
            elif tp is Finish:
                self._on_finish(frame, st, now)  # type: ignore[arg-type]
            elif tp is Hardware:
                self._on_hardware(frame, st)  # type: ignore[arg-type]
            elif tp is Svg:
                self._on_svg(frame)  # type: ignore[arg-type]
            elif tp is Stacks:
                self._on_stacks(frame, st, now)  # type: ignore[arg-type]
            elif tp is Collectives:  # (RunSink._on_collectives, below)
                self._on_collectives(frame, st, now)  # type: ignore[arg-type]
            elif tp is Metadata and frame.json != self._metadata_raw:  # type: ignore[union-attr]
                if parsed != self._metadata:
                    # (re-formatted but equal JSON changes nothing). Coalesced like the
                    # hardware: a burst of replaced blobs is one header per ranks_interval,
                    # not one ~1 MiB header per frame held in the server's batch.
                    self._header_pending = True
                self._metadata = parsed
                self._metadata_raw = frame.json  # type: ignore[union-attr]
            ws = self.world_size
            if ws is not None and self._n_finished == ws and self.status not in ENDED:
                self._complete()
            elif self._header_changed:
                self._emit_header()
        except BaseException:
            # A bug, not bad input (Runs counts it): drop this frame's half-made events.
            self._events = []
            self._header_changed = False
            raise
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def apply_held(self, frames: List[Resources],
                   now: float) -> Tuple[List[Event], List[Tuple[Resources, str]]]:
        """Apply a batch's held ``resources`` frames of this run, in order: what
        :meth:`apply` does to each but the GPU rules, which every held sample feeds
        (:meth:`gpu_health_many`, called by :class:`broker.runs.Runs` just before; not
        twice), in one call, because a batch releases each rank's newest sample at once
        (:class:`broker.coalesce.HeldSamples`). Returns the events and the frames rejected,
        each with why (a rank past the world size; held frames were checked when held,
        and a frame that could change the world size releases them first)."""
        ws = self.world_size
        seen, put = self._seen, self._samples.put
        rejected: List[Tuple[Resources, str]] = []
        att = self.attempts
        for frame in frames:
            rank = frame.rank
            if ws is not None and rank >= ws:
                rejected.append((frame, f"rank {rank} >= world_size {ws}"))
                continue
            if att.current and rank not in att.registered:  # (8.1)
                rejected.append((frame, f"old_proc: rank {rank} has not registered in "
                                        f"attempt {att.current}"))
                continue
            put(rank, frame.sample)
            seen(rank, now).sample_json = None
        if len(rejected) < len(frames):
            if self.started_at is None:
                self.started_at = now
                self._header_changed = True
            self.updated_at = now
            self._ranks_dirty = True
        return (self._take_events() if self._header_changed else []), rejected

    def _seen(self, rank: int, now: float) -> RankState:
        """Any accepted frame marks its rank seen: a stale rank is ok again (and counts for
        the step watermark), a finished one stays finished."""
        st = self._ranks.get(rank)
        if st is None:
            st = self._ranks[rank] = RankState(rank, now)
            self._failure_dirty = True
        else:
            st.last_seen = now
            if st.status == "stale":
                st.status = "ok"
                self._closer.set_active(rank, True)
                self._failures.unstale(rank)
                self._failure_dirty = True
        return st

    def tick(self, now: float) -> List[Event]:
        """Liveness at ``now``: stale transitions and their alerts; the rate-limited ``ranks``
        and coalesced header (``run``) events."""
        limit = now - self.stale_after
        if self.liveness_floor > limit:
            limit = -math.inf
        for st in self._ranks.values():
            if st.status == "ok" and st.last_seen <= limit:
                st.status = "stale"
                self._closer.set_active(st.rank, False)
                self._ranks_dirty = True
                self._failures.stale(st.rank, st.last_seen)
                self._failure_dirty = True
                # A rank not heard from since a restart turns stale from replayed state
                # alone: listed, but not posted (an abandoned run in the data dir would
                # otherwise post on every broker start).
                self._raise("stale", st.rank, f"rank {st.rank} silent for {self.stale_after:g}s", now,
                            notify=st.last_seen >= self.liveness_floor)
        self._close_steps(now)
        self._publish_steps_due(now)
        if self._failure_dirty and self._refresh_failure():
            self._header_pending = True  # (8.2: e.g. the last live rank went stale)
        if (self._stack_feed.pending or self._stack_feed.collectives.latest
                or self._stack_feed.collectives.has_gone):
            self._stacks_due(now)  # (with the collective verdict: StackFeed.refresh_verdict)
        header_due = self._header_changed or (self._header_pending and (
            self._header_sent_at is None or now - self._header_sent_at >= self.ranks_interval
        ))
        ranks_due = self._ranks_dirty and (
            self._ranks_sent_at is None or now - self._ranks_sent_at >= self.ranks_interval
        )
        if header_due or ranks_due:
            self._flush_snapshot(now)
        return self._take_events()

    def _flush_snapshot(self, now: float) -> None:
        """One snapshot (issue 44 item 6): when either the coalesced header or the ``ranks``
        array goes out, the other goes with it if it has changed, header first, and both
        timers restart together.

        Why: a stall dump makes its rank ``stalled`` (the ranks array) and raises its alert
        (the header) in one frame, but the two were coalesced on timers of their own; a
        sampling run keeps the ranks dirty, so the timers drift apart and a ``ranks`` event
        showed ranks ``stalled`` up to a second before a ``run`` event listed their alerts
        (a 3-rank hang read over HTTP: 4 of 7 tries). Header first: a reader between the two
        events sees at most an alert whose status is on its way, never a status without its
        alert. Rates stay as they were: each goes out at most once per ``ranks_interval``
        (plus the header's immediate changes), and in phase from then on."""
        if self._header_changed or self._header_pending:
            self._header_sent_at = now
            self._emit_header()
        if self._ranks_dirty:
            self._ranks_dirty = False
            self._ranks_sent_at = now
            self._emit("ranks", self.ranks())

    def header(self) -> Dict[str, Any]:
        """The run header of PROTOCOL 4 as a JSON-ready dict.

        The dict is new, but ``hosts`` is shared with earlier headers (rebuilding it per
        event would make a registration storm quadratic): event data is read-only for
        every consumer. ``metadata`` is decoded anew (see :func:`parse_metadata`).
        """
        return {
            "run": self.run,
            "status": self.status,
            "world_size": self.world_size,
            "total_epochs": self.total_epochs or None,
            "label": self.label,
            "shard": self.shard,
            "hash": self.hash,
            "port": self.port or None,
            "metadata": self.metadata,  # decoded per header: resident only as MessagePack
            "hardware": self._hw.render(),
            "has_svg": self.svg is not None,
            "hosts": self.topology.ordered(),
            "alerts": self.alerts.listed(),
            "started_at": self.started_at,
            "updated_at": self.updated_at,
            "steps_done": self.steps.last_step,
            "step_metrics": self.line.metric_names(),  # (8.1: superseded records' too)
            "data_share": self.data_wait.share,
            "data_stragglers": self.data_wait.stragglers,
            "collectives_last": self.collectives_last.value,
            "total_steps": self.total_steps or None,  # 8.5
            "eta_secs": step_eta(self.total_steps, self.steps),
            "alert_ranks": self.alerts.ranks_raised(),  # 8.5: whose the alerts are
            "failure": self.failure,  # 8.2
            # 8.3: nonfinite, nonfinite_more, replica_divergence
            **self._steps.numbers.header(self.topology.place.get),
            **self._attempts_header(),  # 8.1: attempt, attempts
        }

    @property
    def failure(self) -> Dict[str, Any] | None:
        """The header's ``failure`` (8.2, :func:`broker.run.failure.failure`), recomputed only
        after a rank's status changed. Read-only, like all event data."""
        if self._failure_dirty:
            self._refresh_failure()
        return self._failure

    def _refresh_failure(self) -> bool:
        """Recompute ``failure``; True when it changed (the header must go out)."""
        self._failure_dirty = False
        place, ranks = self.topology.place, self._ranks
        failures = self._failures
        new = failures.failure(lambda r: ranks[r].error,
                               lambda r: (place.get(r) or (None,))[0],
                               self._n_finished + len(failures.silent) == len(ranks))
        if new == self._failure:
            return False
        self._failure = new
        return True

    def ranks(self) -> List[Dict[str, Any]]:
        """The ``ranks`` array of PROTOCOL 4 (rank order), each entry plus its last ``loss``."""
        return ranks_array(self._ranks, self.topology.place, self._samples, self._closer,
                           self.gpu_rules.xids)

    def snapshot(self) -> Dict[str, Any]:
        """Everything a late subscriber needs (the Clone pattern of docs/DESIGN.md) plus the svg."""
        return {
            "run": self.run,
            "seq": self.seq,
            "header": self.header(),
            "ranks": self.ranks(),
            "records": [[s, r] for s, r in zip(self.record_seqs, self.records)],
            "complete": list(self.complete) if self.complete is not None else None,
            "svg": self.svg,
            "steps": self.steps.to_wire(),
            "stacks": self.stacks.wire(),
            "collectives": self.collectives_view(),
            "line": self.line.wire(),  # 8.1: attempts along the line, superseded steps
            "epochs_superseded": list(self.epoch_line.superseded),
        }

    def _attempts_header(self) -> Dict[str, Any]:
        """The header's ``attempt`` and ``attempts`` (8.1); the entries' figures are the
        line's (broker/run/steps/line.py) as of now."""
        att = self.attempts
        cur = att.now
        if cur["world_size"] is None:
            cur["world_size"] = self.world_size
        att.first["started_at"] = self.started_at
        self._fill_attempt_figures()
        return {"attempt": att.current, "attempts": att.listed(),
                # 8.5 with 8.1: per kind, the distinct ranks that raised it in each attempt
                "alert_attempts": self.alerts.raised_by_attempt()}

    def _fill_attempt_figures(self) -> None:
        """Each listed entry's first/last step and epoch and superseded counts (8.1)."""
        line = self.line
        for entry in self.attempts.listed_entries():
            k = entry["attempt"]
            entry.update(line.figures(k))
            entry.update(self.epoch_line.figures(k))

    def host_of(self, rank: int) -> str | None:
        """The host of ``rank`` as the topology places it (None: unknown)."""
        placed = self.topology.place.get(rank)
        return placed[0] if placed else None

    def _reset_processes(self, now: float) -> None:
        """A new attempt (8.1): what belongs to processes begins as for a new run (rank
        states, stall dumps, collectives, data waits, the step and epoch closing with its
        start-up grace, the topology and hardware string); the run's id, label, svg,
        metadata, alerts, records, steps, port and totals are kept. Attempt k's steps
        closed and went out before this (RunSink._start_attempt); its incomplete epochs
        are dropped here."""
        for st in self._ranks.values():
            self._errors.release(st.error)
        self._ranks = {}
        self._n_finished = self._n_error = 0
        self.topology = Topology()
        self._samples = RankSamples(self.topology.place)
        self._hw = HardwareString(self.topology, self._summary_of)
        last_epoch = self.epochs.new_attempt()  # (its open epochs dropped)
        self.epoch_line.new_attempt(self.attempts.current, last_epoch)
        self.stacks = RunStacks()
        self._stack_feed = StackFeed(self.stacks, self._emit, self.run)
        self._steps.new_attempt(self.attempts.current)
        self._closer = self._steps.closer
        self.alerts.new_attempt(self.attempts.current)
        self._errors = ErrorStore()
        self._failures = FailureIndex()
        self._failure = None
        self._failure_dirty = True
        self.complete = None
        self._ranks_dirty = True
        self._header_changed = True

    # ------------------------------------------------------------------ validation

    def _check(self, frame: Frame) -> Any:
        """Raise Rejected if the frame breaks a sink rule; returns packed metadata if any.

        Runs before any state changes: this is what makes a rejection side-effect free.
        """
        ws = self.world_size
        if isinstance(frame, Register):
            if ws is not None and frame.world_size != ws:
                raise Rejected(
                    "world_size_mismatch",
                    f"rank {frame.rank} says world_size {frame.world_size}, run has {ws}",
                )
            limit = ws if ws is not None else frame.world_size
            if frame.rank >= limit:
                raise Rejected("rank_out_of_range", f"rank {frame.rank} >= world_size {limit}")
            return None
        if ws is not None and frame.rank >= ws:
            raise Rejected("rank_out_of_range", f"rank {frame.rank} >= world_size {ws}")
        self._attempt_gate(frame)  # (8.1: an old process's frame)
        if isinstance(frame, Metadata) and frame.json != self._metadata_raw:
            # Every rank often sends the same blob: the text already accepted needs no parse.
            return parse_metadata(frame.json)
        return None

    # ------------------------------------------------------------------ frame rules

    def gpu_health(self, rank: int, sample: ResourceSample, now: float) -> None:
        """The GPU alerts of one sample of ``rank`` (PROTOCOL 3), while the run is live (a
        replayed sample raises nothing). Every sample comes here or to
        :meth:`gpu_health_many` once."""
        if sample.gpus:
            self.gpu_health_many((Sampled(rank, sample),), now)

    def gpu_health_many(self, frames: Sequence[Resources | Sampled], now: float) -> None:
        """:meth:`gpu_health` for each of a batch's held ``resources`` frames of this run,
        in the order they arrived, in one call: every one, whether a newer one of its rank
        replaced it before it was applied (an XID is in one sample only) or not
        (:class:`broker.coalesce.HeldSamples`; :meth:`apply_held` applies the newest)."""
        if self.live:
            for alert in self.gpu_rules.feed_many(frames):
                self._raise(alert.kind, alert.rank, alert.message, now)

    def _on_hardware(self, frame: Hardware, st: RankState) -> None:
        if st.hardware == frame.summary:
            return
        # Interned: ranks nearly always report the same summary (and a storm of identical
        # 4 KiB ones must not cost 4 KiB a rank); interned strings are freed with their
        # last user.
        st.hardware = sys.intern(frame.summary)
        if self._hw.report_changed(st.rank):
            self._header_pending = True  # coalesced (see _header_pending)

    def _on_stacks(self, frame: Stacks, st: RankState, now: float) -> None:
        """Keep the dump (section 2.5); a ``stall`` dump makes the rank ``stalled`` and
        raises the ``stalled`` alert (section 3). Kept dumps go out in ``stacks`` events."""
        self._stack_feed.put(frame, now)
        if frame.reason == "stall":
            st.stalled = True
            self._raise("stalled", st.rank, stall_message(frame), now)

    def forget_stalls(self) -> None:
        """After a journal replay: dumps are still listed, but only a dump received since
        the restart makes a rank ``stalled`` (section 2), and none is pending publication."""
        for st in self._ranks.values():
            st.stalled = st.collective = False  # (and no replayed collectives frame counts)
        self._stack_feed.forget_pending()
        self.collectives_last.end_hang()

    # ------------------------------------------------------------------ across a restart

    def state_marks(self) -> Tuple[int, int, int, int]:
        """Versions of the state a replay of frames cannot rebuild (PROTOCOL 8.5): the
        alert list's shape (more than a time changed), the GPU rules' counters,
        ``collectives_last``, and the alert list's times. The journal writes
        :meth:`saved_state` of a part when its mark moved (cheap: asked after every event)."""
        return (self.alerts.shape, self.gpu_rules.changes, self.collectives_last.version,
                self.alerts.version)

    def figures_mark(self) -> Tuple[int, int, int]:
        """Moves when the ranks' step figures may have (:meth:`saved_state` ``figures``)."""
        return self._closer.figures_mark()

    def saved_state(self, part: str) -> Any:
        """One part of the state a replay cannot rebuild, as plain data for the journal:
        ``alerts``, ``gpu``, ``collectives_last`` or ``figures`` (the ranks' step figures,
        since ``steps`` frames are not journaled). :meth:`restore_state` takes it back."""
        if part == "alerts":
            return self.alerts.state()
        if part == "gpu":
            return self.gpu_rules.state()
        if part == "collectives_last":
            return self.collectives_last.state()
        if part == "figures":
            return self._closer.figures_state()
        raise ValueError(f"unknown state part {part!r}")

    def restore_state(self, part: str, data: Any) -> None:
        """Journal replay: take back a :meth:`saved_state` part. Raises ``ValueError``,
        ``TypeError`` or ``KeyError`` for data it cannot take (the replay logs and skips it;
        the part keeps what the frames rebuilt)."""
        if part == "alerts":
            self.alerts.restore(data)
        elif part == "gpu":
            self.gpu_rules.restore(data)
        elif part == "collectives_last":
            self.collectives_last.restore(data)
        elif part == "figures":
            active = {r: not st.finished and st.status != "stale" for r, st in self._ranks.items()}
            self._closer.restore_figures(data, active)
            # the header's data-wait figures read them; the alerts they raised were restored
            # with the list, so none is raised again here
            self._update_data_wait(self.updated_at or 0.0, force=True, quiet=True)
        else:
            raise ValueError(f"unknown state part {part!r}")
        self._header_pending = True

    def _summary_of(self, rank: int) -> str | None:
        st = self._ranks.get(rank)
        return st.hardware if st is not None else None

    def _on_svg(self, frame: Svg) -> None:
        if self.svg is None and frame.svg:
            self.svg = frame.svg
            self.label = frame.label or self._register_label  # the svg's own label wins
            self.hash = frame.hash
            self._header_changed = True

    # ------------------------------------------------------------------ events

    @property
    def on_alert(self) -> OnAlert | None:
        """Hook for alerts raised while live (the broker's webhooks)."""
        return self.alerts.on_alert

    @on_alert.setter
    def on_alert(self, hook: OnAlert | None) -> None:
        self.alerts.on_alert = hook

    def _raise(self, kind: str, rank: int | None, message: str, now: float,
               notify: bool = True) -> None:
        """Raise (or re-raise) an alert (:class:`~broker.run.alerts.RunAlerts`), told to the
        webhooks while ``live``. The header change is coalesced: 65,536 ranks finishing
        with an error must not be 65,536 headers of a growing alert list (quadratic
        bytes); tick() emits it within ranks_interval."""
        self.alerts.raise_(self.run, kind, rank, message, now, self.topology.place.get,
                           self.live and notify)
        self._header_pending = True

    def _emit(self, kind: str, data: Any) -> int:
        self.seq += 1
        self._events.append(Event(self.seq, kind, data))
        return self.seq

    def _complete(self) -> None:
        """Every rank finished: the run ends; the header (with its status), the ranks if they
        changed (not throttled: whoever sees the end saw every rank's), then completion."""
        completed = "failed" if self._n_error else "complete"
        if self._steps.close_all():
            assert self.updated_at is not None
            self._publish_steps(self.updated_at, final=True)
        self.status = completed
        self._emit_header()
        if self._ranks_dirty:  # the final ranks go with the completion, never after it
            self._ranks_dirty, self._ranks_sent_at = False, self.updated_at
            self._emit("ranks", self.ranks())
        self.complete = (self._emit("complete", {"status": completed}), completed)
        if self.live and self.on_end is not None:
            assert self.updated_at is not None
            self.on_end(self.run, completed, self.updated_at)

    def _emit_header(self) -> None:
        """A ``run`` event with the full header (so every pending change goes with it)."""
        self._header_changed = False
        self._header_pending = False
        self._emit("run", self.header())

    def _take_events(self) -> List[Event]:
        """Emit the header if it changed, then hand over the events (and reset the scratch)."""
        if self._header_changed:
            self._emit_header()
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    # ------------------------------------------------ membership (PROTOCOL.md 2, 2.1, 3)
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
        self.epochs.pending.rank_active(rank, True)
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
        self.epochs.pending.rank_active(rank, False)
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
            self.epochs.pending.discard(rank, not st.finished)
        if gone:
            self.alerts.forget_ranks_from(ws)
        self.gpu_rules.forget_from(ws)
        if touched:
            self._hw.hosts_changed(touched)

    # ------------------------------------------------------------ attempts (PROTOCOL.md 8.1)
    @property
    def attempt(self) -> int:
        """The current attempt (0-based)."""
        return self.attempts.current

    def _attempt_gate(self, frame: Any) -> None:
        """A frame other than ``register`` from a rank that has not registered in the current
        attempt, past attempt 0, is an old process's (``old_proc``). Call after the range
        check; changes nothing."""
        att = self.attempts
        if att.current and frame.rank not in att.registered:
            raise Rejected("old_proc", f"rank {frame.rank} has not registered in attempt "
                                       f"{att.current}")

    def _start_attempt(self, frame: Register, now: float) -> None:
        """``frame`` starts attempt k+1 (decided by :meth:`Attempts.decide`): attempt k ends
        (its pending steps close and go out, its cause is kept), then what belongs to
        processes begins afresh and the ``restart`` alert is raised."""
        if self.started_at is None:
            self.started_at = now
        if self._steps.close_all():
            self._publish_steps(now, final=True)
        ranks = self._ranks
        ended_cause = cause(failure(ranks, self.host_of, unfinished_silent=True)) if ranks else None
        self._fill_attempt_figures()  # (the entry's last step, for the message)
        prev = self.attempts.begin(now, frame.world_size)
        prev["cause"] = ended_cause
        self.world_size = frame.world_size
        self._reset_processes(now)
        self._raise("restart", None, restart_message(self.attempts.current, prev), now)
        self.status = "training"
        self._header_changed = True

    # ------------------------------------------------------ collectives (PROTOCOL.md 7.2)
    # A frame is kept by the run's StackFeed (which forms the verdict over the current
    # frames, broker/stacks/feed.py), it makes its rank's latest frame current
    # (``RankState.collective``: the rank's next steps/metrics frame clears it, as it clears
    # ``stalled``, one store on the hottest path where asking the feed would be a call per
    # frame), and the verdict is due. It is formed when a ``stacks`` event may go out (at
    # most 4 a second) and only when a frame came or the set of current ranks changed: a
    # verdict over 1,024 ranks is milliseconds, not to be redone per frame. A new verdict
    # raises its alerts here and is offered to the header's ``collectives_last`` (8.5).
    def _on_collectives(self, frame: Collectives, st: RankState, now: float) -> None:
        """Keep the frame; the rank's latest is current until its loop moves (7.2)."""
        self._stack_feed.put_collectives(frame)
        st.collective = True
        self._stacks_due(now)

    def _stacks_due(self, now: float) -> None:
        """The run's ``stacks`` event, if one may go out now: the verdict first, when
        something it reads changed (the tick calls this while anything is pending or any
        ``collectives`` frame is kept)."""
        feed = self._stack_feed
        if not feed.due(now):
            return
        if feed.take_gone():
            self._refresh_verdict(now)
        feed.publish_due(now)

    def _refresh_verdict(self, now: float) -> None:
        ranks = self._ranks
        formed = self._stack_feed.refresh_verdict(
            lambda r: (st := ranks.get(r)) is not None and st.collective, self.world_size)
        if formed is None:
            return
        previous, verdict, any_current = formed
        if self.collectives_last.offer(verdict, any_current, now):
            self._header_pending = True  # the header's collectives_last (8.5)
        if verdict != previous and not self.replaying:
            # a replay's verdicts are formed at other times than live ones were: the
            # alerts they raised come back from the journal as they were (8.5)
            for kind, rank, message in verdict_alerts(previous, verdict):
                self._raise(kind, rank, message, now)

    def settle_verdict(self, now: float) -> None:
        """End of a journal replay that held no ``collectives_last`` (a data dir an earlier
        version wrote): form the verdict over the replayed frames once more, so the header
        keeps the answer they give."""
        if self._stack_feed.settle():
            self._refresh_verdict(now)

    def close_collectives(self) -> None:
        """The run leaves memory: its frames leave the process's byte budget."""
        self._stack_feed.collectives.close()

    def collectives_view(self) -> Dict[str, Any]:
        """``GET /api/runs/<run>/collectives`` as the broker has it, and what a run snapshot
        carries: ``{"groups": verdict, "ranks": [frames]}``."""
        return self._stack_feed.view()

    # ----------------------------------------------------------- epochs (PROTOCOL.md 2.3)
    @property
    def records(self) -> List[Dict[str, Any]]:
        """Closed epoch records, ascending epoch (:attr:`RunEpochs.records`)."""
        return self.epochs.records

    @property
    def record_seqs(self) -> List[int]:
        """The seq of each record's ``epoch`` event."""
        return self.epochs.record_seqs

    @property
    def late_metrics(self) -> int:
        """Reports of an epoch that had already closed (dropped, counted)."""
        return self.epochs.late

    def _on_metrics(self, frame: Metrics, st: RankState, now: float) -> None:
        st.stalled = st.collective = False  # the loop moves (sections 3, 7.2)
        sample = frame.resources
        if sample is not None:  # applied first, exactly as a resources frame
            self._samples.put(st.rank, sample)
            st.sample_json = None
            self.gpu_health(st.rank, sample, now)
        reported = self.epochs.report(frame, st)
        ws = self.world_size
        if reported is not None and ws is not None and reported == ws - self._n_finished:
            self._close_through(frame.epoch)

    def _close_ready(self) -> None:
        """Close the highest pending epoch that is complete, and every one below it."""
        ws = self.world_size
        pending = self.epochs.pending
        if ws is None or not pending:
            return
        epoch = pending.highest_complete(ws - self._n_finished)
        if epoch is not None:
            self._close_through(epoch)

    def _close_through(self, epoch: int) -> None:
        """Close every pending epoch <= ``epoch`` (:meth:`RunEpochs.close_through`)."""
        now = self.updated_at
        assert self.world_size is not None and now is not None and self.started_at is not None
        self.epochs.close_through(
            epoch, world_size=self.world_size, now=now, started_at=self.started_at,
            samples=self._samples, topology=self.topology, total_epochs=self.total_epochs,
            attempt=self.attempts.current, line=self.epoch_line)

    def _emit_record(self, kind: str, record: Dict[str, Any]) -> int:
        """An ``epoch`` event for :class:`RunEpochs`: a coalesced header change goes out
        first (the web must never show a record under a stale header), and the first
        record turns a waiting run to training."""
        if self._header_pending:
            self._emit_header()
        seq = self._emit(kind, record)
        if self.status == "waiting":
            self.status = "training"
            self._header_changed = True
        return seq

    # ------------------------------------------------------------ steps (PROTOCOL.md 2.4)
    # The step rules are RunSteps' (broker/run/steps/closer.py); the sink keeps the run's
    # status and header flags, which a published or restored step changes.
    @property
    def data_wait(self) -> DataWait:
        """The header's data-wait figures (7.1): the current attempt's, RunSteps' own."""
        return self._steps.data_wait

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
            self._steps.restore_numbers(numbers, published if isinstance(published, float)
                                        else (self.updated_at or 0.0), self.world_size)
        self._update_data_wait(self.updated_at or 0.0, force=True)

    def numbers_wire(self) -> Dict[str, Any] | None:
        """(8.3) The number rules' state for the journal's next STEPS block when it changed
        (None: unchanged): :meth:`RunSteps.numbers_wire`."""
        return self._steps.numbers_wire(self.alerts.listed)

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
        """One ``steps`` event (:meth:`RunSteps.publish`); the first turns a waiting run
        to training, and the header goes out (coalesced) when its figures moved."""
        if self._steps.publish(now, self.world_size, self.topology.place.get, final):
            self._header_pending = True
        if self.status == "waiting":
            self.status = "training"
            self._header_changed = True

    def _update_data_wait(self, now: float, force: bool = False, quiet: bool = False) -> None:
        """The header's data-wait figures (:meth:`RunSteps.update_data_wait`); the header
        goes out (coalesced) when they moved."""
        if self._steps.update_data_wait(now, self.topology.place.get, force, quiet):
            self._header_pending = True
