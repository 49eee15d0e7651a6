"""Which broker owns a run: the jump consistent hash of the run id (PROTOCOL.md 7.3).

A cluster that outgrows one broker runs N of them, each owning the runs whose id hashes to
it; nothing is coordinated at run time, so every party computes the same answer alone: the
agent (which endpoint of its broker list to connect to), the broker (``--shard K/N``: reject
what is not its own), the web (which shard's copy of a run id seen twice is the current one).
One definition, here in the bottom layer, imported by all three.

Why the jump hash (Lamping and Veach, 2014): no table to store or agree on, perfectly even
over any N, and changing N moves only about 1/N of the run ids (a StatefulSet scaled from N
to N + 1 keeps most runs where they were). The key is the first 8 bytes of SHA-256 of the run
id read big-endian: a fixed, portable digest (Python's ``hash`` is salted per process).

Pure: no sockets, no environment reads (the callers pass the strings in).
"""
from __future__ import annotations

import hashlib
from typing import List, Optional, Tuple

from .digits import ascii_int, is_ascii_digits

__all__ = [
    "jump", "run_key", "shard_of", "split_endpoints", "parse_shard", "pick_endpoint",
    "pick_control", "ShardError", "MAX_SHARD_COUNT",
]

#: The most shards a ``--shard K/N`` may name. Why a bound: N is a deployment's broker
#: count, and a huge one (``0/<400 digits>``) was accepted and then failed every new run's
#: frame (the jump hash's doubles overflow); 1,024 brokers is far past any deployment this
#: design serves (each web holds one feed per shard).
MAX_SHARD_COUNT = 1024
_COUNT_DIGITS = len(str(MAX_SHARD_COUNT))

_MASK = (1 << 64) - 1
_MULT = 2862933555777941757
_TWO31 = float(1 << 31)


class ShardError(ValueError):
    """A bad ``K/N`` or endpoint list (a deployment mistake: its message says which)."""


def jump(key: int, buckets: int) -> int:
    """The jump consistent hash of the unsigned 64-bit ``key`` into ``buckets`` (≥ 1), exactly
    as the contract's pseudo-code: the multiply wraps at 2**64 and the division is done in
    IEEE doubles, as the paper's C does, so every implementation agrees bucket for bucket."""
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    key &= _MASK
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * _MULT + 1) & _MASK
        j = int((b + 1) * (_TWO31 / float((key >> 33) + 1)))
    return b


def run_key(run: str) -> int:
    """The first 8 bytes of SHA-256 of ``run``'s UTF-8 bytes, as a big-endian unsigned int."""
    digest = hashlib.sha256(run.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big")


def shard_of(run: str, shards: int) -> int:
    """The index (0..shards-1) of the shard that owns ``run`` among ``shards``."""
    if shards == 1:
        return 0
    return jump(run_key(run), shards)


def split_endpoints(text: str) -> List[str]:
    """A comma-separated endpoint list as its items, blanks around them stripped. An empty
    item (``"a,,b"``, a trailing comma) is an error, not a shorter list: the positions are
    the shard indices, and a silent shift would send runs to the wrong broker."""
    items = [item.strip() for item in str(text).split(",")]
    if any(not item for item in items):
        raise ShardError(f"empty endpoint in the list {text!r}")
    return items


def parse_shard(text: str) -> Tuple[int, int]:
    """``"K/N"`` as (K, N) with 0 ≤ K < N ≤ :data:`MAX_SHARD_COUNT`; :class:`ShardError`
    saying what is wrong. K and N are ASCII digits (``int()`` alone also takes other
    scripts' digits, signs and underscores)."""
    k, sep, n = (part.strip() for part in str(text).strip().partition("/"))
    shown = text if len(text) <= 40 else text[:40] + "..."
    if not sep or not is_ascii_digits(k) or not is_ascii_digits(n):
        raise ShardError(f"expected K/N (e.g. 0/2), got {shown!r}")
    count = ascii_int(n, _COUNT_DIGITS)  # (int() of 400 digits: none is made)
    if count is None or count > MAX_SHARD_COUNT:
        raise ShardError(f"N must be 1..{MAX_SHARD_COUNT}, got {shown!r}")
    if count < 1:
        raise ShardError(f"N must be >= 1, got {shown!r}")
    index = ascii_int(k, _COUNT_DIGITS)
    if index is None:
        raise ShardError(f"K must be 0..{count - 1} (N - 1), got {shown!r}")
    if not 0 <= index < count:
        raise ShardError(f"K must be 0..{count - 1} (N - 1), got {shown!r}")
    return index, count


def pick_endpoint(brokers: str, run: str) -> Tuple[str, int, int]:
    """(endpoint, shard, N) for ``run`` from the agent's broker list (one endpoint or N
    comma-separated, shard 0 first)."""
    items = split_endpoints(brokers)
    index = shard_of(run, len(items))
    return items[index], index, len(items)


def pick_control(controls: str, shard: int, shards: int) -> Optional[str]:
    """The control endpoint at position ``shard`` of a comma-separated list of ``shards``
    items; None when the list has another length (or a blank item): the caller warns once."""
    try:
        items = split_endpoints(controls)
    except ShardError:
        return None
    if len(items) != shards:
        return None
    return items[shard]
