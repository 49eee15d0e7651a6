"""The columnar store of closed steps (broker/run/steps/store.py) against brute-force references:
``series`` (PROTOCOL 4 "Step series": exact lo/hi, every step in exactly one bucket, at most
N buckets, one per step when they fit), the rate series, ``csv_rows``/``csv_header``
(PROTOCOL 4 ``/steps.csv``); the wire blocks the journal and snapshots carry are
:mod:`tests.broker.test_step_store_wire`'s."""
from __future__ import annotations

import csv
import io
import math
import random
from typing import Any, Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.run.steps.store import (
    SAMPLES_PER_S,
    STEP_MS,
    TOKENS_PER_S,
    StepStore,
)
from tests.support.randomsteps import (
    NONFINITE,
    csv_header,
    point,
    random_records,
    store_of,
)
from tests.support.steprecords import step_record

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
    import broker.run.steps.store as ss

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
