"""Closing optimizer steps and aggregating them across ranks (PROTOCOL.md 2.4), pure.

A :class:`StepCloser` belongs to one run's sink. It is fed ``steps`` frames with their
receive time and told which ranks are active (neither finished nor stale); it answers with
closed step records, ascending, each exactly once. It reads no clock and does no I/O, so
every rule is a unit test with a fake ``now``:

* **watermark**: step S closes once every active *step rank* (a rank that has sent at least
  one ``steps`` frame) has reported a step >= S;
* **start-up grace**: during the first ``grace`` seconds after the run's first ``steps``
  frame the watermark closes nothing, unless ``world_size`` is known and that many ranks are
  already step ranks (otherwise the first rank to flush would close the first steps alone);
* **force close**: ``close_after`` seconds after the broker first received a point for S,
  S (and every pending step below it) closes whoever is missing;
* **run end**: :meth:`StepCloser.close_all`;
* **late points**: a point for a step at or below the last closed one is dropped and counted
  (:attr:`StepCloser.late`); the rest of its frame still applies.

Cost per point is a dict store (a reference to its frame: nothing is copied); the
watermark is a lazily cleaned min-heap over the active ranks' highest steps, so a frame is
O(points + log ranks) and a close is O(reporting ranks x metrics).

The per-rank straggler figures (``step``, ``step_ms``, ``slowest_share``) live here too:
they are what the closing sees.
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import Counter, deque
from itertools import repeat
from operator import attrgetter, getitem, methodcaller
from typing import Any, Deque, Dict, Iterable, List, Optional

from broker.events import Rejected
from broker.stepstore import StepStore
from rank_agent.protocol import Steps

__all__ = ["RunSteps", "MAX_RUN_STEP_METRICS", "StepCloser", "step_record", "RankSteps", "STEP_MS_WINDOW", "SHARE_WINDOW"]

#: Most distinct step metric names one run holds (contract v3 section 2): a ``steps`` frame
#: that would take it past that is rejected (``step_metric_names``). Each name is a series in
#: the broker and in every web, and journal and snapshot work is per name.
MAX_RUN_STEP_METRICS = 1024
#: ``step_ms`` of a rank is the mean of its last this many non-null values.
STEP_MS_WINDOW = 100
#: ``slowest_share`` counts over the last this many closed steps that have a slowest rank.
SHARE_WINDOW = 1000

_isfinite = math.isfinite
_fsum = math.fsum


def _triple(values: List[float]) -> List[Optional[float]]:
    """``[mean, min, max]`` of PROTOCOL 2.4: the arithmetic mean (non-finite if any value is;
    exactly rounded, so it does not depend on the order ranks reported in) and min/max over
    the finite values (None when there are none)."""
    n = len(values)
    try:
        total = _fsum(values)
    except (OverflowError, ValueError):  # finite values overflowing, or +inf and -inf
        total = math.nan
    if _isfinite(total):  # then every value is finite
        return [total / n, min(values), max(values)]
    finite = [v for v in values if _isfinite(v)]
    if len(finite) == n:  # an intermediate overflow of finite values: scale first
        mean: float = _fsum(v / n for v in values)
    elif any(v != v for v in values) or (math.inf in values and -math.inf in values):
        mean = math.nan
    else:
        mean = math.inf if math.inf in values else -math.inf
    if finite:
        return [mean, min(finite), max(finite)]
    return [mean, None, None]


def step_record(step: int, reports: Dict[int, Steps]) -> Dict[str, Any]:
    """The closed step record of PROTOCOL 2.4 from the ranks' reports (rank -> the frame
    that holds its point of ``step``; last write wins, so it is the latest such frame).

    Column-wise, with C-level ``map`` chains to pull each field out of the frames and
    ``fsum``/``min``/``max`` to reduce it: no bytecode runs per rank and value, which is
    what the broker pays per closed step (a 1,024-rank step is about a millisecond)."""
    frames = list(reports.values())
    # where the step sits in each frame's lists (C-level bisect: the frames only hold
    # references, no per-point tuple was made when they arrived)
    idxs = list(map(bisect_left, map(_steps, frames), repeat(step)))
    times: List[Any] = list(map(getitem, map(_times, frames), idxs))
    ms_col: List[Any] = list(map(getitem, map(_step_ms, frames), idxs))
    ms_values = [v for v in ms_col if v is not None] if None in ms_col else ms_col
    step_ms = _triple(ms_values) if ms_values else None
    top = step_ms[2] if step_ms is not None else None
    slowest: Optional[int] = None
    if top is not None:  # the lowest rank among those with the largest finite step_ms
        if ms_col.count(top) == 1:
            slowest = list(reports)[ms_col.index(top)]
        else:
            slowest = min(r for r, v in zip(reports, ms_col) if v == top)
    samples = _count_sum(list(map(_samples, frames)), idxs)
    tokens = _count_sum(list(map(_tokens, frames)), idxs)
    dicts = list(map(_metrics, frames))
    metrics: Dict[str, List[Optional[float]]] = {}
    names = set().union(*dicts)
    if len(names) > 8 and len(names) * len(dicts) > 4 * sum(map(len, dicts)) + 256:
        # The ranks log different names (a per-rank metric): column-wise would be
        # O(names x ranks) (1,024 ranks x 64 names of their own: ~30 s); per rank it is
        # O(values), with the values of a name in the same (report) order.
        per_name: Dict[str, List[float]] = {}
        for d, i in zip(dicts, idxs):
            for name, column in d.items():
                v = column[i]
                if v is not None:
                    got = per_name.get(name)
                    if got is None:
                        per_name[name] = [v]
                    else:
                        got.append(v)
        for name in sorted(per_name):
            metrics[name] = _triple(per_name[name])
        names = set()
    for name in sorted(names):
        col: List[Any] = list(map(getitem, map(methodcaller("get", name, _NO_COLUMN), dicts),
                                  idxs))
        values = [v for v in col if v is not None] if None in col else col
        if values:
            metrics[name] = _triple(values)
    seconds = top / 1000.0 if top else None  # None when null or 0
    return {
        "step": step,
        "time": max([t for t in times if t == t], default=None),  # NaN times ignored
        "n": len(idxs),
        "metrics": metrics,
        "step_ms": step_ms,
        "slowest_rank": slowest,
        "samples": samples,
        "tokens": tokens,
        "samples_per_s": samples / seconds if seconds and samples else None,
        "tokens_per_s": tokens / seconds if seconds and tokens else None,
    }


#: Stand-ins for a list a frame did not send (indices are < 1024 points).
_NO_COLUMN: List[Optional[float]] = [None] * 1024
_steps = attrgetter("steps")
_times = attrgetter("times")
_step_ms = attrgetter("step_ms")
_metrics = attrgetter("metrics")


_samples = attrgetter("samples")
_tokens = attrgetter("tokens")


def _count_sum(columns: List[List[int]], idxs: List[int]) -> int:
    """Sum of ``columns[k][idxs[k]]``, an empty column (not sent) counting 0; C-level unless
    some frames sent the list and others did not."""
    if [] not in columns:
        return sum(map(getitem, columns, idxs))
    return sum(c[i] for c, i in zip(columns, idxs) if c)


class RankSteps:
    """One step rank: its highest reported step, its recent step times, whether it counts
    for the watermark."""

    __slots__ = ("highest", "ms", "active")

    def __init__(self) -> None:
        self.highest = -1
        self.ms: Deque[float] = deque(maxlen=STEP_MS_WINDOW)
        self.active = True

    def mean_ms(self) -> Optional[float]:
        ms = self.ms
        return sum(ms) / len(ms) if ms else None


class StepCloser:
    """One run's pending steps and the rules that close them; see the module docstring."""

    def __init__(self, *, close_after: float = 10.0, grace: float = 1.0) -> None:
        if close_after <= 0:
            raise ValueError("step close_after must be > 0")
        self.close_after = close_after
        self.grace = grace
        #: the last closed step (-1: none)
        self.last_closed = -1
        #: points dropped because their step had closed
        self.late = 0
        #: receive time of the run's first ``steps`` frame
        self.started: Optional[float] = None
        self.ranks: Dict[int, RankSteps] = {}
        self._pending: Dict[int, Dict[int, Steps]] = {}  # step -> rank -> frame
        self._heap: List[int] = []  # pending steps
        self._first_seen: Dict[int, float] = {}  # step -> first receive time (arrival order)
        # Watermark: how many active ranks have each highest step, and a lazy min-heap of them.
        self._wm_count: Dict[int, int] = {}
        self._wm_heap: List[int] = []
        self._in_grace = True
        # slowest_share: the slowest rank of the last SHARE_WINDOW steps that had one.
        self._slowest: Deque[int] = deque()
        self._slowest_count: Counter[int] = Counter()

    # ----------------------------------------------------------------- input

    def add(self, frame: Steps, now: float, active: bool) -> bool:
        """Take one accepted frame's points (``active``: the rank is neither finished nor
        stale). Late points are counted and dropped; the rank's figures update regardless.

        Returns True when the watermark may have moved (the rank was new, or at the
        watermark): only then can :meth:`ready` close something the timers would not, so
        the sink skips it otherwise (the timers run in ``tick``)."""
        rank = frame.rank
        if self.started is None:
            self.started = now
        rs = self.ranks.get(rank)
        moved = False
        if rs is None:
            rs = self.ranks[rank] = RankSteps()
            rs.active = active
            if active:
                self._wm_add(-1)
            moved = True
        last_closed = self.last_closed
        pending = self._pending
        steps = frame.steps
        for step in steps:
            if step > last_closed:
                reports = pending.get(step)
                if reports is None:
                    pending[step] = {rank: frame}
                    heapq.heappush(self._heap, step)
                    self._first_seen[step] = now
                else:
                    reports[rank] = frame
            else:
                self.late += 1
        ms = frame.step_ms
        if None in ms:
            rs.ms.extend([v for v in ms if v is not None])
        else:
            rs.ms.extend(ms)  # type: ignore[arg-type]
        top = steps[-1]
        old = rs.highest
        if top > old:
            rs.highest = top
            if rs.active:
                count = self._wm_count
                c = count[old] - 1
                if c:
                    count[old] = c
                else:
                    del count[old]
                    moved = True  # the last rank at that height: the minimum may rise
                count[top] = count.get(top, 0) + 1
                heapq.heappush(self._wm_heap, top)
        return moved

    def set_active(self, rank: int, active: bool) -> None:
        """The rank turned stale or finished (False), or back to ok (True)."""
        rs = self.ranks.get(rank)
        if rs is None or rs.active == active:
            return
        rs.active = active
        if active:
            self._wm_add(rs.highest)
        else:
            self._wm_remove(rs.highest)

    def discard(self, rank: int) -> None:
        """Forget a rank entirely (it turned out to be >= the run's world size)."""
        rs = self.ranks.pop(rank, None)
        if rs is None:
            return
        if rs.active:
            self._wm_remove(rs.highest)
        for reports in self._pending.values():
            reports.pop(rank, None)
        self._slowest_count.pop(rank, None)

    # ----------------------------------------------------------------- closing

    def ready(self, now: float, world_size: Optional[int]) -> List[Dict[str, Any]]:
        """Close what the watermark or the force-close timer allows at ``now``."""
        if not self._heap:
            return []
        target = self.last_closed
        if self._in_grace and self.started is not None:
            if now - self.started >= self.grace or (
                    world_size is not None and len(self.ranks) >= world_size):
                self._in_grace = False
        if not self._in_grace:
            wm = self._watermark()
            if wm is None:  # no active step rank: nobody to wait for
                target = self._max_pending()
            elif wm > target:
                target = wm
        limit = now - self.close_after
        for step, seen in self._first_seen.items():  # arrival order
            if seen > limit:
                break
            if step > target:
                target = step
        if target <= self.last_closed or self._heap[0] > target:
            return []
        return self._close_through(target)

    def close_all(self) -> List[Dict[str, Any]]:
        """The run ended: close every pending step."""
        if not self._heap:
            return []
        return self._close_through(self._max_pending())

    def _max_pending(self) -> int:
        return max(self._pending)

    def _close_through(self, target: int) -> List[Dict[str, Any]]:
        out = []
        heap, pending, first_seen = self._heap, self._pending, self._first_seen
        while heap and heap[0] <= target:
            step = heapq.heappop(heap)
            reports = pending.pop(step)
            del first_seen[step]
            if not reports:  # every reporter was discarded (out of range)
                continue
            record = step_record(step, reports)
            slowest = record["slowest_rank"]
            if slowest is not None:
                self._note_slowest(slowest)
            out.append(record)
        self.last_closed = max(self.last_closed, target)
        return out

    def forget_through(self, step: int) -> None:
        """After a restart: every step <= ``step`` closed before it; pending points for them
        (replayed from the run's first frame) are dropped, not closed twice."""
        if step <= self.last_closed:
            return
        self.last_closed = step
        heap, pending, first_seen = self._heap, self._pending, self._first_seen
        while heap and heap[0] <= step:
            s = heapq.heappop(heap)
            del pending[s]
            del first_seen[s]

    # ----------------------------------------------------------------- figures

    def share(self, rank: int) -> float:
        """``slowest_share`` of PROTOCOL 2.4."""
        n = len(self._slowest)
        return self._slowest_count.get(rank, 0) / n if n else 0.0

    def restore_slowest(self, ranks: Iterable[int]) -> None:
        """After a restart: the slowest ranks of the closed steps, oldest first."""
        for rank in ranks:
            self._note_slowest(rank)

    def _note_slowest(self, rank: int) -> None:
        window = self._slowest
        if len(window) == SHARE_WINDOW:
            old = window.popleft()
            c = self._slowest_count[old] - 1
            if c:
                self._slowest_count[old] = c
            else:
                del self._slowest_count[old]
        window.append(rank)
        self._slowest_count[rank] += 1

    # ----------------------------------------------------------------- watermark

    def _wm_add(self, highest: int) -> None:
        self._wm_count[highest] = self._wm_count.get(highest, 0) + 1
        heapq.heappush(self._wm_heap, highest)

    def _wm_remove(self, highest: int) -> None:
        c = self._wm_count[highest] - 1
        if c > 0:
            self._wm_count[highest] = c
        else:
            del self._wm_count[highest]

    def _watermark(self) -> Optional[int]:
        """The lowest highest-step over active step ranks (None: no active step rank)."""
        heap, count = self._wm_heap, self._wm_count
        while heap and heap[0] not in count:
            heapq.heappop(heap)
        if not heap:
            return None
        if len(heap) > 4 * len(count) + 64:  # duplicates piled up: rebuild
            self._wm_heap = heap = list(count)
            heapq.heapify(heap)
        return heap[0]


class RunSteps:
    """One run's steps from frames to storage: the :class:`StepCloser`, the closed steps
    waiting for the next ``steps`` event (at most one per ``interval`` seconds), and the
    :class:`~broker.stepstore.StepStore` of the published ones.

    Only published steps enter :attr:`store`, so a snapshot never holds a step an event
    will bring again. Emitting the event is the sink's business: :meth:`take` hands the
    records over.
    """

    def __init__(self, *, close_after: float = 10.0, interval: float = 0.25) -> None:
        self.closer = StepCloser(close_after=close_after)
        self.store = StepStore()
        self.interval = interval
        #: steps published through :meth:`take` (not restored ones)
        self.published = 0
        #: when the last ``steps`` event went out (None: none yet)
        self.sent_at: Optional[float] = None
        self._out: List[Dict[str, Any]] = []  # closed, not yet in a steps event
        #: every metric name an accepted frame (or a restored block) brought
        self.names: set[str] = set()

    def admit(self, frame: Steps) -> None:
        """Take note of the frame's metric names, or raise :class:`Rejected`
        (``step_metric_names``), changing nothing, when they would take the run past
        :data:`MAX_RUN_STEP_METRICS`. The caller's last check: after it, the frame applies.
        O(names in the frame) when within the cap."""
        metrics = frame.metrics
        if not metrics:
            return
        names = self.names
        if len(names) + len(metrics) > MAX_RUN_STEP_METRICS:
            new = sum(1 for name in metrics if name not in names)
            if len(names) + new > MAX_RUN_STEP_METRICS:
                raise Rejected("step_metric_names",
                               f"{new} new step metric names, run has {len(names)} "
                               f"of {MAX_RUN_STEP_METRICS}")
        names.update(metrics)

    def close(self, now: float, world_size: Optional[int]) -> None:
        """Queue what the closer lets close now (watermark, grace, force close)."""
        closed = self.closer.ready(now, world_size)
        if closed:
            self._out.extend(closed)

    def close_all(self) -> bool:
        """The run ends: every pending step closes; True when any step is waiting."""
        self._out.extend(self.closer.close_all())
        return bool(self._out)

    def due(self, now: float) -> bool:
        """Closed steps wait and ``interval`` has passed since the last event."""
        return bool(self._out) and (self.sent_at is None or now - self.sent_at >= self.interval)

    def take(self, now: float) -> List[Dict[str, Any]]:
        """The waiting closed steps, now stored as published at ``now``."""
        out, self._out = self._out, []
        self.store.append(out)
        self.published += len(out)
        self.sent_at = now
        return out

    def restore(self, block: Dict[str, Any]) -> int | None:
        """Journal replay of a :meth:`StepStore.to_wire` block; returns the first new row
        (None: the block added nothing). The closer forgets what closed before the restart
        and takes back the straggler window."""
        store = self.store
        before = store.rows
        store.extend_wire(block)
        if store.rows == before:
            return None
        self.names.update(store.metrics)
        self.closer.forget_through(store.last_step)  # type: ignore[arg-type]
        # Only the last SHARE_WINDOW matter (a million restored steps must not mean a
        # million window updates).
        self.closer.restore_slowest(store.slowest_ranks(since=before)[-SHARE_WINDOW:])
        published = block.get("published_at")
        if isinstance(published, float):
            self.sent_at = published
        return before
