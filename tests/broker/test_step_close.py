"""When a step closes (PROTOCOL.md 2.4), pure: the watermark, the start-up grace, stale and
finished ranks, the force close, the run's end, late points and last writes, then a random
cross-check against a brute-force reference. Each test is built so that it fails if its
rule is missing: the frames are chosen so that the rule-less outcome differs (a step
closing early or late, a value from the wrong rank)."""
from __future__ import annotations

import math
from typing import Any

import pytest

from broker.run.steps.closer import StepCloser
from broker.run.steps.store import wire_records
from broker.runs import Runs
from rank_agent.protocol import encoder
from tests.support.stepdrive import RUN, T0, Drive, closer_with, fin, numbers, reg, stp

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
