"""The columnar store of closed steps (broker/steps/store.py) against brute-force references:
``series`` (PROTOCOL 4 "Step series": exact lo/hi, every step in exactly one bucket, at most
N buckets, one per step when they fit), the rate series, ``csv_rows``/``csv_header``
(PROTOCOL 4 ``/steps.csv``) and the wire blocks the journal and snapshots carry."""
from __future__ import annotations

import csv
import io
import math
import random
from typing import Any, Optional

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.steps.encodings import csv_columns
from broker.steps.store import (
    SAMPLES_PER_S,
    STEP_MS,
    TOKENS_PER_S,
    StepStore,
    wire_records,
)
from rank_agent.protocol import Steps
from tests.support.steprecords import step_record


def csv_header(metric_names: list[str]) -> str:
    """The header line, CSV-quoted (the web's adds only the formula guard)."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\r\n").writerow(csv_columns(metric_names))
    return out.getvalue()


NONFINITE = (math.nan, math.inf, -math.inf)


# ---------------------------------------------------------------- records


def point(rank: int, step: int, *, ms: Optional[float], metrics: dict[str, Optional[float]],
          samples: int, tokens: int, time: float) -> Steps:
    return Steps(run="r", rank=rank, steps=[step], times=[time], step_ms=[ms],
                 samples=[samples], tokens=[tokens],
                 metrics={k: [v] for k, v in metrics.items()})


def value(rng: random.Random, p_none: float = 0.2, p_bad: float = 0.05) -> Optional[float]:
    x = rng.random()
    if x < p_none:
        return None
    if x < p_none + p_bad:
        return rng.choice(NONFINITE)
    return round(rng.uniform(-1000, 1000), rng.randrange(0, 6))


def random_records(rng: random.Random, n: int, names: list[str], *, first: int = 0,
                   ranks: int = 3) -> list[dict[str, Any]]:
    """``n`` closed step records built by step_record from random per-rank points: sparse
    metrics (absent at many steps), NaN/inf values, null step times, zero counts."""
    out = []
    step = first
    p_metric = {name: rng.choice((0.1, 0.5, 0.9, 1.0)) for name in names}
    for _ in range(n):
        reps = {}
        present = [m for m in names if rng.random() < p_metric[m]]
        for r in rng.sample(range(ranks), rng.randrange(1, ranks + 1)):
            ms = value(rng, 0.15, 0.05)
            if ms is not None and ms == ms and math.isfinite(ms):
                ms = abs(ms) if rng.random() < 0.9 else 0.0
            reps[r] = point(r, step, ms=ms, metrics={m: value(rng) for m in present},
                            samples=rng.choice((0, 0, 8, 32, 2**40)),
                            tokens=rng.choice((0, 1000, 4096)),
                            time=rng.choice((1e9 + step, 1e9 + step + 0.5, math.nan)))
        out.append(step_record(step, reps))
        step += rng.choice((1, 1, 1, 2, 10, 1000))
    return out


def store_of(records: list[dict[str, Any]], *, batches: int = 3) -> StepStore:
    """A store fed the records in a few append() calls (batch boundaries must not matter)."""
    s = StepStore()
    cuts = sorted({0, len(records), *(len(records) * k // batches for k in range(1, batches))})
    for a, b in zip(cuts, cuts[1:]):
        s.append(records[a:b])
    return s


# ---------------------------------------------------------------- reference series


def _nan(x: Optional[float]) -> float:
    return math.nan if x is None else x


def reference_points(records: list[dict[str, Any]], metric: str, start: Optional[int],
                     end: Optional[int]) -> list[tuple[int, float, float, float]]:
    """(step, mean, rank_min, rank_max) of every closed step in range with a mean."""
    out = []
    for r in records:
        if (start is not None and r["step"] < start) or (end is not None and r["step"] > end):
            continue
        if metric in (SAMPLES_PER_S, TOKENS_PER_S):
            v = r[metric]
            if v is not None:
                out.append((r["step"], v, v, v))
            continue
        triple = r["step_ms"] if metric == STEP_MS else r["metrics"].get(metric)
        if triple is not None:
            out.append((r["step"], triple[0], _nan(triple[1]), _nan(triple[2])))
    return out


def same_float(a: float, b: float, exact: bool = True) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if exact or math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def check_series(buckets: list[list[Any]], pts: list[tuple[int, float, float, float]],
                 points: int) -> None:
    """Every property PROTOCOL 4 states for a step series, against brute force."""
    assert len(buckets) <= points
    if not pts:
        assert buckets == []
        return
    if len(pts) <= points:
        assert len(buckets) == len(pts)  # one bucket per step
    steps = [p[0] for p in pts]
    pos = 0
    prev_last = None
    for b in buckets:
        assert len(b) == 8
        first, last, mean, lo, hi, rmin, rmax, count = b
        assert isinstance(first, int) and isinstance(last, int) and isinstance(count, int)
        assert first <= last and count >= 1
        if prev_last is not None:
            assert first > prev_last  # ascending, disjoint
        prev_last = last
        mine = pts[pos:pos + count]
        assert len(mine) == count
        assert mine[0][0] == first and mine[-1][0] == last  # the bucket's first/last steps
        pos += count
        means = [p[1] for p in mine]
        finite = [m for m in means if math.isfinite(m)]
        assert same_float(lo, min(finite) if finite else math.nan)  # exact
        assert same_float(hi, max(finite) if finite else math.nan)
        mins = [p[2] for p in mine if not math.isnan(p[2])]
        maxs = [p[3] for p in mine if not math.isnan(p[3])]
        assert same_float(rmin, min(mins) if mins else math.nan)
        assert same_float(rmax, max(maxs) if maxs else math.nan)
        with np.errstate(all="ignore"):
            want = float(np.mean(np.array(means))) if count > 1 else means[0]
        assert same_float(mean, want, exact=count == 1)
    assert pos == len(pts) == sum(b[7] for b in buckets)  # every step in exactly one
    # each step falls in exactly one [first, last]
    for s in steps[:: max(1, len(steps) // 50)]:
        assert sum(1 for b in buckets if b[0] <= s <= b[1]) == 1


# ---------------------------------------------------------------- series


@pytest.mark.parametrize("seed", range(12))
def test_series_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    names = ["loss", "acc", "lr"][: rng.randrange(1, 4)]
    records = random_records(rng, rng.choice((1, 2, 17, 300, 2500)), names)
    store = store_of(records, batches=rng.randrange(1, 5))
    assert len(store) == len(records) and store.last_step == records[-1]["step"]
    lo_step, hi_step = records[0]["step"], records[-1]["step"]
    for _ in range(25):
        metric = rng.choice(names + [STEP_MS, SAMPLES_PER_S, TOKENS_PER_S])
        start = rng.choice((None, lo_step, rng.randint(lo_step - 5, hi_step + 5)))
        end = rng.choice((None, hi_step, rng.randint(lo_step - 5, hi_step + 5)))
        n = rng.choice((1, 2, 3, 7, 100, 1000, len(records), len(records) + 1, 10000))
        buckets = store.series(metric, start, end, n)
        check_series(buckets, reference_points(records, metric, start, end), n)


step_values = st.one_of(st.none(), st.sampled_from(NONFINITE),
                        st.floats(-1e12, 1e12, allow_nan=False, allow_infinity=False))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 3), st.lists(st.tuples(step_values, step_values),
                                                      min_size=1, max_size=3)),
                min_size=1, max_size=60),
       st.integers(1, 70), st.one_of(st.none(), st.integers(0, 200)),
       st.one_of(st.none(), st.integers(0, 200)))
def test_series_properties_hypothesis(spec: list[Any], n: int, start: Optional[int],
                                      end: Optional[int]) -> None:
    records = []
    step = 0
    for gap, ranks in spec:
        step += gap
        reps = {r: point(r, step, ms=ms, metrics={"m": v}, samples=r, tokens=0, time=1.0)
                for r, (v, ms) in enumerate(ranks)}
        records.append(step_record(step, reps))
    store = store_of(records, batches=2)
    for metric in ("m", STEP_MS, SAMPLES_PER_S):
        check_series(store.series(metric, start, end, n),
                     reference_points(records, metric, start, end), n)


def test_one_step_spike_in_200000_steps_survives_1000_buckets() -> None:
    n = 200_000
    spike, dip = 123_457, 7_001
    store = StepStore()
    chunk = []
    for s in range(n):
        v = 1.0 + (s % 7) * 1e-3
        lo, hi = v - 0.5, v + 0.5
        if s == spike:
            v, hi = 1e6, 2e6
        elif s == dip:
            v, lo = -5.0, -50.0
        chunk.append({"step": s, "time": 1e9 + s, "n": 2, "metrics": {"loss": [v, lo, hi]},
                      "step_ms": [100.0, 90.0, 110.0], "slowest_rank": 1, "samples": 64,
                      "tokens": 0, "samples_per_s": 64 / 0.11, "tokens_per_s": None})
        if len(chunk) == 10_000:
            store.append(chunk)
            chunk = []
    store.append(chunk)
    buckets = store.series("loss", None, None, 1000)
    assert len(buckets) == 1000 and sum(b[7] for b in buckets) == n
    (b_spike,) = [b for b in buckets if b[0] <= spike <= b[1]]
    assert b_spike[4] == 1e6 and b_spike[6] == 2e6
    (b_dip,) = [b for b in buckets if b[0] <= dip <= b[1]]
    assert b_dip[3] == -5.0 and b_dip[5] == -50.0
    assert max(b[4] for b in buckets) == 1e6 and min(b[3] for b in buckets) == -5.0
    # and at any N, and in any window that holds it
    for points in (1, 2, 3, 999, 10000):
        got = store.series("loss", None, None, points)
        assert max(b[4] for b in got) == 1e6 and min(b[3] for b in got) == -5.0
    got = store.series("loss", spike - 50_000, spike + 3, 7)
    assert max(b[4] for b in got) == 1e6 and got[0][0] == spike - 50_000
    assert got[-1][1] == spike + 3


def test_rate_series_are_the_records_rates_with_lo_hi_equal_rank_min_max() -> None:
    rng = random.Random(5)
    records = random_records(rng, 500, ["loss"])
    store = store_of(records)
    for metric in (SAMPLES_PER_S, TOKENS_PER_S):
        want = [(r["step"], r[metric]) for r in records if r[metric] is not None]
        assert want  # the generator makes some
        got = store.series(metric, None, None, 10000)
        assert [(b[0], b[2]) for b in got] == want  # exactly the records' figures
        for b in store.series(metric, None, None, 13):
            assert same_float(b[3], b[5]) and same_float(b[4], b[6])
    # steps with no rate are not in the series (count 0 samples, null or 0 step time)
    none = [r["step"] for r in records if r["samples_per_s"] is None]
    assert none
    covered = {b[0] for b in store.series(SAMPLES_PER_S, None, None, 10000)}
    assert not covered & set(none)


@pytest.mark.parametrize("ms", [5e-324, 1e-310, 2.2250738585e-313])
def test_rates_of_tiny_step_times_agree_with_the_record_and_warn_nothing(ms: float) -> None:
    rec = step_record(0, {0: point(0, 0, ms=ms, metrics={}, samples=8, tokens=0, time=1.0)})
    store = store_of([rec], batches=1)
    got = store.series(SAMPLES_PER_S, None, None, 10)  # filterwarnings=error: no warning
    if rec["samples_per_s"] is None:
        assert got == []
    else:
        assert got[0][2] == rec["samples_per_s"]
    assert list(store.csv_rows())[0].split(",")[-2] == _cell(rec["samples_per_s"])


def test_step_ms_series_and_metric_shadowed_by_it() -> None:
    recs = [step_record(s, {0: point(0, s, ms=10.0 * (s + 1), metrics={"step_ms": -1.0},
                                     samples=0, tokens=0, time=1.0)}) for s in range(5)]
    store = store_of(recs)
    assert [b[2] for b in store.series(STEP_MS, None, None, 10)] == [10.0, 20.0, 30.0, 40.0,
                                                                     50.0]
    assert "step_ms" in store.metric_names()


def test_unknown_metric_empty_range_and_empty_store() -> None:
    store = StepStore()
    assert store.series("loss", None, None, 10) == []
    assert store.series(STEP_MS, None, None, 10) == []
    assert store.series(SAMPLES_PER_S, None, None, 10) == []
    assert store.last_step is None and len(store) == 0 and store.metric_names() == []
    store.append(random_records(random.Random(1), 50, ["loss"], first=100))
    assert store.series("nope", None, None, 10) == []
    assert store.series("loss", 0, 99, 10) == []
    assert store.series("loss", 10**12, None, 10) == []
    assert store.series("loss", 150, 120, 10) == []


def test_series_bounds_are_inclusive() -> None:
    recs = [step_record(s, {0: point(0, s, ms=1.0, metrics={"m": float(s)}, samples=0,
                                     tokens=0, time=1.0)}) for s in range(0, 100, 10)]
    store = store_of(recs)
    got = store.series("m", 20, 50, 100)
    assert [b[0] for b in got] == [20, 30, 40, 50]
    assert [b[0] for b in store.series("m", 21, 49, 100)] == [30, 40]


def test_nonfinite_means_are_in_the_series_but_never_lo_or_hi() -> None:
    triples = [[1.0, 1.0, 1.0], [math.nan, 0.5, 3.0], [math.inf, 2.0, 2.0], [4.0, 4.0, 4.0],
               [math.nan, None, None]]
    recs = [{"step": s, "time": None, "n": 1, "metrics": {"m": t}, "step_ms": None,
             "slowest_rank": None, "samples": 0, "tokens": 0, "samples_per_s": None,
             "tokens_per_s": None} for s, t in enumerate(triples)]
    store = store_of(recs, batches=1)
    one = store.series("m", None, None, 100)
    assert [b[0] for b in one] == [0, 1, 2, 3, 4]
    assert math.isnan(one[1][2]) and math.isnan(one[1][3]) and one[1][5] == 0.5
    assert one[2][2] == math.inf and math.isnan(one[2][4])
    (b,) = store.series("m", None, None, 1)
    assert b[0:2] == [0, 4] and b[7] == 5
    assert math.isnan(b[2])  # mean of means with a NaN in it
    assert (b[3], b[4], b[5], b[6]) == (1.0, 4.0, 0.5, 4.0)
    (b,) = store.series("m", 1, 2, 1)
    assert math.isnan(b[3]) and math.isnan(b[4]) and (b[5], b[6]) == (0.5, 3.0)


# ---------------------------------------------------------------- wire blocks


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


# ---------------------------------------------------------------- csv


def _cell(x: Any) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return ""
    return repr(x) if isinstance(x, float) else str(x)


def expected_csv(records: list[dict[str, Any]]) -> list[list[str]]:
    names = sorted({m for r in records for m in r["metrics"]})
    rows = [["step", "time", "n"] + [f"{m}_{k}" for m in names for k in ("mean", "min", "max")]
            + ["step_ms_mean", "step_ms_min", "step_ms_max", "data_ms_mean", "data_ms_min",
               "data_ms_max", "slowest_rank", "samples", "tokens", "samples_per_s",
               "tokens_per_s"]]
    for r in records:
        row = [str(r["step"]), _cell(r["time"]), str(r["n"])]
        for m in names:
            t = r["metrics"].get(m)
            row += [_cell(v) for v in t] if t is not None else ["", "", ""]
        row += [_cell(v) for v in r["step_ms"]] if r["step_ms"] is not None else ["", "", ""]
        dms = r.get("data_ms")
        row += [_cell(v) for v in dms] if dms is not None else ["", "", ""]
        row += [_cell(r["slowest_rank"]), str(r["samples"]), str(r["tokens"]),
                _cell(r["samples_per_s"]), _cell(r["tokens_per_s"])]
        rows.append(row)
    return rows


@pytest.mark.parametrize("chunk", [1, 5, 4096])
def test_csv_matches_protocol_columns_and_cells(chunk: int) -> None:
    rng = random.Random(chunk)
    records = random_records(rng, 230, ["zeta", "alpha", "with,comma \"q\""])
    store = store_of(records)
    text = csv_header(store.metric_names()) + "".join(store.csv_rows(chunk=chunk))
    assert text.endswith("\r\n") and "\r\n\r\n" not in text
    got = list(csv.reader(io.StringIO(text, newline="")))
    want = expected_csv(records)
    assert got[0] == want[0]
    assert got[0][3:6] == ["alpha_mean", "alpha_min", "alpha_max"]
    assert len(got) == len(want)
    for g, w in zip(got[1:], want[1:]):
        assert len(g) == len(w)
        for a, b in zip(g, w):
            assert a == b or (a and b and math.isclose(float(a), float(b), rel_tol=1e-15))


def test_csv_of_an_empty_store() -> None:
    store = StepStore()
    assert list(store.csv_rows()) == []
    assert csv_header([]) == ("step,time,n,step_ms_mean,step_ms_min,step_ms_max,"
                              "data_ms_mean,data_ms_min,data_ms_max,slowest_rank,"
                              "samples,tokens,samples_per_s,tokens_per_s\r\n")


def test_nbytes_counts_a_few_dozen_bytes_a_step() -> None:
    store = StepStore()
    recs = random_records(random.Random(2), 20_000, ["loss"], ranks=1)
    store.append(recs)
    assert store.nbytes() < 20_000 * (44 + 2 * 28) * 1.3


def test_a_new_series_starts_small_so_1024_names_cost_kilobytes_not_megabytes() -> None:
    """Issue 19 finding 3: each new name allocated >= 1,024 rows (~28 KB) in the broker
    and in every web; 1,024 names x a few steps were ~29 MB. Series grow geometrically
    from a few rows now, so appending stays amortised O(1)."""
    store = StepStore()
    for step in range(3):
        store.append([{"step": step, "time": 1.0, "n": 1, "metrics": {
            f"m{j}": [1.0, 1.0, 1.0] for j in range(1024)}, "step_ms": [1.0, 1.0, 1.0],
            "slowest_rank": 0, "samples": 0, "tokens": 0}])
    assert store.nbytes() < 512 * 1024, store.nbytes()
    series = store.metrics["m0"]
    for _ in range(20_000):  # growth stays geometric: few reallocations, little slack
        series.extend([series.row[series.n - 1] + 1], [1.0], [1.0], [1.0])
    assert series.n == 20_003 and len(series.row) < 20_003 * 1.3


def _append_batch(store: StepStore, s0: int, k: int) -> None:
    step = np.arange(s0, s0 + k, dtype=np.int64)
    vals = step.astype(np.float64) * 0.5
    idx = np.arange(k, dtype=np.int64)
    store.append_columns(step, step.astype(np.float64), np.ones(k, np.int64),
                         np.full(k, -1, np.int64), np.zeros(k, np.int64), np.zeros(k, np.int64),
                         (idx, vals, vals, vals), [("loss", idx, vals, vals - 1, vals + 1)])


@pytest.mark.parametrize("in_place", [True, False])
def test_growth_keeps_every_row_and_a_live_view_keeps_its_values(
        in_place: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's arrays grow in place where nothing points into them (issue 17: a realloc,
    no copy) and by a copy where a view is alive: a view taken before a growth still reads
    what it read (the array it points into is never freed under it), and the store keeps
    every row, on both paths (the copy is the only path from Python 3.14)."""
    import broker.steps.store as ss

    monkeypatch.setattr(ss, "_IN_PLACE", in_place)
    store = StepStore()
    s0 = 0
    for k in (3, 1000, 5000, 20_000):  # past the doubling: growth by 1/8
        _append_batch(store, s0, k)
        s0 += k
    loss = store.metrics["loss"]
    mean_view, step_view = loss.mean[:loss.n], store._cols["step"][:store.rows]
    before = (mean_view.copy(), step_view.copy())
    for _ in range(40):  # ~10 growths of every array, each with the views alive
        _append_batch(store, s0, 2000)
        s0 += 2000
    assert np.array_equal(mean_view, before[0]) and np.array_equal(step_view, before[1])
    del mean_view, step_view
    arrays = (id(loss.mean), id(store._cols["step"]))
    for _ in range(40):  # and as many with none (in place where it may)
        _append_batch(store, s0, 2000)
        s0 += 2000
    # grown in place, the arrays are the same objects; copied, new ones
    assert ((id(loss.mean), id(store._cols["step"])) == arrays) == in_place
    assert store.rows == loss.n == s0
    assert np.array_equal(store._cols["step"][:s0], np.arange(s0))
    assert np.array_equal(loss.mean[:s0], np.arange(s0) * 0.5)
    assert np.array_equal(loss.hi[:s0], np.arange(s0) * 0.5 + 1)
    assert np.array_equal(loss.row[:s0], np.arange(s0))
    assert [r["step"] for r in store.records(s0 - 2, s0)] == [s0 - 2, s0 - 1]
