"""What a closed step holds (PROTOCOL.md 2.4), pure: ``step_record``'s figures (means,
extremes, the slowest rank, samples and rates, non-finite values) and the per-rank figures
the sink keeps (the rank's step, its step time, its share of slowest steps)."""
from __future__ import annotations

import math
from typing import Any, Optional

import pytest

from broker.run.steps.closer import SHARE_WINDOW, STEP_MS_WINDOW
from rank_agent.protocol import Steps
from tests.support.stepdrive import T0, Drive, fin, same, stp
from tests.support.steprecords import step_record

# ---------------------------------------------------------------- step_record: the figures


def reports(*points: tuple[int, dict[str, Any]]) -> dict[int, Steps]:
    """rank -> the frame holding its point of one step (7), given as keyword fields."""
    out = {}
    for rank, kw in points:
        kw = dict(kw)
        out[rank] = stp(rank, [7], **kw)
    return out


def test_record_shape_and_plain_figures() -> None:
    rec = step_record(7, reports(
        (0, dict(ms=100.0, samples=[8], tokens=[800], loss=2.0, times=[T0 + 3])),
        (1, dict(ms=300.0, samples=[8], tokens=[800], loss=4.0, times=[T0 + 9])),
        (2, dict(ms=200.0, samples=[8], tokens=[800], loss=6.0, times=[T0 + 5])),
    ))
    assert list(rec) == ["step", "time", "n", "metrics", "step_ms", "slowest_rank", "samples",
                         "tokens", "samples_per_s", "tokens_per_s", "data_ms"]
    assert rec["step"] == 7 and rec["n"] == 3
    assert rec["time"] == T0 + 9  # the largest times value, not the last rank's
    assert rec["metrics"] == {"loss": [4.0, 2.0, 6.0]}
    assert rec["step_ms"] == [200.0, 100.0, 300.0] and rec["slowest_rank"] == 1
    assert (rec["samples"], rec["tokens"]) == (24, 2400)
    assert rec["samples_per_s"] == 24 / 0.3 and rec["tokens_per_s"] == 2400 / 0.3


def test_metric_mean_is_arithmetic_and_only_over_ranks_that_gave_a_value() -> None:
    rec = step_record(7, reports(
        (0, dict(metrics={"a": [1.0], "b": [None]})),
        (1, dict(metrics={"a": [None], "b": [None]})),
        (2, dict(metrics={"a": [4.0]})),
        (3, dict(metrics={"c": [0.1]})),
    ))
    assert rec["metrics"] == {"a": [2.5, 1.0, 4.0], "c": [0.1, 0.1, 0.1]}  # no "b": all None
    assert list(rec["metrics"]) == ["a", "c"]
    assert rec["n"] == 4


def test_metric_mean_of_finite_values_that_overflow_a_naive_sum_stays_finite() -> None:
    rec = step_record(7, reports((0, dict(loss=1e308)), (1, dict(loss=1e308))))
    assert rec["metrics"]["loss"] == [1e308, 1e308, 1e308]
    rec = step_record(7, reports((0, dict(loss=0.1)), (1, dict(loss=0.2)), (2, dict(loss=0.3))))
    assert rec["metrics"]["loss"][0] == math.fsum([0.1, 0.2, 0.3]) / 3


@pytest.mark.parametrize("seed", range(6))
def test_means_of_many_ranks_are_exactly_rounded(seed: int) -> None:
    """Issue 17: a step's sums are vectorised (a long-double sum is used where it provably
    rounds to the exact sum, else ``fsum``): the mean is still exactly ``fsum / n``, for
    few and for many ranks, values of mixed signs and magnitudes, sums that cancel."""
    import random

    rng = random.Random(seed)
    for n in (3, 4, 17, 300, 1024):
        kind = rng.randrange(4)
        if kind == 0:
            vals = [rng.uniform(-1, 1) * 10 ** rng.randrange(-8, 8) for _ in range(n)]
        elif kind == 1:
            vals = [rng.choice((0.1, 0.2, 0.3, 0.7)) for _ in range(n)]
        elif kind == 2:  # cancellation: the exact sum is tiny next to the values
            half = [rng.uniform(0, 1e6) for _ in range(n // 2)]
            vals = half + [-v for v in half] + [rng.uniform(0, 1e-9)] * (n - 2 * (n // 2))
            vals = vals or [1.0]
        else:
            vals = [rng.gauss(2.5, 0.01) for _ in range(n)]
        rng.shuffle(vals)
        rec = step_record(7, reports(*[(r, dict(loss=v, ms=abs(v))) for r, v in enumerate(vals)]))
        assert rec["metrics"]["loss"] == [math.fsum(vals) / n, min(vals), max(vals)], (n, kind)
        ms = [abs(v) for v in vals]
        assert rec["step_ms"] == [math.fsum(ms) / n, min(ms), max(ms)]


@pytest.mark.parametrize("values, want", [
    ([1.0, math.nan, 3.0], [math.nan, 1.0, 3.0]),
    ([math.inf, 1.0, 5.0], [math.inf, 1.0, 5.0]),
    ([-math.inf, 1.0], [-math.inf, 1.0, 1.0]),
    ([math.inf, -math.inf, 2.0], [math.nan, 2.0, 2.0]),
    ([math.nan], [math.nan, None, None]),
    ([math.inf, math.inf], [math.inf, None, None]),
    ([math.nan, math.inf], [math.nan, None, None]),
])
def test_nonfinite_metric_values(values: list[float], want: list[Any]) -> None:
    rec = step_record(7, reports(*[(r, dict(loss=v)) for r, v in enumerate(values)]))
    assert same(rec["metrics"]["loss"], want)
    assert rec["n"] == len(values)


@pytest.mark.parametrize("ms, want, slowest", [
    ([100.0, math.nan, 300.0], [math.nan, 100.0, 300.0], 2),
    ([math.inf, 100.0], [math.inf, 100.0, 100.0], 1),     # inf is never the slowest
    ([math.nan, math.inf], [math.nan, None, None], None),  # no finite value: no slowest
    ([None, 50.0, None], [50.0, 50.0, 50.0], 1),          # nulls are skipped
    ([None, None], None, None),
    ([-5.0, -1.0], [-3.0, -5.0, -1.0], 1),
])
def test_step_ms_rules(ms: list[Any], want: Any, slowest: Optional[int]) -> None:
    rec = step_record(7, reports(*[(r, dict(ms=v, samples=[10])) for r, v in enumerate(ms)]))
    assert same(rec["step_ms"], want)
    assert rec["slowest_rank"] == slowest


def test_slowest_rank_ties_go_to_the_lowest_rank() -> None:
    # reports inserted highest rank first: the rule, not the dict order, must decide
    pts = {r: stp(r, [7], ms=ms) for r, ms in [(5, 300.0), (3, 300.0), (4, 100.0),
                                                   (9, math.inf)]}
    assert step_record(7, pts)["slowest_rank"] == 3


@pytest.mark.parametrize("ms, samples, tokens, sps, tps", [
    ([100.0, 200.0], [4, 6], [40, 60], 10 / 0.2, 100 / 0.2),    # max step_ms, not the mean
    ([100.0, math.inf], [4, 6], [40, 60], 10 / 0.1, 100 / 0.1),  # max over the finite values
    ([None, None], [4, 6], [40, 60], None, None),                # max null
    ([math.nan, None], [4, 6], [40, 60], None, None),            # max null (none finite)
    ([0.0, 0.0], [4, 6], [40, 60], None, None),                  # max 0
    ([100.0, 200.0], [0, 0], [40, 60], None, 100 / 0.2),         # samples sum 0
    ([100.0, 200.0], None, None, None, None),                    # not sent: sums 0
])
def test_samples_tokens_and_rates(ms: list[Any], samples: Any, tokens: Any, sps: Any,
                                  tps: Any) -> None:
    rec = step_record(7, reports(*[
        (r, dict(ms=v, samples=None if samples is None else [samples[r]],
                 tokens=None if tokens is None else [tokens[r]])) for r, v in enumerate(ms)]))
    assert rec["samples"] == (sum(samples) if samples else 0)
    assert rec["tokens"] == (sum(tokens) if tokens else 0)
    assert rec["samples_per_s"] == sps and rec["tokens_per_s"] == tps


def test_samples_of_ranks_that_did_not_send_them_count_zero() -> None:
    rec = step_record(7, reports((0, dict(samples=[5], ms=100.0)), (1, dict(ms=100.0))))
    assert rec["samples"] == 5 and rec["tokens"] == 0 and rec["samples_per_s"] == 50.0


def test_per_rank_metric_names_close_in_time_linear_in_the_values() -> None:
    """Ranks that log names of their own (``loss/rank7``) make a step of many names, each
    from one rank: closing it must cost O(values), not O(names x ranks) (512 ranks x 64
    names of their own took ~8 s per step, the broker's loop blocked)."""
    import time as _time

    ranks = 512
    pts = {r: stp(r, [7], metrics={**{f"r{r}/m{i}": [float(r + i)] for i in range(62)},
                                   "loss": [float(r)], "sparse": [None if r % 2 else 1.0]})
           for r in range(ranks)}
    t0 = _time.perf_counter()
    rec = step_record(7, pts)
    took = _time.perf_counter() - t0
    assert len(rec["metrics"]) == ranks * 62 + 2
    assert rec["metrics"]["r5/m3"] == [8.0, 8.0, 8.0]
    assert rec["metrics"]["loss"] == [math.fsum(range(ranks)) / ranks, 0.0, ranks - 1.0]
    assert rec["metrics"]["sparse"] == [1.0, 1.0, 1.0]
    assert list(rec["metrics"]) == sorted(rec["metrics"])
    assert took < 2.0, took


def test_record_time_ignores_nan_times_whatever_the_rank_order() -> None:
    rec = step_record(7, reports((0, dict(times=[math.nan]))))
    assert rec["time"] is None or math.isnan(rec["time"])  # null on the wire either way
    for order in ((0, 1, 2), (2, 1, 0), (1, 0, 2)):
        times = {0: math.nan, 1: 5.0, 2: 3.0}
        rec = step_record(7, reports(*[(r, dict(times=[times[r]])) for r in order]))
        assert rec["time"] == 5.0, order


# ---------------------------------------------------------------- per-rank figures


def test_rank_step_is_the_highest_reported_late_or_not() -> None:
    d = Drive(3)
    d.send(stp(0, range(10)), 1.0)
    d.send(stp(1, range(10)), 1.0)
    d.send(fin(2), 1.0)
    d.tick(2.0)
    assert d.closed == list(range(10))
    d.send(stp(0, [3]), 3.0)  # late; a lower step does not lower it
    assert d.rank(0)["step"] == 9
    d.send(stp(2, [4, 5]), 3.0)  # all late: the rank's first report still counts
    assert d.rank(2)["step"] == 5
    assert d.sink.late_steps == 3
    assert d.rank(1)["step"] == 9


def test_rank_step_ms_is_the_mean_of_its_last_100_non_null_values() -> None:
    d = Drive(1)
    values: list[Optional[float]] = []
    for i in range(250):
        values.append(None if i % 3 == 0 else float(i))
    d.send(stp(0, range(125), ms=values[:125]), 1.0)
    d.send(stp(0, range(125, 250), ms=values[125:]), 2.0)
    nonnull = [v for v in values if v is not None]
    assert STEP_MS_WINDOW == 100
    assert d.rank(0)["step_ms"] == pytest.approx(sum(nonnull[-100:]) / 100, rel=1e-15)
    d1 = Drive(2)
    d1.send(stp(0, [0, 1], ms=[None, None]), 1.0)
    assert d1.rank(0)["step_ms"] is None and d1.rank(1)["step_ms"] is None
    assert d1.rank(1)["step"] is None


def test_slowest_share_over_the_last_1000_closed_steps_with_a_slowest_rank() -> None:
    assert SHARE_WINDOW == 1000
    d = Drive(2)
    # 600 steps rank 0 is slowest, 200 with no slowest rank (null step_ms), then 600 with rank 1
    ms0 = [200.0] * 600 + [None] * 200 + [100.0] * 600
    ms1 = [100.0] * 600 + [None] * 200 + [200.0] * 600
    for k in range(0, 1400, 100):
        d.send(stp(0, range(k, k + 100), ms=ms0[k:k + 100]), 1.0 + k / 1000)
        d.send(stp(1, range(k, k + 100), ms=ms1[k:k + 100]), 1.0 + k / 1000)
    d.send(fin(0), 3.0)
    d.send(fin(1), 3.0)
    assert d.closed == list(range(1400))
    assert sum(r["slowest_rank"] is None for r in d.records) == 200
    # last 1000 with a slowest rank: 400 of rank 0, 600 of rank 1
    assert d.rank(0)["slowest_share"] == pytest.approx(0.4)
    assert d.rank(1)["slowest_share"] == pytest.approx(0.6)


def test_slowest_share_is_zero_with_no_closed_step() -> None:
    d = Drive(1)
    d.send(stp(0, [0], ms=[None]), 1.0)
    d.tick(2.0)
    assert d.closed == [0]
    assert d.rank(0)["slowest_share"] == 0.0
