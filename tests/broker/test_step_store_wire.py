"""The step store's wire blocks (what the journal and snapshots carry of closed steps),
against the store itself: round trips whole and in blocks, a block that does not follow or
does not ascend refused with nothing changed, a rebased block renumbered, and the records
read back from the wire equal to those appended."""
from __future__ import annotations

import random
from typing import Any, Optional

import msgspec
import numpy as np
import pytest

from broker.run.steps.store import (
    SAMPLES_PER_S,
    STEP_MS,
    TOKENS_PER_S,
    StepStore,
    wire_records,
)
from tests.support.randomsteps import (
    csv_header,
    random_records,
    store_of,
)


def observable(store: StepStore) -> bytes:
    """Everything a store answers, as bytes (NaN-safe)."""
    names = store.metric_names()
    out: list[Any] = [len(store), store.last_step, names,
                      [store.column(c).tolist() for c in ("step", "time", "n", "slowest",
                                                          "samples", "tokens")],
                      csv_header(names), "".join(store.csv_rows(chunk=7)),
                      store.slowest_ranks()]
    for m in names + [STEP_MS, SAMPLES_PER_S, TOKENS_PER_S]:
        for n in (1, 5, 10000):
            out.append(store.series(m, None, None, n))
    return msgspec.msgpack.encode(out)


def test_wire_round_trip_whole_and_in_blocks() -> None:
    rng = random.Random(11)
    records = random_records(rng, 700, ["loss", "acc", "late_metric"])
    # a metric that first appears late in the run
    for r in records[:400]:
        r["metrics"].pop("late_metric", None)
    src = store_of(records)
    whole = StepStore()
    whole.extend_wire(msgspec.msgpack.decode(msgspec.msgpack.encode(src.to_wire())))
    assert observable(whole) == observable(src)
    parts = StepStore()
    for a in range(0, 700, 123):
        block = msgspec.msgpack.decode(msgspec.msgpack.encode(src.to_wire(a, a + 123)))
        parts.extend_wire(block)
    assert observable(parts) == observable(src)
    empty = StepStore()
    empty.extend_wire(StepStore().to_wire())
    assert len(empty) == 0


def test_wire_prefix_holds_only_the_metrics_its_rows_have() -> None:
    """A store restored from a prefix of blocks (a torn journal tail) must not list a metric
    that only later rows have: step_metrics is 'every metric seen in a closed step'."""
    recs = [{"step": s, "time": 1.0, "n": 1, "metrics": {"loss": [1.0, 1.0, 1.0]}
             | ({"late": [2.0, 2.0, 2.0]} if s >= 5 else {}),
             "step_ms": None, "slowest_rank": None, "samples": 0, "tokens": 0,
             "samples_per_s": None, "tokens_per_s": None} for s in range(10)]
    src = store_of(recs, batches=1)
    prefix = StepStore()
    prefix.extend_wire(src.to_wire(0, 5))
    ref = store_of(recs[:5], batches=1)
    assert prefix.metric_names() == ref.metric_names() == ["loss"]
    assert observable(prefix) == observable(ref)


def _block(src: StepStore, start: int = 0, end: Optional[int] = None) -> dict[str, Any]:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(src.to_wire(start, end)))


def test_extend_wire_rejects_a_block_that_does_not_follow_and_changes_nothing() -> None:
    rng = random.Random(3)
    src = store_of(random_records(rng, 40, ["loss"]))
    dst = StepStore()
    dst.extend_wire(_block(src, 0, 20))
    before = observable(dst)
    bad_blocks = []
    bad_blocks.append(_block(src, 0, 20))        # base 0 again (a repeat)
    bad_blocks.append(_block(src, 25, 40))       # a gap
    b = _block(src, 20, 40)
    b["step"] = src.column("step")[:20].tobytes()  # steps not ascending from the last
    bad_blocks.append(b)
    b = _block(src, 20, 40)
    b["time"] = b["time"][:-8]                   # a column one row short
    bad_blocks.append(b)
    b = _block(src, 20, 40)
    b["step_ms"] = [b["step_ms"][0], b["step_ms"][1][:-8], b["step_ms"][2], b["step_ms"][3]]
    bad_blocks.append(b)                         # a series of unequal lengths
    b = _block(src, 20, 40)
    b["rows"] = 10                               # rows that do not match the columns
    bad_blocks.append(b)
    b = _block(src, 20, 40)
    rows = np.frombuffer(b["metrics"]["loss"][0], np.uint32).copy()
    rows[-1] = 99                                # a series row outside the block
    b["metrics"]["loss"] = [rows.tobytes()] + b["metrics"]["loss"][1:]
    bad_blocks.append(b)
    b = _block(src, 20, 40)
    b["base"] = -1
    bad_blocks.append(b)
    for i, bad in enumerate(bad_blocks):
        with pytest.raises(ValueError):
            dst.extend_wire(bad)
        assert observable(dst) == before, i
    dst.extend_wire(_block(src, 20, 40))  # the right one still fits
    assert observable(dst) == observable(src)


def test_extend_wire_rejects_steps_or_series_rows_that_do_not_ascend_within_the_block() -> None:
    """The web appends the broker's ``steps`` events as blocks (issue 17): a block must
    ascend in itself too (the old per-record check), or ``series``' searches go wrong."""
    rng = random.Random(5)
    src = store_of(random_records(rng, 30, ["loss"]), batches=1)
    dst = StepStore()
    dst.extend_wire(_block(src, 0, 10))
    before = observable(dst)
    b = _block(src, 10, 30)
    steps = src.column("step")[10:30].copy()
    steps[[3, 4]] = steps[[4, 3]]  # two steps swapped
    b["step"] = steps.tobytes()
    bad = [b]
    b = _block(src, 10, 30)
    rows = np.frombuffer(b["step_ms"][0], np.uint32).copy()
    assert len(rows) > 2
    rows[[0, 1]] = rows[[1, 0]]
    b["step_ms"] = [rows.tobytes()] + b["step_ms"][1:]
    bad.append(b)
    for i, block in enumerate(bad):
        for rebase in (False, True):
            with pytest.raises(ValueError):
                dst.extend_wire(block, rebase=rebase)
            assert observable(dst) == before, i


def test_extend_wire_rebase_renumbers_a_block_that_ascends_past_the_last_step() -> None:
    rng = random.Random(8)
    records = random_records(rng, 50, ["loss", "acc"])
    src = store_of(records)
    dst = store_of(records[:20])
    other = store_of(records[20:])  # its rows start at 0, not 20
    with pytest.raises(ValueError):
        dst.extend_wire(_block(other))
    dst.extend_wire(_block(other), rebase=True)
    assert observable(dst) == observable(src)
    ahead = StepStore()
    ahead.extend_wire(_block(src, 0, 30))
    shifted = _block(src, 30, 50)
    shifted["base"] = 1000  # numbered past the store's rows, its series rows not
    with pytest.raises(ValueError):
        ahead.extend_wire(shifted, rebase=True)  # series rows outside the block: malformed
    assert len(ahead) == 30


def test_to_wire_of_named_series_and_wire_records() -> None:
    """The broker's ``steps`` event is ``to_wire(r0, r1, names)`` of the batch's names;
    :func:`wire_records` of it are the store's records of those rows."""
    rng = random.Random(9)
    records = random_records(rng, 60, ["loss", "acc", "lr"])
    src = store_of(records)
    for a, b in ((0, 60), (10, 25), (59, 60)):
        full = src.to_wire(a, b)
        named = src.to_wire(a, b, ["acc", "loss", "lr", "never"])
        assert msgspec.msgpack.encode(named["metrics"]) == msgspec.msgpack.encode(
            {k: v for k, v in sorted(full["metrics"].items()) if v[0]})
        got = wire_records(msgspec.msgpack.decode(msgspec.msgpack.encode(named)))
        assert msgspec.json.encode(got) == msgspec.json.encode(src.records(a, b))
    only = src.to_wire(0, 60, ["loss"])
    assert list(only["metrics"]) == ["loss"]


def reference_records(store: StepStore, r0: int, r1: int) -> list[dict[str, Any]]:
    """Rows as records, one at a time (what ``records`` did before it went columnar)."""
    def triple(s: Any, row: int) -> Any:
        p0, p1 = s.span(row, row + 1)
        if p1 == p0:
            return None
        lo, hi = float(s.lo[p0]), float(s.hi[p0])
        return [float(s.mean[p0]), None if lo != lo else lo, None if hi != hi else hi]

    out = []
    for row in range(r0, r1):
        metrics = {}
        for name in sorted(store.metrics):
            t = triple(store.metrics[name], row)
            if t is not None:
                metrics[name] = t
        rates = {}
        for m in (SAMPLES_PER_S, TOKENS_PER_S):
            rows, vals = store._rates(m, row, row + 1)
            rates[m] = float(vals[0]) if len(rows) else None
        time = float(store.column("time")[row])
        slowest = int(store.column("slowest")[row])
        out.append({"step": int(store.column("step")[row]), "time": None if time != time else time,
                    "n": int(store.column("n")[row]), "metrics": metrics,
                    "step_ms": triple(store.step_ms, row), "slowest_rank": None if slowest < 0 else slowest,
                    "samples": int(store.column("samples")[row]),
                    "tokens": int(store.column("tokens")[row]),
                    "samples_per_s": rates[SAMPLES_PER_S], "tokens_per_s": rates[TOKENS_PER_S],
                    "data_ms": triple(store.data_ms, row)})
    return out


@pytest.mark.parametrize("seed", range(8))
def test_records_equal_one_row_at_a_time(seed: int) -> None:
    """``records`` (the web's SSE ``steps`` event) builds columns; the same dicts, in the
    same key order, with NaN/None where they were, for dense and sparse metrics."""
    rng = random.Random(seed)
    src = store_of(random_records(rng, 120, ["loss", "acc", "lr"][: 1 + seed % 3]))
    for a, b in ((0, 120), (5, 6), (40, 90), (119, 120)):
        got, want = src.records(a, b), reference_records(src, a, b)
        assert msgspec.json.encode(got) == msgspec.json.encode(want)
        assert repr(got) == repr(want)
    assert src.records(50, 50) == [] and src.records(200) == []

