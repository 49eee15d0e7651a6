"""Issue 38, items 2, 3 and 7 without sockets: the hub hands a big message's work to its
``offload`` (the pump's thread pool) only where its state is whole, the work is done in
pieces (``web/piecewise.py``), a run's collectives are held encoded and charged to the byte
budget at what they hold, and ``GET /collectives`` is built once per state."""
from __future__ import annotations

import json
import tracemalloc
from typing import Any, Callable

import msgspec
import pytest

from broker import budget as _budget
from broker import feed
from tests.web.test_hub_collectives import RUN, VERDICT, coll, connected_hub, ev
from web import hub as hubmod
from web import piecewise
from web.collectivesview import RunCollectiveView
from web.hub import Hub


def big_ranks(n: int) -> list[dict[str, Any]]:
    return [{"rank": r, "host": f"h{r % 97}", "status": "ok", "loss": 1.5, "gpu_xids": [],
             "resources": {"cpu": r % 100, "gpus": [{"util": 3.5, "mem": float(r)}]}}
            for r in range(n)]


def test_piecewise_decode_and_encode_equal_a_whole_one() -> None:
    value = {"seq": 3, "kind": "ranks", "data": big_ranks(5000),
             "nested": [[{"x": [1, 2.5, None, "é"]} for _ in range(300)] for _ in range(40)]}
    packed = msgspec.msgpack.encode(value)
    assert len(packed) > 4 * piecewise.PIECE_BYTES
    assert piecewise.decode(packed) == msgspec.msgpack.decode(packed)
    for payload in (value["data"], {"dumps": [], "collectives": value["data"]},
                    [float("nan")] * 3000, {1: [0] * 3000}):
        assert piecewise.encode_json(payload) == msgspec.json.encode(payload)
    with pytest.raises(msgspec.DecodeError):
        piecewise.decode(packed[:-1])


def test_a_big_message_is_worked_off_the_loop_while_the_hub_is_whole() -> None:
    hub = connected_hub()
    sub, _, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
    seen: list[tuple[str, int, int]] = []

    def offload(fn: Callable[..., Any], *args: Any) -> Any:
        state = hub.runs[RUN]
        seen.append((fn.__name__, state.seq, len(state.ranks)))  # what another greenlet reads
        return fn(*args)

    hub.offload = offload
    n = 2 * hubmod.OFFLOAD_ITEMS
    message = ev(2, "ranks", big_ranks(n))
    assert len(message[1]) > hubmod.OFFLOAD_BYTES
    hub.handle_pub(message)
    # decoded and made public before any change (seq 1, no ranks), encoded after the last
    assert seen == [("decode_big_update", 1, 0), ("public_ranks", 1, 0), ("ranks_event", 2, n)]
    assert hub.runs[RUN].ranks[5] == {k: v for k, v in big_ranks(6)[5].items()
                                      if k not in ("loss", "gpu_xids")}
    seq, chunk = sub.queue.get_nowait()
    assert seq == 2 and len(json.loads(chunk.split(b"data: ", 1)[1])) == n
    seen.clear()
    hub.handle_pub(ev(3, "stacks", {"dumps": [], "collectives": [coll(r, 12) for r in range(n)],
                                    "verdict": VERDICT}))
    assert [s[0] for s in seen] == ["decode_big_update", "prepare", "json_event"]
    assert len(hub.collectives_view(RUN)["ranks"]) == n  # type: ignore[index]
    seen.clear()
    hub.handle_pub(ev(4, "ranks", big_ranks(3)))  # small: on the loop, nothing handed over
    assert seen == []


def test_collectives_are_held_encoded_and_charged_at_what_they_hold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 3: the held frames' memory is about what the budget is charged (they were
    decoded dicts ~7 times the bytes the broker charged, and the web charged nothing)."""
    budget = _budget.ByteBudget(1 << 40)
    monkeypatch.setattr(_budget, "PROCESS_BUDGET", budget)
    frames = [coll(r, 12) for r in range(4000)]
    for frame in frames:  # 64 entries each, as a real hang's
        frame["entries"] = frame["entries"] * 64
    data = {"dumps": [], "collectives": frames, "verdict": VERDICT}
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        view = RunCollectiveView()
        view.apply_event(data)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    charged = budget.used
    assert charged >= sum(len(msgspec.json.encode(f)) for f in frames)
    assert held < 1.5 * charged, (held, charged)
    view.close()
    assert budget.used == 0 and len(budget) == 0


def test_the_budget_drops_the_oldest_frames_and_the_answer_follows() -> None:
    budget = _budget.ByteBudget(10_000)
    view = RunCollectiveView(budget)
    view.apply_event({"collectives": [coll(r, 12) for r in range(100)], "verdict": VERDICT})
    assert budget.used <= 10_000 and 0 < len(view) < 100 and view.over_budget == 100 - len(view)
    ranks = [f["rank"] for f in view.view()["ranks"]]
    assert ranks and ranks == list(range(100 - len(ranks), 100))  # the newest kept
    assert view.view()["groups"] == VERDICT


def test_get_collectives_is_built_once_per_state() -> None:
    hub = connected_hub()
    hub.handle_pub(ev(2, "stacks", {"dumps": [], "collectives": [coll(0, 12), coll(1, 11)],
                                    "verdict": VERDICT}))
    first = hub.collectives_view_json(RUN)
    assert first is not None and hub.collectives_view_json(RUN) is first  # cached bytes
    assert json.loads(first) == {"groups": VERDICT, "ranks": [coll(0, 12), coll(1, 11)]}
    hub.handle_pub(ev(3, "stacks", {"dumps": [], "collectives_gone": [[0, "stall"]]}))
    second = hub.collectives_view_json(RUN)
    assert second is not None and second is not first and [f["rank"] for f in json.loads(second)["ranks"]] == [1]
    assert hub.collectives_view_json("nope") is None
    empty = Hub()
    empty.next_request()
    empty.handle_snapshot(feed.encode_snapshot_end("i1", 0))
    assert empty.collectives_view_json(RUN) is None


def test_a_piecewise_decode_peaks_no_higher_than_a_whole_one() -> None:
    """A run snapshot's steps are a map of big ``bin`` columns inside a map: each level's
    items were copied out of their parent before being decoded, so the decode of a 1M-step
    snapshot peaked at ~3x its result (the web's RSS 595 MiB instead of 405 after a broker
    restart, ``steps_restart_1m_s``' details). The items are views of the message now."""
    columns = {f"c{i}": bytes(range(256)) * 8192 for i in range(8)}  # 2 MiB each
    value = {"header": {"run": "r"}, "steps": {"columns": columns, "ms": [b"\0" * 2**20] * 4},
             "ranks": big_ranks(3000)}
    packed = msgspec.msgpack.encode(value)

    def peak(decode: Callable[[bytes], Any]) -> int:
        tracemalloc.start()
        try:
            result = decode(packed)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert result == value
        return peak

    whole, pieces = peak(msgspec.msgpack.decode), peak(piecewise.decode)
    assert pieces < 1.25 * whole, (pieces, whole)


def test_the_stacks_answer_holds_no_decoded_copy_of_the_dumps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 3: after ``GET /stacks`` the run holds the store's bytes and the cached answer,
    both charged; a cache of decoded thread blobs beside them held several times more."""
    from tests.web.test_hub_stacks import dump
    from web.stacksview import RunDumps

    budget = _budget.ByteBudget(1 << 40)
    monkeypatch.setattr(_budget, "PROCESS_BUDGET", budget)
    items = [dump(r, *(f"fn_{r}_{i}" for i in range(64))) for r in range(200)]
    ranks = [{"rank": r, "host": f"n{r}", "status": "stalled"} for r in range(200)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        dumps = RunDumps()
        dumps.apply_event(1, {"dumps": items})
        built: list[str] = []

        def offload(fn: Callable[..., Any], *args: Any) -> Any:
            built.append(fn.__name__)
            return fn(*args)

        data = dumps.view_json(ranks, 1, msgspec.json.encode, offload)
        assert dumps.view_json(ranks, 1, msgspec.json.encode, offload) is data
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert built == ["_view_json"]  # built once, by the offload
    assert len(msgspec.json.decode(data)["dumps"]) == 200
    assert held < 1.5 * budget.used, (held, budget.used)
    dumps.close()
    assert budget.used == 0


def test_a_big_run_snapshot_is_built_off_the_loop() -> None:
    hub = Hub()
    handed: list[str] = []

    def offload(fn: Callable[..., Any], *args: Any) -> Any:
        handed.append(fn.__name__)
        return fn(*args)

    hub.offload = offload
    hub.next_request()
    n = 2 * hubmod.OFFLOAD_ITEMS
    body = {"run": RUN, "seq": 5, "header": {"run": RUN}, "ranks": big_ranks(n), "records": [],
            "complete": None, "svg": None, "stacks": [],
            "collectives": {"groups": VERDICT, "ranks": [coll(r, 12) for r in range(n)]}}
    hub.handle_snapshot(feed.encode_run_snapshot(body))
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 1))
    assert handed == ["decode_big_snapshot_reply", "from_snapshot", "prepare_snapshot"]
    assert len(hub.runs[RUN].ranks) == n and "loss" not in hub.runs[RUN].ranks[0]
    view = hub.collectives_view(RUN)
    assert view is not None and view["groups"] == VERDICT and len(view["ranks"]) == n


def test_a_dump_that_arrives_while_the_stacks_answer_is_built_is_in_the_next_answer() -> None:
    """The answer is built off the loop; a dump the loop takes meanwhile is not in it, so the
    answer is cached for the state it was built from and the next read builds again. (It was
    stamped with the newer state, as if the budget had dropped dumps, and served without the
    new rank's dump until something else changed: the stall view's one group of two.)"""
    from tests.web.test_hub_stacks import dump
    from web.stacksview import RunDumps

    dumps = RunDumps()
    dumps.apply_event(1, {"dumps": [dump(r, "all_reduce", "backward") for r in range(3)]})
    ranks = [{"rank": r, "host": f"n{r}", "status": "stalled"} for r in range(4)]

    def offload(fn: Callable[..., Any], *args: Any) -> Any:
        data = fn(*args)
        if len(dumps.store.wire()) == 3:  # the loop runs while the pool builds
            dumps.apply_event(2, {"dumps": [dump(3, "__next__", "train_step")]})
        return data

    first = msgspec.json.decode(dumps.view_json(ranks, 1, msgspec.json.encode, offload))
    assert sorted(d["rank"] for d in first["dumps"]) == [0, 1, 2]
    again = msgspec.json.decode(dumps.view_json(ranks, 1, msgspec.json.encode, offload))
    assert sorted(d["rank"] for d in again["dumps"]) == [0, 1, 2, 3]
    assert len(again["groups"]) == 2
    dumps.close()
