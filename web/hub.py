"""The web's view of the broker: SUB + snapshot (Clone pattern) -> per-run state -> SSE clients.

Two layers, kept apart so the rules are unit-testable without sockets (STYLE "receive loop
apart from the handler"):

* :class:`Hub` is the state machine. It is fed decoded feed messages
  (:meth:`Hub.handle_pub`, :meth:`Hub.handle_snapshot`) with an injected clock, keeps every
  run's header, ranks, epoch records and completion with their sequence numbers, decides
  when a snapshot must be (re)requested (:meth:`Hub.next_request`), and fans each event out
  to the run's subscribers as SSE bytes encoded exactly once.
* :class:`FeedPump` is the I/O shell: one greenlet per broker connection owning a
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
import math
import time
from collections import deque
from typing import Any, Callable, Iterable

import gevent
import gevent.queue

from broker import feed
from broker.stepstore import StepStore
from web import sse

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

#: Sentinel the hub puts into a client's queue to end its stream.
_CLOSE = None
#: The first chunk of every stream (shared, like every other chunk of a replay).
_RETRY = sse.retry(RETRY_MS)


class Subscriber:
    """One SSE connection: a bounded queue of ``(seq, sse_bytes)`` items.

    The hub never blocks on a subscriber: a full queue means the client is too slow (or not
    reading at all), so it is dropped: its queue is replaced by the close sentinel, and the
    greenlet serving it (which may be stuck in a socket write to a client that never reads)
    is killed so the connection is released.
    """

    __slots__ = ("run", "queue", "greenlet", "dropped", "closed")

    def __init__(self, run: str, maxsize: int) -> None:
        self.run = run
        self.queue: gevent.queue.Queue = gevent.queue.Queue(maxsize)
        #: the gevent greenlet serving this client, set by the app; killed on drop
        self.greenlet: gevent.Greenlet | None = None
        self.dropped = False
        self.closed = False

    def offer(self, item: tuple[int, bytes]) -> bool:
        """Queue ``item`` without blocking; False when the queue is full."""
        try:
            self.queue.put_nowait(item)
        except gevent.queue.Full:
            return False
        return True

    def close(self) -> None:
        """End the stream: empty the queue and leave only the close sentinel."""
        if self.closed:
            return
        self.closed = True
        while True:
            try:
                self.queue.get_nowait()
            except gevent.queue.Empty:
                break
        self.queue.put_nowait(_CLOSE)


class RunState:
    """What the web knows of one run, with the sequence number of each piece."""

    __slots__ = ("run", "seq", "header", "ranks", "ranks_full", "records", "complete", "svg",
                 "steps", "subscribers", "_record_bytes", "_header_event")

    def __init__(self, run: str) -> None:
        self.run = run
        #: the last sequence number applied
        self.seq = 0
        self.header: dict[str, Any] = {}
        #: the public ranks array (the feed's extra "loss" stripped)
        self.ranks: list[dict[str, Any]] = []
        #: the feed's ranks array as received (with "loss", for /metrics)
        self.ranks_full: list[dict[str, Any]] = []
        #: (seq, record) in ascending epoch order
        self.records: list[tuple[int, dict[str, Any]]] = []
        #: (seq, status) of the "complete" event while the run is ended
        self.complete: tuple[int, str] | None = None
        #: the model graph (only run snapshots carry it; a live header only says has_svg)
        self.svg: str | None = None
        #: closed steps, as published (``steps`` events; snapshots carry them columnar)
        self.steps = StepStore()
        self.subscribers: set[Subscriber] = set()
        #: seq -> the record's "epoch" event bytes, encoded once (replays reuse them)
        self._record_bytes: dict[int, bytes] = {}
        #: (id, closed steps, bytes) of the last replayed ``run`` header event: a burst of
        #: connecting clients (all at the same position) shares one encoding; reset with the
        #: header
        self._header_event: tuple[int, int, bytes] | None = None

    def public_header(self) -> dict[str, Any]:
        """The run header of PROTOCOL 4 with every key present, even before the broker's
        first ``run`` event (absent = null). ``steps_done``/``step_metrics`` are this web's
        own closed steps (the broker's header is only as fresh as its last ``run`` event):
        the no-gap, no-overlap rule of ``steps`` events is kept against them."""
        header: dict[str, Any] = {
            "run": self.run, "status": "waiting", "world_size": None, "total_epochs": None,
            "label": None, "hash": None, "port": None, "metadata": None, "hardware": "",
            "has_svg": False, "hosts": [], "alerts": [], "started_at": None, "updated_at": None,
        }
        header.update(self.header)
        header["steps_done"] = self.steps.last_step
        header["step_metrics"] = self.steps.metric_names()
        return header

    def record_event(self, seq: int, record: dict[str, Any]) -> bytes:
        data = self._record_bytes.get(seq)
        if data is None:
            data = self._record_bytes[seq] = sse.json_event("epoch", seq, record)
        return data

    def header_event(self, position: int) -> bytes:
        """The replay's ``run`` event (the public header with id ``position``), encoded once
        per header and position however many clients subscribe."""
        cached = self._header_event
        rows = self.steps.rows
        if cached is None or cached[0] != position or cached[1] != rows:
            cached = self._header_event = (position, rows, sse.json_event(
                "run", position, self.public_header()))
        return cached[2]

    def set_header(self, header: Any) -> None:
        self._header_event = None
        header = dict(header) if isinstance(header, dict) else {}
        svg = header.pop("svg", None)  # tolerated, never published: the header shape is exact
        if isinstance(svg, str) and svg:
            self.svg = svg
        self.header = header

    def set_ranks(self, ranks: Any) -> None:
        self.ranks_full = ranks if isinstance(ranks, list) else []
        self.ranks = [public_rank(r) for r in self.ranks_full]

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any]) -> RunState:
        """Build from a broker run snapshot (``RunSink.snapshot()``); KeyError/TypeError if malformed."""
        state = cls(str(snap["run"]))
        state.seq = int(snap["seq"])
        state.set_header(snap["header"])
        svg = snap.get("svg")
        if isinstance(svg, str) and svg:
            state.svg = svg
        state.set_ranks(snap.get("ranks") or [])
        state.records = [(int(seq), rec) for seq, rec in snap.get("records") or []]
        complete = snap.get("complete")
        state.complete = (int(complete[0]), str(complete[1])) if complete else None
        steps = snap.get("steps")
        if steps:
            state.steps.extend_wire(steps)
        return state


def public_rank(entry: Any) -> Any:
    """A feed ranks entry without the feed-only ``loss`` key (PROTOCOL 4's shape is exact)."""
    if isinstance(entry, dict) and "loss" in entry:
        return {k: v for k, v in entry.items() if k != "loss"}
    return entry


def finite(value: Any) -> float | None:
    """``value`` as a float if it is a finite number, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


class Hub:
    """Per-run state built from the broker feed, and the SSE subscribers of each run.

    Pure apart from gevent queues: no sockets, an injectable clock. The :class:`FeedPump`
    calls :meth:`handle_pub` / :meth:`handle_snapshot` and sends what :meth:`next_request`
    returns; the app calls :meth:`subscribe` and reads :attr:`runs`.
    """

    def __init__(
        self,
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        clock: Callable[[], float] = time.time,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
    ) -> None:
        self.queue_size = queue_size
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
        # snapshot request state
        self._want_full = True
        self._want_runs: dict[str, None] = {}  # ordered set
        self._outstanding: tuple[str | None, float] | None = None  # (run or None=all, sent at)
        self._reset_socket = False
        self._full_buffer: deque[feed.EventUpdate] = deque()
        self._run_buffers: dict[str, list[feed.EventUpdate]] = {}
        self._snap_runs: dict[str, RunState] = {}  # RUN replies of the outstanding request

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
        a reply to the abandoned request must never be mistaken for the next one's."""
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
        """Apply one update in sequence, or start healing a gap."""
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
            state.records.append((update.seq, data))
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
            state.set_ranks(data)
            payload = state.ranks
        elif update.kind == "complete":
            status = data.get("status") if isinstance(data, dict) else None
            state.complete = (update.seq, str(status))
            payload = data
        elif update.kind == "steps":
            if not self._append_steps(state, data):
                return
            payload = data
        else:
            log.debug("unknown event kind %r in run %s ignored", update.kind, update.run)
            return
        self._broadcast(state, update.seq, sse.json_event(update.kind, update.seq, payload))

    @staticmethod
    def _append_steps(state: RunState, data: Any) -> bool:
        """Add a ``steps`` event's records to the run's store; False (logged) when they do
        not follow it (then nothing is added and nothing is broadcast)."""
        records = data.get("steps") if isinstance(data, dict) else None
        if not isinstance(records, list) or not records:
            log.warning("malformed steps event of run %s skipped", state.run)
            return False
        last = state.steps.last_step
        try:
            steps = [r["step"] for r in records]
            if any(b <= a for a, b in zip(steps, steps[1:])) or (
                    last is not None and steps[0] <= last):
                raise ValueError("steps do not ascend past the last closed one")
            state.steps.append(records)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            log.warning("steps event of run %s skipped: %r", state.run, exc)
            return False
        return True

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
            self._outstanding = (self._outstanding[0], self.clock())  # progress: not timed out
            return
        target = self._outstanding[0]
        self._outstanding = None
        snap_runs, self._snap_runs = self._snap_runs, {}
        if target is None:
            self._finish_full(snap_runs, str(body.get("instance", "")))
        else:
            self._finish_run(target, snap_runs.get(target))

    def _finish_full(self, snap_runs: dict[str, RunState], instance: str) -> None:
        for run in [r for r in self.runs if r not in snap_runs]:
            log.info("run %s is gone from the broker", run)
            for sub in list(self.runs[run].subscribers):
                sub.close()
            del self.runs[run]
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
        if old is None:
            return
        new.subscribers = old.subscribers
        if not new.subscribers:
            return
        last = old.seq
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
        old_last = old.steps.last_step
        r0 = 0 if old_last is None else new.steps.row_range(old_last + 1, None)[0]
        if r0 < new.steps.rows and new.seq > last:
            chunk = sse.json_event("steps", new.seq, {"steps": new.steps.records(r0)})
        if new.seq > last and new.header != old.header:
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
                self.drop(sub, "queue full")

    def drop(self, sub: Subscriber, why: str) -> None:
        """Stop feeding ``sub`` and end its stream without waiting for it."""
        state = self.runs.get(sub.run)
        if state is not None:
            state.subscribers.discard(sub)
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
        sub = Subscriber(run, self.queue_size)
        state.subscribers.add(sub)
        return sub, chunks, last

    def unsubscribe(self, sub: Subscriber) -> None:
        state = self.runs.get(sub.run)
        if state is not None:
            state.subscribers.discard(sub)

    def close_all(self) -> None:
        """End every stream (server shutdown)."""
        for state in self.runs.values():
            for sub in list(state.subscribers):
                sub.close()
            state.subscribers.clear()

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


class FeedPump:
    """One greenlet per broker connection: SUB + DEALER (``zmq.green``) <-> :class:`Hub`.

    Constructing it does no I/O; :meth:`start` spawns the greenlet, :meth:`stop` ends it and
    closes the sockets with ``linger=0`` (a green context with pending messages can otherwise
    freeze every greenlet, pyzmq#809).

    ``curve``: ZeroMQ options that make both sockets CURVE clients
    (:func:`broker.keys.client_options`), for a broker started with ``--curve-secret-key``.
    A broker that refuses the handshake (a key it does not authorize, or CURVE on one side
    only) lets nothing through, so the hub never connects and ``/healthz`` stays 503; a
    monitor on the SUB turns refusals into a log line (the first at once, then at most one
    per ``REFUSAL_LOG_INTERVAL``), since otherwise nothing would say why.
    """

    #: seconds between two log lines about refused handshakes
    REFUSAL_LOG_INTERVAL = 60.0

    def __init__(self, hub: Hub, publish: str, snapshot: str, *, poll_ms: int = 250,
                 curve: dict[int, bytes] | None = None) -> None:
        self.hub = hub
        self.publish = publish
        self.snapshot = snapshot
        self.poll_ms = poll_ms
        self.curve = dict(curve) if curve else None
        #: handshakes the broker refused (or that failed) on the SUB since start
        self.handshake_failures = 0
        # a connection is up whose handshake has not succeeded yet: if it drops, that was a
        # failed handshake too (a plain client meeting a CURVE server often sees only the
        # server hanging up, not a protocol event, depending on who reads the greeting first)
        self._handshaking = False
        self._unlogged_failures = 0
        self._failure_logged_at: float | None = None
        self._greenlet: gevent.Greenlet | None = None
        self._stopping = False

    def start(self) -> None:
        self._greenlet = gevent.spawn(self._run)

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping = True
        if self._greenlet is not None:
            self._greenlet.join(timeout)
            if not self._greenlet.dead:
                self._greenlet.kill(block=True, timeout=timeout)

    def _run(self) -> None:
        import zmq.green as zmq

        ctx = zmq.Context()

        def client(kind: int) -> Any:
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            for option, value in (self.curve or {}).items():  # before connect, or it is plain
                sock.setsockopt(option, value)
            return sock

        sub = client(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.publish)

        def new_dealer() -> Any:
            dealer = client(zmq.DEALER)
            dealer.connect(self.snapshot)
            return dealer

        dealer = new_dealer()
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        log.info("web feed: SUB %s, snapshot %s%s", self.publish, self.snapshot,
                 " (CURVE)" if self.curve else "")
        try:
            while not self._stopping:
                if self.hub.take_socket_reset():
                    poller.unregister(dealer)
                    dealer.close(linger=0)
                    dealer = new_dealer()
                    poller.register(dealer, zmq.POLLIN)
                request = self.hub.next_request()
                if request is not None:
                    dealer.send_multipart(request)
                ready = dict(poller.poll(self.poll_ms))
                if sub in ready:
                    self._drain(sub, self.hub.handle_pub, zmq)
                if dealer in ready:
                    self._drain(dealer, self.hub.handle_snapshot, zmq)
                if monitor in ready:
                    self._drain(monitor, self._on_monitor_event, zmq)
        finally:
            for sock in (sub, dealer, monitor):
                poller.unregister(sock)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            dealer.close(linger=0)
            ctx.term()

    def _on_monitor_event(self, parts: list[bytes]) -> None:
        """Log handshake refusals: the first at once, then at most one per interval."""
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        event = parse_monitor_message(parts)
        kind = event["event"]
        value = int(event["value"])  # pyzmq hands it over as an Event flag; it is a number
        if kind == zmq.EVENT_CONNECTED:
            self._handshaking = True
            return
        if kind == zmq.EVENT_DISCONNECTED:
            if not self._handshaking:
                return  # a connection that had worked went away (a broker restart, say)
            kind, value = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0
        self._handshaking = False
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if self.handshake_failures:
                log.info("web feed: handshake with the broker at %s succeeded", self.publish)
                self.handshake_failures = self._unlogged_failures = 0
                self._failure_logged_at = None
            return
        self.handshake_failures += 1
        now = time.monotonic()
        if (self._failure_logged_at is not None
                and now - self._failure_logged_at < self.REFUSAL_LOG_INTERVAL):
            self._unlogged_failures += 1
            return
        self._failure_logged_at = now
        more = (f" ({self._unlogged_failures} more since the last report)"
                if self._unlogged_failures else "")
        self._unlogged_failures = 0
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            log.error("the broker at %s refused this web's CURVE key (ZAP status %s): is its "
                      "public key in the broker's --curve-authorized directory?%s",
                      self.publish, value, more)
        elif self.curve:
            log.error("CURVE handshake with the broker at %s failed (error %#x): is the "
                      "broker started with --curve-secret-key, and is --curve-server-key "
                      "its public key?%s", self.publish, value, more)
        else:
            log.error("handshake with the broker at %s failed (error %#x): a broker started "
                      "with --curve-secret-key needs --curve-server-key and "
                      "--curve-client-key%s", self.publish, value, more)

    @staticmethod
    def _drain(sock: Any, handler: Callable[[list[bytes]], None], zmq: Any) -> None:
        """Handle what is queued on ``sock`` now, yielding to other greenlets now and then."""
        for n in range(1, 100_000):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handler(parts)
            except Exception:  # one bad message never kills the pump
                log.exception("feed message handling failed")
            if n % 100 == 0:
                gevent.sleep(0)
