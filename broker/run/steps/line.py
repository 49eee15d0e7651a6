"""The run's line of closed steps and the records it superseded (PROTOCOL.md 8.1).

Each attempt closes its own steps. The run's **line** holds, for each step, the record of the
latest attempt that closed it: when attempt k+1 closes its first step S, every step >= S an
earlier attempt closed leaves the line and is **superseded** (kept, never changed).

Storage, shared by the broker and every web (numpy and the standard library only):

* the line is the run's :class:`~broker.run.steps.store.StepStore`, as before, so a run that
  never restarts pays nothing (no column, no per-row work). Attempts only ever grow along
  it (a rewind takes every later row off before the new attempt appends), so which attempt
  closed a row is a short list of ``(first row, attempt)`` bounds (:attr:`StepLine.bounds`),
  not a column;
* a rewind copies the rows it takes off into one :class:`StepStore` chunk per attempt (a
  few ``tobytes``/``frombuffer`` of the cut rows) and cuts the line (:meth:`StepStore.
  truncate`: a binary search per series). Its cost is that of the rows superseded, not of
  the run: a rewind of 1,000 steps in a run of 10^6 copies 1,000 rows;
* at most :data:`MAX_SUPERSEDED` superseded records a run: past it the oldest attempt's
  chunks go first (its ``superseded_steps`` still counts them);
* ``?attempt=K`` (its own records, superseded or not) merges K's part of the line with
  its chunks into one store, built once per change and kept (:meth:`StepLine.of_attempt`).

:class:`EpochLine` does the same for epoch records (a few per run: plain lists).
"""
from __future__ import annotations

import bisect
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from broker.run.steps.store import StepStore

__all__ = ["StepLine", "EpochLine", "MAX_SUPERSEDED"]

#: Most superseded step (and epoch) records a run keeps (8.1: 2**20).
MAX_SUPERSEDED = 2**20


def _copy(store: StepStore, r0: int, r1: int) -> StepStore:
    """Rows ``[r0, r1)`` of ``store`` as a store of their own."""
    out = StepStore()
    out.extend_wire(store.to_wire(r0, r1), rebase=True)
    return out


class StepLine:
    """The attempts along one run's line of closed steps and its superseded chunks."""

    __slots__ = ("store", "bounds", "chunks", "n_superseded", "sup_counts", "closed",
                 "cut", "version", "_cache")

    def __init__(self, store: StepStore) -> None:
        self.store = store
        #: ``(first row, attempt)`` of each attempt's part of the line, both ascending
        #: (empty: every row is attempt 0's)
        self.bounds: List[Tuple[int, int]] = []
        #: ``(attempt, chunk)`` of the superseded records, in the order superseded
        self.chunks: List[Tuple[int, StepStore]] = []
        self.n_superseded = 0
        #: attempt -> how many of its records later attempts superseded (dropped included)
        self.sup_counts: Dict[int, int] = {}
        #: attempt -> [first, last] step it closed (superseded or not)
        self.closed: Dict[int, List[int]] = {}
        #: the lowest row count the line was cut to since :meth:`take_cut` (None: not cut)
        self.cut: Optional[int] = None
        self.version = 0
        self._cache: Dict[int, Tuple[int, StepStore]] = {}

    # ------------------------------------------------------------------ facts

    @property
    def attempt(self) -> int:
        """The attempt of the line's last part (0 when the line never changed hands)."""
        return self.bounds[-1][1] if self.bounds else 0

    def attempt_of(self, row: int) -> int:
        """The attempt that closed row ``row`` of the line."""
        b = self.bounds
        if not b or row < b[0][0]:
            return 0
        return b[bisect.bisect_right(b, (row, 1 << 62)) - 1][1]

    def attempts_of(self, r0: int, r1: int) -> np.ndarray:
        """The attempt of each row in ``[r0, r1)`` (int64)."""
        out = np.zeros(max(0, r1 - r0), np.int64)
        for i, (row, att) in enumerate(self.bounds):
            end = self.bounds[i + 1][0] if i + 1 < len(self.bounds) else r1
            lo, hi = max(row, r0), min(end, r1)
            if hi > lo:
                out[lo - r0:hi - r0] = att
        return out

    def rows_of(self, attempt: int) -> Tuple[int, int]:
        """The line's rows closed by ``attempt``."""
        b, n = self.bounds, self.store.rows
        if not b:
            return (0, n) if attempt == 0 else (0, 0)
        starts = [0] + [r for r, _ in b] if b[0][0] > 0 else [r for r, _ in b]
        atts = [0] + [a for _, a in b] if b[0][0] > 0 else [a for _, a in b]
        for i, a in enumerate(atts):
            if a == attempt:
                return starts[i], starts[i + 1] if i + 1 < len(starts) else n
        return 0, 0

    def first_row(self, attempt: int) -> int:
        """The line's first row closed by ``attempt`` when it is the line's latest part (the
        rows since are its own: 8.1's "the current attempt's" figures); the line's length
        while it closed none."""
        if attempt == 0:
            return 0
        b = self.bounds
        return b[-1][0] if b and b[-1][1] == attempt else self.store.rows

    def figures(self, attempt: int) -> Dict[str, Any]:
        """The ``attempts`` entry's step figures (8.1)."""
        c = self.closed.get(attempt)
        if c is None and attempt == 0 and not self.bounds and self.store.rows:
            c = [int(self.store.column("step")[0]), int(self.store.last_step or 0)]
        return {"first_step": c[0] if c else None, "last_step": c[1] if c else None,
                "superseded_steps": self.sup_counts.get(attempt, 0)}

    # ------------------------------------------------------------------ changes

    def rewind(self, attempt: int, first_step: int) -> Optional[int]:
        """Attempt ``attempt`` is about to append steps from ``first_step`` on: when it is a
        newer attempt than the line's last part and ``first_step`` is at or below the line's
        last step, the rows from ``first_step`` on are superseded (copied out, the line cut).
        Returns the row the line was cut to (None: no rewind)."""
        store = self.store
        last = store.last_step
        if attempt <= self.attempt or last is None or first_step > last:
            return None
        if not self.bounds and store.rows:
            self.bounds.append((0, 0))
        row = int(np.searchsorted(store.column("step"), first_step, "left"))
        n = store.rows
        # split the cut rows by the attempt that closed them (newest part first)
        b = self.bounds
        parts = [(start, b[i + 1][0] if i + 1 < len(b) else n, att)
                 for i, (start, att) in enumerate(b)]
        for start, end, att in reversed(parts):
            lo = max(start, row)
            if end > lo:
                self.chunks.append((att, _copy(store, lo, end)))
                self.sup_counts[att] = self.sup_counts.get(att, 0) + (end - lo)
                self.n_superseded += end - lo
        self.bounds = [(start, att) for start, att in b if start < row]
        store.truncate(row)
        self._drop_oldest()
        self.cut = row if self.cut is None else min(self.cut, row)
        self.version += 1
        self._cache.clear()
        return row

    def appended(self, before: int, attempt: int) -> None:
        """Rows ``[before, store.rows)`` were appended, closed by ``attempt``."""
        store = self.store
        if store.rows <= before:
            return
        if attempt and (not self.bounds or self.bounds[-1][1] != attempt):
            if not self.bounds and before:
                self.bounds.append((0, 0))
            self.bounds.append((before, attempt))
        steps = store.column("step")
        first, last = int(steps[before]), int(steps[store.rows - 1])
        c = self.closed.get(attempt)
        if c is None:
            self.closed[attempt] = [first, last]
        else:
            c[0], c[1] = min(c[0], first), max(c[1], last)
        self.version += 1
        self._cache.pop(attempt, None)

    def take_cut(self) -> Optional[int]:
        """The lowest row the line was cut to since the last call (the journal's)."""
        cut, self.cut = self.cut, None
        return cut

    def _drop_oldest(self) -> None:
        """Keep at most MAX_SUPERSEDED superseded records: the oldest attempt's go first."""
        while self.n_superseded > MAX_SUPERSEDED and self.chunks:
            oldest = min(a for a, _ in self.chunks)
            i = next(j for j, (a, _) in enumerate(self.chunks) if a == oldest)
            att, chunk = self.chunks[i]
            over = self.n_superseded - MAX_SUPERSEDED
            if chunk.rows <= over:
                del self.chunks[i]
                self.n_superseded -= chunk.rows
            else:  # keep its latest steps
                self.chunks[i] = (att, _copy(chunk, over, chunk.rows))
                self.n_superseded -= over

    # ------------------------------------------------------------------ queries

    def superseded_attempts(self) -> List[int]:
        """The attempts that have superseded records kept, oldest first."""
        return sorted({a for a, c in self.chunks if c.rows})

    def superseded_of(self, attempt: int) -> StepStore:
        """Attempt ``attempt``'s superseded records alone, as one store (not kept)."""
        return self._merged(attempt, line=False)

    def of_attempt(self, attempt: int) -> StepStore:
        """Attempt ``attempt``'s own closed records, superseded or not, as one store (built
        once per change of the line, then kept)."""
        hit = self._cache.get(attempt)
        if hit is not None and hit[0] == self.version:
            return hit[1]
        out = self._merged(attempt, line=True)
        self._cache[attempt] = (self.version, out)
        return out

    def _merged(self, attempt: int, line: bool) -> StepStore:
        parts: List[Tuple[int, StepStore, int, int]] = []
        r0, r1 = self.rows_of(attempt) if line else (0, 0)
        if r1 > r0:
            parts.append((int(self.store.column("step")[r0]), self.store, r0, r1))
        for att, chunk in self.chunks:
            if att == attempt and chunk.rows:
                parts.append((int(chunk.column("step")[0]), chunk, 0, chunk.rows))
        parts.sort(key=lambda p: p[0])
        out = StepStore()
        # the merged store names every metric the line does, in the line's order
        for name in self.store.in_order(self.store.metrics):
            out._new_series(name)
        for _, src, a, b in parts:
            block = src.to_wire(a, b)
            out.extend_wire(block, rebase=True)
        return out

    def metric_names(self) -> List[str]:
        """Sorted names of the line's and the superseded records' metrics (8.1); the store's
        own cached list while nothing was superseded (the store keeps a cut series' name)."""
        if not self.chunks:
            return self.store.metric_names()
        names = set(self.store.metric_names())
        for _, chunk in self.chunks:
            names.update(chunk.metrics)
        return sorted(names)

    # ------------------------------------------------------------------ wire

    def wire(self) -> Dict[str, Any]:
        """Snapshot form: the bounds, counts and chunks (the line is the store's wire)."""
        return {"bounds": [list(b) for b in self.bounds],
                "sup_counts": [[a, n] for a, n in sorted(self.sup_counts.items())],
                "closed": [[a, c[0], c[1]] for a, c in sorted(self.closed.items())],
                "chunks": [[a, c.to_wire()] for a, c in self.chunks]}

    def load_wire(self, wire: Dict[str, Any]) -> None:
        """Take back :meth:`wire` (over a store already loaded)."""
        self.bounds = [(int(r), int(a)) for r, a in wire.get("bounds") or []]
        self.sup_counts = {int(a): int(n) for a, n in wire.get("sup_counts") or []}
        self.closed = {int(a): [int(f), int(last)] for a, f, last in wire.get("closed") or []}
        self.chunks = []
        self.n_superseded = 0
        for a, block in wire.get("chunks") or []:
            chunk = StepStore()
            chunk.extend_wire(block, rebase=True)
            self.chunks.append((int(a), chunk))
            self.n_superseded += chunk.rows
        self.version += 1
        self._cache.clear()


class EpochLine:
    """Superseded epoch records (8.1): the line is the sink's ``records`` list (each record
    carrying ``attempt``); a rewind moves the records from an epoch on to :attr:`superseded`
    (``(attempt, record)``, oldest first, at most MAX_SUPERSEDED)."""

    __slots__ = ("superseded", "sup_counts", "closed", "current", "cut")

    def __init__(self) -> None:
        self.superseded: List[Dict[str, Any]] = []
        self.sup_counts: Dict[int, int] = {}
        self.closed: Dict[int, List[int]] = {}
        self.current = 0
        #: the fewest records the line was cut to since :meth:`take_cut` (None: not cut)
        self.cut: Optional[int] = None

    def take_cut(self) -> Optional[int]:
        """The fewest records the line was cut to since the last call (the journal's: it
        notes the ids of the records from there on again)."""
        cut, self.cut = self.cut, None
        return cut

    def new_attempt(self, attempt: int, last_closed: int) -> None:
        """Attempt ``attempt`` begins (the previous one's last closed epoch: for nothing but
        symmetry with the steps; records carry their own attempt)."""
        self.current = attempt

    def figures(self, attempt: int) -> Dict[str, Any]:
        c = self.closed.get(attempt)
        return {"first_epoch": c[0] if c else None, "last_epoch": c[1] if c else None,
                "superseded_epochs": self.sup_counts.get(attempt, 0)}

    def rewind(self, records: List[Dict[str, Any]], seqs: List[int], epoch: int) -> int:
        """Before the current attempt appends ``epoch``: supersede the line's records of
        earlier attempts from ``epoch`` on. Returns how many left the line."""
        cut = len(records)
        while cut and records[cut - 1]["epoch"] >= epoch \
                and records[cut - 1].get("attempt", 0) < self.current:
            cut -= 1
        gone = records[cut:]
        if not gone:
            return 0
        for rec in gone:
            a = rec.get("attempt", 0)
            self.sup_counts[a] = self.sup_counts.get(a, 0) + 1
        self.superseded.extend(gone)
        del records[cut:]
        del seqs[cut:]
        self.cut = cut if self.cut is None else min(self.cut, cut)
        if len(self.superseded) > MAX_SUPERSEDED:
            self.superseded.sort(key=lambda r: r.get("attempt", 0))
            del self.superseded[: len(self.superseded) - MAX_SUPERSEDED]
        return len(gone)

    def closed_one(self, record: Dict[str, Any]) -> None:
        a, e = record.get("attempt", 0), record["epoch"]
        c = self.closed.get(a)
        if c is None:
            self.closed[a] = [e, e]
        else:
            c[0], c[1] = min(c[0], e), max(c[1], e)

    def of_attempt(self, records: List[Dict[str, Any]], attempt: int) -> List[Dict[str, Any]]:
        """Attempt ``attempt``'s own closed epoch records, superseded or not, by epoch."""
        out = [r for r in self.superseded if r.get("attempt", 0) == attempt]
        out += [r for r in records if r.get("attempt", 0) == attempt]
        out.sort(key=lambda r: r["epoch"])
        return out
