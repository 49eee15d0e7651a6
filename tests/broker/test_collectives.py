"""The ``collectives`` frame in the broker (PROTOCOL.md section 7.2): the wire's bounds, the
verdict per group (seq, op, waiting, behind, absent, mismatched) over current frames only,
the ``collective_behind``/``collective_mismatch`` alerts, ``stacks`` events that carry the
frames and the verdict, the snapshot, and a replay that lists frames but counts none."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from broker.journal.journal import Journal
from broker.run.sink import RunSink
from broker.runs import Runs
from broker.stacks.collectives import (
    RunCollectives,
    collective_verdict,
    digest_of,
    verdict_alerts,
    wire_of,
)
from broker.stacks.feed import STACKS_INTERVAL
from rank_agent import protocol
from rank_agent.protocol import (
    CollectiveEntry,
    Collectives,
    Metrics,
    ProcessGroupStatus,
    Register,
    Steps,
)
from tests.support import sinkframes
from tests.support.sinkframes import RUN


def coll(rank: int, enqueued: int, completed: int | None = None, *, op: str = "gloo:all_reduce",
         sizes: list[list[int]] | None = None, pg: str = "0", reason: str = "stall",
         request_id: str = "", extra_groups: tuple[str, ...] = ()) -> Collectives:
    """A frame of ``rank``: group ``pg`` at ``enqueued`` (completed one less unless given),
    entries for the last three seqs, all ``op`` of ``sizes``."""
    done = enqueued - 1 if completed is None else completed
    groups = [ProcessGroupStatus(pg=pg, desc="default_pg", size=3, last_enqueued=enqueued,
                                 last_completed=done)]
    groups += [ProcessGroupStatus(pg=g, last_enqueued=5, last_completed=5) for g in extra_groups]
    entries = [CollectiveEntry(pg=pg, seq=s, op=op, input_sizes=sizes or [[4, 8]],
                               state="scheduled") for s in range(max(0, enqueued - 2), enqueued + 1)]
    return Collectives(run=RUN, rank=rank, reason=reason, request_id=request_id,  # type: ignore[arg-type]
                       taken_at=100.0 + rank, groups=groups, entries=entries)


def registered(ws: int = 3) -> RunSink:
    return sinkframes.registered(ws, hosts=[f"n{r}" for r in range(ws)])


def verdict_of(*frames: Collectives, ws: int | None = 3) -> list[dict[str, Any]]:
    return collective_verdict({f.rank: digest_of(wire_of(f)) for f in frames}, ws)


def alerts(sink: RunSink, kind: str) -> dict[int, str]:
    return {a["rank"]: a["message"] for a in sink.alerts.listed() if a["kind"] == kind}


# ------------------------------------------------------------------ wire


def encode(frame: Any) -> bytes:
    return protocol.encoder.encode(frame)


@pytest.mark.parametrize("change", [
    {"groups": [{"pg": str(i)} for i in range(65)]},
    {"groups": [{"pg": "x" * 129}]},
    {"entries": [{"pg": "0", "seq": 1, "op": "o" * 129}]},
    {"entries": [{"pg": "0", "seq": 1, "op": "x", "input_sizes": [[1] * 17]}]},
    {"entries": [{"pg": "0", "seq": 1, "op": "x", "input_sizes": [[1]] * 17}]},
    {"entries": [{"pg": "0", "seq": i, "op": "x"} for i in range(65)]},
    {"reason": "later"},
    {"request_id": "r" * 65},
    {"entries": [{"pg": "0", "seq": "7", "op": "x"}]},
])
def test_a_frame_past_the_bounds_is_rejected_as_schema(change: dict[str, Any]) -> None:
    body = {"type": "collectives", "run": RUN, "rank": 0, "reason": "stall", "taken_at": 1.0}
    body.update(change)
    runs = Runs()
    assert runs.ingest(msgspec.msgpack.encode(body), 1.0) == []
    assert runs.rejected == {"schema": 1}
    assert RUN not in runs


def test_a_frame_at_the_bounds_is_accepted() -> None:
    groups = [{"pg": str(i), "desc": "d" * 128} for i in range(64)]
    entries = [{"pg": str(g), "seq": s, "op": "o" * 128, "input_sizes": [[1] * 16] * 16}
               for g in range(2) for s in range(64)]
    body = {"type": "collectives", "run": RUN, "rank": 0, "reason": "request",
            "taken_at": 1.0, "groups": groups, "entries": entries, "unknown": 1}
    runs = Runs()
    runs.ingest(msgspec.msgpack.encode(body), 1.0)
    assert runs.rejected == {}
    sink = runs.get(RUN)
    assert sink is not None
    assert [r["rank"] for r in sink.collectives_view()["ranks"]] == [0]


# ------------------------------------------------------------------ the verdict, pure


def test_the_rank_behind_is_named_with_its_own_op_and_the_others_wait() -> None:
    groups = verdict_of(coll(0, 2501), coll(1, 2501), coll(2, 2500, 2500, op="gloo:broadcast"))
    assert groups == [{"pg": "0", "desc": "default_pg", "size": 3, "seq": 2501,
                       "op": "gloo:all_reduce", "waiting": [0, 1],
                       "behind": [{"rank": 2, "last_enqueued": 2500, "op": "gloo:broadcast"}],
                       "absent": [], "mismatched": []}]


def test_a_group_where_everyone_is_done_is_not_listed() -> None:
    assert verdict_of(coll(0, 7, 7), coll(1, 7, 7), coll(2, 7, 7)) == []
    # ... but where all wait (a hang below every rank), it is
    [group] = verdict_of(coll(0, 7), coll(1, 7), coll(2, 7))
    assert group["waiting"] == [0, 1, 2] and group["behind"] == []


def test_a_different_collective_or_sizes_at_seq_is_mismatched_against_the_majority() -> None:
    [group] = verdict_of(coll(0, 9), coll(1, 9, op="gloo:broadcast"), coll(2, 9))
    assert group["op"] == "gloo:all_reduce"
    assert group["mismatched"] == [{"rank": 1, "op": "gloo:broadcast", "input_sizes": [[4, 8]]}]
    [group] = verdict_of(coll(0, 9), coll(1, 9), coll(2, 9, sizes=[[4, 9]]))
    assert group["mismatched"] == [{"rank": 2, "op": "gloo:all_reduce", "input_sizes": [[4, 9]]}]
    # a tie: the lowest rank's pair is the majority's
    [group] = verdict_of(coll(0, 9, op="a"), coll(1, 9, op="b"), ws=2)
    assert group["op"] == "a" and [m["rank"] for m in group["mismatched"]] == [1]


def test_absent_is_group_0_ranks_without_a_current_frame_once_the_world_size_is_known() -> None:
    [group] = verdict_of(coll(0, 3), coll(2, 3), ws=4)
    assert group["absent"] == [1, 3]
    [group] = verdict_of(coll(0, 3), coll(2, 3), ws=None)
    assert group["absent"] == []
    # another group's members are not known: nothing absent, and everyone done: not listed
    assert verdict_of(coll(0, 3, 3, pg="1"), ws=4) == []


def test_groups_are_listed_in_numeric_order_then_by_name() -> None:
    frames = [coll(r, 4, pg=pg) for pg in ("10", "2", "b", "a") for r in range(1)]
    digests: dict[int, Any] = {0: {}}
    for f in frames:
        digests[0].update(digest_of(wire_of(f)))
    assert [g["pg"] for g in collective_verdict(digests, None)] == ["2", "10", "a", "b"]


def test_alerts_are_raised_on_entering_and_again_when_the_seq_moves() -> None:
    first = verdict_of(coll(0, 5), coll(1, 5), coll(2, 4, 4))
    raised = verdict_alerts([], first)
    assert raised == [("collective_behind", 2, "not in gloo:all_reduce #5 of group 0 where "
                                               "2 ranks wait")]
    assert verdict_alerts(first, first) == []
    moved = verdict_of(coll(0, 6), coll(1, 6), coll(2, 4, 4))
    assert [r[:2] for r in verdict_alerts(first, moved)] == [("collective_behind", 2)]
    mism = verdict_of(coll(0, 6), coll(1, 6), coll(2, 6, sizes=[[1]]))
    assert verdict_alerts(moved, mism) == [
        ("collective_mismatch", 2, "gloo:all_reduce #6 of group 0 differs: gloo:all_reduce [[1]]")]


def test_the_store_keeps_the_latest_per_rank_and_reason_under_a_byte_cap() -> None:
    store = RunCollectives(cap=12_000)  # (about two of these frames, as they are held)
    assert store.put(coll(0, 1))
    assert store.put(coll(0, 2, reason="request", request_id="q"))
    assert store.latest == {0: "request"}
    store.remove((0, "request"))
    assert store.latest == {0: "stall"}
    n = 0
    while store.put(coll(1 + n, 1)):
        n += 1
    assert store.over_cap == 1 and store.bytes <= 12_000 and n >= 1


# ------------------------------------------------------------------ in the sink


def test_the_sink_raises_the_alerts_and_publishes_the_verdict_in_a_stacks_event() -> None:
    sink = registered()
    events = []
    events += sink.apply(coll(0, 2501), 10.0)
    events += sink.apply(coll(1, 2501), 10.01)
    events += sink.apply(coll(2, 2500, 2500), 10.02)
    assert alerts(sink, "collective_behind") == {}  # within the interval: not yet
    events += sink.tick(10.0 + STACKS_INTERVAL + 0.01)
    assert alerts(sink, "collective_behind") == {
        2: "not in gloo:all_reduce #2501 of group 0 where 2 ranks wait"}
    stacks = [e.data for e in events if e.kind == "stacks"]
    carried = [(c["rank"], c["reason"]) for d in stacks for c in d.get("collectives", [])]
    assert sorted(carried) == [(0, "stall"), (1, "stall"), (2, "stall")]
    assert stacks[-1]["verdict"][0]["behind"][0]["rank"] == 2
    view = sink.collectives_view()
    assert [g["pg"] for g in view["groups"]] == ["0"]
    assert [r["rank"] for r in view["ranks"]] == [0, 1, 2]
    assert sink.snapshot()["collectives"] == view
    json.dumps(sink.snapshot()["collectives"])  # JSON-ready


def test_a_steps_or_metrics_frame_makes_the_ranks_frame_not_current() -> None:
    sink = registered()
    for r, enq in ((0, 8), (1, 8), (2, 7)):
        sink.apply(coll(r, enq, 7), 10.0)
    sink.tick(11.0)
    assert sink.collectives_view()["groups"][0]["behind"][0]["rank"] == 2
    sink.apply(Steps(run=RUN, rank=2, steps=[1], times=[11.0], step_ms=[5.0]), 11.1)
    events = sink.tick(12.0)
    [group] = sink.collectives_view()["groups"]
    assert group["behind"] == [] and group["absent"] == [2]
    assert any(e.kind == "stacks" and "verdict" in e.data for e in events)
    for r in range(3):
        sink.apply(Metrics(run=RUN, rank=r, epoch=0, avg_loss=1.0), 12.1)
    sink.tick(13.0)
    assert sink.collectives_view()["groups"] == []
    # still listed under ranks
    assert len(sink.collectives_view()["ranks"]) == 3


def test_the_latest_frame_of_either_reason_is_the_one_read() -> None:
    sink = registered()
    sink.apply(coll(0, 5), 10.0)
    sink.apply(coll(1, 5), 10.0)
    sink.apply(coll(2, 4, 4), 10.0)
    sink.apply(coll(2, 5, reason="request", request_id="r1"), 10.1)
    sink.tick(11.0)
    [group] = sink.collectives_view()["groups"]
    assert group["behind"] == [] and group["waiting"] == [0, 1, 2]
    assert len(sink.collectives_view()["ranks"]) == 4


def test_ranks_past_the_world_size_are_dropped() -> None:
    sink = RunSink(RUN)
    sink.apply(coll(5, 3), 1.0)
    sink.apply(Register(run=RUN, rank=0, world_size=3, host="n"), 2.0)
    sink.tick(3.0)
    assert sink.collectives_view()["ranks"] == []


def test_a_replay_lists_the_frames_but_none_is_current(tmp_path: Path) -> None:
    j = Journal(tmp_path / "d")
    j.load()
    sink = registered()
    for r in range(3):
        j.accept(sink, b"", Register(run=RUN, rank=r, world_size=3, host=f"n{r}"), 1.0)
    for frame in (coll(0, 5), coll(1, 5), coll(2, 4, 4)):
        sink.apply(frame, 2.0)
        j.accept(sink, b"", frame, 2.0)
    j.flush()
    j.close()
    j = Journal(tmp_path / "d")
    try:
        rebuilt = j.load()[RUN]
        assert rebuilt.collectives_view()["groups"] == []  # not even before a tick
        rebuilt.tick(50.0)
        view = rebuilt.collectives_view()
        assert [r["rank"] for r in view["ranks"]] == [0, 1, 2]
        assert view["groups"] == []
        for frame in (coll(0, 9), coll(1, 9), coll(2, 8, 8)):  # received since: current
            rebuilt.apply(frame, 60.0)
        rebuilt.tick(61.0)
        assert rebuilt.collectives_view()["groups"][0]["behind"][0]["rank"] == 2
    finally:
        j.close()
