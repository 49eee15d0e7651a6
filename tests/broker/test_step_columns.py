"""The single-step fast path of the close (broker/run/steps/columns.py ``FrameBuffer.close_grid``,
issue 17) against the general columnar close (``close_columns`` of ``FrameBuffer.take``),
array for array: the same exact means (``fsum`` semantics), min/max over finite values,
non-finite rules, the slowest rank (lowest rank at the finite max), sums and names; and
the cases it must leave to the general path. Plus its helpers ``_list_floats`` and
``_reduce_rows`` against what they replace."""
from __future__ import annotations

import math
import random
import struct
import warnings
from itertools import chain
from typing import Any, Optional

import numpy as np
import pytest

from broker.run.steps import columns, reduce
from broker.run.steps.closer import StepCloser
from broker.run.steps.columns import ClosedSteps, FrameBuffer, close_columns
from rank_agent.protocol import Steps
from tests.support.spying import spy
from tests.support.steprecords import close_frames

#: (``raw``: references to each path's own per-rank arrays, 8.3, not a result; the two
#: paths' ``values_at`` are compared in tests/broker/test_numbers.py)
FIELDS = tuple(name for name in ClosedSteps.__slots__ if name != "raw")


def frame(rank: int, step: int, *, ms: Optional[float], metrics: dict[str, Any],
          samples: int = 0, tokens: int = 0, time: float = 1.0, counts: bool = True) -> Steps:
    return Steps(run="r", rank=rank, steps=[step], times=[time], step_ms=[ms],
                 samples=[samples] if counts else [], tokens=[tokens] if counts else [],
                 metrics={k: [v] for k, v in metrics.items()})


def both(frames: list[Steps]) -> tuple[Optional[ClosedSteps], ClosedSteps]:
    """(fast path result, general result) of the same frames."""
    fast, general = FrameBuffer(), FrameBuffer()
    for f in frames:
        fast.add(f)
        general.add(f)
    got = fast.close_grid()
    want = close_columns(general.take())
    assert want is not None
    if got is not None:
        assert not fast  # emptied
    return got, want


def same(a: ClosedSteps, b: ClosedSteps) -> None:
    assert a.names == b.names
    for name in FIELDS:
        if name == "names":
            continue
        x, y = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
        assert x.dtype.kind == y.dtype.kind, name
        assert x.shape == y.shape, name
        # bytes: NaN where NaN, -0.0 vs 0.0, every bit of every mean
        assert x.astype(y.dtype).tobytes() == y.tobytes(), (name, x, y)
    assert repr(a.records()) == repr(b.records())


VALUES = (0.0, -0.0, 1.0, -1.0, 0.1, 1e-320, 1e308, -1e308, 1e16, -1e16, 3.0, math.pi,
          math.nan, math.inf, -math.inf)
#: the odd values the fast path never declines (no signed zero, nothing near the range)
TAME = (0.0, 1.0, -1.0, 0.1, 1e-320, 1e16, -1e16, 3.0, math.pi, math.nan, math.inf,
        -math.inf)


def may_decline(frames: list[Steps]) -> bool:
    """Whether the fast path may leave these frames to the general close: a signed zero (a
    min/max tie) or magnitudes near the float64 range (``fsum`` overflow by order)."""
    values = [v for f in frames for v in [*f.step_ms, *chain(*f.metrics.values())]
              if v is not None]
    return any(v == 0 and math.copysign(1, v) < 0 or math.isfinite(v) and abs(v) > 1e300
               for v in values)


def value(rng: random.Random, p_none: float, p_odd: float,
          odd: tuple[float, ...] = VALUES) -> Optional[float]:
    x = rng.random()
    if x < p_none:
        return None
    if x < p_none + p_odd:
        return rng.choice(odd)
    return rng.uniform(-1e3, 1e3)


def grid_frame(rank: int, steps: list[int], rng: random.Random, names: list[str],
               p_none: float, p_odd: float, ms_none: float, counts: bool,
               odd: tuple[float, ...]) -> Steps:
    k = len(steps)
    ms = [None if rng.random() < ms_none else rng.choice((
        rng.uniform(0, 200), float(rng.randrange(5)), *odd[:10])) for _ in range(k)]
    return Steps(run="r", rank=rank, steps=steps,
                 times=[rng.choice((1.7e9 + rng.random(), math.nan)) for _ in range(k)],
                 step_ms=ms, samples=[rng.choice((0, 32, 2**40)) for _ in range(k)] if counts
                 else [], tokens=[rng.randrange(5000) for _ in range(k)] if counts else [],
                 metrics={n: [value(rng, p_none, p_odd, odd) for _ in range(k)]
                          for n in names})


@pytest.mark.parametrize("seed", range(40))
def test_grid_close_of_several_steps_equals_the_general_close(seed: int) -> None:
    rng = random.Random(1000 + seed)
    ranks = rng.choice((1, 2, 3, 33, 256))
    k = rng.choice((2, 3, 7, 15))
    steps = sorted(rng.sample(range(100), k))
    names = rng.sample(["loss", "acc", "lr", "z"], rng.randrange(0, 4))
    p_none, p_odd = rng.choice((0.0, 0.0, 0.3)), rng.choice((0.0, 0.0, 0.05))
    ms_none = rng.choice((0.0, 0.0, 0.3))
    odd = TAME if seed % 2 else VALUES
    frames = [grid_frame(r, steps, rng, names, p_none, p_odd, ms_none, rng.random() < 0.7,
                         odd) for r in rng.sample(range(ranks), ranks)]
    if odd is TAME:
        assert not may_decline(frames)
    got, want = both(frames)
    if got is None:
        assert may_decline(frames)
        return
    same(got, want)
    assert got.step.tolist() == steps and got.n.tolist() == [ranks] * k


@pytest.mark.parametrize("seed", range(60))
def test_fast_close_equals_the_general_close(seed: int) -> None:
    rng = random.Random(seed)
    ranks = rng.choice((1, 2, 3, 5, 31, 32, 33, 100, 1024))
    names = rng.sample(["loss", "acc", "lr", "z", "a b", "é"], rng.randrange(0, 5))
    p_none = rng.choice((0.0, 0.0, 0.1, 0.5, 1.0))
    p_odd = rng.choice((0.0, 0.0, 0.02, 0.3))
    ms_none = rng.choice((0.0, 0.0, 0.2, 1.0))
    order = rng.sample(range(ranks), ranks)  # arrival order is not rank order
    frames = []
    for r in order:
        ms = None if rng.random() < ms_none else rng.choice((
            rng.uniform(0, 200), float(rng.randrange(5)), *VALUES[:12]))
        frames.append(frame(r, 7, ms=ms, metrics={n: value(rng, p_none, p_odd) for n in names},
                            samples=rng.choice((0, 32, 2**40)), tokens=rng.randrange(5000),
                            time=rng.choice((1.7e9 + rng.random(), math.nan)),
                            counts=rng.random() < 0.8))
    got, want = both(frames)
    if got is None:
        assert may_decline(frames)
        return
    same(got, want)


def test_fast_close_means_are_exactly_rounded_where_float_sums_are_not() -> None:
    """Cancellation and many values: the mean is fsum's, not a float64 sum's."""
    vals = [1e16, 1.0, -1e16, 1.0, 3.3, -3.3, 1e-3] + [0.1] * 1017
    rng = random.Random(1)
    rng.shuffle(vals)
    frames = [frame(r, 0, ms=v, metrics={"loss": -v, "m": v * 3}) for r, v in enumerate(vals)]
    got, want = both(frames)
    assert got is not None
    same(got, want)
    assert got.ms_mean[0] == math.fsum(vals) / len(vals)
    assert got.metric_mean.tolist() == [math.fsum(-v for v in vals) / len(vals),
                                        math.fsum(v * 3 for v in vals) / len(vals)]


def test_fast_close_slowest_rank_is_the_lowest_rank_at_the_finite_max() -> None:
    frames = [frame(r, 3, ms=ms, metrics={}) for r, ms in
              [(9, 5.0), (4, 7.0), (8, math.inf), (6, 7.0), (2, None), (5, math.nan)]]
    got, want = both(frames)
    assert got is not None
    same(got, want)
    assert got.slowest.tolist() == [4] and got.ms_hi.tolist() == [7.0]
    got, _ = both([frame(r, 3, ms=v, metrics={}) for r, v in ((1, math.nan), (0, math.inf))])
    assert got is not None and got.slowest.tolist() == [-1]
    got, _ = both([frame(r, 3, ms=None, metrics={"x": 1.0}) for r in range(3)])
    assert got is not None and got.slowest.tolist() == [-1] and not len(got.ms_idx)


def test_a_tie_of_signed_zeros_at_the_min_goes_to_the_general_close() -> None:
    """Which of -0.0 and 0.0 is the min depends on the order the values are scanned in;
    the general close scans in rank order, the fast one would in arrival order."""
    frames = [frame(r, 0, ms=1.0, metrics={"x": v}) for r, v in ((2, 0.0), (0, -0.0), (1, 3.0))]
    buf = FrameBuffer()
    for f in frames:
        buf.add(f)
    assert buf.close_grid() is None
    got, want = both([frame(r, 0, ms=1.0, metrics={"x": v}) for r, v in ((2, 0.0), (0, 0.0))])
    assert got is not None  # no negative zero: no doubt
    same(got, want)


@pytest.mark.parametrize("resent", [0, 1, 2])
def test_a_rank_that_resends_its_point_through_the_closer_takes_the_general_close(
        resent: int) -> None:
    """The closer vouches for ``FrameBuffer.close_grid`` that no rank is in its buffer
    twice (``fresh``: the frame is above its rank's highest step), instead of the close
    looking for one; a rank that re-sends a point must not be counted as another rank."""
    closer = StepCloser(close_after=1e9, grace=0.0)
    frames = [frame(r, 4, ms=1.0 + r, metrics={"loss": 0.5 + r}) for r in range(3)]
    frames.insert(2, frame(resent, 4, ms=9.0, metrics={"loss": 9.0}))  # the last write wins
    for f in frames:
        closer.add(f, 1.0, True)
    got = closer.ready_batch(1.0, 3)
    want = close_frames(frames)
    assert got is not None and want is not None
    assert got.n.tolist() == [3]
    same(got, want)


def test_a_buffer_told_its_frames_are_fresh_skips_the_rank_check() -> None:
    """What ``fresh`` changes (the closer's promise, not checked again), and that a buffer
    used without it still finds a rank twice."""
    frames = [frame(0, 1, ms=1.0, metrics={"x": 1.0}), frame(0, 1, ms=2.0, metrics={"x": 2.0})]
    buf = FrameBuffer()
    for f in frames:
        buf.add(f)
    assert buf.overlap and buf.close_grid() is None
    vouched = FrameBuffer()
    for f in frames:
        vouched.add(f, True)
    assert not vouched.overlap
    got = vouched.close_grid()
    assert got is not None and got.n.tolist() == [2]  # (a false promise is believed)


@pytest.mark.parametrize("case", ["repeat", "names differ", "other steps", "longer frame",
                                  "steps differ"])
def test_what_the_fast_path_leaves_to_the_general_close(case: str) -> None:
    frames = [frame(r, 1, ms=1.0, metrics={"loss": 1.0}) for r in range(3)]
    if case == "repeat":  # a rank re-sent its point: the last write wins, by the sort
        frames.append(frame(1, 1, ms=9.0, metrics={"loss": 9.0}))
    elif case == "names differ":
        frames.append(frame(3, 1, ms=2.0, metrics={"acc": 1.0}))
    elif case == "other steps":
        frames.append(frame(3, 2, ms=2.0, metrics={"loss": 1.0}))
    elif case == "longer frame":
        frames.append(Steps(run="r", rank=3, steps=[1, 2], times=[1.0, 1.0], step_ms=[1, 1],
                            metrics={"loss": [1.0, 1.0]}))
    else:
        frames = [Steps(run="r", rank=r, steps=[1, 2 + r], times=[1.0, 1.0],
                        step_ms=[1.0, 1.0]) for r in range(3)]
    buf = FrameBuffer()
    for f in frames:
        buf.add(f)
    fk = list(buf.fk)
    assert buf.close_grid() is None
    assert buf.fk == fk  # left as it was
    want = close_frames(frames)
    got = close_columns(buf.take())
    assert got is not None and want is not None
    same(got, want)


def test_the_closer_takes_the_fast_path_for_a_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """A close of one round of frames never reaches close_columns; a repeated point does,
    and closes the same as it would have; so do points left pending by an earlier close."""
    import broker.run.steps.closer as steps_mod
    closes = spy(monkeypatch, steps_mod, "close_columns")

    def calls() -> list[int]:  # the points of each general close
        return [len(cols) for (cols,) in closes]
    c = StepCloser(close_after=100.0, grace=0.0)
    for r in range(4):
        c.add(frame(r, 0, ms=float(r), metrics={"loss": r / 3}), 1.0, True)
    (rec,) = c.ready(1.0, 4)
    assert calls() == [] and rec["n"] == 4 and rec["slowest_rank"] == 3
    assert rec["metrics"]["loss"][0] == math.fsum(r / 3 for r in range(4)) / 4
    for r in range(4):
        c.add(frame(r, 1, ms=1.0, metrics={"loss": 1.0}), 2.0, True)
        if r == 1:
            c.add(frame(1, 1, ms=5.0, metrics={"loss": 5.0}), 2.0, True)  # rank 1 again
    (rec,) = c.ready(2.0, 4)
    assert calls() == [5] and rec["n"] == 4 and rec["step_ms"] == [2.0, 1.0, 5.0]
    for r in range(4):  # two steps each: a grid
        c.add(Steps(run="r", rank=r, steps=[2, 3], times=[3.0, 3.0], step_ms=[1.0, float(r)],
                    metrics={"loss": [1.0, 2.0]}), 3.0, True)
    recs = c.ready(3.0, 4)
    assert calls() == [5] and [r["step"] for r in recs] == [2, 3]
    assert recs[1]["slowest_rank"] == 3 and recs[0]["slowest_rank"] == 0
    for r in range(3):  # rank 3 lags: 4 stays pending, carried into the next close
        c.add(Steps(run="r", rank=r, steps=[4, 5], times=[4.0, 4.0], step_ms=[1.0, 1.0]),
              4.0, True)
    c.add(Steps(run="r", rank=3, steps=[4], times=[4.0], step_ms=[1.0]), 4.0, True)
    assert [r["step"] for r in c.ready(4.0, 4)] == [4] and calls() == [5, 4]
    c.add(Steps(run="r", rank=3, steps=[5], times=[5.0], step_ms=[1.0]), 5.0, True)
    assert [r["step"] for r in c.ready(5.0, 4)] == [5] and calls() == [5, 4, 4]


# ------------------------------------------------------------------ the helpers


@pytest.mark.parametrize("n,k", [(1, 1), (15, 1), (16, 1), (4096, 1), (65535, 1), (65536, 1),
                                 (7, 3), (100, 15)])
def test_list_floats_reads_what_chain_gives(n: int, k: int) -> None:
    rng = random.Random(n * 31 + k)
    lists = [[rng.choice((rng.random(), *VALUES)) for _ in range(k)] for _ in range(n)]
    got = columns._list_floats(lists, k)
    want = np.fromiter(chain.from_iterable(lists), np.float64, n * k)
    assert got is not None and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("n", [1, 15, 16, 1024, 65536])
def test_list_floats_of_a_flat_list(n: int) -> None:
    rng = random.Random(n)
    values = [rng.choice((rng.random(), *VALUES)) for _ in range(n)]
    got = columns._list_floats(values, 0)
    assert got is not None and got.tobytes() == np.array(values).tobytes()
    assert columns._list_floats(values[:-1] + [None], 0) is None
    assert columns._list_floats(values[:-1] + [7], 0) is None


@pytest.mark.parametrize("odd", [None, 1, 2**40, 2**70, True])
@pytest.mark.parametrize("k", [1, 3])
def test_list_floats_declines_anything_but_floats(odd: Any, k: int) -> None:
    """Each header and tag byte is checked: an odd value at any position of any list, in
    arrays of each MessagePack header size (fix, 16- and 32-bit)."""
    for n in (3, 20, 70_000):
        for at in range(k):
            lists = [[0.5] * k for _ in range(n)]
            lists[n // 2][at] = odd
            assert columns._list_floats(lists, k) is None
            flat = [0.5] * n
            flat[n // 3] = odd
            assert columns._list_floats(flat, 0) is None
    assert columns._list_floats([[1.0, 2.0], [3.0]], 2) is None  # not all k long
    # a list of two and an empty one are two records' length, and a value whose first
    # byte is 0xcb sits where the second tag would be: only the header bytes tell
    tagged = struct.unpack(">d", b"\xcb" + bytes(7))[0]
    assert columns._list_floats([[0.5, tagged], []], 1) is None
    assert columns._list_floats([[1.0] * 16], 16) is None  # k past 15: not handled


@pytest.mark.parametrize("seed", range(30))
def test_reduce_rows_equals_reduce(seed: int) -> None:
    rng = random.Random(seed)
    c, n = rng.randrange(1, 6), rng.choice((1, 2, 3, 31, 32, 33, 1024))
    odd = rng.choice((0.0, 0.01, 0.2))
    mat = np.array([[rng.choice(VALUES) if rng.random() < odd else rng.uniform(-1e3, 1e3)
                     for _ in range(n)] for _ in range(c)])
    if seed % 5 == 0 and n >= 3:
        mat[0, :3] = [1e308, 1e308, -1e308]  # an intermediate overflow of finite values
    got = reduce.reduce_rows(mat)
    want = reduce.reduce_groups(mat.ravel(), np.arange(c) * n)
    if got is None:  # only where fsum could overflow in one order and not another
        with np.errstate(over="ignore"):
            fin = np.where(np.isfinite(mat), np.abs(mat), 0.0).sum(axis=1)
        assert not np.isfinite(fin).all()
        return
    for g, w in zip(got, want):
        assert g.tobytes() == w.tobytes()
    again = reduce.reduce_rows(mat[:, rng.sample(range(n), n)])
    assert again is not None
    for g, w in zip(again, want):  # the order of a row's values does not matter (but for
        assert np.array_equal(g, w, equal_nan=True)  # which zero: -0.0 == 0.0 here)


@pytest.mark.parametrize("scale", [2.0 ** 999, 2.0 ** 1000, 1e308])
def test_reduce_rows_of_huge_values_on_either_side_of_the_quiet_bound(scale: float) -> None:
    """Below ``_BOUND`` the rows are summed without ``errstate`` (no sum can overflow); at
    and above it, the checked path. Both give ``reduce_groups``' answer, with no warning
    (the suite runs with warnings as errors)."""
    rng = random.Random(7)
    mat = np.array([[scale * rng.uniform(-1, 1) for _ in range(1024)] for _ in range(3)])
    mat[2, :2] = (scale, scale)  # a row whose magnitudes sum past float64 at 1e308
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = reduce.reduce_rows(mat)
    if scale >= 1e308:
        assert got is None  # fsum could overflow in one order: left to rank order
        return
    want = reduce.reduce_groups(mat.ravel(), np.arange(3) * 1024)
    assert got is not None
    for g, w in zip(got, want):
        assert g.tobytes() == w.tobytes()


def test_a_sum_that_fsum_may_overflow_in_one_order_is_left_to_rank_order() -> None:
    row = np.array([[1e308, 1e308, -1e308, -1e308, 1e16, 3.0]])
    assert reduce.reduce_rows(row) is None
    frames = [frame(r, 0, ms=v, metrics={}) for r, v in enumerate(row[0].tolist())]
    buf = FrameBuffer()
    for f in reversed(frames):
        buf.add(f)
    assert buf.close_grid() is None
    got = close_columns(buf.take())
    want = close_frames(frames)
    assert got is not None and want is not None
    same(got, want)
