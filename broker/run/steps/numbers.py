"""Numbers that go wrong, per rank (PROTOCOL.md 8.3): the first non-finite value of each step
metric, and replicas that disagree on a metric every rank computes alike.

A :class:`RunNumbers` belongs to one run's :class:`~broker.run.steps.closer.RunSteps` and sees
every batch of closed steps as it closes (steps close in ascending order and never change,
so "first" is exact). It reads no clock and does no I/O; what it finds is kept as the
header's ``nonfinite`` and ``replica_divergence`` and queued as alerts
(:attr:`RunNumbers.alerts`) that the sink raises when it publishes the steps
(:meth:`broker.run.steps.closer.RunSteps.raise_numbers`).

**Cost.** The close reduces every metric to ``[mean, min, max]`` per step; those decide
whether a step needs a look at its ranks at all, so the hot path stays per step, not per
rank:

* a step whose means are all finite has no non-finite value (2.4: a mean is non-finite when
  any value is), so one ``isfinite`` over the batch's means is the whole test;
* a replicated metric whose finite values span ``max - min <= 1e-6 x min(|min|, |max|)`` has
  every pair within the tolerance (every value lies between them, on one side of zero), so
  it needs no per-rank scan either; only a step that fails this test is scanned
  (:func:`majority`), from the per-rank values the close still holds
  (:meth:`~broker.run.steps.columns.ClosedSteps.values_at`).

**Attempts.** Entries are keyed by attempt (8.1); until attempts exist a run is attempt 0
(:attr:`RunNumbers.attempt`), and :meth:`RunNumbers.new_attempt` starts the per-attempt
rules afresh while keeping the entries already listed.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np

if TYPE_CHECKING:
    from broker.run.steps.columns import ClosedSteps

__all__ = ["RunNumbers", "majority", "TOLERANCE", "MAX_NONFINITE", "MAX_LISTED_RANKS",
           "MAX_REPLICATED", "nonfinite_word"]

#: Relative tolerance of two replicated values (8.3): |a - b| <= TOLERANCE x max(|a|, |b|).
TOLERANCE = 1e-6
#: Entries of the header's ``nonfinite`` at most (later metrics: ``nonfinite_more``).
MAX_NONFINITE = 64
#: Ranks an entry lists at most (the lowest ones).
MAX_LISTED_RANKS = 64
#: Replicated names a run holds (the first ones its registers named).
MAX_REPLICATED = 64
#: Distinct values at a step up to which the majority is found by comparing every pair
#: (exactly); beyond it, against a window of sorted values (see :func:`majority`).
PAIRWISE_LIMIT = 1024

#: One queued alert: (kind, rank or None for run-wide, message, ranks it concerns).
Alert = Tuple[str, Optional[int], str, int]


def nonfinite_word(value: float) -> str:
    """``nan``, ``inf`` or ``-inf`` (the alert's words for a non-finite value)."""
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def majority(ranks: np.ndarray, values: np.ndarray) -> Tuple[Optional[float], np.ndarray]:
    """The majority of 8.3 over finite ``values`` (one per rank in ``ranks``, at least 2) and
    which of them disagree (a bool per value).

    The majority is a value, among them, within the tolerance of which more than half of
    them lie: the most common such value (exactly equal values counted), ties to the lowest
    rank's. None when no value has more than half within its tolerance: then every value
    disagrees. The work is over the *distinct* values (a diverging step nearly always has
    two or three): every pair of them for up to :data:`PAIRWISE_LIMIT`, else, bounded in
    memory, each value's support counted over the sorted values between the bounds the
    tolerance gives on either side of v (for v > 0, a is within it exactly when v(1 - 1e-6)
    <= a <= v / (1 - 1e-6); mirrored for v < 0; only 0 for 0), which differ from the pairwise
    test at most in the last bit at their edges."""
    uniq, inv, cnt = np.unique(values, return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)
    n = len(values)
    m = len(uniq)
    if m == 1:
        return float(uniq[0]), np.zeros(n, bool)
    if m <= PAIRWISE_LIMIT:
        mag = np.abs(uniq)
        within = np.abs(uniq[:, None] - uniq[None, :]) <= TOLERANCE * np.maximum(
            mag[:, None], mag[None, :])
        support = within.astype(np.int64) @ cnt
    else:
        near, far = uniq * (1 - TOLERANCE), uniq / (1 - TOLERANCE)
        cum = np.concatenate(([0], np.cumsum(cnt)))
        lo = np.searchsorted(uniq, np.minimum(near, far), side="left")
        hi = np.searchsorted(uniq, np.maximum(near, far), side="right")
        support = cum[hi] - cum[lo]
    ok = support * 2 > n
    if not ok.any():
        return None, np.ones(n, bool)
    best = cnt[ok].max()
    cand = np.flatnonzero(ok & (cnt == best))
    k = int(cand[0])
    if len(cand) > 1:  # ties: the value of the lowest rank among them
        low = np.full(m, np.iinfo(np.int64).max, np.int64)
        np.minimum.at(low, inv, ranks)
        k = int(cand[np.argmin(low[cand])])
    maj = float(uniq[k])
    agree = np.abs(values - maj) <= TOLERANCE * np.maximum(np.abs(values), abs(maj))
    return maj, ~agree


class RunNumbers:
    """One run's 8.3 state: see the module docstring."""

    def __init__(self) -> None:
        #: ``host_of(rank) -> (host, local_rank) | None``: the run's topology, set by the
        #: sink; an entry takes its rank's host when it is decided (as an alert keeps the
        #: host of when it was raised, 8.5), so the journal keeps it and a replay is the same
        self.host_of: Callable[[int], Any] = lambda rank: None
        #: the current attempt (8.1; 0 until attempts exist)
        self.attempt = 0
        #: the run's replicated names, in the order first declared (at most 64)
        self.replicated: List[str] = []
        #: the header's ``nonfinite`` entries, oldest first
        self.nonfinite: List[Dict[str, Any]] = []
        #: each entry's alert: (message, how many ranks had a non-finite value)
        self.nonfinite_alerts: List[Tuple[str, int]] = []
        #: metrics with a first non-finite value past the 64 entries
        self.nonfinite_more = 0
        #: the header's ``replica_divergence``: one entry a metric, in first-diverged order
        self.divergence: Dict[str, Dict[str, Any]] = {}
        #: alerts found since the sink last raised them
        self.alerts: List[Alert] = []
        #: bumped at every change (the journal writes the state again only then)
        self.version = 0
        #: the version the sink last put in a header, and the journal last wrote
        self.shown = 0
        self.journaled = 0
        # (attempt, metric) that have their first non-finite value (listed or counted)
        self._first: Set[Tuple[int, str]] = set()
        # metric -> the ranks that raised replica_divergence for it (once a metric), and
        # the version at which a rank last joined it (the journal writes these lists, up to
        # the world size a metric, only when they grew: a rank diverging at every step
        # changes ``count`` and ``last_step`` alone)
        self._raised: Dict[str, Set[int]] = {}
        self.raised_version = 0
        self._declared: Set[str] = set()

    # ---------------------------------------------------------------- input

    def declare(self, names: List[str]) -> bool:
        """A register's ``replicated`` list: its names join the run's set (the union of
        every register's lists, the first 64). True when the set grew."""
        grew = False
        for name in names:
            if name not in self._declared and len(self.replicated) < MAX_REPLICATED:
                self._declared.add(name)
                self.replicated.append(name)
                grew = True
        return grew

    def new_attempt(self, attempt: int) -> None:
        """A new attempt (8.1): its first non-finite values and divergences are its own (the
        entries already listed stay, as the records of earlier attempts do)."""
        self.attempt = attempt
        self.divergence = {}
        self._raised = {}
        self.version += 1
        self.raised_version = self.version

    def check(self, batch: ClosedSteps) -> None:
        """Apply the 8.3 rules to a batch of steps that just closed (ascending, never
        seen before). Costs a few numpy calls per batch unless a step needs its ranks."""
        mean = batch.metric_mean
        if not len(mean):
            return
        if not np.isfinite(mean).all():
            self._nonfinite(batch, mean)
        if self.replicated:
            self._replicas(batch)

    # ---------------------------------------------------------------- first non-finite

    def _nonfinite(self, batch: ClosedSteps, mean: np.ndarray) -> None:
        names, vid, idx = batch.names, batch.metric_name, batch.metric_idx
        attempt = self.attempt
        first: Dict[str, Tuple[int, int]] = {}  # name -> (step, segment), its earliest
        bad = np.flatnonzero(~np.isfinite(mean))
        # each name's first bad segment (segments are by name, then ascending step): a run
        # whose loss stays NaN for good costs a few numpy calls a close, not one per step
        ids, at = np.unique(vid[bad], return_index=True)
        for i, j in zip(ids.tolist(), bad[at].tolist()):
            name = names[i]
            if (attempt, name) not in self._first:
                first[name] = (int(batch.step[idx[j]]), j)
        for name, (step, j) in sorted(first.items(), key=lambda item: (item[1][0], item[0])):
            ranks, values = batch.values_at(j)
            bad = ~np.isfinite(values)
            if not bad.any():
                continue  # a mean that overflowed from finite values: nothing non-finite
            bad_ranks = ranks[bad]
            order = np.argsort(bad_ranks, kind="stable")
            bad_ranks, bad_values = bad_ranks[order], values[bad][order]
            self._first.add((attempt, name))
            self.version += 1
            if len(self.nonfinite) >= MAX_NONFINITE:
                self.nonfinite_more += 1
                continue
            rank = int(bad_ranks[0])
            count = len(bad_ranks)
            word = nonfinite_word(float(bad_values[0]))
            self.nonfinite.append({
                "metric": name, "step": step, "rank": rank, "host": _host(self.host_of, rank),
                "ranks": bad_ranks[:MAX_LISTED_RANKS].tolist(), "attempt": attempt,
            })
            noun = "rank" if count == 1 else "ranks"
            message = f"{name} is {word} at step {step}: first non-finite {name} ({count} {noun})"
            self.nonfinite_alerts.append((message, count))
            self.alerts.append(("nonfinite", rank, message, count))

    # ---------------------------------------------------------------- replicas

    def _replicas(self, batch: ClosedSteps) -> None:
        names = batch.names
        vid = batch.metric_name
        k = len(batch.step)
        dense = len(vid) == len(names) * k  # every name at every step: name-major blocks
        for name in self.replicated:
            try:
                i = names.index(name)  # (names are few and sorted; the batch names them)
            except ValueError:
                continue
            if dense:
                a, b = i * k, (i + 1) * k
            else:
                a = int(np.searchsorted(vid, i, side="left"))
                b = int(np.searchsorted(vid, i, side="right"))
            if b - a == 1:  # the live case, one step a close: two floats, no array work
                lo, hi = batch.metric_lo[a].item(), batch.metric_hi[a].item()
                # (NaN lo/hi, no finite value, compares False: nothing to look at)
                if hi - lo > TOLERANCE * min(abs(lo), abs(hi)):
                    self._replica_step(batch, name, a)
                continue
            lo_a, hi_a = batch.metric_lo[a:b], batch.metric_hi[a:b]
            spread = (hi_a - lo_a) > TOLERANCE * np.minimum(np.abs(lo_a), np.abs(hi_a))
            if spread.any():
                for j in (np.flatnonzero(spread) + a).tolist():
                    self._replica_step(batch, name, j)

    def _replica_step(self, batch: ClosedSteps, name: str, j: int) -> None:
        ranks, values = batch.values_at(j)
        fin = np.isfinite(values)
        if not fin.all():  # non-finite values are the non-finite rule's
            ranks, values = ranks[fin], values[fin]
        if len(values) < 2:
            return
        maj, disagree = majority(ranks, values)
        if not disagree.any():
            return
        step = int(batch.step[batch.metric_idx[j]])
        odd = ranks[disagree]
        odd_values = values[disagree]
        order = np.argsort(odd, kind="stable")
        odd, odd_values = odd[order], odd_values[order]
        entry = self.divergence.get(name)
        if entry is None:
            self.divergence[name] = {
                "metric": name, "first_step": step, "last_step": step, "count": 1,
                "ranks": odd[:MAX_LISTED_RANKS].tolist(), "majority": maj,
            }
        else:
            entry["last_step"] = step
            entry["count"] += 1
        self.version += 1
        raised = self._raised.setdefault(name, set())
        n = len(values)
        for rank, value in zip(odd.tolist(), odd_values.tolist()):
            if rank in raised:
                continue
            raised.add(rank)
            self.raised_version = self.version
            if maj is None:
                message = f"{name} = {value:.6g} at step {step}, no majority among {n} ranks"
            else:
                message = (f"{name} = {value:.6g} at step {step}, the majority of {n} ranks "
                           f"has {maj:.6g}")
            self.alerts.append(("replica_divergence", rank, message, 1))

    # ---------------------------------------------------------------- header, journal

    def header(self, host_of: Any = None) -> Dict[str, Any]:
        """The header's ``nonfinite``, ``nonfinite_more`` and ``replica_divergence`` (new
        lists). An entry's ``host`` is its rank's when the entry was decided (:attr:`host_of`
        then), null when the rank had none yet: never a later host, so a restart's replay
        shows the same entry (``host_of`` is accepted for callers and not used)."""
        return {
            "nonfinite": [dict(e) for e in self.nonfinite],
            "nonfinite_more": self.nonfinite_more,
            "replica_divergence": [dict(e) for e in self.divergence.values()],
        }

    def wire(self, raised: bool = True) -> Dict[str, Any]:
        """The state as the journal keeps it (MessagePack-ready; :meth:`restore` reads it);
        without ``raised`` (the lists of ranks that raised ``replica_divergence``) when
        ``raised`` is False: :meth:`restore` then keeps the lists it had."""
        out = {
            "attempt": self.attempt,
            "replicated": list(self.replicated),
            "nonfinite": [dict(e) for e in self.nonfinite],
            "nonfinite_alerts": [list(a) for a in self.nonfinite_alerts],
            "nonfinite_more": self.nonfinite_more,
            "first": sorted([a, m] for a, m in self._first),
            "divergence": [dict(e) for e in self.divergence.values()],
        }
        if raised:
            out["raised"] = {name: sorted(r) for name, r in self._raised.items()}
        return out

    def restore(self, wire: Dict[str, Any]) -> None:
        """Journal replay: the state :meth:`wire` wrote (the latest one wins). A malformed
        part is left out rather than failing the run's load."""
        try:
            self.attempt = int(wire.get("attempt", 0))
            self.declare([n for n in wire.get("replicated", []) if isinstance(n, str)])
            self.nonfinite = [dict(e) for e in wire.get("nonfinite", [])][:MAX_NONFINITE]
            self.nonfinite_alerts = [(str(m), int(c)) for m, c in
                                     wire.get("nonfinite_alerts", [])][:len(self.nonfinite)]
            self.nonfinite_more = int(wire.get("nonfinite_more", 0))
            self._first = {(int(a), str(m)) for a, m in wire.get("first", [])}
            self.divergence = {str(e["metric"]): dict(e) for e in wire.get("divergence", [])}
            if "raised" in wire:
                self._raised = {str(k): {int(r) for r in v}
                                for k, v in dict(wire["raised"]).items()}
        except (TypeError, ValueError, KeyError, AttributeError):
            pass
        self.version += 1


def _host(host_of: Callable[[int], Any], rank: int) -> Any:
    """``rank``'s host as ``host_of`` places it now, or None (not placed yet)."""
    place = host_of(rank)
    return place[0] if place is not None else None
