"""A step run's ETA (PROTOCOL 8.5): ``max(0, total_steps - 1 - steps_done)`` x the median of
the finite ``step_ms`` means of the latest <= 100 closed steps / 1000.

One function for the broker's header and the web's (:meth:`web.runstate.RunState.
public_header` recomputes it against the web's own closed steps, as it does
``steps_done``, so the figure follows the steps without a header event per step). The
median is 7.1's (the mean of the two middle values for an even count): a step that waited
for a checkpoint or a hang moves it by one place, not by its length.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from broker.run.steps.store import StepStore

__all__ = ["ETA_WINDOW", "recent_step_ms", "step_eta"]

#: The closed steps whose ``step_ms`` means the ETA's median is over.
ETA_WINDOW = 100


def recent_step_ms(store: StepStore, window: int = ETA_WINDOW) -> Optional[float]:
    """The median of the finite ``step_ms`` means of the latest ``window`` closed steps
    (None when none of them has one)."""
    rows = store.rows
    if not rows:
        return None
    series = store.step_ms
    p0, p1 = series.span(max(0, rows - window), rows)
    means = series.mean[p0:p1]
    means = means[np.isfinite(means)]
    if not len(means):
        return None
    return float(np.median(means))


def step_eta(total_steps: int | None, store: StepStore) -> Optional[float]:
    """Seconds left of a step run, or None when ``total_steps`` is unknown (0/None), the run
    closed no step, or none of its latest steps has a finite ``step_ms``."""
    last = store.last_step
    if not total_steps or last is None:
        return None
    median = recent_step_ms(store)
    if median is None:
        return None
    return max(0, total_steps - 1 - last) * median / 1000.0
