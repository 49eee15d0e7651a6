"""A run's life at the sink (PROTOCOL.md 2.2 and 3), driven with frames and a fake clock: its
completion and reopening, liveness (stale ranks, the throttled ``ranks`` event), the rank
entries and the snapshot, and the determinism of a replay under any frame sequence."""
from __future__ import annotations

import math
import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.run.sink import Rejected, RunSink
from rank_agent.protocol import (
    GpuSample,
    ResourceSample,
)
from tests.support.sinkframes import (
    RUN,
    fin,
    hw,
    kinds,
    met,
    meta,
    of_kind,
    reg,
    registered,
    res,
    state,
    svg,
)

# ---------------------------------------------------------------- finish and completion


def test_all_finished_completes_once() -> None:
    sink = registered(2)
    assert sink.apply(fin(0), 1.0) == []
    events = sink.apply(fin(1), 2.0)
    assert kinds(events) == ["run", "ranks", "complete"]
    assert events[0].data["status"] == "complete" and events[2].data == {"status": "complete"}
    assert sink.complete == (events[2].seq, "complete") and sink.finished
    assert sink.apply(fin(1), 3.0) == []  # idempotent
    assert sink.status == "complete"
    assert [r["status"] for r in sink.ranks()] == ["finished", "finished"]
    assert sink.snapshot()["complete"] == [events[2].seq, "complete"]


def test_the_final_ranks_go_with_the_completion_not_after_it() -> None:
    """Issue 27: the ``ranks`` event is throttled to one per ``ranks_interval`` and could
    trail ``complete`` (a client saw the run end with a rank still "running")."""
    sink = registered(2)
    assert of_kind(sink.tick(1.0), "ranks")  # the throttle's clock starts now
    assert sink.apply(fin(0), 1.1) == []
    events = sink.apply(fin(1), 1.2)  # well within ranks_interval of the last ranks event
    assert kinds(events)[-2:] == ["ranks", "complete"]
    assert [r["status"] for r in of_kind(events, "ranks")[0]] == ["finished", "finished"]
    assert of_kind(sink.tick(5.0), "ranks") == []  # nothing left to trail it


def test_any_error_fails_the_run_and_raises_alert() -> None:
    sink = registered(2)
    sink.apply(fin(1, "error"), 1.0)
    (alert,) = of_kind(sink.tick(1.0), "run")[0]["alerts"]
    assert (alert["kind"], alert["rank"], alert["at"]) == ("rank_error", 1, 1.0)
    events = sink.apply(fin(0), 2.0)
    assert of_kind(events, "complete") == [{"status": "failed"}]
    assert sink.status == "failed"
    assert [r["status"] for r in sink.ranks()] == ["finished", "error"]


def test_completion_needs_every_rank_of_the_world() -> None:
    sink = RunSink(RUN)
    sink.apply(reg(0, 3), 1.0)
    sink.apply(fin(0), 1.0)
    sink.apply(fin(2), 1.0)  # rank 1 never said anything
    assert not sink.finished and sink.complete is None


def test_other_frames_from_finished_rank_leave_it_finished() -> None:
    sink = registered(2)
    sink.apply(fin(0), 1.0)
    for frame in [res(0, cpu_percent=1.0), hw(0, "c | g"), met(0, 0), svg(0, "<svg/>"), meta(0, "1")]:
        sink.apply(frame, 2.0)
    entry = sink.ranks()[0]
    assert entry["status"] == "finished" and entry["last_seen"] == 2.0


def test_register_from_finished_rank_reopens_the_run() -> None:
    sink = registered(2)
    sink.apply(fin(0), 1.0)
    sink.apply(fin(1), 1.0)
    assert sink.status == "complete"
    assert sink.apply(reg(1, 2), 2.0) == []  # the reopened header is coalesced
    events = sink.tick(2.0)
    assert kinds(events) == ["run", "ranks"] and events[0].data["status"] == "waiting"
    assert sink.complete is None and not sink.finished
    assert sink.ranks()[1]["status"] == "ok"
    assert sink.snapshot()["complete"] is None
    # The reactivated rank is waited for again; the run can complete again.
    sink.apply(met(1, 0), 3.0)
    assert sink.status == "training"
    events = sink.apply(fin(1, "error"), 4.0)
    assert of_kind(events, "complete") == [{"status": "failed"}]


def test_reopen_after_records_is_training() -> None:
    sink = registered(1)
    sink.apply(met(0, 0), 1.0)
    sink.apply(fin(0), 2.0)
    sink.apply(reg(0, 1), 3.0)
    assert of_kind(sink.tick(3.0), "run")[0]["status"] == "training"


def test_reactivated_rank_is_waited_for_its_pending_epoch() -> None:
    sink = registered(3)
    sink.apply(met(0, 0), 1.0)
    sink.apply(fin(0), 1.0)
    sink.apply(reg(0, 3), 2.0)  # active again, its epoch-0 report counts again
    sink.apply(met(1, 0), 3.0)
    (record,) = of_kind(sink.apply(met(2, 0), 3.0), "epoch")
    assert record["missing_ranks"] == []


# ---------------------------------------------------------------- liveness


def test_stale_then_ok_via_tick_and_alert_stays() -> None:
    sink = registered(2, stale_after=30.0)  # registered at t=0
    sink.tick(0.0)  # the registers' (coalesced) header goes out
    sink.apply(res(1), 20.0)
    assert of_kind(sink.tick(29.9), "run") == []
    events = sink.tick(30.0)
    (header,) = of_kind(events, "run")
    assert header["alerts"] == [{"kind": "stale", "rank": 0, "message": header["alerts"][0]["message"], "at": 30.0,
                                 "host": "a"}]
    assert [r["status"] for r in sink.ranks()] == ["stale", "ok"]
    assert of_kind(sink.tick(31.0), "run") == []  # not raised twice while stale
    sink.apply(res(0), 40.0)
    assert sink.ranks()[0]["status"] == "ok"
    assert [a["kind"] for a in sink.header()["alerts"]] == ["stale"]  # still listed
    # Rank 1 goes stale too (a second entry), then rank 0 again: its entry is updated in place.
    sink.tick(50.0)
    events = sink.tick(70.0)
    alerts = of_kind(events, "run")[0]["alerts"]
    assert [(a["rank"], a["at"]) for a in alerts] == [(0, 70.0), (1, 50.0)]


def test_finished_rank_never_goes_stale() -> None:
    sink = registered(2)
    sink.apply(fin(0), 1.0)
    sink.tick(1000.0)
    assert [r["status"] for r in sink.ranks()] == ["finished", "stale"]


def test_ranks_event_only_from_tick_and_rate_limited() -> None:
    sink = registered(2, ranks_interval=1.0)
    assert "ranks" not in kinds(sink.apply(res(0, cpu_percent=1.0), 0.5))
    (ranks,) = of_kind(sink.tick(0.5), "ranks")
    assert [r["rank"] for r in ranks] == [0, 1]
    assert sink.tick(0.6) == []  # nothing changed
    sink.apply(res(0, cpu_percent=2.0), 0.7)
    assert of_kind(sink.tick(0.9), "ranks") == []  # changed, but within the interval
    (ranks,) = of_kind(sink.tick(1.5), "ranks")
    assert ranks[0]["resources"]["cpu_percent"] == 2.0
    assert sink.tick(5.0) == []


def test_rank_entries() -> None:
    sink = RunSink(RUN)
    sink.apply(met(1, 4, loss=0.5), 1.0)  # before register: no host yet
    sink.apply(reg(0, 2, "h", lr=0), 2.0)
    sink.apply(hw(0, "cpu | gpu"), 3.0)
    sink.apply(res(0, cpu_percent=3.0), 4.0)
    r0, r1 = sink.ranks()
    assert r0 == {
        "rank": 0, "host": "h", "local_rank": 0, "status": "ok", "last_seen": 4.0, "epoch": None,
        "hardware": "cpu | gpu",
        "resources": {"cpu_percent": 3.0, "ram_used_bytes": None, "ram_total_bytes": None,
                      "gpu_util_percent": None, "vram_allocated_bytes": None, "vram_total_bytes": None,
                      "gpus": []},
        "step": None, "step_ms": None, "data_ms": None, "slowest_share": 0.0,
        "loss": None, "gpu_xids": None, "error": None,
    }
    assert (r1["host"], r1["local_rank"], r1["epoch"], r1["loss"], r1["last_seen"]) == (None, None, 4, 0.5, 1.0)


def test_snapshot_shape() -> None:
    sink = registered(1)
    sink.apply(svg(0, "<svg/>"), 1.0)
    sink.apply(met(0, 0), 2.0)
    snap = sink.snapshot()
    assert list(snap) == ["run", "seq", "header", "ranks", "records", "complete", "svg",
                          "steps", "stacks", "collectives", "line", "epochs_superseded"]
    assert snap["seq"] == sink.seq and snap["complete"] is None and snap["svg"] == "<svg/>"
    assert snap["records"] == [[sink.record_seqs[0], sink.records[0]]]
    msgspec.msgpack.encode(snap)  # plain values only


# ---------------------------------------------------------------- determinism


def _random_frames(seed: int, ws: int = 4, n: int = 400):
    rng = random.Random(seed)
    out = []
    t = 0.0
    for _ in range(n):
        t += rng.random() * 5
        rank = rng.randrange(ws + 1)
        kind = rng.randrange(8)
        if kind == 0:
            f = reg(rank, ws if rng.random() < 0.9 else ws + 1, rng.choice("ab"), lr=rng.randrange(3),
                    port=rng.choice([0, 1, 2]), total_epochs=rng.choice([0, 9]))
        elif kind == 1:
            f = res(rank, cpu_percent=rng.random(), gpus=[GpuSample(device_index=0, name="g")] * rng.randrange(2))
        elif kind == 2:
            f = hw(rank, rng.choice(["c", "c | g", "c | g | h"]))
        elif kind == 3:
            f = fin(rank, rng.choice(["ok", "error"]))
        elif kind == 4:
            f = meta(rank, rng.choice(["{}", "[1]", "{bad"]))
        elif kind == 5:
            f = svg(rank, rng.choice(["", "<svg/>"]), label="l")
        else:
            f = met(rank, rng.randrange(6), loss=rng.choice([1.0, 2.0, math.nan]), b=rng.randrange(3),
                    scalars={"acc": (rng.random(), rng.randrange(2))},
                    resources=ResourceSample(gpu_util_percent=1.0) if rng.random() < 0.3 else None)
        out.append((f, t))
    return out


def _replay(frames, sink: RunSink):
    events = []
    for frame, t in frames:
        try:
            events += sink.apply(frame, t)
        except Rejected as exc:
            events.append(("rejected", exc.reason))
        events += sink.tick(t)
    return msgspec.msgpack.encode(events), state(sink)


@pytest.mark.parametrize("seed", range(5))
def test_replay_is_deterministic(seed: int) -> None:
    frames = _random_frames(seed)
    assert _replay(frames, RunSink(RUN, stale_after=7.0)) == _replay(frames, RunSink(RUN, stale_after=7.0))


frame_strategy = st.builds(
    lambda kind, rank, epoch, ws, loss, port: [
        reg(rank, ws, "ab"[rank % 2], port=port),
        met(rank, epoch, loss=loss),
        fin(rank, "error" if epoch % 3 == 0 else "ok"),
        res(rank, cpu_percent=float(epoch)),
        meta(rank, "{bad" if epoch % 2 else "{}"),
    ][kind],
    st.integers(0, 4), st.integers(0, 5), st.integers(0, 4), st.integers(1, 5),
    st.sampled_from([0.5, math.nan]), st.sampled_from([0, 80, 81]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(frame_strategy, st.floats(0, 100)), max_size=40))
def test_invariants_under_any_frame_sequence(steps) -> None:
    sink = RunSink(RUN, stale_after=10.0, ranks_interval=0.0)
    last_seq = 0
    t = 0.0
    for frame, dt in steps:
        t += dt
        before = state(sink)
        try:
            events = sink.apply(frame, t)
        except Rejected:
            assert state(sink) == before  # no effect at all
            continue
        events += sink.tick(t)
        for e in events:
            assert e.seq == last_seq + 1
            last_seq = e.seq
    epochs = [r["epoch"] for r in sink.records]
    assert epochs == sorted(set(epochs))
    assert sink.record_seqs == sorted(sink.record_seqs)
    if sink.world_size is not None:
        assert all(r["rank"] < sink.world_size for r in sink.ranks())
        for record in sink.records:
            reported = [g["device_index"] for g in record["gpu_metrics"]]
            assert sorted(reported + record["missing_ranks"]) == list(range(sink.world_size))
