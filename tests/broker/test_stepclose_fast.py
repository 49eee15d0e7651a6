"""The single-step fast path of the close (broker/stepclose.py ``FrameBuffer.close_one_step``,
issue 17) against the general columnar close (``close_columns`` of ``FrameBuffer.take``),
array for array: the same exact means (``fsum`` semantics), min/max over finite values,
non-finite rules, the slowest rank (lowest rank at the finite max), sums and names; and
the cases it must leave to the general path. Plus its helpers ``_list_floats`` and
``_reduce_rows`` against what they replace."""
from __future__ import annotations

import math
import random
from itertools import chain
from typing import Any, Optional

import numpy as np
import pytest

from broker import stepclose
from broker.stepclose import ClosedSteps, FrameBuffer, close_columns
from broker.steps import StepCloser
from rank_agent.protocol import Steps

FIELDS = ClosedSteps.__slots__


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
    got = fast.close_one_step()
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


def value(rng: random.Random, p_none: float, p_odd: float) -> Optional[float]:
    x = rng.random()
    if x < p_none:
        return None
    if x < p_none + p_odd:
        return rng.choice(VALUES)
    return rng.uniform(-1e3, 1e3)


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
    if got is None:  # only for a signed zero at a min or max (the next test)
        values = [v for f in frames for v in [*f.step_ms, *chain(*f.metrics.values())]]
        assert any(v == 0 and math.copysign(1, v) < 0 for v in values if v is not None)
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
    assert buf.close_one_step() is None
    got, want = both([frame(r, 0, ms=1.0, metrics={"x": v}) for r, v in ((2, 0.0), (0, 0.0))])
    assert got is not None  # no negative zero: no doubt
    same(got, want)


@pytest.mark.parametrize("case", ["repeat", "names differ", "two steps"])
def test_what_the_fast_path_leaves_to_the_general_close(case: str) -> None:
    frames = [frame(r, 1, ms=1.0, metrics={"loss": 1.0}) for r in range(3)]
    if case == "repeat":  # a rank re-sent its point: the last write wins, by the sort
        frames.append(frame(1, 1, ms=9.0, metrics={"loss": 9.0}))
    elif case == "names differ":
        frames.append(frame(3, 1, ms=2.0, metrics={"acc": 1.0}))
    else:
        frames.append(Steps(run="r", rank=3, steps=[1, 2], times=[1.0, 1.0], step_ms=[1, 1]))
    buf = FrameBuffer()
    for f in frames:
        buf.add(f)
    if case != "two steps":  # (the closer never asks for two steps: lo != hi)
        assert buf.close_one_step() is None
        assert buf.fk == [1] * 4  # left as it was
    batch = close_columns(buf.take())
    assert batch is not None and batch.n.tolist()[0] == (3 if case == "repeat" else 4)


def test_the_closer_takes_the_fast_path_for_a_single_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A single-step close never reaches close_columns; a repeated point does, and closes
    the same as it would have."""
    calls: list[int] = []
    real = stepclose.close_columns

    def counted(cols: Any) -> Any:
        calls.append(len(cols))
        return real(cols)

    import broker.steps as steps_mod
    monkeypatch.setattr(steps_mod, "close_columns", counted)
    c = StepCloser(close_after=100.0, grace=0.0)
    for r in range(4):
        c.add(frame(r, 0, ms=float(r), metrics={"loss": r / 3}), 1.0, True)
    (rec,) = c.ready(1.0, 4)
    assert calls == [] and rec["n"] == 4 and rec["slowest_rank"] == 3
    assert rec["metrics"]["loss"][0] == math.fsum(r / 3 for r in range(4)) / 4
    for r in range(4):
        c.add(frame(r, 1, ms=1.0, metrics={"loss": 1.0}), 2.0, True)
        if r == 1:
            c.add(frame(1, 1, ms=5.0, metrics={"loss": 5.0}), 2.0, True)  # rank 1 again
    (rec,) = c.ready(2.0, 4)
    assert calls == [5] and rec["n"] == 4 and rec["step_ms"] == [2.0, 1.0, 5.0]


# ------------------------------------------------------------------ the helpers


@pytest.mark.parametrize("n,k", [(1, 1), (15, 1), (16, 1), (4096, 1), (65535, 1), (65536, 1),
                                 (7, 3), (100, 15)])
def test_list_floats_reads_what_chain_gives(n: int, k: int) -> None:
    rng = random.Random(n * 31 + k)
    lists = [[rng.choice((rng.random(), *VALUES)) for _ in range(k)] for _ in range(n)]
    got = stepclose._list_floats(lists, k)
    want = np.fromiter(chain.from_iterable(lists), np.float64, n * k)
    assert got is not None and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("n", [1, 15, 16, 1024, 65536])
def test_list_floats_of_a_flat_list(n: int) -> None:
    rng = random.Random(n)
    values = [rng.choice((rng.random(), *VALUES)) for _ in range(n)]
    got = stepclose._list_floats(values, 0)
    assert got is not None and got.tobytes() == np.array(values).tobytes()
    assert stepclose._list_floats(values[:-1] + [None], 0) is None
    assert stepclose._list_floats(values[:-1] + [7], 0) is None


@pytest.mark.parametrize("odd", [None, 1, 2**70, True])
def test_list_floats_declines_anything_but_floats(odd: Any) -> None:
    lists = [[0.5], [1.5], [odd], [2.5]] * 5
    assert stepclose._list_floats(lists, 1) is None
    assert stepclose._list_floats([[1.0, 2.0], [3.0]], 2) is None  # not all k long
    assert stepclose._list_floats([[1.0] * 16], 16) is None  # k past 15: not handled


@pytest.mark.parametrize("seed", range(30))
def test_reduce_rows_equals_reduce(seed: int) -> None:
    rng = random.Random(seed)
    c, n = rng.randrange(1, 6), rng.choice((1, 2, 3, 31, 32, 33, 1024))
    odd = rng.choice((0.0, 0.01, 0.2))
    mat = np.array([[rng.choice(VALUES) if rng.random() < odd else rng.uniform(-1e3, 1e3)
                     for _ in range(n)] for _ in range(c)])
    if seed % 5 == 0 and n >= 3:
        mat[0, :3] = [1e308, 1e308, -1e308]  # an intermediate overflow of finite values
    got = stepclose._reduce_rows(mat)
    want = stepclose._reduce(mat.ravel(), np.arange(c) * n)
    for g, w in zip(got, want):
        assert g.tobytes() == w.tobytes()
