"""Exact per-group reductions of float64 values: PROTOCOL.md 2.4's mean, min and max of the
values of each closed step (per metric, and of ``step_ms``), for :mod:`broker.run.steps.columns`.

Split from it because it is numerics, not step rules: a group's min and max are over its
finite values (NaN: none); its mean is exactly rounded (``math.fsum``'s answer, which the
contract's tests pin) and non-finite by the rule of 2.4 when any value is. Exactly rounded
without a Python call per value: one or two values need no help; for more, a two-level
long-double sum certifies the float64 result where long double is wider (x86), and only the
groups it cannot prove go through one C ``fsum`` call each.

* :func:`reduce_groups`: groups given by their start indices in one flat array;
* :func:`reduce_rows`: each row of a matrix (the close of a grid of ranks x steps), the same
  results whatever the order of a row's values, or None where that cannot be promised;
* :func:`reduce_checked`: :func:`reduce_groups`, or None where the order of the adds could
  matter (a group's magnitudes summing past the float64 range).
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import numpy as np

__all__ = ["reduce_checked", "reduce_groups", "reduce_rows", "starts_of"]

_NAN = math.nan
_INF = math.inf
_fsum = math.fsum
_EMPTY_I = np.empty(0, np.int64)


def starts_of(keys: np.ndarray) -> np.ndarray:
    """Indices where a run of equal ``keys`` (sorted) starts."""
    if not len(keys):
        return _EMPTY_I
    change = np.empty(len(keys), dtype=bool)
    change[0] = True
    np.not_equal(keys[1:], keys[:-1], out=change[1:])
    return np.flatnonzero(change)


def reduce_groups(vals: np.ndarray, starts: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[mean, min, max]`` of PROTOCOL 2.4 for every group of ``vals`` (groups start at
    ``starts``, none empty): min/max over the finite values (NaN: none), the mean exactly
    rounded (``fsum``; one or two values need no help), non-finite if any value is."""
    n = len(vals)
    cnt = np.diff(np.append(starts, n))
    fin = np.isfinite(vals)
    every = bool(fin.all())
    with np.errstate(all="ignore"):
        mean = np.add.reduceat(vals, starts) / cnt
    if every:
        lo = np.minimum.reduceat(vals, starts)
        hi = np.maximum.reduceat(vals, starts)
        need = cnt >= 3
        need |= ~np.isfinite(mean)  # finite values overflowing the sum
    else:
        fv = np.where(fin, vals, _NAN)
        lo = np.fmin.reduceat(fv, starts)
        hi = np.fmax.reduceat(fv, starts)
        nfin = np.add.reduceat(fin, starts, dtype=np.int64)
        bad = nfin < cnt
        nan = np.add.reduceat(np.isnan(vals), starts, dtype=np.int64) > 0
        pinf = np.add.reduceat(vals == _INF, starts, dtype=np.int64) > 0
        ninf = np.add.reduceat(vals == -_INF, starts, dtype=np.int64) > 0
        rule = np.where(nan | (pinf & ninf), _NAN, np.where(pinf, _INF, -_INF))
        mean = np.where(bad, rule, mean)
        need = (cnt >= 3) | ~np.isfinite(mean)
        need &= ~bad
    groups = np.flatnonzero(need)
    if len(groups) and _LD_CERTIFY:
        groups = _exact_sums(vals, starts, cnt, groups, mean)
    if len(groups):  # fsum, one C call per group (no bytecode per value)
        vl = vals.tolist()
        st = starts[groups].tolist()
        en = (starts[groups] + cnt[groups]).tolist()
        segs = list(map(vl.__getitem__, map(slice, st, en)))
        try:
            sums = np.array(list(map(_fsum, segs)))
        except OverflowError:  # some group overflows: one by one
            sums = np.array([_fsum_or_inf(seg) for seg in segs])
        with np.errstate(all="ignore"):
            means = sums / cnt[groups]
        for i in np.flatnonzero(~np.isfinite(means)).tolist():  # an intermediate overflow of finite values: scale
            seg = segs[i]
            k = len(seg)
            means[i] = _fsum([v / k for v in seg])
        mean[groups] = means
    return mean, lo, hi


#: Sums in long double can be certified exactly rounded where it is wider than float64
#: (x86: 64-bit mantissa); where it is not, every group takes ``fsum``.
_LD_CERTIFY = np.finfo(np.longdouble).nmant > np.finfo(np.float64).nmant + 8
#: unit roundoff of long double, with a margin for the rounding of the bound itself
_LD_U = float(np.finfo(np.longdouble).eps) / 2 * 1.01
#: magnitudes below which no row's sums (of at most 2**23 values) nor their error bound can
#: overflow float64 (above, and for NaN, the checked path with ``errstate``; issue 17: the
#: ``errstate`` context cost as much as the sums)
_BOUND = 2.0 ** 1000
_BOUND_N = 2 ** 23
#: values per block of the two-level long-double sum (the error bound grows with the
#: block size plus the number of blocks, not with n)
_BLOCK = 32


def _exact_sums(vals: np.ndarray, starts: np.ndarray, cnt: np.ndarray, groups: np.ndarray,
                mean: np.ndarray) -> np.ndarray:
    """Set ``mean`` of the ``groups`` (all-finite values) whose float64 sum a long-double
    sum proves exactly rounded; return the groups it could not prove (for ``fsum``).

    Each group is summed in long double in two levels (blocks of ``_BLOCK`` values, then
    the blocks), which is within ``(_BLOCK + blocks) * u * sum|v|`` of the exact sum (u:
    the long-double unit roundoff); when both ends of that interval round to the same
    float64, so does the exact sum, which is then what ``fsum`` returns. A few vectorised
    passes instead of a C ``fsum`` per group over a Python list of the values (a 1,024-rank
    step: 5 x 1,024 values); a sum that cancels to near a rounding boundary is left to
    ``fsum``."""
    nb = (cnt + (_BLOCK - 1)) // _BLOCK  # blocks per group (every group: reduceat needs
    first = np.cumsum(nb) - nb           # the blocks to tile the array)
    total_nb = int(first[-1] + nb[-1])
    bstarts = np.repeat(starts, nb) + (np.arange(total_nb) - np.repeat(first, nb)) * _BLOCK
    ld = vals.astype(np.longdouble)
    with np.errstate(all="ignore"):
        total = np.add.reduceat(np.add.reduceat(ld, bstarts), first)[groups]
        mag = np.add.reduceat(np.abs(vals), starts)[groups]
        # (+ 4: the roundings of total -/+ err themselves, each <= u * sum|v|)
        err = (mag * ((_BLOCK + 4 + nb[groups]) * _LD_U)).astype(np.longdouble)
        lo = (total - err).astype(np.float64)
        hi = (total + err).astype(np.float64)
    ok = (lo == hi) & np.isfinite(lo) & np.isfinite(mag)
    mean[groups[ok]] = lo[ok] / cnt[groups[ok]]
    return groups[~ok]


def reduce_rows(mat: np.ndarray) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """:func:`reduce_groups` of each row of ``mat`` (every value present), the same results
    whatever the order of the values in a row; None where that cannot be promised.

    For all-finite rows of >= 3 values (the live case) the long-double certification of
    :func:`_exact_sums` is done on the matrix itself (rows padded to whole blocks, two
    ``sum`` calls), with no segment bookkeeping; anything else (non-finite values, a sum it
    cannot certify, no wide long double) goes through :func:`reduce_groups`. Its results do not
    depend on the order of a group's values (the mean is exact or by the non-finite rule,
    min/max are order-free but for a tie of signed zeros, which the caller checks), except
    where ``fsum`` meets an intermediate overflow, which depends on the order of the adds:
    possible only when the finite values' magnitudes sum past the float64 range; then
    None, and the caller closes in rank order (:func:`close_columns`)."""
    c, n = mat.shape
    if n < 3 or not _LD_CERTIFY:
        return reduce_checked(mat.ravel(), np.arange(c) * n)
    absv = np.abs(mat)
    if n <= _BOUND_N and absv.max() < _BOUND:  # the live case: no sum here can overflow, no errstate needed
        lo, hi, _ = _ld_rows(mat, absv)
        if not bool((lo == hi).all()):
            return reduce_groups(mat.ravel(), np.arange(c) * n)
        return lo / n, mat.min(axis=1), mat.max(axis=1)
    if not np.isfinite(mat).all():
        return reduce_checked(mat.ravel(), np.arange(c) * n)
    with np.errstate(all="ignore"):
        lo, hi, mag = _ld_rows(mat, absv)
    if not bool(((lo == hi) & np.isfinite(lo) & np.isfinite(mag)).all()):
        if not bool(np.isfinite(mag).all()):
            return None
        return reduce_groups(mat.ravel(), np.arange(c) * n)
    return lo / n, mat.min(axis=1), mat.max(axis=1)


def _ld_rows(mat: np.ndarray, absv: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The two float64 ends of :func:`_exact_sums`' interval around each row's sum, and
    the row's sum of magnitudes (``absv``: ``abs(mat)``). The error bound holds for any
    order of the adds within a block and over the blocks; the padding and the sums' start
    are -0.0, IEEE's additive identity (numpy starts a sum at +0.0: a sum of -0.0 values
    would turn +0.0, where _exact_sums, which starts at the first value, keeps -0.0)."""
    c, n = mat.shape
    nb = -(-n // _BLOCK)
    if n == nb * _BLOCK:  # whole blocks (1,024 ranks): no padding
        ld = mat.astype(np.longdouble)
    else:
        ld = np.full((c, nb * _BLOCK), -0.0, np.longdouble)
        ld[:, :n] = mat
    total = ld.reshape(c, nb, _BLOCK).sum(axis=2, initial=-0.0).sum(axis=1, initial=-0.0)
    mag = absv.sum(axis=1)
    err = (mag * ((_BLOCK + 4 + nb) * _LD_U)).astype(np.longdouble)
    return (total - err).astype(np.float64), (total + err).astype(np.float64), mag


def reduce_checked(vals: np.ndarray, starts: np.ndarray
                    ) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """:func:`reduce_groups`, or None when a group's finite values have magnitudes summing past
    the float64 range (its ``fsum`` could overflow in one order of the values and not in
    another: see :func:`reduce_rows`)."""
    with np.errstate(all="ignore"):
        mag = np.add.reduceat(np.abs(np.where(np.isfinite(vals), vals, 0.0)), starts)
    if not bool(np.isfinite(mag).all()):
        return None
    return reduce_groups(vals, starts)


def _fsum_or_inf(values: List[float]) -> float:
    try:
        return _fsum(values)
    except OverflowError:
        return math.inf
