"""Runs: the broker's registry of live runs, pure (no sockets, no clock of its own).

``Runs.ingest(raw, now)`` is the whole meaning of one received message: size check, decode,
find or create the run's :class:`~broker.run.sink.RunSink`, apply, count. The server only moves
bytes; every reject rule is a fast unit test here (STYLE 4: receive loop apart from handler).

Reject reasons (docs/PROTOCOL.md section 7): ``oversize``, ``decode``, ``schema``, ``limit`` (decode
level) and the sink's ``Rejected.reason``. A rejected frame has no effect but its counter: in
particular it never creates a run.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import Any, Callable, Iterator, Union

import msgspec

from broker.coalesce import HeldSamples
from broker.run.sink import Event, OnAlert, OnEnd, Rejected, RunSink
from rank_agent import protocol
from rank_agent.protocol import Frame, Register, Resources
from rank_agent.ratelimit import RateLimitedLog

__all__ = ["Runs", "OnAccept", "Raw", "Recorder"]

log = logging.getLogger(__name__)

_decode = protocol.decoder.decode
_check_of = protocol.check_of
_MAX_FRAME_BYTES = protocol.MAX_FRAME_BYTES
#: ``resources``, the type of nearly every frame of a sampler flood, when it has no
#: after-decode check (it has none: then its frames skip the lookup), else None
_UNCHECKED = Resources if _check_of(Resources) is None else None

#: A received message: bytes, or a zero-copy buffer of a large one (broker/ingest.py).
Raw = Union[bytes, memoryview]

#: Called with (run, raw, frame, now) for every accepted frame, after the sink applied it
#: (the server journals it and notes registered ports).
OnAccept = Callable[[str, "Raw", Frame, float], None]

#: Called with (sink, raw, frame, now) for every accepted frame, after the sink applied it
#: and before ``on_accept``: the journal's ``accept`` (it needs the sink, which this hands
#: over without a second lookup).
Recorder = Callable[[RunSink, "Raw", Frame, float], None]

#: How many evicted runs' last sequence numbers are remembered (see ``_evicted``).
_EVICTED_MEMORY = 100_000


class Runs:
    """All runs the broker holds in memory, with reject counting and a cap on their number.

    When ``max_runs`` runs are held and a frame names a new one, the least recently active
    run is evicted from memory, *whatever its status* (contract v3 section 6: runs that never
    finish must not lock new ones out); it stays in the journal, and a later frame of it
    brings it back. The eviction is an event: :meth:`ingest` returns, before the new run's
    events, ``(victim, Event(seq, "evicted", {"run": victim}))``, ``seq`` one past the
    victim's last, so the server publishes it like any event and every web can drop the run
    (a web that does not know the kind ignores it). ``evictions`` counts them.

    Hooks (the server wires them to the journal): ``recorder(sink, raw, frame, now)``, then
    ``on_register(frame)`` for an accepted ``register`` and ``on_accept(run, raw, frame,
    now)``, after every accepted frame; ``loader(run)`` when a
    frame names a run not in memory, to bring back one evicted earlier (None: a new run);
    ``on_evict(run)`` when a run leaves memory (also when a run brought back by ``loader``
    is dropped again because its frame was rejected); ``on_alert(run, kind, rank, message,
    host, now)`` for each alert raised live and ``on_run_end(run, status, now)`` when a run
    ends live (the broker's webhooks). Every sink this class takes in (new, brought back by
    ``loader``, or given to :meth:`restore`) is made ``live`` first: a journal replay happens before
    that, so what it replays is never handed to these two (PROTOCOL 3.1).

    ``hold_samples`` (the ingest loop's, :class:`broker.ingest.IngestLoop`): each rank's newest ``resources`` frame of a batch is held
    back and applied by :meth:`release_samples` at the batch's end, or before another frame
    of its run (:class:`broker.coalesce.HeldSamples`: why, and why the state is the same).
    """

    def __init__(
        self,
        *,
        stale_after: float = 30.0,
        max_runs: int = 1000,
        ranks_interval: float = 1.0,
        step_close_after: float = 10.0,
        sinks: dict[str, RunSink] | None = None,
        on_accept: OnAccept | None = None,
        on_register: Callable[[Register], None] | None = None,
        recorder: Recorder | None = None,
        loader: Callable[[str], RunSink | None] | None = None,
        on_evict: Callable[[str], None] | None = None,
        on_alert: OnAlert | None = None,
        on_run_end: OnEnd | None = None,
        rate_log: RateLimitedLog | None = None,
        hold_samples: bool = False,
    ) -> None:
        if max_runs < 1:
            raise ValueError("max_runs must be >= 1")
        self.stale_after = stale_after
        self.max_runs = max_runs
        self.ranks_interval = ranks_interval
        self.step_close_after = step_close_after
        self.on_accept = on_accept
        self.on_register = on_register
        self.recorder = recorder
        self.loader = loader
        self.on_evict = on_evict
        self.on_alert = on_alert
        self.on_run_end = on_run_end
        #: called with a sink that published events on its way out of memory (eviction),
        #: before ``on_evict``: the server's journal notes them (``Journal.note_seq``)
        self.on_settle: Callable[[RunSink], None] | None = None
        #: called with (sink, frames, now) for a batch's held ``resources`` frames of a run
        #: (each rank's newest) once they are applied, instead of ``recorder`` per frame:
        #: the server's journal's ``accept_samples`` (issue 33: a call a frame cost ~3k
        #: instructions in small batches); None: ``recorder`` per frame
        self.sample_recorder: Callable[[RunSink, list[Resources], float], None] | None = None
        self.accepted = 0
        self.rejected: Counter[str] = Counter()
        #: with ``hold_samples`` (the ingest loop's batches): each rank's newest ``resources``
        #: frame is held until :meth:`release_samples` or another frame of its run
        #: (:class:`broker.coalesce.HeldSamples`: why, and what it keeps)
        self._held: HeldSamples | None = HeldSamples() if hold_samples else None
        #: runs evicted from memory to make room for a new one (see the class docstring)
        self.evictions = 0
        self._rlog = rate_log if rate_log is not None else RateLimitedLog(log)
        #: PROTOCOL 7.3: this broker's shard index (each sink's header ``shard``) and the
        #: test a new run's id must pass (None: every run; the server's broker.shardgate)
        self.shard = 0
        self.owns: Callable[[str], bool] | None = None
        # Ordered by last accepted frame, least recent first: eviction scans from the front.
        self._sinks: OrderedDict[str, RunSink] = OrderedDict(sinks or {})
        for sink in self._sinks.values():
            self._go_live(sink)
        self._mru: str | None = None  # the run last moved to the end of ``_sinks``
        # late_metrics of runs no longer in memory, so the total never goes backwards.
        self._late_evicted = 0
        self._late_steps_evicted = 0
        self._steps_evicted = 0
        # run -> last seq issued before eviction: a run that comes back must keep its ids
        # increasing (the web drops anything at or below what it has seen).
        self._evicted: OrderedDict[str, int] = OrderedDict()

    # -- accessors ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sinks)

    def __contains__(self, run: object) -> bool:
        return run in self._sinks

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._sinks))

    def get(self, run: str) -> RunSink | None:
        """The run's sink, or None when it is not in memory."""
        return self._sinks.get(run)

    def sinks(self) -> list[RunSink]:
        """All sinks in memory (least recently active first)."""
        return list(self._sinks.values())

    @property
    def late_metrics(self) -> int:
        """Total metrics frames dropped as late, over every run ever held since start."""
        return self._late_evicted + sum(s.late_metrics for s in self._sinks.values())

    @property
    def late_steps(self) -> int:
        """Total step points dropped as late, over every run ever held since start."""
        return self._late_steps_evicted + sum(s.late_steps for s in self._sinks.values())

    @property
    def steps_closed(self) -> int:
        """Closed steps published since this broker started, over every run."""
        return self._steps_evicted + sum(s.steps_published for s in self._sinks.values())

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def restore(self, sinks: dict[str, RunSink]) -> None:
        """Adopt sinks rebuilt from the journal (they count towards ``max_runs``)."""
        for run, sink in sinks.items():
            self._go_live(sink)
            self._sinks[run] = sink
        self._mru = None

    # -- the handler -------------------------------------------------------------------

    def ingest(self, raw: Raw, now: float) -> list[tuple[str, Event]]:
        """Apply one received message; returns the events it caused, tagged with the run.

        Never raises for bad input: a rejected frame is counted by reason, logged
        rate-limited (one line, no traceback) and returns ``[]``.
        """
        if len(raw) > _MAX_FRAME_BYTES:
            return self._reject("oversize", "%d bytes", len(raw))
        try:
            frame = _decode(raw)  # protocol.decode, inlined: the per-frame path
            if type(frame) is not _UNCHECKED:
                check = _check_of(type(frame))
                if check is not None:
                    check(frame)
        except msgspec.ValidationError as exc:  # subclasses DecodeError: test it first
            return self._reject("schema", "%s", exc)
        except msgspec.DecodeError as exc:
            return self._reject("decode", "%s", exc)
        except RecursionError:  # valid MessagePack nested too deep (in an ignored extra key)
            return self._reject("decode", "nested too deep to decode")
        except protocol.LimitExceeded as exc:  # "limit", or "steps_shape" (BadSteps)
            return self._reject(exc.reason, "%s", exc)
        held = self._held
        if held is not None:
            run = frame.run
            sink = self._sinks.get(run)
            if sink is not None:
                rank = frame.rank
                if type(frame) is Resources and self.on_accept is None and (
                        sink.world_size is None or rank < sink.world_size):
                    # held (inline, not a method of HeldSamples: nearly every frame of a
                    # sampler flood takes this path)
                    entry = held.runs.get(run)
                    if entry is None:
                        entry = held.runs[run] = ({}, [])
                    ranks, arrived = entry
                    old = ranks.pop(rank, None)  # popped: the newest goes last
                    ranks[rank] = (frame, raw)
                    arrived.append(frame)  # for the GPU rules, when the run's are applied
                    if old is not None:
                        held.replaced += 1
                        self.accepted += 1
                    return []
                if run in held.runs:  # a frame the run's held samples must come before
                    out = self._release(run, *held.take(run), now)
                    return out + self.apply(frame, now, raw)
            elif held:  # a new run may evict one whose samples are held
                return self.release_samples(now) + self.apply(frame, now, raw)
        return self.apply(frame, now, raw)

    def release_samples(self, now: float) -> list[tuple[str, Event]]:
        """Apply every held ``resources`` frame (the ingest loop calls it at the end of
        each batch, before anything else reads the sinks); returns the events they caused."""
        held = self._held
        if not held:
            return []
        assert held is not None
        out: list[tuple[str, Event]] = []
        for run, frames, arrived in held.take_all():
            out += self._release(run, frames, arrived, now)
        return out

    def _release(self, run: str, frames: list[tuple[Resources, Raw]],
                 arrived: list[Resources], now: float) -> list[tuple[str, Event]]:
        """Apply one run's held ``resources`` frames: every one that arrived (the replaced
        too) to the GPU rules in one call (:meth:`RunSink.gpu_health_many`), the newest of
        each rank to the sink in one call (:meth:`RunSink.apply_held`), then each of those
        recorded: what :meth:`apply` would have done frame by frame (issue 17: applied one
        by one, a released sample cost ~10 k instructions in four calls)."""
        sink = self._sinks.get(run)
        if sink is None:  # a bug: a new run releases every held sample before it evicts
            self.rejected["internal"] += len(frames)
            self._rlog.error("internal", "%d held samples of run %r outlived it", len(frames),
                             run)
            return []
        try:
            sink.gpu_health_many(arrived, now)
        except Exception:  # (a bug: counted, and the samples are still applied)
            self._internal(run, arrived[0])
        applied = [frame for frame, _ in frames]
        try:
            events, rejected = sink.apply_held(applied, now)
        except Exception:
            return self._internal(run, frames[0][0])
        if rejected:
            for frame, why in rejected:
                self._reject("old_proc" if why.startswith("old_proc") else "rank_out_of_range",
                             "run %r rank %d: %s", run, frame.rank, why)
            gone = {id(frame) for frame, _ in rejected}
            frames = [item for item in frames if id(item[0]) not in gone]
            applied = [frame for frame, _ in frames]
        if run != self._mru:
            self._sinks.move_to_end(run)
            self._mru = run
        self.accepted += len(frames)
        recorder = self.recorder
        if self.sample_recorder is not None and self.on_accept is None:
            try:
                self.sample_recorder(sink, applied, now)
            except Exception:
                self._rlog.error("recorder", "recording the held samples of run %r failed",
                                 run, exc_info=True)
        elif recorder is not None or self.on_accept is not None:
            for frame, raw in frames:
                if recorder is not None:
                    try:
                        recorder(sink, raw, frame, now)
                    except Exception:
                        self._rlog.error("recorder", "recording an accepted frame of run %r "
                                         "failed", run, exc_info=True)
                if self.on_accept is not None:
                    self._hooks(run, raw, frame, now)
        return [(run, ev) for ev in events]

    def apply(self, frame: Frame, now: float, raw: Raw = b"") -> list[tuple[str, Event]]:
        """Apply an already decoded frame (``raw`` is handed to ``on_accept``)."""
        run = frame.run
        sink = self._sinks.get(run)
        if sink is None:  # (a held frame's run stays: a new run releases every one first)
            return self._apply_new(frame, now, raw)
        try:
            events = sink.apply(frame, now)
        except Rejected as exc:
            return self._reject(exc.reason, "run %r rank %d: %s", run, frame.rank, exc)
        except Exception:
            return self._internal(run, frame)
        if run != self._mru:  # most frames are of the run that sent the previous one
            self._sinks.move_to_end(run)
            self._mru = run
        # _accepted, inlined for the frames of runs already held (nearly all of them): the
        # broker's per-frame cost is mostly calls like this one.
        self.accepted += 1
        recorder = self.recorder
        if recorder is not None:
            try:
                recorder(sink, raw, frame, now)
            except Exception:
                self._rlog.error("recorder", "recording an accepted frame of run %r failed",
                                 run, exc_info=True)
        if self.on_accept is not None or (self.on_register is not None
                                          and type(frame) is Register):
            self._hooks(run, raw, frame, now)
        if events:
            return [(run, ev) for ev in events]
        return []

    def _apply_new(self, frame: Frame, now: float, raw: Raw) -> list[tuple[str, Event]]:
        """A frame naming a run not in memory: bring it back or make it, within the cap."""
        run = frame.run
        if self.owns is not None and not self.owns(run):  # before anything is made
            return self._reject("wrong_shard", "run %r is not shard %d's", run, self.shard)
        # The least recently active run, whatever its status (scans nothing: the order is
        # kept by every accepted frame).
        victim = next(iter(self._sinks)) if len(self._sinks) >= self.max_runs else None
        sink = self._load_or_new(run)
        try:
            events = sink.apply(frame, now)
        except Rejected as exc:
            self._forget_new(run)
            return self._reject(exc.reason, "run %r rank %d: %s", run, frame.rank, exc)
        except Exception:
            self._forget_new(run)
            return self._internal(run, frame)
        gone: list[tuple[str, Event]] = []
        if victim is not None:
            gone.extend((victim, ev) for ev in self._evict(victim, now))
        self._sinks[run] = sink
        self._mru = run
        return gone + self._accepted(sink, raw, frame, now, events)

    def _accepted(self, sink: RunSink, raw: Raw, frame: Frame, now: float,
                  events: list[Event]) -> list[tuple[str, Event]]:
        run = sink.run
        self.accepted += 1
        if self.recorder is not None:
            try:
                self.recorder(sink, raw, frame, now)
            except Exception:
                self._rlog.error("recorder", "recording an accepted frame of run %r failed",
                                 run, exc_info=True)
        self._hooks(run, raw, frame, now)
        if events:
            return [(run, ev) for ev in events]
        return []

    def _hooks(self, run: str, raw: Raw, frame: Frame, now: float) -> None:
        if self.on_register is not None and type(frame) is Register:
            try:
                self.on_register(frame)  # type: ignore[arg-type]
            except Exception:
                self._rlog.error("on_register", "a register's hook for run %r failed",
                                 run, exc_info=True)
        if self.on_accept is not None:
            try:
                self.on_accept(run, raw, frame, now)
            except Exception:
                self._rlog.error("on_accept", "an accepted frame's hook for run %r failed",
                                 run, exc_info=True)

    def _internal(self, run: str, frame: Frame) -> list[tuple[str, Event]]:
        """A bug in the sink, not bad input: keep the loop alive, but say where."""
        self.rejected["internal"] += 1
        self._rlog.error("internal", "sink of run %r failed on a %s frame",
                         run, type(frame).__name__, exc_info=True)
        return []

    def count_superseded(self, n: int) -> None:
        """``n`` large metadata frames were replaced by a newer one of their run before they
        were applied (:mod:`broker.coalesce`): counted, logged rate-limited, never applied."""
        if n > 0:
            self.rejected["metadata_superseded"] += n
            self._rlog.warning("metadata_superseded", "%d metadata frames replaced by a newer "
                               "one of their run before they were applied (last write wins)", n)

    def tick(self, now: float) -> list[tuple[str, Event]]:
        """Liveness timers of every run (stale ranks, alerts, throttled ``ranks`` events)."""
        out: list[tuple[str, Event]] = []
        for run, sink in list(self._sinks.items()):
            try:
                events = sink.tick(now)
            except Exception:
                self._rlog.error(("tick", run), "tick of run %r failed", run, exc_info=True)
                continue
            out.extend((run, ev) for ev in events)
        return out

    def snapshot(self, run: str | None = None) -> list[dict[str, Any]]:
        """Run snapshots (docs/DESIGN.md) of every run, or of ``run`` alone ([] if unknown)."""
        if run is not None:
            sink = self._sinks.get(run)
            return [] if sink is None else [sink.snapshot()]
        return [s.snapshot() for s in self._sinks.values()]

    def counters(self) -> dict[str, Any]:
        """Totals since start, as the heartbeat carries them."""
        return {
            "accepted": self.accepted,
            "rejected": dict(self.rejected),
            "late_metrics": self.late_metrics,
            "late_steps": self.late_steps,
            "steps_closed": self.steps_closed,
            "runs": len(self._sinks),
            "evictions": self.evictions,
        }

    # -- internals ---------------------------------------------------------------------

    def _go_live(self, sink: RunSink) -> None:
        """From now on ``sink``'s frames are live: its alerts and its end reach the hooks."""
        sink.live = True
        sink.shard = self.shard
        sink.on_alert = self._alert
        sink.on_end = self._run_end

    def _alert(self, run: str, kind: str, rank: int | None, message: str, host: str | None,
               now: float) -> None:
        hook = self.on_alert
        if hook is not None:
            try:
                hook(run, kind, rank, message, host, now)
            except Exception:  # a bug in the hook must not cost the frame
                self._rlog.error("on_alert", "the alert hook failed for run %r", run, exc_info=True)

    def _run_end(self, run: str, status: str, now: float) -> None:
        hook = self.on_run_end
        if hook is not None:
            try:
                hook(run, status, now)
            except Exception:
                self._rlog.error("on_run_end", "the run-end hook failed for run %r", run,
                                 exc_info=True)

    def _load_or_new(self, run: str) -> RunSink:
        if self.loader is not None:
            try:
                loaded = self.loader(run)
            except Exception:
                self._rlog.error(("load", run), "cannot reload run %r from the journal",
                                 run, exc_info=True)
                loaded = None
            if loaded is not None:
                log.info("run %r reloaded from the journal", run)
                self._go_live(loaded)
                return loaded
        sink = RunSink(run, stale_after=self.stale_after, ranks_interval=self.ranks_interval,
                       step_close_after=self.step_close_after)
        self._go_live(sink)
        last = self._evicted.get(run)
        if last is not None:
            # Skip one id on purpose: the web sees a gap and re-snapshots the run, replacing
            # the state it still holds from before the eviction.
            sink.seq = last + 1
        return sink

    def _forget_new(self, run: str) -> None:
        """Undo bringing in a run whose first frame was rejected: it is not held, and a
        journal that reloaded it may close it again."""
        sink = self._sinks.pop(run, None)
        if sink is not None:  # a reloaded run's answers leave the byte budget
            sink.stacks.close()
            sink.close_collectives()
        if self.loader is not None:
            self._notify_evict(run)

    def _notify_evict(self, run: str) -> None:
        if self.on_evict is None:
            return
        try:
            self.on_evict(run)
        except Exception:
            self._rlog.error(("evict", run), "on_evict of run %r failed", run, exc_info=True)

    def drop(self, run: str, now: float) -> list[tuple[str, Event]]:
        """PROTOCOL 8.4: ``run`` was deleted from the data dir; it leaves memory as a
        ``--max-runs`` eviction does (its ``evicted`` event, which every web drops it on, and
        ``on_evict``), and a later frame of it starts it afresh. [] when it is not held."""
        if run not in self._sinks:
            return []
        if self._held is not None:
            self._held.runs.pop(run, None)  # (none between batches, where this is called)
        if self._mru == run:
            self._mru = None
        return [(run, ev) for ev in self._evict(run, now, why="deleted from the data dir")]

    def _evict(self, run: str, now: float, why: str = "the cap") -> list[Event]:
        """Drop ``run`` from memory; returns what it published on leaving
        (:meth:`RunSink.settle`: its steps in flight), noted by ``on_settle``, then its
        ``evicted`` event (the run's next seq)."""
        sink = self._sinks.pop(run)
        sink.stacks.close()  # its dumps leave the process's byte budget (broker/budget.py)
        sink.close_collectives()  # and its collectives frames
        try:
            events = sink.settle(now)
        except Exception:
            self._rlog.error(("settle", run), "settling run %r before eviction failed", run,
                             exc_info=True)
            events = []
        if events and self.on_settle is not None:
            try:
                self.on_settle(sink)
            except Exception:
                self._rlog.error(("settle", run), "on_settle of run %r failed", run,
                                 exc_info=True)
        sink.seq += 1
        event = Event(sink.seq, "evicted", {"run": run})
        self.evictions += 1
        self._late_evicted += sink.late_metrics
        self._late_steps_evicted += sink.late_steps
        self._steps_evicted += sink.steps_published
        self._evicted[run] = sink.seq
        self._evicted.move_to_end(run)
        while len(self._evicted) > _EVICTED_MEMORY:
            self._evicted.popitem(last=False)
        self._notify_evict(run)
        log.info("run %r (%s) evicted from memory: %d runs held, %s", run, sink.status,
                 len(self._sinks), why)
        events.append(event)
        return events

    def _reject(self, reason: str, detail: str, *args: Any) -> list[tuple[str, Event]]:
        self.rejected[reason] += 1
        self._rlog.warning(reason, "rejected frame (%s): " + detail, reason, *args)
        return []
