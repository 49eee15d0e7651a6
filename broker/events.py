"""What a run's sink says: the events it emits and the rejection it raises.

Kept apart from :mod:`broker.sink` so that the server, the journal and the feed, which only
move events and count rejections, depend on this vocabulary and not on the state machine.
"""
from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Event", "Rejected"]


class Event(NamedTuple):
    """One thing the web must hear about, numbered in the run's sequence."""

    seq: int  # the run's sequence number; strictly increasing per run, never reused
    kind: str  # "run" | "epoch" | "ranks" | "steps" | "complete" | "evicted" (by Runs)
    data: Any  # run header | epoch record | ranks list | StepStore.to_wire block | {"status": ...}
    #            | {"run": run} (the run left the broker's memory: --max-runs)


class Rejected(Exception):
    """A frame the sink refuses; ``reason`` is the counter key.

    Reasons: ``world_size_mismatch``, ``rank_out_of_range``, ``bad_metadata_json``,
    ``step_metric_names`` (a run's distinct step metric names would pass 1,024),
    ``open_epochs`` (a run's open epochs would pass 1,024).
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
