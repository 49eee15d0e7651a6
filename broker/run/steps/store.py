"""Closed steps, columnar: millions of them in a few bytes each, queried at any zoom.

Both processes that hold closed steps use this (the broker for snapshots and its journal,
the web for ``/steps`` and ``/steps.csv``), so it imports only numpy and the standard
library. A closed step is a row: ``step``, ``time``, ``n``, ``slowest_rank`` (-1: none),
``samples``, ``tokens``. Each metric, and the step time, is a *series*: the rows where it
has a value, as ``(row index, mean, min, max)`` arrays (28 bytes a point; min/max are NaN
where no rank gave a finite value). Arrays start small and grow geometrically (doubling up
to ``_DOUBLE_UNTIL`` items, then by 1/8), so a new series costs a few hundred bytes, not
~28 KB (a run may hold 1,024 names, and every web holds them too), and the slack of a long
one stays small; :meth:`StepStore.nbytes` counts what is allocated.

:meth:`StepStore.series` answers PROTOCOL 4's "Step series": at most N buckets of equal
point count, each with the mean of its per-step means and the *exact* smallest and largest
finite per-step mean (``np.fmin.reduceat``: one pass over the range, no sampling), so a
one-step spike in a million steps is in every answer. A series remembers how many of its
means are non-finite; when none are (the usual case) no masking pass is needed.

Wire form (journal blocks and snapshots): :meth:`StepStore.to_wire` gives a dict of raw
little-endian array bytes for a row range; :meth:`StepStore.extend_wire` appends one. A
million-step run travels as ~40 MB of arrays and loads with ``np.frombuffer``.
"""
from __future__ import annotations

import math
import sys
from itertools import compress, repeat
from operator import is_not, itemgetter
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import numpy as np

from broker.run.steps.encodings import (
    RECORD_KEYS,
    buckets,
    float_cells,
    int_cells,
    none_where,
    series_arrays,
    series_wire,
    spread,
    trip_array,
)

__all__ = ["StepStore", "Series", "STEP_MS", "DATA_MS", "SAMPLES_PER_S", "TOKENS_PER_S", "wire_records"]

#: ``/steps`` names of the series that are not user metrics (they shadow a metric of the
#: same name there; ``/steps.csv`` has every metric under its own name).
STEP_MS = "step_ms"
#: (v4, 7.1) the ms a step waited for its batch: a series like ``step_ms``, not a metric
DATA_MS = "data_ms"
SAMPLES_PER_S = "samples_per_s"
TOKENS_PER_S = "tokens_per_s"

_DATA_KEY = object()  # extend_wire's key of the data_ms series (no metric name is it)
_ROW_FIELDS = (("step", np.int64), ("time", np.float64), ("n", np.int32),
               ("slowest", np.int32), ("samples", np.int64), ("tokens", np.int64))
_MIN_CAPACITY = 8
_DOUBLE_UNTIL = 4096
_NAN = math.nan
_isfinite = math.isfinite


#: Grow arrays in place where it is safe (:func:`_capacity`). ``ndarray.resize`` is a
#: realloc, which moves a big block by remapping its pages: growing by 1/8 copied each
#: array ~9 times over, a fifth of the broker's CPU for one run's 1,000-step frames (issue
#: 17). Only numpy's reference check stops it from freeing memory a live view still points
#: into (it then raises, and the array is copied as before); that check is unreliable from
#: Python 3.14 (numpy#30265, numpy#30991), where every growth copies.
_IN_PLACE = sys.version_info < (3, 14)

#: a record's fields in the order :meth:`StepStore.append` reads them
_RECORD = itemgetter("step", "time", "n", "slowest_rank", "samples", "tokens", "step_ms",
                     "metrics")


def _capacity(n: int, need: int) -> int:
    """Room for ``need`` items in an array of ``n``: doubled while small, then 1/8 more
    (geometric either way, so appends stay amortised O(1); the slack of a big array stays
    small)."""
    return max(need, 2 * n if n < _DOUBLE_UNTIL else n + n // 8, _MIN_CAPACITY)


def _grow(arr: np.ndarray, cap: int) -> np.ndarray:
    """A copy of ``arr`` with room for ``cap`` items (``arr`` itself if it has it)."""
    if cap <= len(arr):
        return arr
    new = np.empty(cap, dtype=arr.dtype)
    new[:len(arr)] = arr
    return new


def _grow_in(holder: Any, key: str, cap: int, get: Any = getattr, put: Any = setattr) -> None:
    """Give ``holder``'s array ``key`` (an attribute; an item with ``get``/``put`` of a dict)
    room for ``cap`` items: in place where :data:`_IN_PLACE` allows and no view of it is
    alive, else by a copy. The array is reached through ``holder`` alone: a local name for it
    would be one more reference, which numpy's check reads as a view."""
    if _IN_PLACE:
        try:
            get(holder, key).resize(cap)
            return
        except ValueError:  # a view of it is alive (or it does not own its data)
            pass
    put(holder, key, _grow(get(holder, key), cap))


class Series:
    """The rows where one metric (or the step time) has a value."""

    __slots__ = ("n", "row", "mean", "lo", "hi", "nonfinite")

    def __init__(self) -> None:
        self.n = 0
        self.row = np.empty(0, np.uint32)
        self.mean = np.empty(0, np.float64)
        self.lo = np.empty(0, np.float64)  # per-step min over ranks (NaN: none finite)
        self.hi = np.empty(0, np.float64)  # per-step max over ranks
        #: how many per-step means are not finite (0: no masking needed)
        self.nonfinite = 0

    def extend(self, rows: Sequence[int] | np.ndarray, mean: Sequence[float] | np.ndarray,
               lo: Sequence[float] | np.ndarray, hi: Sequence[float] | np.ndarray) -> None:
        k = len(rows)
        if not k:
            return
        n = self.n
        need = n + k
        if need > len(self.row):  # (the four grow together)
            self._grow(_capacity(len(self.row), need))
        self.row[n:need] = rows
        self.mean[n:need] = mean
        self.lo[n:need] = lo
        self.hi[n:need] = hi
        if k <= 16:  # (a close of a few steps: Python's isfinite costs a third of numpy's calls)
            self.nonfinite += k - sum(map(_isfinite, self.mean[n:need].tolist()))
        else:
            self.nonfinite += int(k - np.count_nonzero(np.isfinite(self.mean[n:need])))
        self.n = need

    def _grow(self, cap: int) -> None:
        for key in ("row", "mean", "lo", "hi"):
            _grow_in(self, key, cap)

    def nbytes(self) -> int:
        return self.row.nbytes + self.mean.nbytes + self.lo.nbytes + self.hi.nbytes

    def span(self, r0: int, r1: int) -> tuple[int, int]:
        """Positions ``[p0, p1)`` of this series' points on rows ``[r0, r1)``."""
        p0, p1 = self.row[: self.n].searchsorted((r0, r1)).tolist()
        return p0, p1

    def dense(self, arr: np.ndarray, r0: int, r1: int) -> np.ndarray:
        """``arr`` (``mean``, ``lo`` or ``hi``) spread over rows ``[r0, r1)``: NaN where the
        series has no point."""
        p0, p1 = self.span(r0, r1)
        out = np.full(r1 - r0, _NAN)
        out[self.row[p0:p1] - r0] = arr[p0:p1]
        return out


class StepStore:
    """Every closed step of one run, columnar; append-only, ascending steps."""

    def __init__(self) -> None:
        self.rows = 0
        self._cols: Dict[str, np.ndarray] = {name: np.empty(0, dt) for name, dt in _ROW_FIELDS}
        self.step_ms = Series()
        self.data_ms = Series()
        self.metrics: Dict[str, Series] = {}
        self._names: List[str] | None = []
        self._order: Dict[str, int] = {}  # name -> when its series was made (0, 1, ...)

    # ----------------------------------------------------------------- facts

    def __len__(self) -> int:
        return self.rows

    @property
    def last_step(self) -> Optional[int]:
        """The last closed step (None: none)."""
        return int(self._cols["step"][self.rows - 1]) if self.rows else None

    def metric_names(self) -> List[str]:
        """Sorted names of every metric seen in a closed step (shared; do not mutate)."""
        if self._names is None:
            self._names = sorted(self.metrics)
        return self._names

    def in_order(self, names: Iterable[str]) -> List[str]:
        """Those of ``names`` that have a series here, in the order their series were made
        (the order of ``metrics``): a STEPS block lists its series so, and a store replayed
        from the blocks lists them as the live one did."""
        order = self._order
        return sorted([n for n in names if n in order], key=order.__getitem__)

    def _new_series(self, name: str) -> Series:
        series = self.metrics[name] = Series()
        self._order[name] = len(self._order)
        self._names = None
        return series

    def column(self, name: str) -> np.ndarray:
        """A row column (``step``, ``time``, ``n``, ``slowest``, ``samples``, ``tokens``)."""
        return self._cols[name][: self.rows]

    def nbytes(self) -> int:
        """Bytes allocated for the closed steps (arrays, capacity included)."""
        return (sum(c.nbytes for c in self._cols.values()) + self.step_ms.nbytes()
                + self.data_ms.nbytes()
                + sum(s.nbytes() for s in self.metrics.values()))

    def slowest_ranks(self, since: int = 0) -> List[int]:
        """The slowest ranks of the rows from ``since`` on that have one, oldest first."""
        col = self._cols["slowest"][since: self.rows]
        return col[col >= 0].tolist()

    def last_nonfinite(self, metric: str, since: int = 0) -> Optional[tuple[int, float, float]]:
        """``(step, mean, time)`` of the last row from ``since`` on where ``metric``'s mean
        is not finite; None when there is none."""
        s = self.metrics.get(metric)
        if s is None or not s.nonfinite:
            return None
        p0 = s.span(since, self.rows)[0]
        mean = s.mean[p0: s.n]
        bad = np.flatnonzero(~np.isfinite(mean))
        if not len(bad):
            return None
        i = int(bad[-1])
        row = int(s.row[p0 + i])
        return (int(self._cols["step"][row]), float(mean[i]), float(self._cols["time"][row]))

    # ----------------------------------------------------------------- appending

    def _reserve(self, k: int) -> int:
        start = self.rows
        cols = self._cols
        for name in cols:
            if start + k > len(cols[name]):
                _grow_in(cols, name, _capacity(len(cols[name]), start + k),
                         dict.__getitem__, dict.__setitem__)
        return start

    def append(self, records: Sequence[Dict[str, Any]]) -> None:
        """Append closed step records (PROTOCOL 2.4 dicts), ascending and above the last.

        The web's path for every ``steps`` event: the columns are pulled out with C-level
        ``map``/``zip`` and converted by numpy (None -> NaN), and when every record has the
        same metric names (the usual case) each series is one array, so there is no
        bytecode per record. Everything is converted before anything is stored: a record
        that does not convert (KeyError, TypeError, ValueError) leaves the store as it was."""
        k = len(records)
        if not k:
            return
        step, time, n, slowest, samples, tokens, ms, mets = zip(*map(_RECORD, records))
        step_a = np.array(step, np.int64)
        time_a = np.array(time, np.float64)  # None -> NaN
        n_a = np.array(n, np.int32)
        slow_f = np.array(slowest, np.float64)
        slow_a = np.where(np.isnan(slow_f), -1, slow_f).astype(np.int32)
        samples_a = np.array(samples, np.int64)
        tokens_a = np.array(tokens, np.int64)
        has = np.fromiter(map(is_not, ms, repeat(None)), bool, k)
        ms_rows = np.flatnonzero(has)
        ms_trip = trip_array(list(compress(ms, has)))
        dms = [r.get(DATA_MS) for r in records]
        d_has = np.fromiter(map(is_not, dms, repeat(None)), bool, k)
        d_rows = np.flatnonzero(d_has)
        d_trip = trip_array(list(compress(dms, d_has)))
        series_in: List[tuple[str, np.ndarray, np.ndarray]] = []
        keys = mets[0].keys()
        if all(map(keys.__eq__, map(dict.keys, mets))):  # every record: the same names
            every = np.arange(k)
            for name in keys:
                series_in.append((name, every, trip_array(list(map(itemgetter(name), mets)))))
        else:
            per_metric: Dict[str, tuple[List[int], List[Any]]] = {}
            for row, m in enumerate(mets):
                for name, triple in m.items():
                    got = per_metric.get(name)
                    if got is None:
                        got = per_metric[name] = ([], [])
                    got[0].append(row)
                    got[1].append(triple)
            for name, (rows, vals) in per_metric.items():
                series_in.append((name, np.array(rows, np.int64), trip_array(vals)))
        base, end = self._put_rows(step_a, time_a, n_a, slow_a, samples_a, tokens_a)
        if len(ms_rows):
            self.step_ms.extend(ms_rows + base, ms_trip[:, 0], ms_trip[:, 1], ms_trip[:, 2])
        if len(d_rows):
            self.data_ms.extend(d_rows + base, d_trip[:, 0], d_trip[:, 1], d_trip[:, 2])
        for name, at, trip in series_in:
            series = self.metrics.get(name)
            if series is None:
                series = self._new_series(name)
            series.extend(at + base, trip[:, 0], trip[:, 1], trip[:, 2])
        self.rows = end

    def _put_rows(self, step: Any, time: Any, n: Any, slowest: Any, samples: Any,
                  tokens: Any) -> tuple[int, int]:
        """Write a batch's row columns after the last row; ``(base, end)``: the rows they
        took (``self.rows`` moves once the batch's series are in too)."""
        k = len(step)
        base = self._reserve(k)
        cols = self._cols
        end = base + k
        cols["step"][base:end] = step
        cols["time"][base:end] = time
        cols["n"][base:end] = n
        cols["slowest"][base:end] = slowest
        cols["samples"][base:end] = samples
        cols["tokens"][base:end] = tokens
        return base, end

    def append_columns(self, step: np.ndarray, time: np.ndarray, n: np.ndarray,
                       slowest: np.ndarray, samples: np.ndarray, tokens: np.ndarray,
                       step_ms: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                       metrics: Iterable[tuple[str, np.ndarray, np.ndarray, np.ndarray,
                                               np.ndarray]],
                       data_ms: Optional[tuple[np.ndarray, np.ndarray, np.ndarray,
                                               np.ndarray]] = None) -> None:
        """Append a batch of closed steps given as arrays (the broker's close: one call per
        batch, no Python per step): the row columns (``time`` NaN: none; ``slowest`` -1:
        none), then each series as ``(idx, mean, lo, hi)`` with ``idx`` the position in the
        batch (ascending) of the steps where it has a value."""
        k = len(step)
        if not k:
            return
        base, end = self._put_rows(step, time, n, slowest, samples, tokens)
        idx, mean, lo, hi = step_ms
        self.step_ms.extend(idx + base, mean, lo, hi)
        if data_ms is not None and len(data_ms[0]):
            idx, mean, lo, hi = data_ms
            self.data_ms.extend(idx + base, mean, lo, hi)
        for name, idx, mean, lo, hi in metrics:
            series = self.metrics.get(name)
            if series is None:
                series = self._new_series(name)
            series.extend(idx + base, mean, lo, hi)
        self.rows = end

    # ----------------------------------------------------------------- wire form

    def to_wire(self, start: int = 0, end: Optional[int] = None,
                names: Optional[Iterable[str]] = None) -> Dict[str, Any]:
        """Rows ``start:end`` as ``{"base", "rows", <column>: bytes, "step_ms": [4 x bytes],
        "metrics": {name: [4 x bytes]}}``; row indices stay absolute. ``names``: the only
        metrics that can have a point there (the broker's ``steps`` event knows them from
        the batch), so a block of a few rows does not visit a run's 1,024 series; None:
        every series is looked at."""
        end = self.rows if end is None else min(end, self.rows)
        out: Dict[str, Any] = {"base": start, "rows": end - start}
        for name, _ in _ROW_FIELDS:
            out[name] = self._cols[name][start:end].tobytes()
        out["step_ms"] = series_wire(self.step_ms, start, end)
        # None while the run never sent a data wait (most runs): a run without it costs no
        # arrays here (2.7 % of a 1,024-rank close)
        out["data_ms"] = series_wire(self.data_ms, start, end) if self.data_ms.n else None
        metrics = self.metrics
        if names is None:
            names = list(metrics)
        wire: Dict[str, List[bytes]] = {}
        for name in names:
            s = metrics.get(name)
            if s is not None and s.n and s.row[s.n - 1] >= start:
                parts = series_wire(s, start, end)
                if parts[0]:
                    wire[name] = parts
        out["metrics"] = wire
        return out

    def extend_wire(self, block: Dict[str, Any], *, rebase: bool = False) -> None:
        """Append a :meth:`to_wire` block whose ``base`` is this store's row count. Raises
        ``ValueError`` (nothing changed) for a block that does not fit: rows outside the
        block, columns of the wrong length, steps that do not ascend (within the block, and
        from this store's last step), series rows that do not ascend.

        ``rebase``: the block's rows are moved to follow this store's whatever its
        ``base`` (the web's ``steps`` events: what must hold there is the contract's, that
        the steps ascend past the last one, not the broker's row numbering)."""
        base, k = int(block["base"]), int(block["rows"])
        if k < 0 or (base != self.rows and not rebase):
            raise ValueError(f"step block at row {base} does not follow row {self.rows}")
        cols = {name: np.frombuffer(block[name], dtype=dt) for name, dt in _ROW_FIELDS}
        # keys: None = step_ms, _DATA_KEY = data_ms, else a metric's name
        series: List[tuple[Any, tuple[np.ndarray, ...]]] = [
            (None, series_arrays(block["step_ms"]))]
        if block.get("data_ms") is not None:  # (absent from blocks written before v4)
            series.append((_DATA_KEY, series_arrays(block["data_ms"])))
        series += [(str(name), series_arrays(v)) for name, v in block["metrics"].items()]
        for name, arr in cols.items():
            if len(arr) != k:
                raise ValueError(f"step block column {name} has {len(arr)} rows, not {k}")
        if base != self.rows:  # (rebase) rows as this store numbers them
            delta = self.rows - base
            series = [(key, (rows.astype(np.int64) + delta, mean, lo, hi))
                      for key, (rows, mean, lo, hi) in series]
            base = self.rows
        for _, (rows, mean, lo, hi) in series:
            if not (len(rows) == len(mean) == len(lo) == len(hi)):
                raise ValueError("step block series of unequal lengths")
            if len(rows) and (rows[0] < base or rows[-1] >= base + k):
                raise ValueError("step block series row outside the block")
            if len(rows) > 1 and not bool((rows[1:] > rows[:-1]).all()):
                raise ValueError("step block series rows do not ascend")
        step = cols["step"]
        if k > 1 and not bool(np.greater(step[1:], step[:-1]).all()):
            raise ValueError("step block steps do not ascend")
        if k and self.rows and step[0] <= self._cols["step"][self.rows - 1]:
            raise ValueError("step block does not ascend from the last step")
        start = self._reserve(k)
        for col, arr in cols.items():
            self._cols[col][start:start + k] = arr
        for key, (rows, mean, lo, hi) in series:
            target = self.step_ms if key is None else self.data_ms if key is _DATA_KEY \
                else self.metrics.get(key)
            if target is None:
                assert key is not None
                if not len(rows):  # no row of this block has it: not seen yet
                    continue
                target = self._new_series(key)
            target.extend(rows, mean, lo, hi)
        self.rows += k

    def truncate(self, rows: int) -> None:
        """Keep rows ``[0, rows)`` only (PROTOCOL 8.1: a rewind takes the later rows off the
        run's line; they were copied out first). O(series): each series' cut is a binary
        search; metric names stay (``step_metrics`` names superseded records' metrics)."""
        if rows >= self.rows:
            return
        rows = max(0, rows)
        for s in (self.step_ms, self.data_ms, *self.metrics.values()):
            if not s.n or s.row[s.n - 1] < rows:
                continue
            p = int(s.row[: s.n].searchsorted(rows))
            if s.nonfinite:
                s.nonfinite -= int(np.count_nonzero(~np.isfinite(s.mean[p: s.n])))
            s.n = p
        self.rows = rows

    # ----------------------------------------------------------------- queries

    def row_range(self, start: Optional[int], end: Optional[int]) -> tuple[int, int]:
        """Rows ``[r0, r1)`` whose step is within ``start..end`` (inclusive, None: open)."""
        steps = self._cols["step"][: self.rows]
        r0 = 0 if start is None else int(np.searchsorted(steps, start, "left"))
        r1 = self.rows if end is None else int(np.searchsorted(steps, end, "right"))
        return r0, max(r0, r1)

    def series(self, metric: str, start: Optional[int], end: Optional[int],
               points: int) -> List[List[Any]]:
        """PROTOCOL 4's buckets ``[first_step, last_step, mean, lo, hi, rank_min, rank_max,
        count]`` over the closed steps in ``start..end`` where ``metric`` has a mean; NaN
        and infinities come back as NaN/inf (the JSON encoder writes them as null)."""
        r0, r1 = self.row_range(start, end)
        if r1 <= r0:
            return []
        steps = self._cols["step"]
        if metric == SAMPLES_PER_S or metric == TOKENS_PER_S:
            rows, mean = self._rates(metric, r0, r1)
            return buckets(steps[rows], mean, mean, mean, None, points)
        series = self.step_ms if metric == STEP_MS else self.data_ms if metric == DATA_MS \
            else self.metrics.get(metric)
        if series is None or not series.n:
            return []
        p0, p1 = series.span(r0, r1)
        if p1 <= p0:
            return []
        mean = series.mean[p0:p1]
        return buckets(steps[series.row[p0:p1]], mean, series.lo[p0:p1], series.hi[p0:p1],
                        series.nonfinite, points)

    def _rates(self, metric: str, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows in ``[r0, r1)`` with a ``samples_per_s``/``tokens_per_s`` and the rates."""
        count = self._cols["samples" if metric == SAMPLES_PER_S else "tokens"][r0:r1]
        # max step_ms per row, as step_record divides it (a subnormal -> 0)
        seconds = self.step_ms.dense(self.step_ms.hi, r0, r1) / 1000.0
        ok = (count > 0) & np.isfinite(seconds) & (seconds != 0)
        idx = np.flatnonzero(ok)
        with np.errstate(over="ignore"):  # a tiny step time: an infinite rate (null)
            rates = count[idx] / seconds[idx]
        return idx + r0, rates

    def records(self, r0: int, r1: Optional[int] = None) -> List[Dict[str, Any]]:
        """Rows ``[r0, r1)`` as closed step records (PROTOCOL 2.4 dicts in its key order;
        NaN for the non-finite values the record had, None for what it did not have).

        The web's SSE ``steps`` event for its subscribers (the broker's event carries the
        rows, not records): built column by column with C-level ``map``/``zip`` over
        ``tolist()`` columns, so no bytecode runs per step unless a metric is sparse (then
        one dict per step)."""
        r1 = self.rows if r1 is None else min(r1, self.rows)
        k = r1 - r0
        if k <= 0:
            return []
        cols = self._cols
        ms = self._spread_triples(self.step_ms, r0, r1)
        names = self.metric_names()
        per: List[tuple[str, List[Any]]] = []
        for name in names:
            col = self._spread_triples(self.metrics[name], r0, r1)
            if col is not None:
                per.append((name, col))
        metrics: List[Dict[str, Any]]
        if not per:
            metrics = [{} for _ in range(k)]
        elif all(None not in col for _, col in per):  # every name at every row
            metrics = list(map(dict, map(zip, repeat([n for n, _ in per]),
                                         zip(*[col for _, col in per]))))
        else:
            metrics = [{name: col[i] for name, col in per if col[i] is not None}
                       for i in range(k)]
        rates = []
        for metric in (SAMPLES_PER_S, TOKENS_PER_S):
            rows, vals = self._rates(metric, r0, r1)
            rates.append(spread(k, rows - r0, vals.tolist()))
        times = cols["time"][r0:r1]
        slowest = cols["slowest"][r0:r1]
        return list(map(dict, map(zip, repeat(RECORD_KEYS), zip(
            cols["step"][r0:r1].tolist(), none_where(times, np.isnan(times)),
            cols["n"][r0:r1].tolist(), metrics, ms if ms is not None else repeat(None, k),
            none_where(slowest, slowest < 0), cols["samples"][r0:r1].tolist(),
            cols["tokens"][r0:r1].tolist(), rates[0], rates[1],
            self._spread_triples(self.data_ms, r0, r1) or repeat(None, k)))))

    @staticmethod
    def _spread_triples(s: Series, r0: int, r1: int) -> Optional[List[Any]]:
        """The series on rows ``[r0, r1)``: a list with ``[mean, min, max]`` (None for a NaN
        min/max) at each row that has a point, None elsewhere; None when no row has one."""
        p0, p1 = s.span(r0, r1)
        if p1 <= p0:
            return None
        lo, hi = s.lo[p0:p1], s.hi[p0:p1]
        triples = list(map(list, zip(s.mean[p0:p1].tolist(), none_where(lo, np.isnan(lo)),
                                     none_where(hi, np.isnan(hi)))))
        return spread(r1 - r0, s.row[p0:p1].astype(np.int64) - r0, triples)

    def csv_rows(self, chunk: int = 4096, names: Optional[List[str]] = None,
                 attempts: Optional[Callable[[int, int], np.ndarray]] = None) -> Iterator[str]:
        """``/steps.csv`` body lines after the header, ``chunk`` rows per string (CRLF).
        ``names``: the metric columns (8.1: superseded records' metrics too; a name with no
        series here has empty cells); ``attempts(r0, r1)``: each row's attempt, written as
        the last column (8.1)."""
        names = list(self.metric_names()) if names is None else names
        empty = Series()
        for r0 in range(0, self.rows, chunk):
            r1 = min(self.rows, r0 + chunk)
            columns: List[List[str]] = [
                int_cells(self._cols["step"][r0:r1]), float_cells(self._cols["time"][r0:r1]),
                int_cells(self._cols["n"][r0:r1]),
            ]
            for name in names:
                columns.extend(self._dense_cells(self.metrics.get(name, empty), r0, r1))
            columns.extend(self._dense_cells(self.step_ms, r0, r1))
            columns.extend(self._dense_cells(self.data_ms, r0, r1))
            slowest = self._cols["slowest"][r0:r1]
            columns.append(["" if v < 0 else str(v) for v in slowest.tolist()])
            columns.append(int_cells(self._cols["samples"][r0:r1]))
            columns.append(int_cells(self._cols["tokens"][r0:r1]))
            for metric in (SAMPLES_PER_S, TOKENS_PER_S):
                rows, rates = self._rates(metric, r0, r1)
                dense = np.full(r1 - r0, _NAN)
                dense[rows - r0] = rates
                columns.append(float_cells(dense))
            if attempts is not None:
                att = attempts(r0, r1)
                columns.append([str(v) for v in (att.tolist() if isinstance(att, np.ndarray)
                                                 else att)])
            yield "".join(",".join(cells) + "\r\n" for cells in zip(*columns))

    @staticmethod
    def _dense_cells(s: Series, r0: int, r1: int) -> List[List[str]]:
        return [float_cells(s.dense(arr, r0, r1)) for arr in (s.mean, s.lo, s.hi)]


def wire_records(block: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The closed step records (PROTOCOL 2.4 dicts, as :meth:`StepStore.records` gives them)
    of one :meth:`StepStore.to_wire` block, whatever its ``base``: for what needs records
    from a ``steps`` event of the feed (tests, tools), which carries the block, not them."""
    store = StepStore()
    store.extend_wire(block, rebase=True)
    return store.records(0)
