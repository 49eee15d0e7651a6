"""The closed steps' encodings: records, CSV cells, wire arrays and zoom buckets.

Split from :mod:`broker.run.steps.store` (which keeps the arrays and their growth) because these
are the read side's formats, each a pure function of arrays: what ``/steps`` buckets,
``/steps.csv`` cells, PROTOCOL 2.4's record dicts and the journal's and snapshots' wire
arrays look like. Like the store, it imports only numpy and the standard library: the web
uses it too.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional

import numpy as np

__all__ = ["RECORD_KEYS", "csv_columns", "none_where", "spread", "series_wire", "series_arrays", "buckets",
           "trip_array", "float_cells", "int_cells"]

_NAN = math.nan


def csv_columns(metric_names: List[str]) -> List[str]:
    """The ``/steps.csv`` columns of PROTOCOL 4, in order (the cells of
    :meth:`~broker.run.steps.store.StepStore.csv_rows` follow them; the web writes the header
    line, neutralising the names that come from ranks)."""
    cols = ["step", "time", "n"]
    for name in metric_names:
        cols += [f"{name}_mean", f"{name}_min", f"{name}_max"]
    return cols + ["step_ms_mean", "step_ms_min", "step_ms_max", "data_ms_mean", "data_ms_min",
                   "data_ms_max", "slowest_rank", "samples", "tokens", "samples_per_s",
                   "tokens_per_s"]


def int_cells(arr: np.ndarray) -> List[str]:
    return [str(v) for v in arr.tolist()]


def float_cells(arr: np.ndarray) -> List[str]:
    """CSV cells: ``repr`` of finite values, empty for NaN and infinities."""
    isfinite = math.isfinite
    return [repr(v) if isfinite(v) else "" for v in arr.tolist()]


#: PROTOCOL 2.4's closed step record keys, in its order (what :meth:`StepStore.records`
#: gives, as the broker's records did: the SSE bytes are the same)
RECORD_KEYS = ("step", "time", "n", "metrics", "step_ms", "slowest_rank", "samples", "tokens",
                "samples_per_s", "tokens_per_s", "data_ms")


def none_where(arr: np.ndarray, mask: np.ndarray) -> List[Any]:
    """``arr.tolist()`` with None where ``mask``."""
    if not mask.any():
        return arr.tolist()
    obj = arr.astype(object)
    obj[mask] = None
    return obj.tolist()


def spread(k: int, idx: np.ndarray, items: List[Any]) -> List[Any]:
    """``items`` at positions ``idx`` of a list of ``k`` (None elsewhere)."""
    if len(items) == k:
        return items
    out: List[Any] = [None] * k
    for i, item in zip(idx.tolist(), items):
        out[i] = item
    return out


def trip_array(triples: List[Any]) -> np.ndarray:
    """``[mean, min, max]`` lists as a (n, 3) float64 array (None -> NaN)."""
    if not triples:
        return np.empty((0, 3), np.float64)
    arr = np.array(triples, np.float64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError("a step series value is not [mean, min, max]")
    return arr


def series_wire(s: Any, start: int, end: int) -> List[bytes]:
    """Rows ``start:end`` of a :class:`~broker.run.steps.store.Series` as its four arrays' bytes
    (typed loosely: the store imports this module, not the other way round)."""
    p0, p1 = s.span(start, end)
    return [s.row[p0:p1].tobytes(), s.mean[p0:p1].tobytes(), s.lo[p0:p1].tobytes(),
            s.hi[p0:p1].tobytes()]


def series_arrays(parts: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rows, mean, lo, hi = parts
    return (np.frombuffer(rows, np.uint32), np.frombuffer(mean, np.float64),
            np.frombuffer(lo, np.float64), np.frombuffer(hi, np.float64))


def buckets(steps: np.ndarray, mean: np.ndarray, lo_src: np.ndarray, hi_src: np.ndarray,
             nonfinite: Optional[int], points: int) -> List[List[Any]]:
    """Buckets of equal point count over aligned arrays (``nonfinite``: how many means are
    non-finite, 0 to skip masking; None: unknown, check)."""
    m = len(steps)
    if m == 0:
        return []
    if nonfinite is None:
        nonfinite = int(m - np.count_nonzero(np.isfinite(mean)))
    finite_mean = mean if not nonfinite else np.where(np.isfinite(mean), mean, _NAN)
    if m <= points:
        s = steps.tolist()
        fm = finite_mean.tolist()
        return [list(t) for t in zip(s, s, mean.tolist(), fm, fm, lo_src.tolist(),
                                      hi_src.tolist(), [1] * m)]
    edges = (np.arange(points, dtype=np.int64) * m) // points
    counts = np.diff(np.append(edges, m))
    last = np.append(edges[1:], m) - 1
    with np.errstate(invalid="ignore", over="ignore"):
        means = np.add.reduceat(mean, edges) / counts
    lo = np.fmin.reduceat(finite_mean, edges)
    hi = np.fmax.reduceat(finite_mean, edges)
    rmin = np.fmin.reduceat(lo_src, edges)
    rmax = np.fmax.reduceat(hi_src, edges)
    return [list(t) for t in zip(steps[edges].tolist(), steps[last].tolist(), means.tolist(),
                                  lo.tolist(), hi.tolist(), rmin.tolist(), rmax.tolist(),
                                  counts.tolist())]
