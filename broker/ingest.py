"""The broker's receive loop: one ingest batch, from the PULL socket to encoded PUB messages.

Split from :mod:`broker.server` (which owns the sockets, the timers, the journal's flush and
the snapshot ROUTER) because this is the broker's per-frame hot path and carries state of
its own across batches: how many messages are still to be received zero-copy, the large
``metadata`` frames taken aside for coalescing (:mod:`broker.coalesce`) and the ports that
``register`` frames announced. Everything with meaning is :class:`~broker.runs.Runs`'s; this
module only hoists lookups out of the loop and turns events into feed messages.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import zmq

from broker import feed
from broker.coalesce import COALESCE_MIN_BYTES, Coalescer
from broker.run.events import Event
from broker.runs import Runs
from broker.snapshots import msgpack_ints
from rank_agent.ratelimit import RateLimitedLog

__all__ = ["IngestLoop", "INGEST_BATCH_BYTES", "FLOOD_BATCH_S", "FLOOD_SPINS", "ZERO_COPY_BYTES",
           "ZERO_COPY_RUN"]

log = logging.getLogger(__name__)

#: Bytes one ingest batch takes in before it is journaled, flushed and published: whatever a
#: batch holds in proportion to its input (events, journal buffers) stays bounded by bytes,
#: not by ``batch_limit`` messages of up to 4 MiB each.
INGEST_BATCH_BYTES = 16 * 1024 * 1024

#: A message this large is expensive to copy out of ZeroMQ (a 4 MiB copy measured 0.65 ms
#: here, against 1.8 us zero-copy), a small one cheaper copied (0.5 us) than wrapped in a
#: Frame (1.5 us). So after a message of ZERO_COPY_BYTES or more the loop receives the next
#: ZERO_COPY_RUN zero-copy (a flood of large frames alternates with the other senders' in
#: the socket's fair queue), then copies again; the buffers live no longer than the batch.
ZERO_COPY_BYTES = 64 * 1024
ZERO_COPY_RUN = 256

#: A flood keeps its batch open across the receive queue's refills (issue 33). The receive
#: HWM (``broker.server.INGEST_RCVHWM``, 32 messages a connection: the byte bound) means
#: ZeroMQ's I/O thread refills each connection's queue as the loop reads it, so under a
#: flood a batch runs dry every few dozen messages: it ended there, and every 32-64 frames
#: paid a turn of the server's poller (a sleep and a wake-up), the journal's flush and the
#: held samples' release. So when a batch has taken at least ``flood_after`` messages (a
#: full queue) and the batch before it had too, it yields the CPU (``sched_yield``: the I/O
#: thread may be waiting for this core) up to FLOOD_SPINS times, looking for the refill
#: after each, and carries on when it came, until ``batch_limit``, the byte budget, or
#: FLOOD_BATCH_S after it began. Sleeping instead cost more on this VM: a socket wait wakes
#: at the refill's first message, and a 0.1 ms nap costs ~25 us of CPU in the timer
#: (BENCHMARKS.md, issue 33), and a long spin burns what a sleep costs: 8 yields catch a
#: refill under way (A/B medians 2.50 us a frame, 64 yields 2.73, none 2.67; noisy). A
#: burst that fits in one batch (an epoch's frames) never spins; the queue's bound holds.
FLOOD_SPINS = 8
FLOOD_BATCH_S = 0.005


class IngestLoop:
    """Drains one batch of the PULL socket into :class:`Runs` and encodes what it caused.

    ``pending_ports`` is filled by the server's ``on_register`` hook (``Runs`` calls it while
    applying a ``register`` frame) and emptied here into ``port`` feed messages.
    """

    def __init__(self, runs: Runs, batch_limit: int, rlog: RateLimitedLog,
                 flood_after: int | None = None) -> None:
        self.runs = runs
        self.batch_limit = batch_limit
        self._rlog = rlog
        #: messages a batch takes before running dry that make it a flood's (FLOOD_SPINS);
        #: None: a batch never waits
        self.flood_after = flood_after
        #: until how long after it began a flood's batch waits for refills (FLOOD_BATCH_S),
        #: and how it gives way to the I/O thread (``os.sched_yield``; tests spy on it)
        self.flood_batch_s = FLOOD_BATCH_S
        self.nap: Callable[[], None] = os.sched_yield
        #: the last batch took at least ``flood_after`` messages
        self._flooded = False
        #: (run, rank, port) of the register frames applied since the last drain
        self.pending_ports: list[tuple[str, int, int]] = []
        #: the current batch's large metadata frames, newest per run (broker/coalesce.py)
        self._aside = Coalescer()
        #: messages still to receive zero-copy (ZERO_COPY_RUN after each large one)
        self._zero_copy = 0

    def drain(self, pull: zmq.Socket, now: float) -> list[list[bytes]]:
        """Receive up to ``batch_limit`` messages (and about INGEST_BATCH_BYTES) and return
        the encoded feed messages their events and registered ports make.

        A message is taken with one non-blocking ``recv`` (copied: small frames are cheaper
        as bytes than as zero-copy Frames), and a frame that causes no event (nearly all)
        costs nothing here beyond the call into :class:`Runs`. Large ``metadata`` frames
        are taken aside and only the newest of each run is applied, after the batch's other
        frames (:mod:`broker.coalesce`: why, and what it changes). Under a flood the batch
        takes the receive queue's refills instead of ending dry (FLOOD_SPINS).
        """
        out: list[list[bytes]] = []
        recv = pull.recv
        noblock = zmq.NOBLOCK
        again = zmq.Again
        ingest = self.runs.ingest
        encode = self.encode
        ports = self.pending_ports
        budget = INGEST_BATCH_BYTES
        aside = self._aside
        offer = aside.offer
        held = aside.held
        zero_copy = self._zero_copy
        large = min(ZERO_COPY_BYTES, COALESCE_MIN_BYTES)
        flood_after = self.flood_after
        waits = flood_after is not None and self._flooded
        began = time.monotonic() if waits else 0.0
        i = 0
        raw: bytes | memoryview
        for i in range(self.batch_limit):
            if budget < 0:
                break
            try:
                if zero_copy:
                    zero_copy -= 1
                    raw = recv(noblock, copy=False).buffer
                else:
                    raw = recv(noblock)
            except again:
                if waits and i >= flood_after and self._refilled(pull, began):  # type: ignore[operator]
                    continue
                break
            n = len(raw)
            budget -= n
            if n >= large or held:  # (one test a small frame: both sizes are 64 KiB)
                if n >= ZERO_COPY_BYTES:
                    zero_copy = ZERO_COPY_RUN
                if n >= COALESCE_MIN_BYTES or held:  # (small frames only while some are
                    taken, freed = offer(raw)         # aside: a later small metadata must
                    if taken:                         # still win)
                        budget += freed
                        continue
            try:
                events = ingest(raw, now)
            except Exception:  # a bug, not bad input (Runs counts those): keep serving
                self.runs.rejected["internal"] += 1
                self._rlog.error("ingest", "ingesting a %d-byte message failed", n,
                                 exc_info=True)
                events = []
            if events:
                for run, event in events:
                    msg = encode(run, event)
                    if msg is not None:
                        out.append(msg)
            if ports:
                out.extend(feed.encode_port(*p) for p in ports)
                ports.clear()
        self._zero_copy = zero_copy
        self._flooded = flood_after is not None and i >= flood_after
        try:  # each rank's newest sample of the batch (broker.coalesce.HeldSamples)
            self.queue_events(self.runs.release_samples(now), out)
        except Exception:
            self.runs.rejected["internal"] += 1
            self._rlog.error("ingest", "applying the batch's held samples failed", exc_info=True)
        if held:
            for raw in aside.take():
                self._ingest_one(raw, now, out)
            self.runs.count_superseded(aside.superseded)
            aside.superseded = 0
        return out

    def _refilled(self, pull: zmq.Socket, began: float) -> bool:
        """Yield the CPU up to FLOOD_SPINS times for the queues' refill (ZeroMQ's I/O thread
        may be waiting for this core), looking for a message after each, unless the batch
        began ``flood_batch_s`` ago: True when one came (the batch goes on)."""
        if time.monotonic() - began >= self.flood_batch_s:
            return False
        get, nap = pull.get, self.nap
        for _ in range(FLOOD_SPINS):
            nap()
            events: int = get(zmq.EVENTS)  # type: ignore[assignment]
            if events & zmq.POLLIN:
                return True
        return False

    def _ingest_one(self, raw: bytes | memoryview, now: float, out: list[list[bytes]]) -> None:
        """Apply one message through :class:`Runs` and queue what it caused for the PUB
        (the batch's frames taken aside; :meth:`drain` inlines the same steps, its lookups
        hoisted, because it is the broker's per-frame hot path)."""
        try:
            events = self.runs.ingest(raw, now)
        except Exception:  # a bug, not bad input (Runs counts those): keep serving
            self.runs.rejected["internal"] += 1
            self._rlog.error("ingest", "ingesting a %d-byte message failed", len(raw),
                             exc_info=True)
            events = []
        self.queue_events(events, out)
        ports = self.pending_ports
        if ports:
            out.extend(feed.encode_port(*p) for p in ports)
            ports.clear()

    def queue_events(self, events: list[tuple[str, Event]], out: list[list[bytes]]) -> None:
        """Encode ``events`` for the PUB onto ``out`` (the unencodable ones are logged)."""
        for run, event in events:
            msg = self.encode(run, event)
            if msg is not None:
                out.append(msg)

    def encode(self, run: str, event: Event) -> list[bytes] | None:
        """One event as a feed message, or None (logged) when a sink bug made it
        unencodable: the web will see a gap in the ids and re-snapshot."""
        try:
            try:
                return feed.encode_event(run, event)
            except OverflowError:
                return feed.encode_event(run, event._replace(data=msgpack_ints(event.data)))
        except (TypeError, ValueError, OverflowError, RecursionError):
            self._rlog.error("encode", "cannot encode %s event %d of run %r",
                             event.kind, event.seq, run, exc_info=True)
            return None
