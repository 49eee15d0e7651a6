"""The columnar arithmetic of closing steps (PROTOCOL.md 2.4): pending points as arrays,
reduced per step into a :class:`ClosedSteps` batch.

Split from :mod:`broker.run.steps.closer`, which keeps the *when* (the watermark, grace and force-close
rules of :class:`~broker.run.steps.closer.StepCloser`) while this module holds the *how*: it reads no
clock, keeps no per-rank state and knows nothing of activity. Why columnar (issue 17): the
broker pays per frame and per closed step, and a frame of 1,000 points that closes 1,000
steps, or a step of 1,024 ranks, must not be Python per value.

* **A frame**'s lists are appended as slices (``list.extend``, C) to a
  :class:`FrameBuffer`'s lists, one per field, the metric values as the frame's lists (a
  frame whose first points are late is replaced by its :func:`slice_frame` tail). A fixed
  number of calls a frame, none per point.
* **A close** (:func:`close_columns`) takes the batch as flat arrays (one C conversion
  per list, :func:`_list_floats`), one entry per (rank, step) point: sorted by (step,
  rank) (stable, so the last write of a rank's point wins), then every field is reduced per
  step with ``np.add/fmin/fmax.reduceat`` over the step segments (a ranks x k matrix reduced
  along the rank axis, stored flat so sparse reports cost what they hold). The metrics go
  through the same arrays in *long* form (one entry per (name, rank, step) value, sorted by
  (name, step, rank)), so the number of numpy calls per close does not depend on how many
  names a run has. The slowest rank is the first (lowest-rank) entry of a step whose finite
  ``step_ms`` equals the step's max.
* **Means are exactly rounded** (``math.fsum``, as the contract's tests pin): a step with
  one or two values per name is exact in float arithmetic already (vectorised); a step of
  three or more all-finite values takes one C ``fsum`` call over its slice (per step and
  name, not per value); non-finite means follow 2.4 through per-step counts of NaN/+inf/-inf.
"""
from __future__ import annotations

import math
from itertools import chain, repeat
from typing import Any, Dict, Iterator, List, Optional, Tuple

import msgspec
import numpy as np

from broker.run.steps.encodings import RECORD_KEYS as _RECORD_KEYS
from broker.run.steps.encodings import none_where as _none_where
from broker.run.steps.encodings import spread as _spread
from broker.run.steps.floats import list_floats as _list_floats
from broker.run.steps.floats import opt_floats as _opt_floats
from broker.run.steps.merge import merge_points
from broker.run.steps.reduce import reduce_checked, reduce_groups, reduce_rows, starts_of
from rank_agent.protocol import Steps

__all__ = ["ClosedSteps", "Columns", "FrameBuffer", "close_columns", "slice_frame", "merge_points"]

_NAN = math.nan
_chain = chain.from_iterable
_EMPTY_I = np.empty(0, np.int64)
_EMPTY_F = np.empty(0, np.float64)


def slice_frame(frame: Steps, i: int, j: int) -> Steps:
    """The frame's points ``[i, j)`` (a late head cut off, a closed head left behind)."""
    return msgspec.structs.replace(
        frame, steps=frame.steps[i:j], times=frame.times[i:j], step_ms=frame.step_ms[i:j],
        samples=frame.samples[i:j], tokens=frame.tokens[i:j],
        metrics={name: v[i:j] for name, v in frame.metrics.items()},
        data_ms=frame.data_ms[i:j])


# ------------------------------------------------------------------ a closed batch


class ClosedSteps:
    """Steps closed together, as arrays (one entry per step, ascending): the row columns of
    :class:`~broker.run.steps.store.StepStore`, the step-time series and every metric in long
    form (``metric_*``: one entry per (name, step) with a value, sorted by name then step;
    ``names``: the names, sorted, ``metric_name`` indexing them; ``*_idx``: the step's
    position in this batch)."""

    __slots__ = ("step", "time", "n", "slowest", "samples", "tokens", "ms_idx", "ms_mean",
                 "ms_lo", "ms_hi", "names", "metric_name", "metric_idx", "metric_mean",
                 "metric_lo", "metric_hi", "d_idx", "d_mean", "d_lo", "d_hi", "raw")

    def __init__(self) -> None:
        self.step = self.n = self.slowest = self.samples = self.tokens = _EMPTY_I
        self.time = _EMPTY_F
        self.ms_idx = self.metric_name = self.metric_idx = _EMPTY_I
        self.ms_mean = self.ms_lo = self.ms_hi = _EMPTY_F
        self.metric_mean = self.metric_lo = self.metric_hi = _EMPTY_F
        self.names: List[str] = []
        #: ``data_ms`` (7.1) as ``step_ms``: the steps that have one, and their reduction
        self.d_idx = _EMPTY_I
        self.d_mean = self.d_lo = self.d_hi = _EMPTY_F
        #: (8.3) references to the close's per-rank values, for :meth:`values_at` (no copy
        #: is made for it); dropped by :meth:`drop_raw` once the number rules have looked
        self.raw: Optional[Tuple[Any, ...]] = None

    def __len__(self) -> int:
        return len(self.step)

    def values_at(self, j: int) -> Tuple[np.ndarray, np.ndarray]:
        """``(ranks, values)``: every rank's value at metric entry ``j`` (a position in
        ``metric_*``), as the close reduced them (8.3 looks at the ranks of the few steps
        whose ``[mean, min, max]`` call for it). Empty arrays once the raw values are
        dropped."""
        raw = self.raw
        if raw is None:
            return _EMPTY_I, _EMPTY_F
        if raw[0] == "grid":
            _, rows, has2, frank, present, order = raw
            row = int(present[order[j]])
            ranks = np.array(frank, np.int64)
            vals = rows[row]
            if has2 is not None:
                keep = has2[row]
                return ranks[keep], vals[keep]
            return ranks, vals.copy()
        _, g, vals, rank_s, entry = raw
        a = int(g[j])
        b = int(g[j + 1]) if j + 1 < len(g) else len(vals)
        return rank_s[entry[a:b]], vals[a:b]

    def drop_raw(self) -> None:
        """Free the close's per-rank values (the batch may wait for its event a while)."""
        self.raw = None

    def per_metric(self) -> Iterator[Tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """``(name, idx, mean, lo, hi)`` of each metric with a value in the batch."""
        vid = self.metric_name
        if not len(vid):
            return
        starts = starts_of(vid).tolist()
        ends = starts[1:] + [len(vid)]
        names = self.names
        ids = vid[starts].tolist()
        for a, b, i in zip(starts, ends, ids):
            yield (names[i], self.metric_idx[a:b], self.metric_mean[a:b], self.metric_lo[a:b],
                   self.metric_hi[a:b])

    def last_nonfinite(self, metric: str) -> Optional[Tuple[int, float]]:
        """``(step, mean)`` of the last step whose ``metric`` mean is not finite."""
        for name, idx, mean, _, _ in self.per_metric():
            if name == metric:
                bad = np.flatnonzero(~np.isfinite(mean))
                if len(bad):
                    i = int(bad[-1])
                    return int(self.step[idx[i]]), float(mean[i])
        return None

    def records(self) -> List[Dict[str, Any]]:
        """The closed step records of PROTOCOL 2.4 (the ``steps`` event), from the arrays.

        The dicts and lists are made by C-level ``map``/``zip`` over ``tolist()`` columns
        (NaN -> None done on object arrays), so no bytecode runs per step or per value
        unless the batch's metrics are sparse (then one dict store per (step, name))."""
        k = len(self.step)
        ms = _spread(k, self.ms_idx, _triples(self.ms_mean, self.ms_lo, self.ms_hi))
        data = _spread(k, self.d_idx, _triples(self.d_mean, self.d_lo, self.d_hi)) \
            if len(self.d_idx) else repeat(None, k)
        names = self.names
        metrics: List[Dict[str, Any]]
        vid = self.metric_name
        if not len(vid):
            metrics = [{} for _ in range(k)]
        else:
            trip = _triples(self.metric_mean, self.metric_lo, self.metric_hi)
            per = len(names)
            if len(vid) == per * k:  # every name at every step: name-major blocks of k
                cols = [trip[i * k:(i + 1) * k] for i in range(per)]
                metrics = list(map(dict, map(zip, repeat(names), zip(*cols))))
            else:
                metrics = [{} for _ in range(k)]
                for v, i, t in zip(vid.tolist(), self.metric_idx.tolist(), trip):
                    metrics[i][names[v]] = t  # sorted by name: each dict in name order
        hi = np.full(k, _NAN)
        hi[self.ms_idx] = self.ms_hi
        with np.errstate(all="ignore"):
            seconds = hi / 1000.0  # NaN: no finite step time
            ok_t = np.isfinite(seconds) & (seconds != 0)
            sps = _none_where(self.samples / seconds, ~(ok_t & (self.samples != 0)))
            tps = _none_where(self.tokens / seconds, ~(ok_t & (self.tokens != 0)))
        times = _none_where(self.time, np.isnan(self.time))
        slowest = _none_where(self.slowest, self.slowest < 0)
        return list(map(dict, map(zip, repeat(_RECORD_KEYS), zip(
            self.step.tolist(), times, self.n.tolist(), metrics, ms, slowest,
            self.samples.tolist(), self.tokens.tolist(), sps, tps, data))))


def _triples(mean: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> List[List[Any]]:
    """``[mean, min, max]`` lists (None for a NaN min/max: no finite value)."""
    return list(map(list, zip(mean.tolist(), _none_where(lo, np.isnan(lo)),
                              _none_where(hi, np.isnan(hi)))))


class Columns:
    """Pending points as flat arrays, one entry per received (rank, step) point, arrival
    order; metric values in long form (``m_pos``: the entry, ``m_name``: index into
    ``names``; ``None`` values are not entries)."""

    __slots__ = ("step", "rank", "time", "ms", "ms_has", "samples", "tokens", "m_pos",
                 "m_name", "m_val", "names", "dms", "dms_has")

    def __init__(self, step: np.ndarray, rank: np.ndarray, time: np.ndarray, ms: np.ndarray,
                 ms_has: np.ndarray, samples: np.ndarray, tokens: np.ndarray,
                 m_pos: np.ndarray, m_name: np.ndarray, m_val: np.ndarray,
                 names: List[str], dms: np.ndarray, dms_has: np.ndarray) -> None:
        self.step, self.rank, self.time, self.ms, self.ms_has = step, rank, time, ms, ms_has
        self.samples, self.tokens = samples, tokens
        self.m_pos, self.m_name, self.m_val, self.names = m_pos, m_name, m_val, names
        self.dms, self.dms_has = dms, dms_has  # data_ms (7.1), as ms and ms_has

    def __len__(self) -> int:
        return len(self.step)

    def select(self, keep: np.ndarray) -> Columns:
        """The entries where ``keep`` (arrival order kept)."""
        new = np.cumsum(keep) - 1
        mk = keep[self.m_pos]
        return Columns(self.step[keep], self.rank[keep], self.time[keep], self.ms[keep],
                     self.ms_has[keep], self.samples[keep], self.tokens[keep],
                     new[self.m_pos[mk]], self.m_name[mk], self.m_val[mk], self.names,
                     self.dms[keep], self.dms_has[keep])

    def then(self, later: Columns) -> Columns:
        """These entries followed by ``later``'s (which arrived after them)."""
        if not len(self):
            return later
        if not len(later):
            return self
        names = self.names
        m_name = later.m_name
        if later.names != names:
            ids = {name: i for i, name in enumerate(names)}
            names = names + [n for n in later.names if n not in ids]
            ids = {name: i for i, name in enumerate(names)}
            remap = np.array([ids[n] for n in later.names], np.int64)
            m_name = remap[m_name] if len(m_name) else m_name
        n = len(self)
        cat = np.concatenate
        return Columns(cat((self.step, later.step)), cat((self.rank, later.rank)),
                     cat((self.time, later.time)), cat((self.ms, later.ms)),
                     cat((self.ms_has, later.ms_has)), cat((self.samples, later.samples)),
                     cat((self.tokens, later.tokens)), cat((self.m_pos, later.m_pos + n)),
                     cat((self.m_name, m_name)), cat((self.m_val, later.m_val)), names,
                     cat((self.dms, later.dms)), cat((self.dms_has, later.dms_has)))


class FrameBuffer:
    """Points received since the last close, as flat Python lists: a frame's lists are
    appended as slices (``list.extend``, C), so a frame costs a fixed number of calls; its
    metric values go in as the frame's lists, with the frame's names noted once per run of
    frames that name the same metrics (nearly always one run: every rank logs the same).
    (Flattened as they arrive instead, a frame cost ~1.1 k instructions more, as much as
    its share of the close's conversion saved: issue 17.)"""

    __slots__ = ("step", "time", "ms", "samples", "tokens", "frank", "fk", "mvals", "groups",
                 "gnames", "overlap", "dms", "any_dms")

    def __init__(self) -> None:
        self.step: List[int] = []
        self.time: List[float] = []
        self.ms: List[Optional[float]] = []
        self.samples: List[int] = []
        self.tokens: List[int] = []
        self.frank: List[int] = []  # per frame: its rank
        self.fk: List[int] = []  # per frame: its number of points
        self.mvals: List[List[Optional[float]]] = []  # per frame and name, the frame's list
        self.groups: List[List[Any]] = []  # [names, frames]: consecutive frames naming them
        self.gnames: Optional[List[str]] = None
        #: a frame may share a rank with an earlier one (see :meth:`add`)
        self.overlap = False
        #: ``data_ms`` per point (None: not sent), and whether any frame sent it
        self.dms: List[Optional[float]] = []
        self.any_dms = False

    def __bool__(self) -> bool:
        return bool(self.fk)

    def add(self, frame: Steps, fresh: bool = False) -> None:
        """Buffer the frame's points. ``fresh``: the caller knows its steps are above every
        point its rank has in the buffer (:class:`broker.run.steps.closer.StepCloser` does: a rank's
        highest step only rises), so :meth:`close_grid` need not look for a rank twice."""
        if not fresh:
            self.overlap = True
        steps = frame.steps
        k = len(steps)
        self.step += steps
        self.time += frame.times
        self.ms += frame.step_ms
        samples = frame.samples
        self.samples += samples if samples else _zeros(k)
        tokens = frame.tokens
        self.tokens += tokens if tokens else _zeros(k)
        dms = frame.data_ms
        if dms:  # (held from the first frame that sends it: a run without costs a test)
            if not self.any_dms:
                self.any_dms = True
                self.dms = [None] * (len(self.step) - k)
            self.dms += dms
        elif self.any_dms:
            self.dms += _nones(k)
        self.frank.append(frame.rank)
        self.fk.append(k)
        metrics = frame.metrics
        names = list(metrics)
        if names == self.gnames:
            self.groups[-1][1] += 1
        else:
            self.gnames = names
            self.groups.append([names, 1])
        self.mvals += metrics.values()

    def take(self) -> Columns:
        """The buffered points as :class:`Columns` (the buffer is emptied)."""
        fk = np.array(self.fk, np.int64)
        step = np.array(self.step, np.int64)
        ms, has = _opt_floats(self.ms, len(self.ms))
        names: List[str] = []
        ids: Dict[str, int] = {}
        cid, clen, cbase = [], [], []
        fbase = np.cumsum(fk) - fk
        f0 = 0
        for gnames, n in self.groups:
            if gnames:
                for name in gnames:
                    if name not in ids:
                        ids[name] = len(names)
                        names.append(name)
                g = len(gnames)
                cid.append(np.tile(np.array([ids[x] for x in gnames], np.int64), n))
                clen.append(np.repeat(fk[f0:f0 + n], g))
                cbase.append(np.repeat(fbase[f0:f0 + n], g))
            f0 += n
        if cid:
            lens = np.concatenate(clen)
            mvals = self.mvals
            vhas = None
            k0 = self.fk[0]
            flat = _list_floats(mvals, k0) if self.fk.count(k0) == len(self.fk) else None
            if flat is not None:
                vals = flat
            else:
                vals, vhas = _opt_floats(_chain(mvals), int(lens.sum()),
                                         lambda: list(_chain(mvals)))
            m_name = np.repeat(np.concatenate(cid), lens)
            m_pos = np.repeat(np.concatenate(cbase) - (np.cumsum(lens) - lens), lens) + \
                np.arange(len(vals))
            if vhas is not None:
                vals, m_name, m_pos = vals[vhas], m_name[vhas], m_pos[vhas]
        else:
            vals, m_name, m_pos = _EMPTY_F, _EMPTY_I, _EMPTY_I
        total = len(step)
        if self.any_dms:
            dms, dhas = _opt_floats(self.dms, total)
            dms_has = np.ones(total, bool) if dhas is None else dhas
        else:
            dms, dms_has = np.zeros(total), np.zeros(total, bool)
        cols = Columns(step, np.repeat(np.fromiter(self.frank, np.int64, len(fk)), fk),
                     np.fromiter(self.time, np.float64, total), ms,
                     np.ones(total, bool) if has is None else has,
                     np.fromiter(self.samples, np.int64, total),
                     np.fromiter(self.tokens, np.int64, total), m_pos, m_name, vals, names,
                     dms, dms_has)
        self.__init__()  # type: ignore[misc]
        return cols


    def close_grid(self) -> Optional[ClosedSteps]:
        """Every buffered point closed into one :class:`ClosedSteps` when they form a grid:
        every frame holds the same ``k`` <= 15 steps (k = 1: the live case of 1,024
        one-point frames), each rank sent them once, and the frames name the same metrics;
        None otherwise, the buffer left as it was (the caller then goes the general way,
        :meth:`take` and :func:`close_columns`). The caller knows every point closes.

        The rules and results of :func:`close_columns` without its machinery (issue 17: a
        sort by (step, rank), segment bookkeeping and a long-form scatter, ~110 numpy
        calls): ``step_ms`` and every metric at every step are the rows of one
        ((1 + names) x k) x ranks matrix, reduced by :func:`reduce_rows` (the same exact
        means); the slowest rank is the lowest rank at a step's finite ``step_ms`` max; only
        the names are sorted. A tie of -0.0 and 0.0 at a min or max is left to the general
        close (which zero wins depends on the order the values are scanned in)."""
        fk = self.fk
        nf = len(fk)
        if not nf or len(self.groups) > 1:
            return None
        k = fk[0]
        if k > 15 or fk.count(k) != nf:
            return None
        frank = self.frank
        step = self.step
        first = step[:k]
        if (step.count(first[0]) != nf if k == 1 else step != first * nf) \
                or (self.overlap and len(set(frank)) != nf):
            return None
        gnames: List[str] = self.groups[0][0] if self.groups else []
        g = len(gnames)
        total = nf * k
        # rows: step_ms at each step, data_ms at each step (when sent), then each name at
        # each step; columns: the frames
        dd = 1 if self.any_dms else 0
        b = 1 + dd  # the metrics' first block
        mat = np.empty((b + g, k, nf))
        has: Optional[np.ndarray] = None
        ms = _list_floats(self.ms, 0)
        if ms is None:  # a None (or an int) among them
            ms, ms_has = _opt_floats(self.ms, total)
            if ms_has is not None:
                has = np.ones((b + g, k, nf), dtype=bool)
                has[0] = ms_has.reshape(nf, k).T
        mat[0] = ms.reshape(nf, k).T
        if dd:
            dms = _list_floats(self.dms, 0)
            if dms is None:
                dms, d_has = _opt_floats(self.dms, total)
                if d_has is not None:
                    if has is None:
                        has = np.ones((b + g, k, nf), dtype=bool)
                    has[1] = d_has.reshape(nf, k).T
            mat[1] = dms.reshape(nf, k).T
        if g:
            mvals = self.mvals
            vals = _list_floats(mvals, k)
            vhas = None
            if vals is None:
                vals, vhas = _opt_floats(_chain(mvals), total * g, lambda: list(_chain(mvals)))
            mat[b:] = vals.reshape(nf, g, k).transpose(1, 2, 0)
            if vhas is not None:
                if has is None:
                    has = np.ones((b + g, k, nf), dtype=bool)
                has[b:] = vhas.reshape(nf, g, k).transpose(1, 2, 0)
        rows = mat.reshape((b + g) * k, nf)
        reduced: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = None
        if has is None:  # every value there: each row reduced whole
            present = np.arange(len(rows))
            reduced = reduce_rows(rows)
            if reduced is None:
                return None
        else:
            has2 = has.reshape(len(rows), nf)
            counts = has2.sum(axis=1)
            present = counts.nonzero()[0]
            if len(present):
                reduced = reduce_checked(rows[has2], (np.cumsum(counts) - counts)[present])
                if reduced is None:
                    return None
        if reduced is not None:
            mean, lo, hi = reduced
            zero = ((lo == 0) | (hi == 0)).nonzero()[0]
            if len(zero):
                sub = rows[present[zero]]
                if bool(((sub == 0) & np.signbit(sub)).any()):
                    return None
        out = ClosedSteps()
        out.step = np.array(first, np.int64)
        out.n = np.full(k, nf, np.int64)
        times = _list_floats(self.time, 0)
        if times is None:
            times = np.fromiter(self.time, np.float64, total)
        out.time = np.fmax.reduce(times.reshape(nf, k), axis=0)
        if k == 1:  # (counts are <= 2**40: a Python sum of them is the int64 sum)
            out.samples = np.array([sum(self.samples)], np.int64)
            out.tokens = np.array([sum(self.tokens)], np.int64)
        else:
            out.samples = np.fromiter(self.samples, np.int64, total).reshape(nf, k).sum(axis=0)
            out.tokens = np.fromiter(self.tokens, np.int64, total).reshape(nf, k).sum(axis=0)
        slowest = np.full(k, -1, np.int64)
        nms = int(np.searchsorted(present, k))  # rows of step_ms come first
        if nms:
            pos = present[:nms]
            out.ms_idx = pos
            out.ms_mean, out.ms_lo, out.ms_hi = mean[:nms], lo[:nms], hi[:nms]
            top = hi[:nms]
            fin = (top == top).nonzero()[0]  # a finite max (NaN: none)
            if len(fin):
                if k == 1:
                    slowest[0] = min(map(frank.__getitem__, (ms == top[0]).nonzero()[0].tolist()))
                else:  # per step, the lowest rank at its max
                    at = mat[0][pos[fin]] == top[fin][:, None]
                    ranks = np.array(frank, np.int64)
                    slowest[pos[fin]] = np.where(at, ranks, np.iinfo(np.int64).max).min(axis=1)
        out.slowest = slowest
        nd = nms
        if dd:  # data_ms rows come next
            nd = int(np.searchsorted(present, 2 * k))
            if nd > nms:
                out.d_idx = present[nms:nd] - k
                out.d_mean, out.d_lo, out.d_hi = mean[nms:nd], lo[nms:nd], hi[nms:nd]
        if nd < len(present):  # metrics, sorted by (name, step)
            by_name = sorted(range(g), key=gnames.__getitem__)
            rank_of = np.empty(g, np.int64)
            rank_of[by_name] = np.arange(g)
            mrow = present[nd:] - b * k
            name = rank_of[mrow // k]
            at_step = mrow % k
            order = np.argsort(name * k + at_step, kind="stable")
            out.names = [gnames[i] for i in by_name]
            out.metric_name = name[order]
            out.metric_idx = at_step[order]
            order += nd
            out.metric_mean, out.metric_lo, out.metric_hi = mean[order], lo[order], hi[order]
            out.raw = ("grid", rows, None if has is None else has2, frank, present, order)
        self.__init__()  # type: ignore[misc]
        return out


_ZEROS: List[int] = [0] * 1024
_NONES: List[Optional[float]] = [None] * 1024


def _zeros(k: int) -> List[int]:
    return _ZEROS if k == 1024 else _ZEROS[:k]


def _nones(k: int) -> List[Optional[float]]:
    return _NONES if k == 1024 else _NONES[:k]


def close_columns(cols: Columns) -> Optional[ClosedSteps]:
    """Every point of ``cols`` (per (rank, step) the last one wins) closed into one
    :class:`ClosedSteps` (None: no point). See the module docstring for how."""
    total = len(cols)
    if not total:
        return None
    step, rank = cols.step, cols.rank
    # (step, rank) order; stable, so of a rank's repeated points the last sent is last
    if total == 1 or (not (rank != rank[0]).any() and bool((step[1:] > step[:-1]).all())):
        sel: Optional[np.ndarray] = None  # one rank, ascending: already in order, no repeat
        step_s, rank_s = step, rank
    else:
        order = np.lexsort((rank, step))
        step_s, rank_s = step[order], rank[order]
        dup = (step_s[1:] == step_s[:-1]) & (rank_s[1:] == rank_s[:-1])
        if dup.any():  # a rank sent a step twice: one point, merged field by field
            return close_columns(merge_points(cols, order, dup))
        sel = order
    entries = len(step_s)
    starts = starts_of(step_s)
    nsteps = len(starts)
    counts = np.diff(np.append(starts, entries))
    seg = np.repeat(np.arange(nsteps), counts)

    def pick(arr: np.ndarray) -> np.ndarray:
        return arr if sel is None else arr[sel]

    out = ClosedSteps()
    out.step = step_s[starts]
    out.n = counts
    out.time = np.fmax.reduceat(pick(cols.time), starts)
    out.samples = np.add.reduceat(pick(cols.samples), starts)
    out.tokens = np.add.reduceat(pick(cols.tokens), starts)
    # step_ms: its reduction, and the slowest rank
    ms, has = pick(cols.ms), pick(cols.ms_has)
    ms_seg, ms_rank = seg, rank_s
    if not has.all():
        ms, ms_seg, ms_rank = ms[has], seg[has], rank_s[has]
    slowest = np.full(nsteps, -1, np.int64)
    if len(ms):
        g0 = starts_of(ms_seg)
        out.ms_idx = ms_seg[g0]
        out.ms_mean, out.ms_lo, out.ms_hi = reduce_groups(ms, g0)
        top = np.repeat(out.ms_hi, np.diff(np.append(g0, len(ms))))
        at_top = np.flatnonzero(ms == top)  # NaN top (no finite value) matches nothing
        if len(at_top):
            tseg = ms_seg[at_top]
            first = at_top[starts_of(tseg)]  # the lowest rank of a step at its top
            slowest[ms_seg[first]] = ms_rank[first]
    out.slowest = slowest
    # data_ms (7.1): reduced as step_ms is
    dhas = cols.dms_has
    if dhas.any():
        dhas = pick(dhas)
        dms, d_seg = pick(cols.dms)[dhas], seg[dhas]
        if len(dms):
            g0 = starts_of(d_seg)
            out.d_idx = d_seg[g0]
            out.d_mean, out.d_lo, out.d_hi = reduce_groups(dms, g0)
    # metrics, long form, sorted by (name, step, rank)
    if len(cols.m_val):
        names = cols.names
        by_name = sorted(range(len(names)), key=names.__getitem__)
        rank_of = np.empty(len(names), np.int64)
        rank_of[by_name] = np.arange(len(names))
        vid = rank_of[cols.m_name]
        vals = cols.m_val
        if sel is None:
            entry = cols.m_pos
        else:
            inv = np.full(total, -1, np.int64)
            inv[sel] = np.arange(entries)
            entry = inv[cols.m_pos]
            ok = entry >= 0
            if not ok.all():
                vid, entry, vals = vid[ok], entry[ok], vals[ok]
        if len(vals):
            key = vid * entries + entry  # unique: one value per (name, point)
            span = len(names) * entries
            if span <= 4 * len(key) + 4096:  # dense enough: order by scattering, O(span)
                at = np.full(span, -1, np.int64)
                at[key] = np.arange(len(key))
                order2 = at[at >= 0]
            else:  # names of their own per rank: sort
                order2 = np.argsort(key)
            vid, entry, vals = vid[order2], entry[order2], vals[order2]
            vstep = seg[entry]
            g = starts_of(vid * nsteps + vstep)
            out.names = [names[i] for i in by_name]
            out.metric_name = vid[g]
            out.metric_idx = vstep[g]
            out.metric_mean, out.metric_lo, out.metric_hi = reduce_groups(vals, g)
            out.raw = ("long", g, vals, rank_s, entry)
    return out


# ------------------------------------------------------------------ per rank
