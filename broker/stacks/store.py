"""One run's stack dumps (PROTOCOL.md section 2, ``stacks``; section 2.5): each rank's latest
dump per reason, kept compact and bounded in bytes.

Why a store of its own: a ``stacks`` frame may be 4 MiB, and 65,536 ranks x 2 reasons x
4 MiB is 512 GiB, so "keep the latest per (rank, reason)" alone bounds nothing. Two things
make it fit:

* **Compact, shared form.** A dump is kept as its scalar fields plus one MessagePack blob per
  thread (and one for the profile), the blob already in the JSON-ready shape the feed and
  ``GET /stacks`` use. Blobs are interned by content with a reference count: the ranks of
  a hang stand in the same place, so 1,023 ranks in one ``all_reduce`` share one blob for
  their training thread (the agent's own threads differ only in name and are small).
* **One byte budget per process** (:mod:`broker.budget`, 256 MiB): every run's store charges
  what it keeps to the process's budget, and past it the oldest dumps of any run are dropped
  first (:meth:`RunStacks.evict`, counted in :attr:`RunStacks.over_budget`): the cap below
  alone let 1,000 runs hold 64 GiB (issue 32, finding 2).
* **A byte cap per run**, :data:`MAX_RUN_STACKS_BYTES`, counted on the distinct blobs (plus
  :data:`BLOB_OVERHEAD` each) plus :data:`DUMP_OVERHEAD` per dump: what is held. A dump that would pass it is not kept (the rank's previous
  dump of that reason is dropped too, so nothing older poses as the latest) and is counted in
  :attr:`RunStacks.over_cap`. The rank's ``stalled`` status does not depend on it: the sink
  keeps that apart, in a few bytes per rank.

Pure: no I/O, no clock.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Tuple

import msgspec

from broker import budget as _budget
from rank_agent.protocol import Stacks
from rank_agent.ratelimit import RateLimitedLog

__all__ = ["RunStacks", "MAX_RUN_STACKS_BYTES", "DUMP_OVERHEAD", "BLOB_OVERHEAD", "dump_dict",
           "wire_of", "Wire"]

log = logging.getLogger(__name__)
_rlog = RateLimitedLog(log)

#: The most bytes one run's dumps may hold (distinct blobs + per-dump overhead): 1,024 ranks
#: with a distinct 64 KiB dump each, or 65,536 ranks whose training threads share their
#: stacks (the common shape of a hang). Beyond it new dumps are counted, not kept.
MAX_RUN_STACKS_BYTES = 64 * 1024 * 1024
#: What one kept dump costs beyond its blobs (its list, key, scalars, the budget's slot), in
#: the count: 558 bytes measured with tracemalloc (CPython 3.11), rounded up (256 before,
#: issue 38: the count is what is held).
DUMP_OVERHEAD = 576
#: What one distinct blob costs beyond its bytes (the bytes object's header, its entry in the
#: shared table and that table's slot): ~230 measured, rounded up.
BLOB_OVERHEAD = 256

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode

#: A dump's wire form (feed events, run snapshots), also how it is kept:
#: [rank, reason, request_id, taken_at, idle_s, samples, seconds, [thread blobs], profile
#: blob]; each thread blob is MessagePack of ``{"name", "main", "frames": [{file, line,
#: function, code}]}``, the profile blob of ``[{"stack", "count"}]`` (b"": none).
Wire = List[Any]


def _exact(blob: bytes) -> bytes:
    """``blob`` in a bytes object of its own size. Why: the encoder's result keeps the
    capacity its buffer grew to (up to 1.6 times the bytes: a 210-byte blob held 335), and
    a kept blob should cost what it is counted."""
    return bytes(memoryview(blob))


def _thread_blob(thread: Any) -> bytes:
    return _exact(_encode({
        "name": thread.name,
        "main": thread.main,
        "frames": [{"file": f.file, "line": f.line, "function": f.function, "code": f.code}
                   for f in thread.frames],
    }))


def _profile_blob(profile: Iterable[Any]) -> bytes:
    entries = [{"stack": list(e.stack), "count": e.count} for e in profile]
    return _exact(_encode(entries)) if entries else b""


def wire_of(frame: Stacks) -> Wire:
    """A decoded ``stacks`` frame in the wire form (its known fields only)."""
    return [frame.rank, frame.reason, frame.request_id, frame.taken_at, frame.idle_s,
            frame.samples, frame.seconds, [_thread_blob(t) for t in frame.threads],
            _profile_blob(frame.profile)]


def dump_dict(item: Wire) -> Dict[str, Any]:
    """A dump as ``GET /stacks`` lists it (without ``host``: the web adds it from the run's
    topology)."""
    rank, reason, request_id, taken_at, idle_s, samples, seconds, threads, profile = item
    return {
        "rank": rank, "reason": reason, "request_id": request_id, "taken_at": taken_at,
        "idle_s": idle_s, "threads": [_decode(b) for b in threads],
        "profile": _decode(profile) if profile else [], "samples": samples, "seconds": seconds,
    }


def _check_wire(item: Any) -> Wire:
    """``item`` if it has the wire form's shape (a web reads it from the feed), else
    ValueError."""
    if (not isinstance(item, (list, tuple)) or len(item) != 9 or type(item[0]) is not int
            or item[1] not in ("stall", "request") or not isinstance(item[2], str)
            or not isinstance(item[7], (list, tuple))
            or not all(isinstance(b, bytes) for b in item[7])
            or not isinstance(item[8], bytes)):
        raise ValueError("not a stacks dump in wire form")
    return list(item)


class RunStacks:
    """The latest dump per (rank, reason) of one run (see the module docstring). The web
    keeps its copy of the broker's in the same form (``web/hub.py``)."""

    def __init__(self, cap: int = MAX_RUN_STACKS_BYTES,
                 budget: _budget.ByteBudget | None = None) -> None:
        self.cap = cap
        #: the process's byte budget (every run's store shares it)
        self.budget = budget if budget is not None else _budget.PROCESS_BUDGET
        #: dumps dropped because the process's budget was full (oldest first)
        self.over_budget = 0
        #: bumped by every change (a reader's cache key: the web's ``GET /stacks`` answer)
        self.version = 0
        self._dumps: Dict[Tuple[int, str], Wire] = {}
        self._blobs: Dict[bytes, List[Any]] = {}  # content -> [the shared bytes, references]
        #: bytes counted against the cap now
        self.bytes = 0
        #: dumps not kept because the cap bit (since this store was made)
        self.over_cap = 0

    def __len__(self) -> int:
        return len(self._dumps)

    def __contains__(self, key: object) -> bool:
        return key in self._dumps

    def put(self, frame: Stacks) -> bool:
        """Keep ``frame`` as its rank's latest dump of its reason; False when the cap bit
        (then the rank has no dump of that reason)."""
        return self.put_wire(wire_of(frame), frame.run)

    def put_wire(self, item: Wire, run: str = "") -> bool:
        """:meth:`put` of a dump in wire form (ValueError if it is not one)."""
        item = _check_wire(item)
        key = (item[0], item[1])
        self.remove(key)
        blobs, profile = item[7], item[8]
        cost = DUMP_OVERHEAD + len(profile)
        seen: set[bytes] = set()
        for blob in blobs:
            if blob not in self._blobs and blob not in seen:
                cost += BLOB_OVERHEAD + len(blob)
                seen.add(blob)
        if self.bytes + cost > self.cap:
            self.over_cap += 1
            _rlog.warning("stacks_cap", "run %s: a stacks dump of rank %d not kept: the run's "
                          "dumps hold %d bytes, the cap is %d (%d not kept so far)", run,
                          key[0], self.bytes, self.cap, self.over_cap)
            return False
        shared = []
        for blob in blobs:
            entry = self._blobs.get(blob)
            if entry is None:
                entry = self._blobs[blob] = [blob, 0]
            entry[1] += 1
            shared.append(entry[0])
        self.bytes += cost
        item[7] = shared
        self._dumps[key] = item
        self.version += 1
        self.budget.charge(self, key, cost)  # may drop older dumps, of any run
        return True

    def evict(self, key: Any) -> None:
        """The process's byte budget is full and this is the oldest dump kept: drop it."""
        if key in self._dumps:
            self.over_budget += 1
            self.remove(key)

    def close(self) -> None:
        """Forget every dump (the run left memory): their bytes go back to the budget."""
        for key in list(self._dumps):
            self.remove(key)

    def remove(self, key: Tuple[int, str]) -> None:
        """Forget the dump of ``key`` = (rank, reason), if any."""
        old = self._dumps.pop(key, None)
        if old is None:
            return
        self.version += 1
        freed = DUMP_OVERHEAD + len(old[8])
        blobs = self._blobs
        for blob in old[7]:
            entry = blobs[blob]
            entry[1] -= 1
            if entry[1] == 0:
                del blobs[blob]
                freed += BLOB_OVERHEAD + len(blob)
        self.bytes -= freed
        self.budget.forget(self, key)
        self.budget.adjust(-freed)

    def discard(self, rank: int) -> None:
        """Forget ``rank``'s dumps (a rank that turned out to be >= the world size)."""
        self.remove((rank, "stall"))
        self.remove((rank, "request"))

    def keys(self) -> List[Tuple[int, str]]:
        return list(self._dumps)

    def wire(self, keys: Optional[Iterable[Tuple[int, str]]] = None) -> List[Wire]:
        """The kept dumps (of ``keys`` only, when given) in wire form, by rank then reason."""
        chosen = sorted(self._dumps) if keys is None else sorted(k for k in keys
                                                                  if k in self._dumps)
        return [self._dumps[k] for k in chosen]

    def dumps(self, keys: Optional[Iterable[Tuple[int, str]]] = None) -> List[Dict[str, Any]]:
        """The kept dumps as dicts (:func:`dump_dict`), by rank then reason."""
        return [dump_dict(item) for item in self.wire(keys)]

