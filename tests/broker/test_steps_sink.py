"""The RunSink's steps rules (PROTOCOL.md 2.4 and 4), pure: a run's status and header from
its steps, the non-finite loss alert, the ``steps`` events' rate and latency, ranks beyond
the world size, and the cap on distinct step metric names."""
from __future__ import annotations

import math

import msgspec
import pytest

from broker.run.sink import STEPS_INTERVAL, Rejected, RunSink
from broker.run.steps.store import wire_records
from broker.runs import Runs
from rank_agent.protocol import Register, encoder
from tests.support.stepdrive import RUN, T0, Drive, fin, reg, stp

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
    # (v5, 8.3: rank 0's first NaN of loss is also its per-rank ``nonfinite`` alert)
    assert [(a["kind"], a["rank"]) for a in alerts] == [("nonfinite_loss", None), ("nonfinite", 0)]
    assert "step 2" in alerts[0]["message"] and "nan" in alerts[0]["message"]
    assert alerts[0]["at"] == 1.0
    assert [e.kind for e in events] == ["steps", "run"]
    assert events[1].data["alerts"] == alerts
    # an infinite mean later: the one alert now names that step
    d.send(stp(0, [4], loss=math.inf), 5.0)
    d.send(stp(1, [4], loss=1.0), 5.0)
    (alert,) = [a for a in d.sink.header()["alerts"] if a["kind"] == "nonfinite_loss"]
    assert "step 4" in alert["message"] and "inf" in alert["message"] and alert["at"] == 5.0


def test_finite_loss_and_other_nonfinite_metrics_raise_no_loss_alert() -> None:
    d = Drive(1)
    d.send(stp(0, range(3), loss=[1.0, 2.0, 3.0], metrics={"grad": [math.nan] * 3}), 1.0)
    d.tick(2.0)
    # (v5, 8.3: the grad's first NaN is the one alert, run-wide on a one-rank run)
    assert d.closed == [0, 1, 2] and [(a["kind"], a["rank"], a["message"]) for a in
                                      d.sink.header()["alerts"]] == [
        ("nonfinite", None, "grad is nan at step 0: first non-finite grad (1 rank)")]


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


# ---------------------------------------------------------------- distinct names (v3)


def test_a_run_holds_at_most_1024_distinct_step_metric_names() -> None:
    """Contract v3 section 2 (issue 19 finding 3): a steps frame that would take the run past
    1,024 distinct metric names is rejected whole, counted as ``step_metric_names``; names
    the run already holds stay welcome."""
    from broker.run.steps.closer import MAX_RUN_STEP_METRICS

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
