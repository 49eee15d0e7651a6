"""The hub's stack dumps without sockets (PROTOCOL.md sections 2.5 and 4): ``stacks`` feed
events become SSE ``stacks`` events (live only, never replayed), ``stacks_view`` answers the
``GET /stacks`` JSON with the groups of the ranks stalled now and of the latest request,
snapshots carry the dumps, and the broker's ``gone`` keys are dropped."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from broker import feed
from broker.stacks.store import wire_of
from rank_agent.protocol import StackFrame, Stacks, ThreadStack
from web.hub import Hub

RUN = "r1"


def ev(seq: int, kind: str, data: Any) -> list[bytes]:
    return feed.encode_event(RUN, SimpleNamespace(seq=seq, kind=kind, data=data))


def dump(rank: int, *functions: str, reason: str = "stall", request_id: str = "") -> Any:
    frames = [StackFrame(file="t.py", line=i + 1, function=f, code="")
              for i, f in enumerate(functions)]
    return wire_of(Stacks(run=RUN, rank=rank, reason=reason, request_id=request_id,  # type: ignore[arg-type]
                          taken_at=100.0 + rank, idle_s=70.0,
                          threads=[ThreadStack(name="MainThread", main=True, frames=frames),
                                   ThreadStack(name=f"rankboard-stallwatch-{rank}",
                                               frames=frames[:1])]))


def ranks(**status: str) -> list[dict[str, Any]]:
    return [{"rank": r, "host": f"n{r}", "status": status.get(f"r{r}", "ok")} for r in range(4)]


def connected_hub() -> Hub:
    hub = Hub()
    hub.next_request()
    hub.handle_snapshot(feed.encode_run_snapshot({
        "run": RUN, "seq": 1, "header": {"run": RUN}, "ranks": ranks(), "records": [],
        "complete": None, "svg": None,
        "stacks": [dump(3, "main", "old", reason="request", request_id="q0")]}))
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 1))
    return hub


def test_stacks_events_are_kept_grouped_and_streamed_live_only() -> None:
    hub = connected_hub()
    sub, _, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
    # the snapshot's dumps are listed at once (a restart keeps them)
    view = hub.stacks_view(RUN)
    assert view is not None and [(d["rank"], d["reason"]) for d in view["dumps"]] == [
        (3, "request")]
    assert view["dumps"][0]["host"] == "n3"
    hub.handle_pub(ev(2, "stacks", {"dumps": [dump(0, "main", "all_reduce"),
                                              dump(1, "main", "all_reduce"),
                                              dump(2, "main", "__next__")], "gone": []}))
    seq, chunk = sub.queue.get_nowait()
    assert seq == 2 and chunk.startswith(b"id: 2\nevent: stacks\n")
    payload = json.loads(chunk.split(b"data: ", 1)[1])
    assert payload == {"dumps": [{"rank": r, "reason": "stall", "request_id": "",
                                  "taken_at": 100.0 + r} for r in range(3)]}
    # stalled before the broker's next ranks array says so: the dumps came after the last one
    view = hub.stacks_view(RUN)
    assert view is not None
    assert [(g["reason"], g["ranks"]) for g in view["groups"]] == [
        ("stall", [0, 1]), ("stall", [2]), ("request", [3])]
    assert [f["function"] for f in view["groups"][0]["frames"]] == ["main", "all_reduce"]
    # a ranks array after them that says rank 2 is ok again (and 0, 1 still stalled)
    hub.handle_pub(ev(3, "ranks", ranks(r0="stalled", r1="stalled")))
    view = hub.stacks_view(RUN)
    assert view is not None
    assert [g["ranks"] for g in view["groups"] if g["reason"] == "stall"] == [[0, 1]]
    # never replayed: a new client's first chunks have no stacks event
    _, chunks, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
    assert not any(b"event: stacks" in c for c in chunks)
    # the broker dropped a dump (its cap): the web drops it too
    hub.handle_pub(ev(4, "stacks", {"dumps": [], "gone": [[1, "stall"]]}))
    view = hub.stacks_view(RUN)
    assert view is not None
    assert [d["rank"] for d in view["dumps"] if d["reason"] == "stall"] == [0, 2]
    assert hub.stacks_view("nope") is None


def test_the_latest_request_is_this_webs_or_the_newest_answer() -> None:
    hub = connected_hub()
    hub.note_stacks_request(RUN, "q1")  # sent, no answer yet: the old answers are not grouped
    view = hub.stacks_view(RUN)
    assert view is not None and view["groups"] == []
    hub.handle_pub(ev(2, "stacks", {"dumps": [dump(1, "main", "f", reason="request",
                                                   request_id="q1")], "gone": []}))
    view = hub.stacks_view(RUN)
    assert view is not None
    assert [(g["request_id"], g["ranks"]) for g in view["groups"]] == [("q1", [1])]


def test_a_malformed_stacks_event_is_skipped() -> None:
    hub = connected_hub()
    hub.handle_pub(ev(2, "stacks", {"dumps": [[1, 2, 3], "x"], "gone": [["a"]]}))
    hub.handle_pub(ev(3, "stacks", ["not", "a", "map"]))
    view = hub.stacks_view(RUN)
    assert view is not None and len(view["dumps"]) == 1


def test_the_web_holds_what_the_broker_holds_under_the_cap() -> None:
    """An event that replaces a big dump by a small one and adds another big one fits the
    cap in the broker; the web must not refuse the new one on the way (keys it replaces go
    first)."""
    from broker.stacks.store import BLOB_OVERHEAD, DUMP_OVERHEAD, RunStacks

    def big(rank: int, tag: str) -> Any:
        frames = [StackFrame(file="t.py", line=i, function=f"{tag}_{i}_" + "z" * 60, code="")
                  for i in range(100)]
        return wire_of(Stacks(run=RUN, rank=rank, reason="stall", taken_at=1.0,  # type: ignore[arg-type]
                              threads=[ThreadStack(name="T", main=True, frames=frames)]))

    one = len(big(0, "a")[7][0])
    broker = RunStacks(cap=2 * (one + DUMP_OVERHEAD + BLOB_OVERHEAD) + 3000)
    broker.put_wire(dump(3, "main", "old", reason="request", request_id="q0"))  # as the hub's
    hub = connected_hub()
    store = hub._dumps(RUN).store
    store.cap = broker.cap
    for r, tag in ((1, "a"), (2, "b")):
        assert broker.put_wire(big(r, tag))
    hub.handle_pub(ev(2, "stacks", {"dumps": broker.wire(), "gone": []}))
    # the broker: rank 1 small now, rank 0 big (both fit); in the event, rank 0 sorts first
    small = dump(1, "main", "f")
    assert broker.put_wire(small) and broker.put_wire(big(0, "c"))
    hub.handle_pub(ev(3, "stacks", {"dumps": broker.wire([(0, "stall"), (1, "stall")]),
                                    "gone": []}))
    assert sorted(store.keys()) == sorted(broker.keys())
    assert store.over_cap == 0


def test_request_stacks_refuses_a_pump_with_no_broker() -> None:
    import pytest

    from rank_agent.controlwire import ControlRequest
    from web.pump import FeedPump, StacksRequestError

    hub = connected_hub()
    pump = FeedPump(hub, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")  # never started
    with pytest.raises(StacksRequestError):
        pump.request_stacks(ControlRequest(run=RUN, request_id="q", kind="stacks", ranks=[0]))
    assert pump.stacks_requests == 0


def test_the_stacks_json_is_built_once_per_state() -> None:
    """Issue 32 (Low): six tabs reading /stacks once a second re-encoded it each time; the
    answer is now cached until the dumps, the ranks or the latest request change."""
    hub = connected_hub()
    encoded: list[int] = []

    def encode(view: Any) -> bytes:
        encoded.append(1)
        return json.dumps(view).encode()

    first = hub.stacks_view_json(RUN, encode)
    assert all(hub.stacks_view_json(RUN, encode) is first for _ in range(6))
    assert len(encoded) == 1
    hub.handle_pub(ev(2, "stacks", {"dumps": [dump(0, "main", "all_reduce")], "gone": []}))
    second = hub.stacks_view_json(RUN, encode)
    assert len(encoded) == 2 and json.loads(second)["dumps"][0]["rank"] == 0
    hub.handle_pub(ev(3, "ranks", ranks(r0="stalled")))
    hub.stacks_view_json(RUN, encode)
    hub.note_stacks_request(RUN, "q9")
    hub.stacks_view_json(RUN, encode)
    assert len(encoded) == 4
    assert hub.stacks_view_json("nope", encode) is None
