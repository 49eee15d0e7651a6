"""The web's view of the broker: SUB + snapshot (Clone pattern) -> per-run state -> SSE clients.

Two layers, kept apart so the rules are unit-testable without sockets (the receive loop
apart from the handler, docs/DESIGN.md "The feed"):

* :class:`Hub` is the state machine. It is fed decoded feed messages
  (:meth:`Hub.handle_pub`, :meth:`Hub.handle_snapshot`) with an injected clock, keeps every
  run's header, ranks, epoch records and completion with their sequence numbers, decides
  when a snapshot must be (re)requested (:meth:`Hub.next_request`), and fans each event out
  to the run's subscribers as SSE bytes encoded exactly once.
* :class:`web.pump.FeedPump` is the I/O shell: one greenlet per broker connection owning a
  ``zmq.green`` SUB and DEALER, which only moves messages between the sockets and the hub.

Snapshot protocol (docs/DESIGN.md "The feed"): subscribe first, then ask ``[SNAP]``; while a
snapshot is outstanding, run updates are buffered; after it, buffered and new updates apply
only if their ``seq`` is above the run's. An update that skips a number is a gap: the run's
updates are buffered again and ``[SNAP, run]`` is asked. A heartbeat with a new broker
``instance`` (a restart) asks a fresh full snapshot.

Everything runs in one gevent thread; the hub never yields while it mutates state, so a
subscriber's replay (taken in :meth:`Hub.subscribe`) and its live queue cannot overlap or
leave a hole.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable, Iterable

import gevent
import numpy as np

from broker import feed
from web import sse
from web.cluster import ClusterIndex
from web.parking import ParkedStreams
from web.runstate import MAX_QUEUED_BYTES, RunState, Subscriber, finite
from web.stacksview import RunDumps

log = logging.getLogger(__name__)

#: The ``retry:`` line every stream starts with (milliseconds).
RETRY_MS = 2000
#: Default bound of a client's queue; a client that falls this far behind is dropped.
DEFAULT_QUEUE_SIZE = 256
#: The web counts as connected while heartbeats are at most this old (seconds).
HEARTBEAT_TIMEOUT = 3.0
#: A snapshot request unanswered for this long is abandoned and asked again on a new socket.
SNAPSHOT_TIMEOUT = 5.0
#: Buffered updates beyond this are dropped; the gap that causes is healed by a snapshot.
MAX_BUFFERED = 100_000

ENDED = ("complete", "failed")

#: The first chunk of every stream (shared, like every other chunk of a replay).
_RETRY = sse.retry(RETRY_MS)


class Hub:
    """Per-run state built from the broker feed, and the SSE subscribers of each run.

    Pure apart from gevent queues: no sockets, an injectable clock. The :class:`~web.pump.FeedPump`
    calls :meth:`handle_pub` / :meth:`handle_snapshot` and sends what :meth:`next_request`
    returns; the app calls :meth:`subscribe` and reads :attr:`runs`.
    """

    def __init__(
        self,
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        queue_bytes: int = MAX_QUEUED_BYTES,
        clock: Callable[[], float] = time.time,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
    ) -> None:
        self.queue_size = queue_size
        self.queue_bytes = queue_bytes
        self.clock = clock
        self.heartbeat_timeout = heartbeat_timeout
        self.runs: dict[str, RunState] = {}
        #: the latest heartbeat (counters for /metrics) and when it arrived
        self.heartbeat: feed.Heartbeat | None = None
        self.heartbeat_at: float | None = None
        #: the broker instance of the last complete full snapshot
        self.instance: str | None = None
        #: callbacks for the ``!port`` topic: fn(run, rank, port)
        self.port_listeners: list[Callable[[str, int, int], None]] = []
        #: callbacks after each complete full snapshot: fn(hub)
        self.snapshot_listeners: list[Callable[[Hub], None]] = []
        # SSE bookkeeping for /metrics
        self.clients_dropped = 0
        self.gaps = 0
        #: how often each of the web's limits bit, by reason (``rankboard_web_limited`` on
        #: /metrics): ``sse_queue_events``/``sse_queue_bytes`` (a slow client dropped), and
        #: the server's and app's own (``head_too_large``, ``head_timeout``, ``bad_framing``,
        #: ``host``), counted here so one process reports them all in one place
        self.limited: dict[str, int] = {}
        # snapshot request state
        self._want_full = True
        self._want_runs: dict[str, None] = {}  # ordered set
        self._outstanding: tuple[str | None, float] | None = None  # (run or None=all, sent at)
        self._reset_socket = False
        self._full_buffer: deque[feed.EventUpdate] = deque()
        self._run_buffers: dict[str, list[feed.EventUpdate]] = {}
        self._snap_runs: dict[str, RunState] = {}  # RUN replies of the outstanding request
        #: each run's stack dumps (section 2.5; ``web/stacksview.py``): from ``stacks``
        #: events and run snapshots, read by :meth:`stacks_view`
        self.stacks: dict[str, RunDumps] = {}
        self._snap_stacks: dict[str, RunDumps] = {}  # the dumps of the RUN replies
        #: evicted runs' open streams (:mod:`web.parking`)
        self._parked = ParkedStreams()
        #: the cluster view's per-run figures, cached (:mod:`web.cluster`)
        self.cluster = ClusterIndex()

    # ----------------------------------------------------------------- status
    @property
    def connected(self) -> bool:
        """A full snapshot of the current broker instance is applied and heartbeats are fresh."""
        hb = self.heartbeat
        return (
            self.instance is not None
            and hb is not None
            and hb.instance == self.instance
            and self.heartbeat_at is not None
            and self.clock() - self.heartbeat_at <= self.heartbeat_timeout
        )

    @property
    def client_count(self) -> int:
        return sum(len(s.subscribers) for s in self.runs.values())

    # ------------------------------------------------------- snapshot requests
    def next_request(self) -> list[bytes] | None:
        """The snapshot request to send now, or None (one request is outstanding at a time)."""
        if self._outstanding is not None:
            return None
        now = self.clock()
        if self._want_full:
            self._want_full = False
            self._want_runs.clear()
            self._outstanding = (None, now)
            self._snap_runs = {}
            return feed.encode_snapshot_request()
        if self._want_runs:
            run = next(iter(self._want_runs))
            del self._want_runs[run]
            self._outstanding = (run, now)
            self._snap_runs = {}
            return feed.encode_snapshot_request(run)
        return None

    def take_socket_reset(self) -> bool:
        """True once when the snapshot socket should be replaced (timeout or broker restart):
        a reply to the abandoned request must never be mistaken for the next one's.
        (Called on every turn of the pump's loop, so it also ends parked streams whose run
        did not come back within ``web.parking.PARK_S``.)"""
        if self._parked:
            self._parked.expire(self.clock())
        if self._outstanding is not None and self.clock() - self._outstanding[1] > SNAPSHOT_TIMEOUT:
            log.warning("snapshot request unanswered for %.0f s; asking again", SNAPSHOT_TIMEOUT)
            self._abandon_outstanding()
        reset, self._reset_socket = self._reset_socket, False
        return reset

    def _abandon_outstanding(self) -> None:
        if self._outstanding is not None:
            run = self._outstanding[0]
            if run is None:
                self._want_full = True
            else:
                self._want_runs[run] = None
            self._outstanding = None
            self._snap_runs = {}
            self._reset_socket = True

    @property
    def buffering_all(self) -> bool:
        return self._want_full or (self._outstanding is not None and self._outstanding[0] is None)

    # ------------------------------------------------------------- PUB input
    def handle_pub(self, parts: list[bytes]) -> None:
        """One PUB message. A malformed one is logged and skipped, never raised."""
        try:
            update = feed.decode_update(parts)
        except feed.FeedError as exc:
            log.warning("bad feed message skipped: %s", exc)
            return
        if isinstance(update, feed.EventUpdate):
            self._on_event(update)
        elif isinstance(update, feed.Heartbeat):
            self._on_heartbeat(update)
        elif isinstance(update, feed.PortUpdate):
            for listener in list(self.port_listeners):
                try:
                    listener(update.run, update.rank, update.port)
                except Exception:
                    log.exception("port listener failed")

    def _on_heartbeat(self, hb: feed.Heartbeat) -> None:
        previous = self.heartbeat
        self.heartbeat = hb
        self.heartbeat_at = self.clock()
        if previous is not None and previous.instance != hb.instance:
            # A restart: a request in flight may have gone to the dead broker; ask anew.
            log.info("broker restarted (instance %s -> %s); taking a fresh snapshot",
                     previous.instance, hb.instance)
            self._abandon_outstanding()
            self._want_full = True
            self._reset_socket = True
        elif self.instance is not None and hb.instance != self.instance and not self.buffering_all:
            self._want_full = True

    def _on_event(self, update: feed.EventUpdate) -> None:
        if self.buffering_all:
            if len(self._full_buffer) >= MAX_BUFFERED:
                self._full_buffer.popleft()
            self._full_buffer.append(update)
            return
        buffer = self._run_buffers.get(update.run)
        if buffer is not None:
            if len(buffer) < MAX_BUFFERED:
                buffer.append(update)
            return
        self._apply(update)

    def _apply(self, update: feed.EventUpdate) -> None:
        """Apply one update in sequence, or start healing a gap. An ``evicted`` event (the
        broker dropped the run from memory at ``--max-runs``, PROTOCOL 6) drops it here too,
        whatever its sequence number: a web must not keep what the broker let go."""
        if update.kind == "evicted":
            if self.drop_run(update.run, park=True):
                log.info("run %s evicted by the broker; dropped", update.run)
            return
        state = self.runs.get(update.run)
        current = state.seq if state is not None else 0
        if update.seq <= current:
            return  # already in a snapshot
        if update.seq != current + 1:
            self.gaps += 1
            log.info("gap in run %s (have seq %d, got %d); asking its snapshot",
                     update.run, current, update.seq)
            self._resnapshot(update.run)
            self._run_buffers[update.run].append(update)
            return
        if state is None:
            state = self.runs[update.run] = RunState(update.run)
        state.seq = update.seq
        data = update.data
        if update.kind == "epoch":
            state.add_epoch(update.seq, data)  # (8.1: a newer attempt's rewind)
            if state.subscribers:  # else encoded when a replay first needs it
                self._broadcast(state, update.seq, state.record_event(update.seq, data))
            return
        if update.kind == "run":
            state.set_header(data)
            if state.header.get("status") not in ENDED:
                state.complete = None
            if state.header.get("has_svg") and state.svg is None:
                self._resnapshot(state.run)  # the SVG itself travels only in run snapshots
            payload: Any = state.public_header()
        elif update.kind == "ranks":
            state.set_ranks(data, update.seq)
            if state.subscribers:  # bounded in bytes: hardware and samples (web/ranksbound.py)
                self._broadcast(state, update.seq, state.ranks_event(update.seq))
            return
        elif update.kind == "stacks":
            # live only (never replayed): the dumps received, the page then reads /stacks
            dumps = self._dumps(update.run)  # (and the collectives of section 7.2)
            payload = {"dumps": dumps.apply_event(update.seq, data)}
            if coll := dumps.collectives.apply_event(data):
                payload["collectives"] = coll
        elif update.kind == "complete":
            status = data.get("status") if isinstance(data, dict) else None
            state.complete = (update.seq, str(status))
            payload = data
        elif update.kind == "steps":
            r0 = self._append_steps(state, data)
            if r0 is None or not state.subscribers:
                return  # nobody to show them to: stored, nothing encoded (issue 17)
            # the contract's {"steps": [records]}, from the rows just stored
            payload = {"steps": state.steps_records(r0)}  # (8.1: with their attempts)
        else:
            log.debug("unknown event kind %r in run %s ignored", update.kind, update.run)
            return
        if state.subscribers:  # nobody to send it to: nothing encoded (a 1 MiB metadata
            # header, a 65,536-rank ranks array: milliseconds each, on the web's one thread)
            self._broadcast(state, update.seq, sse.json_event(update.kind, update.seq, payload))

    @staticmethod
    def _append_steps(state: RunState, data: Any) -> int | None:
        """Add a ``steps`` event's closed steps (the broker's wire block of them,
        :meth:`StepStore.to_wire`) to the run's store; returns the first new row, or None
        (logged) when the block is malformed or does not ascend past the store's last step
        (then nothing is added and nothing is broadcast). The rows are renumbered to follow
        the store's (``rebase``): the rule is the contract's, on steps."""
        if not isinstance(data, dict):
            log.warning("malformed steps event of run %s skipped", state.run)
            return None
        store = state.steps
        try:
            attempt = int(data.get("attempt") or 0)  # 8.1: a newer attempt rewinds the line
            if attempt and int(data["rows"]) > 0:
                state.line.rewind(attempt, int(np.frombuffer(data["step"], np.int64, 1)[0]))
            r0 = store.rows
            store.extend_wire(data, rebase=True)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            log.warning("steps event of run %s skipped: %r", state.run, exc)
            return None
        state.line.appended(r0, attempt)
        if store.rows == r0:
            log.warning("empty steps event of run %s skipped", state.run)
            return None
        return r0

    def _resnapshot(self, run: str) -> None:
        """Buffer the run's updates from now on and ask for its snapshot."""
        self._run_buffers.setdefault(run, [])
        self._want_runs[run] = None

    # ------------------------------------------------------- snapshot input
    def handle_snapshot(self, parts: list[bytes]) -> None:
        """One reply part-list from the snapshot socket (``RUN`` or ``END``)."""
        while parts and parts[0] == b"":  # tolerate a REQ-style empty delimiter
            parts = parts[1:]
        if self._outstanding is None:
            log.debug("snapshot reply with no request outstanding ignored")
            return
        try:
            verb, body = feed.decode_snapshot_reply(parts)
        except feed.FeedError as exc:
            log.warning("bad snapshot reply skipped: %s", exc)
            return
        if verb == "RUN":
            try:
                state = RunState.from_snapshot(body)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("malformed run snapshot skipped: %r", exc)
                return
            self._snap_runs[state.run] = state
            self._snap_stacks[state.run] = RunDumps.from_snapshot(body.get("stacks"),
                                                                  body.get("collectives"))
            self._outstanding = (self._outstanding[0], self.clock())  # progress: not timed out
            return
        target = self._outstanding[0]
        self._outstanding = None
        snap_runs, self._snap_runs = self._snap_runs, {}
        if target is None:
            self._finish_full(snap_runs, str(body.get("instance", "")))
        else:
            self._finish_run(target, snap_runs.get(target))

    def drop_run(self, run: str, park: bool = False) -> bool:
        """Forget ``run``: its state, its pending snapshot request and buffered updates are
        freed and each of its SSE streams ends cleanly (the close sentinel: the client's
        body returns, so the browser sees the stream end and reconnects, to a 404 while the
        run stays away). For a run the broker evicted from memory (PROTOCOL 6, ``--max-runs``
        bounds the webs too) or that a full snapshot no longer holds. A later frame of the
        run brings it back as a new run, healed by its snapshot (a gap from seq 0).
        With ``park`` (an eviction) the streams stay open instead, for up to ``PARK_S``, and
        resume with what they missed if the run comes back (:mod:`web.parking`).
        Returns False when this web did not hold the run."""
        state = self.runs.pop(run, None)
        gone = self.stacks.pop(run, None)
        if gone is not None:
            gone.close()  # its bytes go back to the process's dump budget
        self._run_buffers.pop(run, None)
        self._want_runs.pop(run, None)
        self._snap_runs.pop(run, None)
        if any(u.run == run for u in self._full_buffer):  # older than the drop: never apply
            self._full_buffer = deque(u for u in self._full_buffer if u.run != run)
        if state is None:
            return False
        if park and state.subscribers:
            self._parked.park(state, self.clock())
        else:
            for sub in list(state.subscribers):
                sub.close()
        state.subscribers = set()
        log.info("run %s dropped (%d records freed)", run, len(state.records))
        return True

    def _finish_full(self, snap_runs: dict[str, RunState], instance: str) -> None:
        for run in [r for r in self.runs if r not in snap_runs]:
            log.info("run %s is gone from the broker", run)
            self.drop_run(run)
        for run, new in snap_runs.items():
            self._replace(run, new)
        self.instance = instance
        # Updates buffered before the request are older than the snapshot; apply() skips
        # whatever it already covers, so draining them in arrival order is safe.
        pending = [u for buf in self._run_buffers.values() for u in buf]
        self._run_buffers.clear()
        pending.extend(self._full_buffer)
        self._full_buffer.clear()
        for update in pending:
            self._on_event(update)
        log.info("snapshot of broker %s applied: %d runs", instance, len(snap_runs))
        for listener in list(self.snapshot_listeners):
            try:
                listener(self)
            except Exception:
                log.exception("snapshot listener failed")

    def _finish_run(self, run: str, new: RunState | None) -> None:
        pending = self._run_buffers.pop(run, [])
        if new is not None:
            self._replace(run, new)
        elif pending:
            # The broker has no snapshot of it: take the updates as they come rather than
            # asking again forever.
            log.warning("no snapshot of run %s; continuing from seq %d", run, pending[0].seq)
            state = self.runs.get(run)
            if state is None:
                state = self.runs[run] = RunState(run)
            state.seq = max(state.seq, pending[0].seq - 1)
        if self.buffering_all:
            self._full_buffer.extendleft(reversed(pending))
            return
        for update in pending:
            self._on_event(update)

    def _replace(self, run: str, new: RunState) -> None:
        """Install ``new`` as the run's state and tell its subscribers what they missed."""
        old = self.runs.get(run)
        self.runs[run] = new
        dumps = self._snap_stacks.pop(run, None)
        if dumps is not None:
            previous = self.stacks.get(run)
            if previous is not None:  # this web's own latest request survives a re-snapshot
                dumps._requested = previous._requested
                previous.close()
            self.stacks[run] = dumps
        if old is None:
            parked = self._parked.take(run)
            if parked is None:
                return
            subscribers, last, old_last, old_header = (parked.subscribers, parked.seq,
                                                       parked.last_step, parked.header)
        else:
            subscribers, last, old_last, old_header = (old.subscribers, old.seq,
                                                       old.steps.last_step, old.header)
        new.subscribers = subscribers
        if not new.subscribers:
            return
        for seq, record in new.records:
            if seq > last:
                self._broadcast(new, seq, new.record_event(seq, record))
                last = seq
        if new.complete is not None and new.complete[0] > last:
            self._broadcast(new, new.complete[0],
                            sse.json_event("complete", new.complete[0], {"status": new.complete[1]}))
            last = new.complete[0]
        # Steps closed while this web missed them go out as one catch-up ``steps`` event
        # (steps events are live-only: the clients' /steps fetches stopped at the old
        # steps_done); it shares the snapshot's id with a changed header, so both travel as
        # one queue item (a reader skips a second item with the same id).
        chunk = b""
        r0 = 0 if old_last is None else new.steps.row_range(old_last + 1, None)[0]
        old_attempt = old_header.get("attempt", 0) if isinstance(old_header, dict) else 0
        for row, att in new.line.bounds:  # 8.1: a rewind missed: from the newer attempt on
            if isinstance(old_attempt, int) and att > old_attempt:
                r0 = min(r0, row)
                break
        if r0 < new.steps.rows and new.seq > last:
            chunk = sse.json_event("steps", new.seq, {"steps": new.steps_records(r0)})
        if new.seq > last and new.header != old_header:
            chunk += sse.json_event("run", new.seq, new.public_header())
        if chunk:
            self._broadcast(new, new.seq, chunk)

    # ------------------------------------------------------------ subscribers
    def _broadcast(self, state: RunState, seq: int, data: bytes) -> None:
        """Push the same item (the same bytes) to every subscriber of the run; drop any that
        is full. Queues hold references only: nothing is copied per client."""
        item = (seq, data)
        for sub in list(state.subscribers):
            if not sub.offer(item):
                self.count_limit(f"sse_{sub.full}")
                self.drop(sub, f"too slow ({sub.full.replace('_', ' ')} full)")

    def count_limit(self, reason: str) -> None:
        """One more time the limit ``reason`` bit (see :attr:`limited`)."""
        self.limited[reason] = self.limited.get(reason, 0) + 1

    def drop(self, sub: Subscriber, why: str) -> None:
        """Stop feeding ``sub`` and end its stream without waiting for it."""
        state = self.runs.get(sub.run)
        if state is not None:
            state.subscribers.discard(sub)
        self._parked.forget(sub)
        if sub.dropped:
            return
        sub.dropped = True
        self.clients_dropped += 1
        log.info("SSE client of run %s dropped: %s", sub.run, why)
        sub.close()
        greenlet = sub.greenlet
        if greenlet is not None and greenlet is not gevent.getcurrent():
            # it may be blocked writing to a client that never reads: release the connection
            greenlet.kill(block=False)

    def subscribe(self, run: str, position: int) -> tuple[Subscriber, list[bytes], int] | None:
        """Register a client of ``run`` at ``position`` (its Last-Event-ID, or 0).

        Returns ``(subscriber, initial chunks, last id)`` or None for an unknown run. The
        initial chunks are ``retry``, the ``run`` header event with id = position (0 when the
        position is ahead of the run), each record after the position, and ``complete`` when
        the run ended after it. Live items in the queue with ids at or below ``last id`` are
        already covered and must be skipped by the reader.
        """
        state = self.runs.get(run)
        if state is None:
            return None
        if position < 0 or position > state.seq:
            position = 0
        chunks = [_RETRY, state.header_event(position)]
        last = position
        for seq, record in state.records:
            if seq > position:
                chunks.append(state.record_event(seq, record))
                last = seq
        if state.complete is not None and state.complete[0] > last:
            seq, status = state.complete
            chunks.append(sse.json_event("complete", seq, {"status": status}))
            last = seq
        sub = Subscriber(run, self.queue_size, self.queue_bytes)
        state.subscribers.add(sub)
        return sub, chunks, last

    def unsubscribe(self, sub: Subscriber) -> None:
        state = self.runs.get(sub.run)
        if state is not None:
            state.subscribers.discard(sub)
        self._parked.forget(sub)

    def close_all(self) -> None:
        """End every stream (server shutdown)."""
        for state in self.runs.values():
            for sub in list(state.subscribers):
                sub.close()
            state.subscribers.clear()
        self._parked.close_all()

    # ---------------------------------------------------------------- stacks
    def _dumps(self, run: str) -> RunDumps:
        dumps = self.stacks.get(run)
        if dumps is None:
            dumps = self.stacks[run] = RunDumps()
        return dumps

    def note_stacks_request(self, run: str, request_id: str) -> None:
        """This web asked ``run``'s ranks for dumps (:meth:`web.pump.FeedPump.request_stacks`):
        the groups of ``GET /stacks`` follow that request from now on."""
        self._dumps(run).note_request(request_id)

    def stacks_view(self, run: str) -> dict[str, Any] | None:
        """The ``GET /api/runs/<run>/stacks`` JSON (PROTOCOL.md section 4): ``{"dumps":
        [{rank, host, reason, request_id, taken_at, idle_s, threads, profile, samples,
        seconds}], "groups": [{reason, request_id, frames, ranks}]}``; None for a run this
        web does not know (404). The dicts share decoded stacks: read-only."""
        state = self.runs.get(run)
        if state is None:
            return None
        dumps = self.stacks.get(run)
        if dumps is None:
            return {"dumps": [], "groups": []}
        return dumps.view(state.ranks, state.ranks_seq)

    def collectives_view(self, run: str) -> dict[str, Any] | None:
        """``GET /api/runs/<run>/collectives`` (section 7.2): the broker's verdict and each
        rank's latest frame per reason; None for a run this web does not know (404)."""
        if run not in self.runs:
            return None
        dumps = self.stacks.get(run)
        return dumps.collectives.view() if dumps is not None else {"groups": [], "ranks": []}

    def stacks_view_json(self, run: str, encode: Callable[[Any], bytes]) -> bytes | None:
        """:meth:`stacks_view` encoded, cached per state of the run's dumps and ranks
        (:meth:`web.stacksview.RunDumps.view_json`); None for an unknown run."""
        state = self.runs.get(run)
        if state is None:
            return None
        dumps = self.stacks.get(run)
        if dumps is None:
            return encode({"dumps": [], "groups": []})
        return dumps.view_json(state.ranks, state.ranks_seq, encode)

    # ---------------------------------------------------------------- reads
    def runs_newest_first(self) -> list[RunState]:
        def key(state: RunState) -> tuple[float, str]:
            started = finite(state.header.get("started_at"))
            return (started if started is not None else 0.0, state.run)

        return sorted(self.runs.values(), key=key, reverse=True)


def parse_position(values: Iterable[str | None]) -> int:
    """A client position from the first present of Last-Event-ID-like values; bad -> 0."""
    for value in values:
        if value is None:
            continue
        value = value.strip()
        if value.isascii() and value.isdigit() and len(value) <= 19:
            return int(value)
        return 0
    return 0

