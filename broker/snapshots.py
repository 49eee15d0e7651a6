"""Encoded run snapshots for the broker's ROUTER, cached while their run has not moved.

Split from :mod:`broker.server` (which receives the requests and sends the replies, at most
``SNAPSHOT_SLICE_S`` a loop turn): building and encoding a wide run's snapshot costs tens of
milliseconds, so a request storm must not pay it per request (issue 19 finding 10). An entry
is good while its run's ``seq`` is unchanged (everything published is in it, ids never
repeat) and for at most :data:`SNAPSHOT_CACHE_MAX_AGE_S`. Also here: :func:`msgpack_ints`,
the widening that keeps one hostile aggregate from making an event or a snapshot
unencodable.
"""
from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from typing import Any, Iterable

from broker import feed
from broker.run.sink import RunSink
from rank_agent.ratelimit import RateLimitedLog

__all__ = ["SNAPSHOT_CACHE_BYTES", "SNAPSHOT_CACHE_MAX_AGE_S", "SnapshotCache", "msgpack_ints"]

#: Bytes of encoded run snapshots kept for reuse; a run's entry is good while its ``seq`` is
#: unchanged (everything published is in it, ids never repeat). The most recent entry is
#: kept even when it alone is larger.
SNAPSHOT_CACHE_BYTES = 64 * 1024 * 1024
#: ... and for at most this long (seconds): state that changes without an event (a rank's
#: ``last_seen``, the header's ``updated_at``) stays at most a second behind, as PROTOCOL 4
#: promises of ``ranks``.
SNAPSHOT_CACHE_MAX_AGE_S = 1.0


def msgpack_ints(obj: Any) -> Any:
    """A copy of ``obj`` whose ints outside MessagePack's range (-2**63 .. 2**64-1) are
    floats. Every wire integer fits, but aggregates of them may not (a cluster's summed
    bytes); without this one hostile sample makes a record, and the run's snapshot,
    unencodable. Iterative: metadata may legitimately nest close to the recursion limit."""
    root = [obj]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        parent, key = stack.pop()
        value = parent[key]
        if isinstance(value, dict):
            value = parent[key] = dict(value)
            stack.extend((value, k) for k in value)
        elif isinstance(value, (list, tuple)):
            value = parent[key] = list(value)
            stack.extend((value, i) for i in range(len(value)))
        elif isinstance(value, int) and not isinstance(value, bool) and not (
                -(2**63) <= value < 2**64):
            parent[key] = float(value)
    return root[0]


class SnapshotCache:
    """The encoded snapshots of recent runs: an LRU bounded by :data:`SNAPSHOT_CACHE_BYTES`
    (the most recent entry is kept even when it alone is larger)."""

    def __init__(self, rlog: RateLimitedLog) -> None:
        self._rlog = rlog
        #: run -> (its sink, weakly: an evicted run's sink must not live on here; the seq
        #: encoded; the encoded parts; their bytes; when, monotonic)
        self.entries: OrderedDict[
            str, tuple[weakref.ref[RunSink], int, list[bytes], int, float]] = OrderedDict()
        self._bytes = 0

    def encode(self, snap: dict[str, Any]) -> list[bytes] | None:
        """A run snapshot's parts; None (logged) if even the widened copy cannot be encoded,
        so one bad run never takes the loop, or the other runs' snapshots, with it."""
        try:
            try:
                return feed.encode_run_snapshot(snap)
            except OverflowError:
                return feed.encode_run_snapshot(msgpack_ints(snap))
        except (TypeError, ValueError, OverflowError, RecursionError):
            self._rlog.error("encode_snapshot", "cannot encode the snapshot of run %r",
                             snap.get("run"), exc_info=True)
            return None

    def encoded(self, sinks: Iterable[RunSink]) -> list[list[bytes]]:
        """The encoded snapshots of ``sinks``, each reused from the cache while its run's
        ``seq`` has not moved (for at most SNAPSHOT_CACHE_MAX_AGE_S); a run whose snapshot
        cannot be encoded is left out (logged)."""
        cache = self.entries
        out: list[list[bytes]] = []
        fresh = time.monotonic() - SNAPSHOT_CACHE_MAX_AGE_S
        for sink in sinks:
            entry = cache.get(sink.run)
            if (entry is not None and entry[0]() is sink and entry[1] == sink.seq
                    and entry[4] >= fresh):
                cache.move_to_end(sink.run)
                out.append(entry[2])
                continue
            seq = sink.seq
            parts = self.encode(sink.snapshot())
            if parts is None:
                continue
            out.append(parts)
            if entry is not None:
                self._bytes -= entry[3]
            size = sum(len(p) for p in parts)
            cache[sink.run] = (weakref.ref(sink), seq, parts, size, time.monotonic())
            cache.move_to_end(sink.run)
            self._bytes += size
            while self._bytes > SNAPSHOT_CACHE_BYTES and len(cache) > 1:
                _, gone = cache.popitem(last=False)
                self._bytes -= gone[3]
        return out
