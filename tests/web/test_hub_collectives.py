"""The hub's collectives without sockets (PROTOCOL.md section 7.2): the broker's ``stacks``
feed events carry ``collectives`` frames and the verdict; the SSE ``stacks`` event lists the
frames as ``{rank, reason, request_id, taken_at}``; ``collectives_view`` answers ``GET
/collectives`` with the broker's verdict; snapshots carry both; ``collectives_gone`` drops."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from broker import feed
from broker.stacks.collectives import wire_of
from rank_agent.protocol import CollectiveEntry, Collectives, ProcessGroupStatus
from web.hub import Hub

RUN = "r1"
VERDICT = [{"pg": "0", "desc": "default_pg", "size": 3, "seq": 12, "op": "gloo:all_reduce",
            "waiting": [0, 1], "behind": [{"rank": 2, "last_enqueued": 11, "op": "gloo:all_reduce"}],
            "absent": [], "mismatched": []}]


def ev(seq: int, kind: str, data: Any) -> list[bytes]:
    return feed.encode_event(RUN, SimpleNamespace(seq=seq, kind=kind, data=data))


def coll(rank: int, enqueued: int, reason: str = "stall", request_id: str = "") -> Any:
    return wire_of(Collectives(
        run=RUN, rank=rank, reason=reason, request_id=request_id,  # type: ignore[arg-type]
        taken_at=200.0 + rank,
        groups=[ProcessGroupStatus(pg="0", last_enqueued=enqueued, last_completed=enqueued - 1)],
        entries=[CollectiveEntry(pg="0", seq=enqueued, op="gloo:all_reduce",
                                 input_sizes=[[4, 8]])]))


def connected_hub(collectives: Any = None) -> Hub:
    hub = Hub()
    hub.next_request()
    body = {"run": RUN, "seq": 1, "header": {"run": RUN}, "ranks": [], "records": [],
            "complete": None, "svg": None, "stacks": []}
    if collectives is not None:
        body["collectives"] = collectives
    hub.handle_snapshot(feed.encode_run_snapshot(body))
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 1))
    return hub


def test_collectives_arrive_in_stacks_events_and_the_verdict_is_the_brokers() -> None:
    hub = connected_hub()
    assert hub.collectives_view(RUN) == {"groups": [], "ranks": []}
    assert hub.collectives_view("nope") is None
    sub, _, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
    hub.handle_pub(ev(2, "stacks", {"dumps": [], "gone": [],
                                    "collectives": [coll(0, 12), coll(1, 12), coll(2, 11)],
                                    "collectives_gone": [], "verdict": VERDICT}))
    seq, chunk = sub.queue.get_nowait()
    assert seq == 2 and chunk.startswith(b"id: 2\nevent: stacks\n")
    payload = json.loads(chunk.split(b"data: ", 1)[1])
    assert payload == {"dumps": [], "collectives": [
        {"rank": r, "reason": "stall", "request_id": "", "taken_at": 200.0 + r} for r in range(3)]}
    view = hub.collectives_view(RUN)
    assert view is not None and view["groups"] == VERDICT
    assert [(f["rank"], f["reason"]) for f in view["ranks"]] == [(0, "stall"), (1, "stall"),
                                                                (2, "stall")]
    # a verdict-only event (a rank moved on): the frames stay, the groups change
    hub.handle_pub(ev(3, "stacks", {"dumps": [], "gone": [], "collectives": [],
                                    "collectives_gone": [[1, "stall"]], "verdict": []}))
    view = hub.collectives_view(RUN)
    assert view is not None and view["groups"] == []
    assert [f["rank"] for f in view["ranks"]] == [0, 2]
    # a stacks event of dumps only leaves the verdict alone and lists no collectives
    hub.handle_pub(ev(4, "stacks", {"dumps": [], "gone": []}))
    _, chunk = [sub.queue.get_nowait() for _ in range(2)][-1]
    assert "collectives" not in json.loads(chunk.split(b"data: ", 1)[1])
    # malformed frames from a feed are skipped, never raised
    hub.handle_pub(ev(5, "stacks", {"dumps": [], "collectives": [{"rank": "x"}, 7]}))
    assert len(hub.collectives_view(RUN)["ranks"]) == 2  # type: ignore[index]


def test_a_snapshot_carries_frames_and_verdict() -> None:
    hub = connected_hub({"groups": VERDICT, "ranks": [coll(0, 12), coll(2, 11, "request", "q")]})
    view = hub.collectives_view(RUN)
    assert view is not None and view["groups"] == VERDICT
    assert [(f["rank"], f["reason"], f["request_id"]) for f in view["ranks"]] == [
        (0, "stall", ""), (2, "request", "q")]
