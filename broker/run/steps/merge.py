"""A rank's repeated points of one step, merged field by field (PROTOCOL.md 2 and 5, v3).

Apart from :mod:`broker.run.steps.columns` because it is one rule of its own, taken only on the
rare path of a close (a rank flushed the same step twice) and tested on its own.
"""
from __future__ import annotations

from typing import Any, Tuple

import numpy as np

#: :class:`broker.run.steps.columns.Columns` (typed loosely: that module imports this one)
Columns = Any

__all__ = ["merge_points"]


def merge_points(cols: Columns, order: np.ndarray, dup: np.ndarray) -> Columns:
    """One point per (rank, step) of ``cols``, in (step, rank) order: a rank's repeated
    points merged field by field (PROTOCOL 2 and 5, v3): of each field, the latest point's
    value that says something wins (a non-null ``step_ms``/``data_ms``, a metric value, a
    ``samples``/``tokens`` above 0); ``time`` is the latest point's (7.1). ``order``: the
    entries sorted by (step, rank), stably (so arrival order within a point);
    ``dup[i]``: sorted entry ``i + 1`` repeats entry ``i``'s (rank, step).

    The rare path (a rank flushed one step twice: the Accelerate tracker beside the
    per-rank recipe across a flush boundary), so a few numpy passes over the batch."""
    n = len(order)
    start = np.ones(n, dtype=bool)
    start[1:] = ~dup
    gstart = np.flatnonzero(start)
    gend = np.append(gstart[1:], n) - 1
    gid = np.cumsum(start) - 1
    pos = np.arange(n)

    def latest(ok: np.ndarray) -> np.ndarray:
        """Per point, the sorted position of its latest entry where ``ok`` (-1: none)."""
        return np.maximum.reduceat(np.where(ok, pos, -1), gstart)

    def field(arr: np.ndarray, ok: np.ndarray, empty: Any) -> Tuple[np.ndarray, np.ndarray]:
        at = latest(ok[order])
        got = at >= 0
        return np.where(got, arr[order][np.maximum(at, 0)], empty), got

    first, last = order[gstart], order[gend]
    ms, ms_has = field(cols.ms, cols.ms_has, 0.0)
    dms, dms_has = field(cols.dms, cols.dms_has, 0.0)
    samples, _ = field(cols.samples, cols.samples > 0, 0)
    tokens, _ = field(cols.tokens, cols.tokens > 0, 0)
    # metric values: per (name, point) the latest (values are in arrival order, and a
    # point holds one value per name)
    point = np.empty(len(cols), np.int64)
    point[order] = gid
    m_pos = point[cols.m_pos]
    key = cols.m_name * len(gstart) + m_pos
    by = np.argsort(key, kind="stable")
    ks = key[by]
    keep = by[np.append(ks[1:] != ks[:-1], True)] if len(ks) else by
    return type(cols)(cols.step[first], cols.rank[first], cols.time[last], ms, ms_has,
                   samples.astype(np.int64), tokens.astype(np.int64), m_pos[keep],
                   cols.m_name[keep], cols.m_val[keep], cols.names, dms, dms_has)
