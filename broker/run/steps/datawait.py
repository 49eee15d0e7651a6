"""Why a rank is slow: the data wait (PROTOCOL.md 7.1), the run header's figures.

In synchronous data-parallel training every rank's step lasts as long as the slowest
rank's, so ``step_ms`` rarely names a straggler's cause; the time a rank's loop waited for
its batch (``data_ms``) does. This module turns what the closer and the store already hold
into the header's two figures, and says which ranks newly entered the straggler list (the
``data_straggler`` alert):

* ``data_share``: over the latest <= 100 closed steps that have both a ``data_ms`` and a
  ``step_ms`` mean, the sum of the ``data_ms`` means over the sum of the ``step_ms`` means;
* ``data_stragglers``: the ranks whose ``data_ms`` is >= 2 x the median of the *other*
  ranks' and >= that median + 20 ms, largest first (ties: lowest rank), at most 10.

Pure: no clock, no I/O, no sink; the sink's step rules call :meth:`DataWait.update` when
they publish (at most once a second) and the header reads :attr:`DataWait.share` and
:attr:`DataWait.stragglers`. The median of the others is found for every rank at once from
one sort (removing one value from a sorted array moves the middle by at most one place), so
1,024 ranks cost one numpy sort and a few vector passes, not 1,024 medians.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["DataWait", "data_share", "data_stragglers", "others_medians", "round_half_up",
           "straggler_message", "SHARE_STEPS", "MAX_STRAGGLERS", "share_percent"]

#: ``data_share`` looks at this many of the latest closed steps that have both means.
SHARE_STEPS = 100
#: ``data_share`` looks back at most this many steps with a ``data_ms`` for the ones that
#: also have a ``step_ms`` (a bound on a call's work whatever the run sends).
SEARCH_ROWS = 10_000
#: :func:`share_percent` counts shares up to this many times the step (larger ones: equal).
PERCENT_CAP = 1e12
#: ``data_stragglers`` lists at most this many ranks.
MAX_STRAGGLERS = 10
#: a straggler waits at least this many times the others' median ...
FACTOR = 2.0
#: ... and at least this many ms more than it.
MARGIN_MS = 20.0

#: ``place(rank) -> (host, local_rank) | None``
Place = Callable[[int], Optional[Tuple[str, int]]]


def round_half_up(x: float) -> int:
    """Whole ms, halves up (the alert's message: 310.5 -> 311), not banker's rounding."""
    return int(math.floor(x + 0.5))


def straggler_message(data_ms: float, median: float) -> str:
    """The ``data_straggler`` alert's message, exactly as 7.1 words it."""
    return f"waits {round_half_up(data_ms)} ms a step for data (median {round_half_up(median)} ms)"


def share_percent(share: Optional[float]) -> Optional[int]:
    """``share`` as whole percent, for telling whether the header moved; None for none.

    Why not ``round(share * 100)``: a finite share near the largest float (one ``steps``
    frame with ``data_ms`` 1e307 and ``step_ms`` 1) overflows to infinity when multiplied,
    and ``round`` of it raised in every publish of the run, and at start in the journal's
    replay, so the broker never started again (issue 38). Past :data:`PERCENT_CAP` every
    share is one bucket: the header moves with it as with any other change of percent."""
    if share is None or not math.isfinite(share):
        return None
    return round(max(-PERCENT_CAP, min(share, PERCENT_CAP)) * 100)


def data_share(data_rows: np.ndarray, data_mean: np.ndarray, ms_rows: np.ndarray,
               ms_mean: np.ndarray, window: int = SHARE_STEPS) -> Optional[float]:
    """``data_share`` from the two series (their ascending row numbers and means): over the
    latest ``window`` rows in both, sum of data means / sum of step means; None when no row
    is in both, or the ratio is not a finite number."""
    if not len(data_rows) or not len(ms_rows):
        return None
    take = window
    while True:  # usually once: nearly every step with a data_ms has a step_ms too
        d_rows, d_mean = data_rows[-take:], data_mean[-take:]
        at = np.searchsorted(ms_rows, d_rows)
        ok = at < len(ms_rows)
        ok[ok] = ms_rows[at[ok]] == d_rows[ok]
        both = np.flatnonzero(ok)[-window:]
        if len(both) >= window or take >= min(len(data_rows), SEARCH_ROWS):
            break
        take *= 4
    if not len(both):
        return None
    with np.errstate(all="ignore"):
        den = float(ms_mean[at[both]].sum())
        num = float(d_mean[both].sum())
    if den == 0 or not math.isfinite(num) or not math.isfinite(den):
        return None
    share = num / den
    return share if math.isfinite(share) else None


def others_medians(values: np.ndarray) -> np.ndarray:
    """For each value, the median of the *other* values (the mean of the two middle ones
    for an even count); NaN where there is no other value."""
    n = len(values)
    if n < 2:
        return np.full(n, math.nan)
    order = np.argsort(values, kind="stable")
    s = values[order]
    m = n - 1  # how many others
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(n)  # each value's place in the sorted array

    def other(i: int) -> np.ndarray:
        """The i-th smallest of the others, for every value (skip its own place)."""
        return np.where(pos > i, s[i], s[min(i + 1, n - 1)])

    if m % 2:
        return other(m // 2)
    # halves first: the same number (halving is exact), but two values near the largest
    # float do not overflow to inf
    return other(m // 2 - 1) / 2.0 + other(m // 2) / 2.0


def data_stragglers(figures: Sequence[Tuple[int, float, Optional[float]]], place: Place
                    ) -> Tuple[List[Dict[str, Any]], List[float]]:
    """The header's ``data_stragglers`` from ``(rank, data_ms, step_ms)`` of every rank that
    has a ``data_ms``, and the median each listed rank was compared with (the alert's).

    A rank whose mean is not a finite number (a NaN or infinite ``data_ms`` among its last
    values: the wire allows them, 7.1 does not say) has no wait to compare: it is left out,
    as a rank without one (an infinite wait listed first, "waits inf ms", failed the sink)."""
    if not all(map(math.isfinite, [f[1] for f in figures])):
        figures = [f for f in figures if math.isfinite(f[1])]
    if len(figures) < 2:
        return [], []
    ranks = np.fromiter((f[0] for f in figures), np.int64, len(figures))
    data = np.fromiter((f[1] for f in figures), np.float64, len(figures))
    med = others_medians(data)
    with np.errstate(invalid="ignore", over="ignore"):
        hit = np.flatnonzero((data >= FACTOR * med) & (data >= med + MARGIN_MS)
                             & np.isfinite(med))
    if not len(hit):
        return [], []
    hit = hit[np.lexsort((ranks[hit], -data[hit]))][:MAX_STRAGGLERS]
    entries, medians = [], []
    for i in hit.tolist():
        rank = int(ranks[i])
        p = place(rank)
        # median_ms last (issue 44): the median the rank was compared with, so the page's
        # cause line reads it instead of working it out again from the ranks array
        entries.append({"rank": rank, "host": p[0] if p else None, "data_ms": float(data[i]),
                        "step_ms": figures[i][2], "median_ms": float(med[i])})
        medians.append(float(med[i]))
    return entries, medians


class DataWait:
    """One run's data-wait figures for its header, and who entered the straggler list."""

    __slots__ = ("share", "stragglers", "_listed", "_sig", "at")

    def __init__(self) -> None:
        #: when the figures were last worked out (None: never; the caller's clock)
        self.at: Optional[float] = None
        self.share: Optional[float] = None
        self.stragglers: List[Dict[str, Any]] = []
        self._listed: set[int] = set()
        self._sig: Any = None

    def update(self, share: Optional[float],
               figures: Sequence[Tuple[int, float, Optional[float]]], place: Place
               ) -> Tuple[bool, List[Tuple[int, str]]]:
        """Take the new figures; returns whether the header should be re-sent (the list's
        ranks changed, or the share moved a whole percent, or a listed rank's wait moved
        by 5 % or more: not every jitter of a mean, which would be a header a second) and
        the ``(rank, message)`` of each rank that entered the list now."""
        entries, medians = data_stragglers(figures, place)
        self.share = share
        self.stragglers = entries
        now = {e["rank"] for e in entries}
        new = [(e["rank"], straggler_message(e["data_ms"], m))
               for e, m in zip(entries, medians) if e["rank"] not in self._listed]
        self._listed = now
        sig = (share_percent(share),
               tuple((e["rank"], round(math.log(max(e["data_ms"], 1.0)) / math.log(1.05)))
                     for e in entries))
        changed = sig != self._sig
        self._sig = sig
        return changed, new
