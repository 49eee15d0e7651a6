"""Step closing and aggregation (PROTOCOL.md 2.4), pure: the StepCloser and step_record
driven with frames and a fake clock, the RunSink's steps rules (events, header, ranks,
alerts, liveness) and the decode limits of the ``steps`` frame through ``Runs.ingest``.

Each test is built so that it fails if its rule is missing: the frames are chosen so that
the rule-less outcome differs (a step closing early or late, a value from the wrong rank,
an event too many).
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import msgspec
import pytest

from broker.runs import Runs
from broker.sink import STEPS_INTERVAL, Event, Rejected, RunSink
from broker.steps.closer import SHARE_WINDOW, STEP_MS_WINDOW, StepCloser
from broker.steps.store import wire_records
from rank_agent import protocol
from rank_agent.protocol import Finish, Register, Steps, decode, encoder
from tests.support.steprecords import step_record

RUN = "steps-run"
T0 = 1_000.0


# ---------------------------------------------------------------- builders


def wire(frame: Any) -> Any:
    """The frame as the broker sees it: encoded and decoded through the real schema."""
    return decode(encoder.encode(frame))


def stp(rank: int, steps: Iterable[int], *, ms: Any = 100.0, times: Any = None,
        samples: Optional[list[int]] = None, tokens: Optional[list[int]] = None,
        metrics: Optional[dict[str, list[Optional[float]]]] = None, loss: Any = None,
        run: str = RUN) -> Steps:
    """A steps frame of ``rank``. ``ms`` / ``loss``: a list, or one value for every point;
    ``times`` default: T0 + step."""
    s = list(steps)
    n = len(s)
    step_ms = list(ms) if isinstance(ms, (list, tuple)) else [ms] * n
    m = dict(metrics or {})
    if loss is not None:
        m["loss"] = list(loss) if isinstance(loss, (list, tuple)) else [loss] * n
    return wire(Steps(run=run, rank=rank, steps=s,
                      times=list(times) if times is not None else [T0 + x for x in s],
                      step_ms=step_ms, samples=samples or [], tokens=tokens or [], metrics=m))


def reg(rank: int, ws: int, run: str = RUN) -> Register:
    return wire(Register(run=run, rank=rank, world_size=ws, host="h", local_rank=rank))


def fin(rank: int, status: str = "ok") -> Finish:
    return wire(Finish(run=RUN, rank=rank, status=status))


def numbers(records: list[dict[str, Any]]) -> list[int]:
    return [r["step"] for r in records]


def same(a: Any, b: Any) -> bool:
    """Equality where NaN equals NaN."""
    return msgspec.msgpack.encode(a) == msgspec.msgpack.encode(b)


class Drive:
    """A RunSink with a fake clock, keeping every event and every published step record."""

    def __init__(self, ws: Optional[int] = None, *, t: float = 0.0, **kw: Any) -> None:
        kw.setdefault("step_close_after", 1000.0)
        self.sink = RunSink(RUN, **kw)
        self.events: list[tuple[float, Event]] = []
        self.t = t
        if ws is not None:
            for r in range(ws):
                self.send(reg(r, ws))

    def send(self, frame: Any, t: Optional[float] = None) -> list[Event]:
        if t is not None:
            self.t = t
        events = self.sink.apply(frame, self.t)
        self.events += [(self.t, e) for e in events]
        return events

    def tick(self, t: Optional[float] = None) -> list[Event]:
        if t is not None:
            self.t = t
        events = self.sink.tick(self.t)
        self.events += [(self.t, e) for e in events]
        return events

    @property
    def records(self) -> list[dict[str, Any]]:
        return [r for _, e in self.events if e.kind == "steps" for r in wire_records(e.data)]

    @property
    def closed(self) -> list[int]:
        return numbers(self.records)

    def rank(self, rank: int) -> dict[str, Any]:
        return next(r for r in self.sink.ranks() if r["rank"] == rank)


def closer_with(*frames: tuple[Steps, float], grace: float = 0.0,
                close_after: float = 1000.0) -> StepCloser:
    c = StepCloser(close_after=close_after, grace=grace)
    for frame, t in frames:
        c.add(frame, t, True)
    return c


# ---------------------------------------------------------------- watermark


def test_watermark_closes_through_the_lowest_highest_step_of_the_step_ranks() -> None:
    c = StepCloser(close_after=1000.0)
    c.add(stp(0, range(0, 5)), T0, True)
    c.add(stp(1, range(0, 3)), T0, True)
    got = c.ready(T0 + 2, None)  # past the grace
    assert numbers(got) == [0, 1, 2] and all(r["n"] == 2 for r in got)
    assert c.ready(T0 + 3, None) == []  # 3 and 4 wait for rank 1
    c.add(stp(1, [3, 4, 5]), T0 + 4, True)
    got = c.ready(T0 + 4, None)
    assert numbers(got) == [3, 4] and all(r["n"] == 2 for r in got)
    assert c.last_closed == 4


def test_watermark_counts_a_rank_that_skipped_steps() -> None:
    """'has reported a step >= S': rank 1 never logs step 2 but its step 4 lets 2 close."""
    c = StepCloser(close_after=1000.0, grace=0.0)
    c.add(stp(0, [0, 1, 2, 3, 4]), T0, True)
    c.add(stp(1, [0, 4]), T0, True)
    got = c.ready(T0, None)
    assert numbers(got) == [0, 1, 2, 3, 4]
    assert [r["n"] for r in got] == [2, 1, 1, 1, 2]


def test_a_rank_that_has_sent_no_steps_frame_does_not_hold_the_watermark() -> None:
    d = Drive(3)  # ranks 0..2 registered; only 0 and 1 log steps
    d.send(stp(0, range(4)), 1.0)
    d.send(stp(1, range(4)), 1.0)
    d.tick(3.0)
    assert d.closed == [0, 1, 2, 3]


# ---------------------------------------------------------------- start-up grace


def test_grace_nothing_closes_by_watermark_in_the_first_second() -> None:
    c = StepCloser(close_after=1000.0)  # grace 1 s (the default)
    c.add(stp(0, range(4)), T0, True)
    assert c.ready(T0, None) == []
    assert c.ready(T0 + 0.99, None) == []
    c.add(stp(1, range(2)), T0 + 0.5, True)
    assert c.ready(T0 + 0.999, None) == []
    got = c.ready(T0 + 1.0, None)
    # without the grace rank 0 would have closed 0..3 alone at T0
    assert numbers(got) == [0, 1] and all(r["n"] == 2 for r in got)


def test_grace_counts_from_the_first_steps_frame_not_the_run() -> None:
    d = Drive(2)  # registered at t=0
    d.send(stp(0, range(3)), 50.0)
    d.tick(50.5)
    assert d.closed == []
    d.tick(51.0)
    assert d.closed == [0, 1, 2]


def test_grace_ends_early_when_world_size_ranks_are_step_ranks() -> None:
    d = Drive(2)
    d.send(stp(0, range(3)), 5.0)
    assert d.closed == []  # one step rank of two: grace
    d.send(stp(1, range(2)), 5.1)
    assert d.closed == [0, 1]  # both ranks in: no need to wait out the second


def test_grace_holds_with_world_size_known_but_not_every_rank_in() -> None:
    c = StepCloser(close_after=1000.0)
    c.add(stp(0, range(3)), T0, True)
    c.add(stp(1, range(3)), T0 + 0.2, True)
    assert c.ready(T0 + 0.5, 3) == []   # 2 of 3
    assert c.ready(T0 + 0.5, None) == []  # world size unknown
    assert numbers(c.ready(T0 + 0.5, 2)) == [0, 1, 2]


# ---------------------------------------------------------------- stale and finished ranks


def test_stale_rank_leaves_the_watermark_and_returns_to_it() -> None:
    d = Drive(2, stale_after=5.0)
    d.send(stp(0, range(5)), 1.0)
    d.send(stp(1, range(3)), 1.0)
    d.tick(2.0)
    assert d.closed == [0, 1, 2]
    d.send(stp(0, range(5, 10)), 4.0)
    d.tick(5.9)
    assert d.closed == [0, 1, 2]  # rank 1 (last seen 1.0) is not stale yet: it holds 3..9
    d.send(stp(0, range(10, 12)), 5.95)
    d.tick(6.0)  # rank 1 stale now (silent 5 s): it no longer holds the watermark
    assert d.rank(1)["status"] == "stale"
    assert d.closed == list(range(12))
    # rank 1 comes back: any frame makes it ok, and it holds the watermark again
    d.send(stp(1, [12]), 7.0)
    d.send(stp(0, range(12, 20)), 7.0)
    d.tick(8.0)
    assert d.closed == list(range(13))
    assert d.records[-1]["n"] == 2


def test_finished_rank_leaves_the_watermark() -> None:
    d = Drive(3)
    d.send(stp(0, range(6)), 1.0)
    d.send(stp(1, range(6)), 1.0)
    d.send(stp(2, range(2)), 1.0)
    d.tick(2.0)
    assert d.closed == [0, 1]
    d.send(fin(2), 3.0)
    d.tick(3.5)
    assert d.closed == list(range(6))


def test_register_from_a_finished_rank_puts_it_back_in_the_watermark() -> None:
    d = Drive(2)
    d.send(stp(0, range(3)), 1.0)
    d.send(stp(1, range(3)), 1.0)
    d.send(fin(1), 2.0)
    d.send(stp(0, range(3, 6)), 2.5)
    d.tick(3.0)
    assert d.closed == list(range(6))  # rank 1 finished: rank 0 alone
    d.send(reg(1, 2), 4.0)  # rank 1 trains again (its highest step is 2)
    d.send(stp(0, range(6, 10)), 4.0)
    d.tick(5.0)
    assert d.closed == list(range(6))  # rank 1 holds 6..9 again
    d.send(stp(1, range(6, 8)), 6.0)
    d.tick(7.0)
    assert d.closed == list(range(8))


def test_register_reopens_an_ended_steps_only_run_as_training() -> None:
    """PROTOCOL 2: a register from a finished rank 'reopens an ended run as training'; a run
    that closed steps (and no epoch) has been training, it is not 'waiting' again."""
    d = Drive(1)
    d.send(stp(0, range(3)), 1.0)
    d.send(fin(0), 2.0)
    assert d.sink.status == "complete" and d.closed == [0, 1, 2]
    d.send(reg(0, 1), 3.0)
    assert d.sink.status == "training"
    events = d.tick(3.0)  # the reopened header is coalesced
    assert [e.data["status"] for e in events if e.kind == "run"] == ["training"]
    assert d.sink.complete is None


def test_other_frames_from_a_finished_rank_leave_it_out_of_the_watermark() -> None:
    d = Drive(2)
    d.send(stp(0, range(3)), 1.0)
    d.send(stp(1, range(3)), 1.0)
    d.send(fin(1), 2.0)
    d.send(stp(1, [3]), 2.5)  # a finished rank's points still count as reports ...
    d.send(stp(0, range(3, 8)), 3.0)
    d.tick(4.0)
    assert d.closed == list(range(8))  # ... but it does not hold the watermark
    assert d.records[3]["n"] == 2 and d.records[4]["n"] == 1
    assert d.rank(1)["status"] == "finished"


def test_no_active_step_rank_closes_every_pending_step() -> None:
    c = closer_with((stp(0, [0, 5, 9]), T0))
    c.set_active(0, False)
    assert numbers(c.ready(T0 + 2, None)) == [0, 5, 9]


# ---------------------------------------------------------------- force close


def test_force_close_after_step_close_after_seconds() -> None:
    c = StepCloser(close_after=10.0)
    c.add(stp(0, range(6)), T0, True)
    c.add(stp(1, [0, 1]), T0, True)
    assert numbers(c.ready(T0 + 2, 2)) == [0, 1]
    c.add(stp(0, range(6, 9)), T0 + 3, True)
    assert c.ready(T0 + 9.99, 2) == []
    got = c.ready(T0 + 10.0, 2)  # points for 2..5 first arrived at T0
    assert numbers(got) == [2, 3, 4, 5] and all(r["n"] == 1 for r in got)
    assert c.ready(T0 + 12.99, 2) == []
    assert numbers(c.ready(T0 + 13.0, 2)) == [6, 7, 8]


def test_force_close_also_closes_lower_pending_steps_ascending() -> None:
    c = StepCloser(close_after=10.0, grace=0.0)
    c.add(stp(2, [0]), T0, True)      # rank 2 holds the watermark at 0
    c.add(stp(0, [20]), T0, True)     # step 20 first seen at T0
    c.add(stp(1, [10]), T0 + 5, True)  # step 10 first seen at T0 + 5
    assert numbers(c.ready(T0 + 5, 3)) == [0]
    got = c.ready(T0 + 10, 3)
    assert numbers(got) == [10, 20]  # 10 is below the forced 20: closed with it, first
    assert c.last_closed == 20
    c.add(stp(1, [11, 21]), T0 + 11, True)
    assert c.late == 1  # 11 is below the last closed step


def test_force_close_counts_from_the_first_point_not_the_last() -> None:
    c = StepCloser(close_after=10.0, grace=0.0)
    c.add(stp(9, [0]), T0, True)  # keeps the watermark at 0
    c.add(stp(0, [5]), T0, True)
    c.add(stp(1, [5]), T0 + 8, True)  # a second point for 5 does not restart its clock
    c.ready(T0 + 8, None)
    assert numbers(c.ready(T0 + 10, None)) == [5]


def test_force_close_through_the_sink_tick() -> None:
    d = Drive(2, step_close_after=3.0)
    d.send(stp(1, [0]), 1.0)  # rank 1 holds the watermark at 0
    d.send(stp(0, range(4)), 1.0)
    d.tick(3.9)
    assert d.closed == [0]
    d.tick(4.0)
    assert d.closed == [0, 1, 2, 3]


# ---------------------------------------------------------------- run end


def test_run_end_closes_everything_then_completes() -> None:
    d = Drive(2)
    d.send(stp(0, range(6)), 1.0)
    d.send(stp(1, range(3)), 1.0)
    d.tick(2.0)
    assert d.closed == [0, 1, 2]
    d.send(fin(0), 2.01)
    events = d.send(fin(1), 2.02)  # within STEPS_INTERVAL of the last steps event
    kinds = [e.kind for e in events]
    assert kinds == ["steps", "run", "ranks", "complete"]  # steps first: nothing after complete
    assert numbers(wire_records(events[0].data)) == [3, 4, 5]
    assert d.closed == list(range(6))
    assert events[1].data["status"] == "complete" and events[1].data["steps_done"] == 5


def test_run_end_within_the_grace_still_closes_everything() -> None:
    d = Drive(2)  # only rank 0 logs steps, so the grace holds for a second
    d.send(stp(0, range(3)), 1.0)
    d.send(fin(1), 1.1)
    assert d.closed == []
    events = d.send(fin(0), 1.2)
    assert [e.kind for e in events] == ["steps", "run", "ranks", "complete"]
    assert d.closed == [0, 1, 2]


def test_close_all_closes_every_pending_step_whatever_the_watermark() -> None:
    c = StepCloser(close_after=1000.0)
    c.add(stp(0, [3, 7]), T0, True)
    c.add(stp(1, [1]), T0, True)
    assert c.ready(T0, None) == []  # grace
    assert numbers(c.close_all()) == [1, 3, 7]
    assert c.close_all() == []


# ---------------------------------------------------------------- late points, last write


def test_late_points_are_dropped_and_counted_the_rest_of_the_frame_applies() -> None:
    runs = Runs(step_close_after=1000.0)
    for r in range(2):
        runs.ingest(encoder.encode(reg(r, 2)), 0.0)
    runs.ingest(encoder.encode(stp(0, range(6), loss=1.0)), 1.0)
    runs.ingest(encoder.encode(stp(1, range(3), loss=2.0)), 1.0)
    runs.tick(2.0)
    sink = runs.get(RUN)
    assert sink is not None and sink.steps.last_step == 2
    # rank 1 re-sends 1..2 (late) with 3..4: 1, 2 are dropped, 3 and 4 apply
    events = runs.ingest(encoder.encode(stp(1, [1, 2, 3, 4], loss=[9.0, 9.0, 4.0, 4.0])), 3.0)
    assert sink.late_steps == 2
    assert runs.late_steps == 2 and runs.counters()["late_steps"] == 2
    recs = [r for _, e in events if e.kind == "steps" for r in wire_records(e.data)]
    recs += [r for _, e in runs.tick(4.0) if e.kind == "steps" for r in wire_records(e.data)]
    assert numbers(recs) == [3, 4]
    assert [r["metrics"]["loss"] for r in recs] == [[2.5, 1.0, 4.0]] * 2
    # the closed steps 1 and 2 never changed
    assert sink.steps.series("loss", 1, 2, 10) == [[1, 1, 1.5, 1.5, 1.5, 1.0, 2.0, 1],
                                                   [2, 2, 1.5, 1.5, 1.5, 1.0, 2.0, 1]]
    assert runs.counters()["steps_closed"] == 5
    assert next(r for r in sink.ranks() if r["rank"] == 1)["step"] == 4


def test_a_point_at_the_last_closed_step_is_late() -> None:
    c = closer_with((stp(0, [0, 1, 2]), T0))
    assert numbers(c.ready(T0, None)) == [0, 1, 2]
    c.add(stp(0, [2, 3]), T0 + 1, True)
    assert c.late == 1
    assert numbers(c.ready(T0 + 1, None)) == [3]


def test_last_write_per_rank_and_step_until_close() -> None:
    c = StepCloser(close_after=1000.0)
    c.add(stp(0, [5], loss=1.0, ms=10.0, samples=[1], times=[T0 + 1]), T0, True)
    c.add(stp(1, [5], loss=3.0, ms=30.0, samples=[3]), T0, True)
    c.add(stp(0, [5], loss=7.0, ms=70.0, samples=[7], times=[T0 - 1]), T0 + 0.5, True)
    (rec,) = c.close_all()
    assert rec["n"] == 2
    assert rec["metrics"]["loss"] == [5.0, 3.0, 7.0]
    assert rec["step_ms"] == [50.0, 30.0, 70.0] and rec["slowest_rank"] == 0
    assert rec["samples"] == 10
    assert rec["time"] == T0 + 5  # rank 1's time; rank 0's first write (T0 + 1) is gone


def test_steps_close_in_ascending_order_each_once() -> None:
    c = StepCloser(close_after=5.0)
    c.add(stp(0, [9, 10]), T0, True)
    c.add(stp(1, [3]), T0 + 1, True)
    c.add(stp(2, [1, 2, 4]), T0 + 2, True)
    out = c.ready(T0 + 2, None) + c.ready(T0 + 5, None) + c.ready(T0 + 7, None) + c.close_all()
    assert numbers(out) == [1, 2, 3, 4, 9, 10]


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
                         "tokens", "samples_per_s", "tokens_per_s"]
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


# ---------------------------------------------------------------- sink: events, header, alerts


def test_run_becomes_training_when_its_first_step_closes() -> None:
    d = Drive(2)
    d.send(stp(0, [0]), 1.0)
    d.tick(1.5)
    assert d.sink.status == "waiting" and d.sink.header()["steps_done"] is None
    events = d.send(stp(1, [0]), 1.6)
    assert [e.kind for e in events] == ["steps", "run"]
    assert events[1].data["status"] == "training" and events[1].data["steps_done"] == 0
    assert d.sink.header()["step_metrics"] == []


def test_header_steps_done_and_step_metrics() -> None:
    d = Drive(1)
    d.send(stp(0, [0, 1], metrics={"zeta": [1.0, None], "alpha": [None, 2.0],
                                   "never": [None, None]}), 1.0)
    d.tick(2.0)
    h = d.sink.header()
    assert h["steps_done"] == 1 and h["step_metrics"] == ["alpha", "zeta"]


def test_nonfinite_loss_alert_names_the_step() -> None:
    d = Drive(2)
    d.send(stp(0, range(4), loss=[1.0, 1.0, math.nan, 1.0]), 1.0)
    events = d.send(stp(1, range(4), loss=1.0), 1.0)
    alerts = d.sink.header()["alerts"]
    assert [(a["kind"], a["rank"]) for a in alerts] == [("nonfinite_loss", None)]
    assert "step 2" in alerts[0]["message"] and "nan" in alerts[0]["message"]
    assert alerts[0]["at"] == 1.0
    assert [e.kind for e in events] == ["steps", "run"]
    assert events[1].data["alerts"] == alerts
    # an infinite mean later: the one alert now names that step
    d.send(stp(0, [4], loss=math.inf), 5.0)
    d.send(stp(1, [4], loss=1.0), 5.0)
    (alert,) = d.sink.header()["alerts"]
    assert "step 4" in alert["message"] and "inf" in alert["message"] and alert["at"] == 5.0


def test_finite_loss_and_other_nonfinite_metrics_raise_no_alert() -> None:
    d = Drive(1)
    d.send(stp(0, range(3), loss=[1.0, 2.0, 3.0], metrics={"grad": [math.nan] * 3}), 1.0)
    d.tick(2.0)
    assert d.closed == [0, 1, 2] and d.sink.header()["alerts"] == []


def test_steps_events_at_most_4_a_second_and_each_step_within_half_a_second() -> None:
    assert STEPS_INTERVAL <= 0.25
    d = Drive(1)
    closed_at: dict[int, float] = {}
    for i in range(400):  # a tick every 10 ms (the server's poll), a step every 50 ms
        t = round(1.0 + 0.01 * i, 6)
        if i % 5 == 0 and i < 300:
            k = i // 5
            d.send(stp(0, [k]), t)
            closed_at[k] = t  # world size 1, one step rank: it closes on arrival
        d.tick(t)
    steps_events = [(at, e) for at, e in d.events if e.kind == "steps"]
    times = [at for at, _ in steps_events]
    for i, at in enumerate(times):  # any window of one second holds at most 4 events
        assert sum(1 for u in times[i:] if u < at + 1.0) <= 4, times
    assert d.closed == list(range(60))  # every step once, ascending, batched
    assert len(steps_events) < 60
    for at, e in steps_events:
        for rec in wire_records(e.data):
            assert at - closed_at[rec["step"]] <= 0.5 + 1e-9
    seqs = [e.seq for _, e in d.events]
    assert seqs == sorted(set(seqs))


def test_closed_steps_reach_a_steps_event_via_tick_alone() -> None:
    d = Drive(1)
    d.send(stp(0, [0]), 1.0)
    assert d.closed == [0]
    d.send(stp(0, [1]), 1.1)  # closes, but the last steps event was 0.1 s ago
    assert d.closed == [0]
    d.tick(1.2)
    assert d.closed == [0]
    d.tick(1.25)
    assert d.closed == [0, 1]


def test_steps_events_only_hold_published_steps_in_the_store() -> None:
    d = Drive(1)
    d.send(stp(0, [0]), 1.0)
    d.send(stp(0, [1]), 1.1)
    assert d.sink.steps.last_step == 0 and d.sink.snapshot()["header"]["steps_done"] == 0
    d.tick(1.3)
    assert d.sink.steps.last_step == 1


# ---------------------------------------------------------------- ranks and world size


def test_steps_from_a_rank_at_or_above_the_world_size_are_rejected_without_effect() -> None:
    d = Drive(2)
    d.send(stp(0, [0]), 1.0)
    before = msgspec.msgpack.encode([d.sink.snapshot(), d.sink.late_steps])
    with pytest.raises(Rejected) as exc:
        d.sink.apply(stp(2, [0, 1]), 2.0)
    assert exc.value.reason == "rank_out_of_range"
    assert msgspec.msgpack.encode([d.sink.snapshot(), d.sink.late_steps]) == before
    runs = Runs()
    runs.ingest(encoder.encode(reg(0, 2)), 0.0)
    runs.ingest(encoder.encode(stp(5, [0])), 1.0)
    assert runs.rejected == {"rank_out_of_range": 1}


def test_step_state_of_ranks_beyond_the_world_size_is_discarded_when_it_is_known() -> None:
    d = Drive()
    d.send(stp(0, range(10), loss=1.0), 0.0)
    d.send(stp(5, range(3), loss=100.0, ms=900.0), 0.1)  # holds the watermark at 2
    d.send(reg(0, 2), 0.5)  # rank 5 is out: forgotten with its points
    d.send(reg(1, 2), 0.5)
    d.send(stp(1, range(10), loss=3.0), 0.6)  # 2 step ranks of 2: no grace
    d.tick(0.7)
    assert d.closed == list(range(10))
    assert all(r["n"] == 2 and r["metrics"]["loss"] == [2.0, 1.0, 3.0] for r in d.records)
    assert all(r["slowest_rank"] == 0 for r in d.records)
    assert [r["rank"] for r in d.sink.ranks()] == [0, 1]


# ---------------------------------------------------------------- decode limits via Runs.ingest


def raw_steps(**kw: Any) -> bytes:
    d: dict[str, Any] = {"type": "steps", "run": RUN, "rank": 0, "steps": [1, 2],
                         "times": [1.0, 2.0], "step_ms": [10.0, None]}
    d.update(kw)
    return protocol.encoder.encode(d)


P = 1024  # PROTOCOL 2: 1-1024 points (a literal: the test must not follow the code)
BAD_STEPS = [
    ("times_short", raw_steps(times=[1.0]), "steps_shape"),
    ("step_ms_long", raw_steps(step_ms=[1.0, 2.0, 3.0]), "steps_shape"),
    ("samples_short", raw_steps(samples=[1]), "steps_shape"),
    ("tokens_long", raw_steps(tokens=[1, 2, 3]), "steps_shape"),
    ("metric_short", raw_steps(metrics={"loss": [1.0]}), "steps_shape"),
    ("metric_empty", raw_steps(metrics={"ok": [1.0, 2.0], "loss": []}), "steps_shape"),
    ("repeated_step", raw_steps(steps=[1, 1]), "steps_shape"),
    ("decreasing", raw_steps(steps=[2, 1]), "steps_shape"),
    ("decreasing_late", raw_steps(steps=[1, 5, 3], times=[1.0] * 3, step_ms=[None] * 3),
     "steps_shape"),
    ("repeated_zero", raw_steps(steps=[0, 0]), "steps_shape"),
    # past the short-frame loop (8 points), the C-level pass
    ("long_repeat", raw_steps(steps=[*range(10), 9, 11], times=[1.0] * 12,
                              step_ms=[None] * 12), "steps_shape"),
    ("long_decreasing_end", raw_steps(steps=[*range(1, 12), 0], times=[1.0] * 12,
                                      step_ms=[None] * 12), "steps_shape"),
    ("long_metric_short", raw_steps(steps=list(range(12)), times=[1.0] * 12,
                                    step_ms=[None] * 12,
                                    metrics={"a": [1.0] * 12, "b": [1.0] * 11}), "steps_shape"),
    ("no_points", raw_steps(steps=[], times=[], step_ms=[]), "schema"),
    ("1025_points", raw_steps(steps=list(range(P + 1)), times=[1.0] * (P + 1),
                              step_ms=[None] * (P + 1)), "schema"),
    ("65_names", raw_steps(metrics={f"m{i}": [1.0, 2.0] for i in range(65)}), "schema"),
    ("long_name", raw_steps(metrics={"n" * 129: [1.0, 2.0]}), "schema"),
    ("step_str", raw_steps(steps=["1", "2"]), "schema"),
    ("step_float", raw_steps(steps=[1.0, 2.0]), "schema"),
    ("time_str", raw_steps(times=["a", 2.0]), "schema"),
    ("time_null", raw_steps(times=[None, 2.0]), "schema"),
    ("step_ms_str", raw_steps(step_ms=["x", None]), "schema"),
    ("metric_str", raw_steps(metrics={"loss": ["x", 1.0]}), "schema"),
    ("metric_bool", raw_steps(metrics={"loss": [True, 1.0]}), "schema"),
    ("metric_not_list", raw_steps(metrics={"loss": 1.0}), "schema"),
    ("metrics_list", raw_steps(metrics=[1.0, 2.0]), "schema"),
    ("samples_float", raw_steps(samples=[1.5, 2]), "schema"),
    ("negative_step", raw_steps(steps=[-1, 2]), "schema"),
    ("negative_samples", raw_steps(samples=[1, -1]), "schema"),
    ("negative_tokens", raw_steps(tokens=[-7, 1]), "schema"),
    ("missing_times", protocol.encoder.encode({"type": "steps", "run": RUN, "rank": 0,
                                               "steps": [1], "step_ms": [None]}), "schema"),
    ("steps_null", raw_steps(steps=None), "schema"),
]


@pytest.mark.parametrize("raw, reason", [(raw, reason) for _, raw, reason in BAD_STEPS],
                         ids=[name for name, _, _ in BAD_STEPS])
def test_bad_steps_frame_is_rejected_counted_and_has_no_effect(raw: bytes, reason: str) -> None:
    runs = Runs()
    assert runs.ingest(raw, T0) == []
    assert runs.rejected == {reason: 1} and runs.accepted == 0
    assert len(runs) == 0  # no run created
    # and on an existing run: nothing changes
    runs.ingest(encoder.encode(reg(0, 1)), T0)
    runs.ingest(encoder.encode(stp(0, [0])), T0 + 1)
    sink = runs.get(RUN)
    assert sink is not None
    before = msgspec.msgpack.encode([sink.snapshot(), sink.late_steps, sink.updated_at])
    assert runs.ingest(raw, T0 + 2) == []
    assert runs.rejected == {reason: 2}
    assert msgspec.msgpack.encode([sink.snapshot(), sink.late_steps, sink.updated_at]) == before


OK_STEPS = [
    ("1024_points", raw_steps(steps=list(range(P)), times=[1.0] * P, step_ms=[None] * P)),
    ("64_names", raw_steps(metrics={f"m{i}": [1.0, None] for i in range(64)})),
    ("128_char_name", raw_steps(metrics={"\u00e9" * 128: [1.0, 2.0]})),
    ("one_point", raw_steps(steps=[0], times=[1.0], step_ms=[None])),
    ("samples_not_sent", raw_steps(samples=[], tokens=[])),
    ("int_and_nonfinite_values", raw_steps(metrics={"loss": [1, math.nan]},
                                          times=[math.inf, 2], step_ms=[-math.inf, 3])),
    ("gaps", raw_steps(steps=[0, 2**62], times=[1.0, 2.0])),
    ("unknown_key", raw_steps(extra={"x": [1, 2]})),
]


@pytest.mark.parametrize("raw", [raw for _, raw in OK_STEPS], ids=[n for n, _ in OK_STEPS])
def test_steps_frames_at_the_limits_are_accepted(raw: bytes) -> None:
    runs = Runs()
    runs.ingest(raw, T0)
    assert runs.rejected == {} and runs.accepted == 1 and RUN in runs


def test_check_steps_rejects_directly() -> None:
    with pytest.raises(protocol.BadSteps):
        protocol.check_steps(Steps(run=RUN, rank=0, steps=[3, 2], times=[1.0, 1.0],
                                   step_ms=[None, None]))
    assert protocol.BadSteps.reason == "steps_shape"


# ---------------------------------------------------------------- a random cross-check


def _reference_records(points: dict[int, dict[int, tuple[float, float]]]) -> list[Any]:
    """Closed records from (step -> rank -> (loss, ms)) by brute force over 2.4."""
    out = []
    for step in sorted(points):
        reps = points[step]
        losses = [reps[r][0] for r in sorted(reps)]
        mss = [reps[r][1] for r in sorted(reps)]
        slow = max(sorted(reps), key=lambda r: (reps[r][1], -r))
        out.append((step, len(reps), [math.fsum(losses) / len(losses), min(losses), max(losses)],
                    [math.fsum(mss) / len(mss), min(mss), max(mss)], slow))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_closes_every_accepted_point_once_with_exact_figures(seed: int) -> None:
    """Random ranks, overlapping re-sends, ticks, force closes: at the end every step that
    got a point not late on arrival is closed exactly once, ascending, from the last write
    of each rank; everything else was counted late."""
    import random

    rng = random.Random(seed)
    ws = rng.randrange(1, 6)
    d = Drive(ws, step_close_after=rng.choice([0.5, 2.0, 1000.0]))
    highest = [-1] * ws
    truth: dict[int, dict[int, tuple[float, float]]] = {}
    sent = late = 0
    t = 0.0
    for _ in range(300):
        t = round(t + rng.random() * 0.2, 6)
        r = rng.randrange(ws)
        start = highest[r] + 1 if rng.random() < 0.85 else max(0, highest[r] - 3)
        steps = list(range(start, start + rng.randrange(1, 6)))
        loss = [float(rng.randrange(100)) for _ in steps]
        ms = [float(rng.randrange(1, 100)) for _ in steps]
        last_closed = d.sink._closer.last_closed
        for s, lv, mv in zip(steps, loss, ms):
            sent += 1
            if s <= last_closed:
                late += 1
            else:
                truth.setdefault(s, {})[r] = (lv, mv)
        d.send(stp(r, steps, loss=loss, ms=ms), t)
        highest[r] = max(highest[r], steps[-1])
        if rng.random() < 0.3:
            d.tick(round(t + rng.random() * 0.1, 6))
            t = d.t
    for r in range(ws):
        d.send(fin(r), t + 1)
    assert d.sink.status == "complete"
    recs = d.records
    want = _reference_records(truth)
    assert numbers(recs) == [w[0] for w in want]
    for rec, (step, n, loss, ms, slow) in zip(recs, want):
        assert (rec["step"], rec["n"], rec["slowest_rank"]) == (step, n, slow)
        assert rec["metrics"]["loss"] == loss and rec["step_ms"] == ms
    assert d.sink.late_steps == late and sent - late >= sum(r["n"] for r in recs)


# ---------------------------------------------------------------- distinct names (v3)


def test_a_run_holds_at_most_1024_distinct_step_metric_names() -> None:
    """Contract v3 section 2 (issue 19 finding 3): a steps frame that would take the run past
    1,024 distinct metric names is rejected whole, counted as ``step_metric_names``; names
    the run already holds stay welcome."""
    from broker.steps.closer import MAX_RUN_STEP_METRICS

    assert MAX_RUN_STEP_METRICS == 1024
    runs = Runs()
    runs.ingest(encoder.encode(Register(run=RUN, rank=0, world_size=1, host="h")), T0)
    for i in range(16):  # 16 frames x 64 new names: exactly at the cap
        names = {f"m{i:02d}_{j:02d}_" + "x" * 100: [1.0] for j in range(64)}
        runs.ingest(encoder.encode(stp(0, [i], metrics=names)), T0 + i)
    assert runs.rejected == {}
    sink = runs.get(RUN)
    assert sink is not None
    before = (sink.seq, sink._closer.ranks[0].highest)
    over = {"m00_00_" + "x" * 100: [2.0], "brand_new": [2.0]}
    runs.ingest(encoder.encode(stp(0, [100], metrics=over)), T0 + 20)
    assert runs.rejected == {"step_metric_names": 1}
    assert (sink.seq, sink._closer.ranks[0].highest) == before  # no effect at all
    known = {"m15_63_" + "x" * 100: [3.0], "m00_00_" + "x" * 100: [3.0]}
    runs.ingest(encoder.encode(stp(0, [101], metrics=known)), T0 + 21)
    assert runs.rejected == {"step_metric_names": 1}
    assert sink._closer.ranks[0].highest == 101
    with pytest.raises(Rejected) as exc:
        sink.apply(stp(0, [102], metrics={"another": [1.0]}), T0 + 22)
    assert exc.value.reason == "step_metric_names"


def test_restored_steps_count_towards_the_name_cap() -> None:
    d = Drive(1)
    d.send(stp(0, [0], metrics={f"n{j}": [1.0] for j in range(64)}))
    d.send(fin(0))
    block = d.sink.steps.to_wire()
    fresh = RunSink(RUN)
    fresh.restore_steps(block)
    assert fresh._steps.names == {f"n{j}" for j in range(64)}
