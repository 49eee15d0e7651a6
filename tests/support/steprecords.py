"""Closed step records computed from whole frames, for tests: the expected side of the
step tests, through the broker's own column arithmetic (:mod:`broker.run.steps.columns`).

Not in the broker because nothing there needs a record from frames at rest: the closer
closes columns as frames arrive.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Any, Dict, Iterable, Optional

from broker.run.steps.columns import ClosedSteps, FrameBuffer, close_columns, slice_frame
from rank_agent.protocol import Steps

__all__ = ["close_frames", "step_record"]


def close_frames(frames: Iterable[Steps]) -> Optional[ClosedSteps]:
    """Every point of ``frames`` (arrival order) closed into one :class:`ClosedSteps`."""
    buf = FrameBuffer()
    for frame in frames:
        buf.add(frame)
    return close_columns(buf.take()) if buf else None


def step_record(step: int, reports: Dict[int, Steps]) -> Dict[str, Any]:
    """The closed step record of PROTOCOL 2.4 from the ranks' reports (rank -> a frame that
    holds its point of ``step``), through the same arrays as a close."""
    frames = []
    for frame in reports.values():
        i = bisect_left(frame.steps, step)
        frames.append(slice_frame(frame, i, i + 1))
    batch = close_frames(frames)
    assert batch is not None and len(batch) == 1
    return batch.records()[0]
