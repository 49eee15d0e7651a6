"""Per (rank, step) the broker merges a later point into the earlier one field by field
until the step closes (PROTOCOL.md 2 and 5, v3; ``data_ms`` and ``times`` 7.1).

Each test sends the same step twice from one rank so that the whole-point replacement the
broker did before would give another record: a value only the earlier point had, or a
``None``/0 in the later point that must not erase it. Both ways a step closes are covered:
the grid close (every point of a round of flushes closes) and the general close (points
carried over, or a step that stays open).
"""
from __future__ import annotations

from typing import Any

from broker.run.steps.closer import StepCloser
from rank_agent.protocol import Steps, decode, encoder
from tests.support.stepdrive import RUN, T0, Drive

LATER = T0 + 0.5


def wire(frame: Any) -> Any:
    return decode(encoder.encode(frame))


def pt(rank: int, step: int, *, ms: Any = None, data: Any = None, samples: int = 0,
       tokens: int = 0, t: float = T0, **metrics: Any) -> Steps:
    """One point; ``data``: data_ms (``...``: the list left out, as an old agent sends)."""
    return wire(Steps(run=RUN, rank=rank, steps=[step], times=[t], step_ms=[ms],
                      samples=[samples], tokens=[tokens],
                      metrics={k: [v] for k, v in metrics.items()},
                      data_ms=[] if data is ... else [data]))


def close(*frames: Steps) -> dict[str, Any]:
    """The frames (arrival order) into a closer, then its one closed record."""
    c = StepCloser(close_after=1000.0, grace=0.0)
    for i, f in enumerate(frames):
        c.add(f, T0 + i, True)
    (rec,) = c.close_all()
    return rec


def test_a_later_flush_with_the_loss_keeps_the_earlier_step_time() -> None:
    """The Accelerate tracker's loss in a later flush than the recipe's step time."""
    rec = close(pt(0, 5, ms=100.0, data=7.0, samples=8, tokens=80),
                pt(0, 5, loss=2.5, t=LATER))
    assert rec["metrics"] == {"loss": [2.5, 2.5, 2.5]}
    assert rec["step_ms"] == [100.0, 100.0, 100.0] and rec["slowest_rank"] == 0
    assert rec["data_ms"] == [7.0, 7.0, 7.0]
    assert (rec["samples"], rec["tokens"]) == (8, 80)
    assert rec["time"] == LATER  # the later point's time (7.1)
    assert rec["n"] == 1


def test_a_none_in_a_later_point_does_not_erase_a_value_already_sent() -> None:
    rec = close(pt(0, 5, ms=100.0, data=7.0, loss=2.0, acc=0.5),
                pt(0, 5, ms=None, data=None, loss=None, acc=0.75, t=LATER))
    assert rec["metrics"] == {"acc": [0.75, 0.75, 0.75], "loss": [2.0, 2.0, 2.0]}
    assert rec["step_ms"] == [100.0, 100.0, 100.0]
    assert rec["data_ms"] == [7.0, 7.0, 7.0]


def test_later_non_null_values_replace_and_zero_counts_do_not() -> None:
    rec = close(pt(0, 5, ms=100.0, data=7.0, samples=8, tokens=80, loss=2.0),
                pt(0, 5, ms=300.0, data=9.0, samples=0, tokens=40, loss=4.0, t=LATER),
                pt(0, 5, samples=0, tokens=0, t=LATER + 1))
    assert rec["metrics"]["loss"] == [4.0, 4.0, 4.0]
    assert rec["step_ms"] == [300.0, 300.0, 300.0]
    assert rec["data_ms"] == [9.0, 9.0, 9.0]
    assert (rec["samples"], rec["tokens"]) == (8, 40)
    assert rec["time"] == LATER + 1


def test_a_frame_without_data_ms_does_not_erase_it() -> None:
    rec = close(pt(0, 5, ms=100.0, data=7.0), pt(0, 5, ms=110.0, data=..., t=LATER))
    assert rec["data_ms"] == [7.0, 7.0, 7.0] and rec["step_ms"][0] == 110.0


def test_merge_with_other_ranks_at_the_same_step() -> None:
    """Rank 1's merged point enters the step's figures once; the slowest rank is the merged
    step time's (rank 1's later null step time does not hand 'slowest' to rank 0)."""
    rec = close(pt(0, 5, ms=100.0, data=1.0, loss=1.0),
                pt(1, 5, ms=300.0, data=5.0),
                pt(2, 5, ms=200.0, data=3.0, loss=3.0),
                pt(1, 5, ms=None, loss=5.0, t=LATER))
    assert rec["n"] == 3
    assert rec["metrics"]["loss"] == [3.0, 1.0, 5.0]
    assert rec["step_ms"] == [200.0, 100.0, 300.0] and rec["slowest_rank"] == 1
    assert rec["data_ms"] == [3.0, 1.0, 5.0]


def test_merge_across_a_carried_point() -> None:
    """Step 5 stays open while step 4 closes (carried over as arrays), then rank 0's
    second flush of step 5 merges into the carried point."""
    c = StepCloser(close_after=1000.0, grace=0.0)
    c.add(wire(Steps(run=RUN, rank=0, steps=[4, 5], times=[T0, T0], step_ms=[10.0, 20.0],
                     metrics={"loss": [1.0, 2.0]}, data_ms=[1.0, 2.0])), T0, True)
    c.add(wire(Steps(run=RUN, rank=1, steps=[4], times=[T0], step_ms=[10.0])), T0, True)
    assert [r["step"] for r in c.ready(T0 + 1, None)] == [4]
    c.add(pt(0, 5, ms=None, data=None, acc=0.5, t=LATER), T0 + 2, True)
    (rec,) = c.close_all()
    assert rec["step"] == 5
    assert rec["metrics"] == {"acc": [0.5, 0.5, 0.5], "loss": [2.0, 2.0, 2.0]}
    assert rec["step_ms"] == [20.0, 20.0, 20.0] and rec["data_ms"] == [2.0, 2.0, 2.0]


def test_merge_through_the_sink_publishes_the_merged_record() -> None:
    d = Drive(2)
    d.send(pt(0, 1, ms=100.0, data=4.0), 2.0)
    d.send(pt(0, 1, loss=0.5, t=LATER), 2.1)
    d.send(pt(1, 1, ms=120.0, data=6.0, loss=1.5), 2.2)
    d.send(pt(0, 2, ms=100.0), 2.3)
    d.send(pt(1, 2, ms=100.0), 2.4)
    d.tick(5.0)
    rec = d.records[0]
    assert rec["step"] == 1 and rec["n"] == 2
    assert rec["metrics"]["loss"] == [1.0, 0.5, 1.5]
    assert rec["step_ms"] == [110.0, 100.0, 120.0]
    assert rec["data_ms"] == [5.0, 4.0, 6.0]

