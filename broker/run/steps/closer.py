"""Closing optimizer steps and aggregating them across ranks (PROTOCOL.md 2.4), columnar.

A :class:`StepCloser` belongs to one run's sink. It is fed ``steps`` frames with their
receive time and told which ranks are active (neither finished nor stale); it answers with
batches of closed steps (:class:`ClosedSteps`), ascending, each step exactly once. It reads
no clock and does no I/O, so every rule is a unit test with a fake ``now``:

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

How a batch is reduced (columnar, issue 17) lives in :mod:`broker.run.steps.columns`; this module
decides *when* steps close and keeps the per-rank figures.

* **A frame** costs O(1) Python calls: it is appended, by reference, to the run's pending
  frames; the rank's figures and the watermark heap update as before.
* Frames above the target stay pending untouched; a frame that straddles it leaves its
  tail (sliced once). The force-close timer is a deque of (receive time, highest pending
  step so far), so it needs no per-step bookkeeping either.

The batch then goes, as arrays, into the store (one append per batch, :meth:`StepStore.
append_columns`), and the ``steps`` event carries the store's wire block of those rows
(:meth:`RunSteps.take`), not records.
The per-rank straggler figures (``step``, ``step_ms``, ``slowest_share``) live here too:
they are what the closing sees. So do the step rules (:class:`RunSteps`' ``publish``,
``raise_numbers``, ``update_data_wait``: where a closed step meets the run, issue 44), since
the state they read is the pipeline's; the sink keeps the run's status and header flags.
"""
from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import Counter, deque
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Tuple

import numpy as np

from broker.run.events import Rejected
from broker.run.steps.columns import ClosedSteps, Columns, FrameBuffer, close_columns, slice_frame
from broker.run.steps.datawait import DataWait, data_share
from broker.run.steps.line import StepLine
from broker.run.steps.numbers import RunNumbers
from broker.run.steps.store import StepStore
from rank_agent.protocol import Steps

__all__ = ["RunSteps", "DATA_WAIT_INTERVAL", "MAX_RUN_STEP_METRICS", "StepCloser", "RankSteps", "STEP_MS_WINDOW",
           "SHARE_WINDOW"]

#: Most distinct step metric names one run holds (contract v3 section 2): a ``steps`` frame
#: that would take it past that is rejected (``step_metric_names``). Each name is a series in
#: the broker and in every web, and journal and snapshot work is per name.
MAX_RUN_STEP_METRICS = 1024
#: ``step_ms`` of a rank is the mean of its last this many non-null values.
STEP_MS_WINDOW = 100
#: ``slowest_share`` counts over the last this many closed steps that have a slowest rank.
SHARE_WINDOW = 1000



class RankSteps:
    """One step rank: its highest reported step, its recent step times, whether it counts
    for the watermark."""

    __slots__ = ("highest", "ms", "active", "data")

    def __init__(self) -> None:
        self.highest = -1
        self.ms: Deque[float] = deque(maxlen=STEP_MS_WINDOW)
        self.active = True
        #: (7.1) its last non-null ``data_ms`` values, as ``ms``
        self.data: Deque[float] = deque(maxlen=STEP_MS_WINDOW)

    def mean_ms(self) -> Optional[float]:
        ms = self.ms
        return sum(ms) / len(ms) if ms else None

    def mean_data(self) -> Optional[float]:
        """The ranks array's ``data_ms`` (7.1): mean of the last <= 100 non-null values."""
        data = self.data
        return sum(data) / len(data) if data else None


# ------------------------------------------------------------------ the closer


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
        # Pending points: those carried over from earlier closes (arrays) and those
        # received since (flat lists), arrival order; the lowest and highest pending step
        # (bounds: a rank discarded may leave them loose, which closes nothing that would
        # not close).
        self._carry: Optional[Columns] = None
        self._buf = FrameBuffer()
        self._lo = -1
        self._hi = -1
        # Force close: (receive time, highest pending step received by then), both
        # ascending; the first entry older than close_after says how far to close.
        self._force: Deque[Tuple[float, int]] = deque()
        self._top = -1
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
        A fixed number of Python calls: the frame's lists are appended to the run's
        column lists (:class:`FrameBuffer`), nothing is done per point.

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
        steps = frame.steps
        top = steps[-1]
        first = steps[0]
        old = rs.highest
        last_closed = self.last_closed
        if top <= last_closed:
            self.late += len(steps)
        else:
            pending = frame
            if first <= last_closed:
                i = bisect_right(steps, last_closed)
                self.late += i
                pending = slice_frame(frame, i, len(steps))
                first = steps[i]
            lo = self._lo
            if lo < 0 or first < lo:
                self._lo = first
            if top > self._hi:
                self._hi = top
            # (first above the rank's highest: no point of this rank in the buffer can be
            # at these steps, so the grid close need not look for a rank twice)
            self._buf.add(pending, first > old)
            if top > self._top:
                self._top = top
                force = self._force
                if force and force[-1][0] == now:
                    force[-1] = (now, top)
                else:
                    force.append((now, top))
        ms = frame.step_ms
        if None in ms:
            rs.ms.extend([v for v in ms if v is not None])
        else:
            rs.ms.extend(ms)  # type: ignore[arg-type]
        dms = frame.data_ms
        if dms:
            rs.data.extend([v for v in dms if v is not None] if None in dms else dms)  # type: ignore[arg-type]
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
                c = count.get(top, 0)
                count[top] = c + 1
                if not c:  # a new height: the heap holds every height once (plus stale)
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
        cols = self._take_pending()
        if cols is not None:
            rest = self._carry = cols.select(cols.rank != rank)
            self._lo = int(rest.step.min()) if len(rest) else -1
        self._slowest_count.pop(rank, None)

    # ----------------------------------------------------------------- closing

    def ready_batch(self, now: float, world_size: Optional[int]) -> Optional[ClosedSteps]:
        """Close what the watermark or the force-close timer allows at ``now``."""
        if not self._pending():
            return None
        target = self.last_closed
        if self._in_grace and self.started is not None:
            if now - self.started >= self.grace or (
                    world_size is not None and len(self.ranks) >= world_size):
                self._in_grace = False
        if not self._in_grace:
            wm = self._watermark()
            if wm is None:  # no active step rank: nobody to wait for
                target = self._hi
            elif wm > target:
                target = wm
        limit = now - self.close_after
        force = self._force
        while len(force) > 1 and force[1][0] <= limit:
            force.popleft()
        if force and force[0][0] <= limit and force[0][1] > target:
            target = force[0][1]
        if target <= self.last_closed or self._lo > target:
            return None
        return self._close_through(target)

    def close_all_batch(self) -> Optional[ClosedSteps]:
        """The run ended: close every pending step."""
        if not self._pending():
            return None
        return self._close_through(self._hi)

    def ready(self, now: float, world_size: Optional[int]) -> List[Dict[str, Any]]:
        """:meth:`ready_batch` as closed step records."""
        batch = self.ready_batch(now, world_size)
        return batch.records() if batch is not None else []

    def close_all(self) -> List[Dict[str, Any]]:
        """:meth:`close_all_batch` as closed step records."""
        batch = self.close_all_batch()
        return batch.records() if batch is not None else []

    def _pending(self) -> bool:
        return self._lo >= 0  # (-1 exactly when no point is pending)

    def _take_pending(self) -> Optional[Columns]:
        """Every pending point as one :class:`Columns` (carried ones first), or None."""
        cols = self._carry
        if self._buf:
            new = self._buf.take()
            cols = new if cols is None else cols.then(new)
        self._carry = None
        return cols

    def _close_through(self, target: int) -> Optional[ClosedSteps]:
        if target > self.last_closed:
            self.last_closed = target
        force = self._force
        while force and force[0][1] <= target:
            force.popleft()
        if self._carry is None and self._hi <= target and self._buf:
            # Every pending point closes: the live case (the frames of one round of
            # flushes, every rank the same steps once) FrameBuffer.close_grid reduces
            # without the general sort (None: not a grid, e.g. a rank sent a step twice).
            batch = self._buf.close_grid()
            if batch is not None:
                self._lo = -1
                self._note_slowest_batch(batch.slowest)
                return batch
        cols = self._take_pending()
        if cols is None:
            self._lo = -1
            return None
        if self._hi > target:  # some points stay pending
            closing = cols.step <= target
            rest = cols.select(~closing)
            cols = cols.select(closing)
            self._carry = rest
            self._lo = int(rest.step.min()) if len(rest) else -1
        else:
            self._lo = -1
        batch = close_columns(cols)
        if batch is not None:
            self._note_slowest_batch(batch.slowest)
        return batch

    def forget_through(self, step: int) -> None:
        """After a restart: every step <= ``step`` closed before it; pending points for them
        (replayed from the run's first frame) are dropped, not closed twice."""
        if step <= self.last_closed:
            return
        self.last_closed = step
        cols = self._take_pending()
        if cols is not None:
            rest = cols.select(cols.step > step)
            self._carry = rest
            self._lo = int(rest.step.min()) if len(rest) else -1

    # ----------------------------------------------------------------- figures

    def share(self, rank: int) -> float:
        """``slowest_share`` of PROTOCOL 2.4."""
        n = len(self._slowest)
        return self._slowest_count.get(rank, 0) / n if n else 0.0

    def restore_slowest(self, ranks: Iterable[int]) -> None:
        """After a restart: the slowest ranks of the closed steps, oldest first."""
        for rank in ranks:
            self._note_slowest(rank)

    def _note_slowest_batch(self, slowest: np.ndarray) -> None:
        """The slowest ranks of a closed batch (-1: none) enter the window: one by one when
        few, else the window is rebuilt from its tail (O(window), not O(steps))."""
        ranks = slowest[slowest >= 0]
        if len(ranks) <= 32:
            for rank in ranks.tolist():
                self._note_slowest(rank)
            return
        window = (list(self._slowest) + ranks[-SHARE_WINDOW:].tolist())[-SHARE_WINDOW:]
        self._slowest = deque(window)
        self._slowest_count = Counter(window)

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

    def figures_mark(self) -> Tuple[int, int, int]:
        """Changes whenever the ranks' figures may have (cheap: the journal asks it after
        every event of the run)."""
        return (self._top, self.last_closed, len(self.ranks))

    def figures_state(self) -> List[List[Any]]:
        """The ranks' figures as plain data for the journal (PROTOCOL 8.5: they come back
        after a restart, though ``steps`` frames are not journaled): ``[rank, highest,
        step_ms mean, its count, data_ms mean, its count]`` per rank. Means, not the
        windows: 1,024 ranks are ~40 KB, not 1.6 MB of windows."""
        out: List[List[Any]] = []
        for rank, rs in self.ranks.items():
            out.append([rank, rs.highest, rs.mean_ms(), len(rs.ms), rs.mean_data(), len(rs.data)])
        return out

    def restore_figures(self, state: Iterable[Any], active: Dict[int, bool]) -> None:
        """After a restart: take back :meth:`figures_state` for the ranks the run has
        (``active``: rank -> counts for the watermark). A rank's window is its mean that many
        times: its ``step_ms`` and ``data_ms`` are what they were, and its next values
        enter the window as they would have. A rank that reported since is left alone.
        Raises ``ValueError``/``TypeError`` for data it cannot take, changing nothing."""
        taken: List[Tuple[int, RankSteps]] = []
        for rank, highest, ms, n_ms, data, n_data in state:
            rs = RankSteps()
            rs.highest = int(highest)
            if ms is not None:
                rs.ms.extend([float(ms)] * min(int(n_ms), STEP_MS_WINDOW))
            if data is not None:
                rs.data.extend([float(data)] * min(int(n_data), STEP_MS_WINDOW))
            taken.append((int(rank), rs))
        for rank, rs in taken:
            if rank not in active or rank in self.ranks:
                continue
            self.ranks[rank] = rs
            rs.active = active[rank]
            if rs.active:
                self._wm_add(rs.highest)

    # ----------------------------------------------------------------- watermark

    def _wm_add(self, highest: int) -> None:
        c = self._wm_count.get(highest, 0)
        self._wm_count[highest] = c + 1
        if not c:
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


#: the header's data-wait figures (7.1) are worked out at most this often (seconds)
DATA_WAIT_INTERVAL = 1.0
#: ``raise(kind, rank, message, now, notify=True)``: the sink's alert (``RunSink._raise``)
RaiseAlert = Callable[..., None]


class RunSteps:
    """One run's steps from frames to storage: the :class:`StepCloser`, the closed batches
    waiting for the next ``steps`` event (at most one per ``interval`` seconds), and the
    :class:`~broker.run.steps.store.StepStore` of the published ones.

    Only published steps enter :attr:`store`, so a snapshot never holds a step an event
    will bring again. :meth:`take` hands over the wire block of the rows it stored (the
    batches enter the store one append each); :meth:`publish` emits it through the sink's
    ``emit`` and raises what the published steps say (the step rules, below), handed the
    sink's callbacks as :class:`broker.stacks.feed.StackFeed` is.
    """

    def __init__(self, *, close_after: float = 10.0, interval: float = 0.25,
                 emit: Optional[Callable[[str, Any], int]] = None,
                 raise_: Optional[RaiseAlert] = None) -> None:
        self.closer = StepCloser(close_after=close_after)
        #: the sink's ``emit(kind, data)`` and ``raise(kind, rank, message, now, notify)``,
        #: as :class:`broker.stacks.feed.StackFeed` is handed them (None: a bare pipeline, as
        #: the benchmarks drive it, that publishes nothing itself)
        self._emit = emit
        self._raise = raise_
        #: the header's data-wait figures (7.1), worked out after each publication
        self.data_wait = DataWait()
        self.store = StepStore()
        self.interval = interval
        #: steps published through :meth:`take` (not restored ones)
        self.published = 0
        #: when the last ``steps`` event went out (None: none yet)
        self.sent_at: Optional[float] = None
        self._out: List[ClosedSteps] = []  # closed, not yet in a steps event
        #: every metric name an accepted frame (or a restored block) brought
        self.names: set[str] = set()
        # name -> the store's row count after the last take that published a point of it,
        # ordered by that take (:meth:`named_since`; at most the run's capped names)
        self._taken: Dict[str, int] = {}
        #: (8.3) the first non-finite values and replicas that disagree: every batch is
        #: shown to it as it closes (:meth:`_closed`)
        self.numbers = RunNumbers()
        #: (8.1) the attempt whose steps close now, and the attempts along the line
        self.attempt = 0
        self.line = StepLine(self.store)

    def new_attempt(self, attempt: int) -> None:
        """Attempt ``attempt`` begins (8.1): its steps close by their own rules, from the
        start (a fresh closer: start-up grace, watermark, late against its own steps); the
        previous attempt's closed steps went out before (the sink's ``_start_attempt``)."""
        self.attempt = attempt
        self.closer = StepCloser(close_after=self.closer.close_after)
        self.data_wait = DataWait()
        self.numbers.new_attempt(attempt)

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

    def add(self, frame: Steps, now: float, active: bool, world_size: Optional[int]) -> bool:
        """An accepted frame (after :meth:`admit`): its points to the closer, and what the
        watermark lets close now, queued. True when a ``steps`` event is due (the sink's
        per-frame call: one, whatever happens)."""
        if self.closer.add(frame, now, active):
            batch = self.closer.ready_batch(now, world_size)
            if batch is not None:
                self._closed(batch)
        return bool(self._out) and (self.sent_at is None or now - self.sent_at >= self.interval)

    def close(self, now: float, world_size: Optional[int]) -> None:
        """Queue what the closer lets close now (watermark, grace, force close)."""
        batch = self.closer.ready_batch(now, world_size)
        if batch is not None:
            self._closed(batch)

    def _closed(self, batch: ClosedSteps) -> None:
        """A batch just closed: the number rules (8.3) look at it while its per-rank values
        are still at hand, then those are let go and the batch waits for its event."""
        self.numbers.check(batch)
        batch.drop_raw()
        self._out.append(batch)

    def close_all(self) -> bool:
        """The run ends: every pending step closes; True when any step is waiting."""
        batch = self.closer.close_all_batch()
        if batch is not None:
            self._closed(batch)
        return bool(self._out)

    def due(self, now: float) -> bool:
        """Closed steps wait and ``interval`` has passed since the last event."""
        return bool(self._out) and (self.sent_at is None or now - self.sent_at >= self.interval)

    @property
    def waiting(self) -> int:
        """Closed steps not yet published."""
        return sum(map(len, self._out))

    def take(self, now: float) -> Dict[str, Any]:
        """The waiting closed steps, now stored (one append per batch) as published at
        ``now``, as the ``steps`` event's data: the store's wire block of their rows
        (:meth:`StepStore.to_wire`, the columnar form snapshots and the journal use).

        Columnar rather than records (issue 17): a record is ~7 Python containers a step
        to build, MessagePack-encode here and decode in every web, where most runs have no
        SSE subscriber to show them to. The block is a few ``tobytes`` per series; a web
        appends it with :meth:`StepStore.extend_wire` and builds records only for its
        subscribers (:func:`broker.run.steps.store.wire_records` gives them to whoever else
        needs them)."""
        out, self._out = self._out, []
        store = self.store
        if out and self.attempt and len(out[0].step):  # (8.1: a new attempt's first close)
            self.line.rewind(self.attempt, int(out[0].step[0]))
        before = store.rows
        names: set[str] = set()
        for batch in out:
            store.append_columns(batch.step, batch.time, batch.n, batch.slowest,
                                 batch.samples, batch.tokens,
                                 (batch.ms_idx, batch.ms_mean, batch.ms_lo, batch.ms_hi),
                                 batch.per_metric(),
                                 (batch.d_idx, batch.d_mean, batch.d_lo, batch.d_hi))
            names.update(batch.names)
        self.published += store.rows - before
        self.sent_at = now
        taken, rows = self._taken, store.rows
        for name in names:  # (moved to the end: the latest takes' names are last)
            taken.pop(name, None)
            taken[name] = rows
        self.line.appended(before, self.attempt)
        block = store.to_wire(before, rows, sorted(names))
        if self.attempt:  # (8.1; absent = attempt 0, so a run that never restarts is as before)
            block["attempt"] = self.attempt
        return block

    def named_since(self, row: int) -> List[str]:
        """The metric names that may have a point in the store's rows from ``row`` on, of
        the rows :meth:`take` published: those of the takes since (the journal's STEPS
        blocks visit these series alone, at a cost of what the takes held, not of every
        name the run ever had: issue 19 finding 3). Newest take first."""
        out: List[str] = []
        for name, end in reversed(self._taken.items()):
            if end <= row:
                break
            out.append(name)
        return out

    def restore(self, block: Dict[str, Any]) -> int | None:
        """Journal replay of a :meth:`StepStore.to_wire` block; returns the first new row
        (None: the block added nothing). The closer forgets what closed before the restart
        and takes back the straggler window."""
        store = self.store
        attempt = int(block.get("attempt") or 0)  # (8.1: blocks of older journals: 0)
        k = int(block["rows"])
        if attempt and k:
            first = int(np.frombuffer(block["step"], np.int64, 1)[0])
            self.line.rewind(attempt, first)
        before = store.rows
        store.extend_wire(block)
        if store.rows == before:
            return None
        self.line.appended(before, attempt)
        self.names.update(store.metrics)
        if attempt == self.attempt:  # (8.1: late only against the current attempt's steps)
            self.closer.forget_through(store.last_step)  # type: ignore[arg-type]
        # Only the last SHARE_WINDOW matter (a million restored steps must not mean a
        # million window updates).
        self.closer.restore_slowest(store.slowest_ranks(since=before)[-SHARE_WINDOW:])
        published = block.get("published_at")
        if isinstance(published, float):
            self.sent_at = published
        return before

    # ------------------------------- the step rules: where a closed step meets the run
    # (PROTOCOL.md 2.4, 7.1, 8.3): the steps event, a non-finite loss, the number rules'
    # alerts and the data wait. Here rather than in the sink because their state (the
    # store, the numbers, the closer's ranks, the data wait) is this object's; the sink
    # keeps the run's status and header flags, told by the return values.
    def _alert(self, kind: str, rank: Optional[int], message: str, now: float,
               notify: bool = True) -> None:
        if self._raise is not None:
            self._raise(kind, rank, message, now, notify)

    def publish(self, now: float, world_size: Optional[int],
                place: Callable[[int], Any], final: bool = False) -> bool:
        """One ``steps`` event with every step closed since the last one (at most one per
        ``interval``, or at once when the run ends). Its data is the store's wire block of
        those rows (:meth:`take`; records: :func:`broker.run.steps.store.wire_records`).
        True when the header's figures moved (the number rules' entries, the data wait)."""
        store = self.store
        before = store.rows
        assert self._emit is not None
        self._emit("steps", self.take(now))
        bad = store.last_nonfinite("loss", since=before)  # array scan, not per record
        if bad is not None:
            self._alert("nonfinite_loss", None, f"step {bad[0]}: loss is {bad[1]}", now)
        moved = self.raise_numbers(now, world_size)
        # (the run's end: its last figures)
        return self.update_data_wait(now, place, force=final) or moved

    def raise_numbers(self, now: float, world_size: Optional[int]) -> bool:
        """(8.3) The alerts the number rules found in the steps just published; True when
        their entries moved (the header shows them). A first non-finite value on more than
        half the world size is run-wide (``rank`` null): a NaN everywhere at once blames no
        rank."""
        numbers = self.numbers
        if numbers.alerts:
            alerts, numbers.alerts = numbers.alerts, []
            ws = world_size if world_size is not None else len(self.closer.ranks)
            for kind, rank, message, count in alerts:
                if kind == "nonfinite" and count * 2 > ws:
                    rank = None
                self._alert(kind, rank, message, now)
        if numbers.version != numbers.shown:
            numbers.shown = numbers.version
            return True
        return False

    def update_data_wait(self, now: float, place: Callable[[int], Any], force: bool = False,
                         quiet: bool = False) -> bool:
        """The header's ``data_share`` and ``data_stragglers`` (7.1, :mod:`broker.run.steps.
        datawait`), at most once per DATA_WAIT_INTERVAL; a rank entering the list raises
        ``data_straggler`` (unless ``quiet``: after a restart, whose alerts come back from
        the journal as they were). True when the figures moved."""
        dw = self.data_wait
        if not force and dw.at is not None and now - dw.at < DATA_WAIT_INTERVAL:
            return False
        dw.at = now
        d, ms = self.store.data_ms, self.store.step_ms
        r0 = self.line.first_row(self.attempt)  # 8.1: the current attempt's
        dp = int(d.row[:d.n].searchsorted(r0)) if r0 else 0
        mp = int(ms.row[:ms.n].searchsorted(r0)) if r0 else 0
        share = data_share(d.row[dp:d.n], d.mean[dp:d.n], ms.row[mp:ms.n], ms.mean[mp:ms.n])
        figures = [(rank, rs.mean_data(), rs.mean_ms())
                   for rank, rs in self.closer.ranks.items() if rs.data]
        changed, new = dw.update(share, figures, place)  # type: ignore[arg-type]
        for rank, message in ([] if quiet else new):
            self._alert("data_straggler", rank, message, now)
        return changed

    def restore_numbers(self, wire: Dict[str, Any], at: float, world_size: Optional[int]
                        ) -> None:
        """Journal replay of the 8.3 state (:meth:`RunNumbers.wire`): the entries, and the
        alerts they raised, raised again as they were (the newest state of the journal
        wins; a re-raised alert keeps its (kind, rank) place in the list)."""
        numbers = self.numbers
        numbers.restore(wire)
        numbers.journaled = numbers.shown = numbers.version
        ws = world_size if world_size is not None else len(self.closer.ranks)
        for entry, (message, count) in zip(numbers.nonfinite, numbers.nonfinite_alerts):
            self._alert("nonfinite", None if count * 2 > ws else entry["rank"], message, at,
                        notify=False)
        messages = wire.get("messages")
        for rank, message in sorted(messages.items() if isinstance(messages, dict) else (),
                                    key=lambda item: str(item[0])):
            if isinstance(rank, int) and isinstance(message, str):
                self._alert("replica_divergence", rank, message, at, notify=False)

    def numbers_wire(self, alerts: Callable[[], List[Dict[str, Any]]]
                     ) -> Optional[Dict[str, Any]]:
        """(8.3) The number rules' state for the journal's next STEPS block when it changed
        since the last one (None: unchanged), with each rank's latest ``replica_divergence``
        message (from the run's listed ``alerts()``) so a restart lists the same alerts."""
        numbers = self.numbers
        if numbers.version == numbers.journaled:
            return None
        # the ranks' lists and messages only when a rank joined them since the last write
        grew = numbers.raised_version > numbers.journaled
        numbers.journaled = numbers.version
        wire = numbers.wire(raised=grew)
        if grew:
            wire["messages"] = {a["rank"]: a["message"] for a in alerts()
                                if a["kind"] == "replica_divergence" and a["rank"] is not None}
        return wire
