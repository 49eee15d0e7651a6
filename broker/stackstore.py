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
* **A byte cap per run**, :data:`MAX_RUN_STACKS_BYTES`, counted on the distinct blobs plus
  :data:`DUMP_OVERHEAD` per dump. A dump that would pass it is not kept (the rank's previous
  dump of that reason is dropped too, so nothing older poses as the latest) and is counted in
  :attr:`RunStacks.over_cap`. The rank's ``stalled`` status does not depend on it: the sink
  keeps that apart, in a few bytes per rank.

Pure: no I/O, no clock.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Tuple

import msgspec

from rank_agent.protocol import Stacks
from rank_agent.ratelimit import RateLimitedLog

__all__ = ["RunStacks", "MAX_RUN_STACKS_BYTES", "DUMP_OVERHEAD", "dump_dict"]

log = logging.getLogger(__name__)
_rlog = RateLimitedLog(log)

#: The most bytes one run's dumps may hold (distinct blobs + per-dump overhead): 1,024 ranks
#: with a distinct 64 KiB dump each, or 65,536 ranks whose training threads share their
#: stacks (the common shape of a hang). Beyond it new dumps are counted, not kept.
MAX_RUN_STACKS_BYTES = 64 * 1024 * 1024
#: What one kept dump costs beyond its blobs (its tuple, key and scalars), in the count.
DUMP_OVERHEAD = 256

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode

# (reason, request_id, taken_at, idle_s, samples, seconds, thread blobs, profile blob)
_Stored = Tuple[str, str, float, float, int, float, Tuple[bytes, ...], bytes]


def _thread_blob(thread: Any) -> bytes:
    return _encode({
        "name": thread.name,
        "main": thread.main,
        "frames": [{"file": f.file, "line": f.line, "function": f.function, "code": f.code}
                   for f in thread.frames],
    })


def _profile_blob(profile: Iterable[Any]) -> bytes:
    entries = [{"stack": list(e.stack), "count": e.count} for e in profile]
    return _encode(entries) if entries else b""


def dump_dict(rank: int, stored: _Stored) -> Dict[str, Any]:
    """A kept dump as the feed and ``GET /stacks`` carry it (without ``host``: the web adds
    it from the run's topology)."""
    reason, request_id, taken_at, idle_s, samples, seconds, threads, profile = stored
    return {
        "rank": rank, "reason": reason, "request_id": request_id, "taken_at": taken_at,
        "idle_s": idle_s, "threads": [_decode(b) for b in threads],
        "profile": _decode(profile) if profile else [], "samples": samples, "seconds": seconds,
    }


class RunStacks:
    """The latest dump per (rank, reason) of one run (see the module docstring)."""

    def __init__(self, cap: int = MAX_RUN_STACKS_BYTES) -> None:
        self.cap = cap
        self._dumps: Dict[Tuple[int, str], _Stored] = {}
        self._blobs: Dict[bytes, List[Any]] = {}  # content -> [the shared bytes, references]
        #: bytes counted against the cap now
        self.bytes = 0
        #: dumps not kept because the cap bit (since this sink was made)
        self.over_cap = 0

    def __len__(self) -> int:
        return len(self._dumps)

    def put(self, frame: Stacks) -> bool:
        """Keep ``frame`` as its rank's latest dump of its reason; False when the cap bit."""
        key = (frame.rank, frame.reason)
        self._release(key)
        blobs = [_thread_blob(t) for t in frame.threads]
        profile = _profile_blob(frame.profile)
        cost = DUMP_OVERHEAD + len(profile)
        seen: set[bytes] = set()
        for blob in blobs:
            if blob not in self._blobs and blob not in seen:
                cost += len(blob)
                seen.add(blob)
        if self.bytes + cost > self.cap:
            self.over_cap += 1
            _rlog.warning("stacks_cap", "run %s: a stacks dump of rank %d not kept: the run's "
                          "dumps hold %d bytes, the cap is %d (%d not kept so far)", frame.run,
                          frame.rank, self.bytes, self.cap, self.over_cap)
            return False
        shared = []
        for blob in blobs:
            entry = self._blobs.get(blob)
            if entry is None:
                entry = self._blobs[blob] = [blob, 0]
            entry[1] += 1
            shared.append(entry[0])
        self.bytes += cost
        self._dumps[key] = (frame.reason, frame.request_id, frame.taken_at, frame.idle_s,
                            frame.samples, frame.seconds, tuple(shared), profile)
        return True

    def _release(self, key: Tuple[int, str]) -> None:
        old = self._dumps.pop(key, None)
        if old is None:
            return
        self.bytes -= DUMP_OVERHEAD + len(old[7])
        blobs = self._blobs
        for blob in old[6]:
            entry = blobs[blob]
            entry[1] -= 1
            if entry[1] == 0:
                del blobs[blob]
                self.bytes -= len(blob)

    def discard(self, rank: int) -> None:
        """Forget ``rank``'s dumps (a rank that turned out to be >= the world size)."""
        self._release((rank, "stall"))
        self._release((rank, "request"))

    def get(self, rank: int, reason: str) -> Optional[Dict[str, Any]]:
        stored = self._dumps.get((rank, reason))
        return None if stored is None else dump_dict(rank, stored)

    def dumps(self, keys: Optional[Iterable[Tuple[int, str]]] = None) -> List[Dict[str, Any]]:
        """The kept dumps (of ``keys`` only, when given) by rank then reason."""
        chosen = sorted(self._dumps) if keys is None else sorted(k for k in keys
                                                                  if k in self._dumps)
        return [dump_dict(rank, self._dumps[(rank, reason)]) for rank, reason in chosen]
