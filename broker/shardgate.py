"""Which runs a broker of ``--shard K/N`` takes in (PROTOCOL 7.3).

A frame naming a run the broker does not hold is taken only when the run's id hashes to
this shard (:func:`rank_agent.shards.shard_of`) or the journal already holds the run (a broker
keeps serving every run its journal holds, whatever the hash says: after N changed, an old
run's ranks still reach it and its history stays whole). Anything else is a misconfigured
rank (another broker list, another N): :class:`broker.runs.Runs` rejects it as
``wrong_shard`` before it makes anything.

The verdict is cached per run id: the gate is asked only for frames of runs not in memory, but
a misconfigured rank sends all its frames there, and each would otherwise pay a SHA-256 and a
``stat`` of the journal. The cache holds at most :data:`CACHE_RUNS` ids (≤ 128 characters
each, so at most about 3 MiB) and is emptied when full: a verdict never changes, so forgetting
one only costs recomputing it.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

from rank_agent.shards import MAX_SHARD_COUNT, shard_of

__all__ = ["ShardGate", "CACHE_RUNS"]

#: Run ids whose verdict is remembered.
CACHE_RUNS = 16_384


class ShardGate:
    """``gate(run) -> bool``: may a frame of ``run`` create (or bring back) its run here.

    ``held(run)`` says whether the journal holds the run (None: no journal)."""

    def __init__(self, shard: int, shards: int,
                 held: Optional[Callable[[str], bool]] = None) -> None:
        if not 0 <= shard < shards:
            raise ValueError(f"shard must be 0..{shards - 1}, got {shard}")
        if shards > MAX_SHARD_COUNT:  # (parse_shard says so first, on the command line)
            raise ValueError(f"shards must be 1..{MAX_SHARD_COUNT}, got {shards}")
        self.shard = shard
        self.shards = shards
        self.held = held
        self._verdicts: Dict[str, bool] = {}

    def __call__(self, run: str) -> bool:
        verdict = self._verdicts.get(run)
        if verdict is None:
            verdict = shard_of(run, self.shards) == self.shard
            if not verdict and self.held is not None:
                verdict = bool(self.held(run))
            if len(self._verdicts) >= CACHE_RUNS:
                self._verdicts.clear()
            self._verdicts[run] = verdict
        return verdict
