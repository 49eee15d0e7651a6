"""What a run's sink says: the events it emits and the rejection it raises.

Kept apart from :mod:`broker.run.sink` because the sink is made of modules that need this
vocabulary (its epoch rules, metadata, the steps rules and closer) and that the sink itself
imports: they cannot import it back. The broker's loop (``ingest``, ``server``), which only
moves events, takes ``Event`` from here too; ``runs`` and the journal's replay, which drive
sinks anyway, take both names from :mod:`broker.run.sink`, which re-exports them.
"""
from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Event", "Rejected"]


class Event(NamedTuple):
    """One thing the web must hear about, numbered in the run's sequence."""

    seq: int  # the run's sequence number; strictly increasing per run, never reused
    kind: str  # "run" | "epoch" | "ranks" | "steps" | "stacks" | "complete" | "evicted" (by Runs)
    data: Any  # run header | epoch record | ranks list | StepStore.to_wire block
    #            | {"dumps", "gone"[, "collectives", "collectives_gone", "verdict"]}
    #              (stacks: the collectives keys when a frame or the verdict changed,
    #              broker/stacks/feed.py) | {"status": ...}
    #            | {"run": run} (the run left the broker's memory: --max-runs)


class Rejected(Exception):
    """A frame the sink refuses; ``reason`` is the counter key.

    Reasons: ``world_size_mismatch``, ``rank_out_of_range``, ``bad_metadata_json``,
    ``step_metric_names`` (a run's distinct step metric names would pass 1,024),
    ``open_epochs`` (a run's open epochs would pass 1,024), ``old_proc`` and
    ``attempt_rate`` (8.1, :mod:`broker.run.attempts`).
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
