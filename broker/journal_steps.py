"""The journal's STEPS blocks, at a cost proportional to what a block holds.

A STEPS entry holds the rows of closed steps published since the last one, in the form of
:meth:`StepStore.to_wire`. ``to_wire`` looks at every series of the run to find those with a
point in the rows (issue 19 finding 3: blocks x names), so the journal does not call it:
it remembers which metric names the run's ``steps`` frames named, with the highest step
each was named for (:class:`InFlight`, fed by every ``steps`` frame the journal sees, at a
cost of the frame's own names), and builds the block from those series alone
(:func:`wire_block`). A name whose highest step is already written is dropped, so what a
block visits is the names of steps not yet written, not every name the run ever had. Rows
that did not come from the sink's own publishing (``RunSink.steps_published`` did not grow
with them: restored or appended directly) have no frames behind them; the journal then
visits every series for those rows (``InFlight.published`` is how it tells).

:func:`wire_block` writes what ``to_wire`` writes for the same rows (a test holds them
equal); it reads only the store's public parts (``column``, ``step_ms``, ``metrics`` and
each :class:`~broker.stepstore.Series`' arrays).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, KeysView, List, Optional

from broker.stepstore import Series, StepStore
from rank_agent.protocol import Steps

__all__ = ["InFlight", "wire_block", "COLUMNS"]

#: :meth:`StepStore.column` names, as :meth:`StepStore.to_wire` writes them.
COLUMNS = ("step", "time", "n", "slowest", "samples", "tokens")


class InFlight:
    """Metric names of one run's ``steps`` frames whose steps may not be written yet.

    A run's frames nearly always name the same metrics, so :meth:`saw` keeps the latest
    name set and the highest step of the frames naming it apart (one C-level set
    comparison a frame, issue 17) and merges them into :attr:`names` only when the set
    changes or the names are read."""

    __slots__ = ("_names", "published", "visited", "_keys", "_last")

    def __init__(self, published: int = 0) -> None:
        self._names: Dict[str, int] = {}  # name -> highest step a frame named it for
        #: the sink's ``steps_published`` when the journal last wrote its steps
        self.published = published
        #: series looked at while building blocks (work done, for tests and benchmarks)
        self.visited = 0
        # the latest frames' names (in their order: blocks list series in first-seen
        # order), not merged yet
        self._keys: Optional[KeysView[str]] = None
        self._last = -1  # and the highest step those frames named them for

    def saw(self, frame: Steps) -> None:
        """A ``steps`` frame of the run arrived (the sink accepted it)."""
        metrics = frame.metrics
        if not metrics or not frame.steps:
            return
        last = frame.steps[-1]  # (steps ascend: PROTOCOL 2)
        keys = self._keys
        if keys is not None and metrics.keys() == keys:
            if last > self._last:
                self._last = last
            return
        self._merge()
        self._keys = dict.fromkeys(metrics).keys()
        self._last = last

    def _merge(self) -> None:
        keys = self._keys
        if keys is None:
            return
        names, last = self._names, self._last
        get = names.get
        for name in keys:
            if get(name, -1) < last:
                names[name] = last
        self._keys = None

    @property
    def names(self) -> Dict[str, int]:
        """Each name a frame named, with the highest step it was named for."""
        self._merge()
        return self._names

    def candidates(self, first_step: int) -> List[str]:
        """Names that may have a point at ``first_step`` or later."""
        return [name for name, last in self.names.items() if last >= first_step]

    def written_through(self, step: int) -> None:
        """Every closed step up to ``step`` is written: names not named beyond it can have
        no point in a later block (a later point of theirs would name them again)."""
        self._names = {name: last for name, last in self.names.items() if last > step}


def _series_wire(s: Series, start: int, end: int) -> List[bytes]:
    p0, p1 = s.span(start, end)
    return [s.row[p0:p1].tobytes(), s.mean[p0:p1].tobytes(), s.lo[p0:p1].tobytes(),
            s.hi[p0:p1].tobytes()]


def wire_block(store: StepStore, start: int, end: int, names: Iterable[str],
               flight: InFlight) -> Dict[str, Any]:
    """Rows ``start:end`` of ``store`` as :meth:`StepStore.to_wire` gives them, looking only
    at the series of ``names`` (those that can have a point there) and ``step_ms``."""
    end = min(end, store.rows)
    out: Dict[str, Any] = {"base": start, "rows": end - start}
    for col in COLUMNS:
        out[col] = store.column(col)[start:end].tobytes()
    out["step_ms"] = _series_wire(store.step_ms, start, end)
    metrics: Dict[str, List[bytes]] = {}
    series = store.metrics
    visited = 0
    for name in names:
        s = series.get(name)
        visited += 1
        if s is not None and s.n and s.row[s.n - 1] >= start:
            wire = _series_wire(s, start, end)
            if wire[0]:
                metrics[name] = wire
    flight.visited += visited
    out["metrics"] = metrics
    return out
