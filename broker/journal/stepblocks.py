"""The journal's STEPS blocks, at a cost proportional to what a block holds.

A STEPS entry holds the rows of closed steps published since the last one, in the form of
:meth:`StepStore.to_wire`. ``to_wire`` looks at every series of the run to find those with a
point in the rows (issue 19 finding 3: blocks x names), so the journal does not call it: it
asks the sink which metric names the takes since its last block published
(``RunSink.steps_named_since``, kept per published batch, not per frame: issue 17) and
builds the block from those series alone (:func:`wire_block`). So what a block visits is the
names of the steps it holds, not every name the run ever had. Rows that did not come from
the sink's own publishing (``RunSink.steps_published`` did not grow with them: restored or
appended directly) have no takes behind them; the journal then visits every series for those
rows (:attr:`StepBlocks.published` is how it tells).

:func:`wire_block` writes what ``to_wire`` writes for the same rows (a test holds them
equal); it reads only the store's public parts (``column``, ``step_ms``, ``metrics`` and
each :class:`~broker.run.steps.store.Series`' arrays).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List

from broker.run.steps.encodings import series_wire
from broker.run.steps.store import StepStore

__all__ = ["StepBlocks", "wire_block", "COLUMNS"]

#: :meth:`StepStore.column` names, as :meth:`StepStore.to_wire` writes them.
COLUMNS = ("step", "time", "n", "slowest", "samples", "tokens")


class StepBlocks:
    """What the journal knows of one run's STEPS blocks beyond the store."""

    __slots__ = ("published", "visited")

    def __init__(self, published: int = 0) -> None:
        #: the sink's ``steps_published`` when the journal last wrote its steps
        self.published = published
        #: series looked at while building blocks (work done, for tests and benchmarks)
        self.visited = 0


def wire_block(store: StepStore, start: int, end: int, names: Iterable[str],
               flight: StepBlocks) -> Dict[str, Any]:
    """Rows ``start:end`` of ``store`` as :meth:`StepStore.to_wire` gives them, looking only
    at the series of ``names`` (those that can have a point there) and ``step_ms``."""
    end = min(end, store.rows)
    out: Dict[str, Any] = {"base": start, "rows": end - start}
    for col in COLUMNS:
        out[col] = store.column(col)[start:end].tobytes()
    out["step_ms"] = series_wire(store.step_ms, start, end)
    out["data_ms"] = series_wire(store.data_ms, start, end) if store.data_ms.n else None
    metrics: Dict[str, List[bytes]] = {}
    series = store.metrics
    visited = 0
    for name in names:
        s = series.get(name)
        visited += 1
        if s is not None and s.n and s.row[s.n - 1] >= start:
            wire = series_wire(s, start, end)
            if wire[0]:
                metrics[name] = wire
    flight.visited += visited
    out["metrics"] = metrics
    return out
