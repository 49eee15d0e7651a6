"""Issue 32, finding 2: one byte budget for every run's dumps in a process
(broker/budget.py), oldest dumps dropped first, in the broker's stores and the web's copy."""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from broker import budget as budget_mod
from broker import feed
from broker.budget import ByteBudget
from broker.stacks.store import MAX_RUN_STACKS_BYTES, RunStacks
from web.hub import Hub

MiB = 1024 * 1024


def big_dump(rank: int, size: int, reason: str = "stall", salt: str = "") -> list[Any]:
    """A dump in wire form with one distinct thread blob of ``size`` bytes."""
    code = f"{salt}:{rank}:{reason}:{os.urandom(8).hex()}".ljust(size - 64, "x")
    blob = msgspec.msgpack.encode({"name": "MainThread", "main": True, "frames": [
        {"file": "t.py", "line": 1, "function": "f", "code": code}]})
    return [rank, reason, "", 100.0, 70.0, 0, 0.0, [blob], b""]


def held(stores: list[RunStacks]) -> int:
    return sum(s.bytes for s in stores)


def test_many_runs_of_maximal_dumps_stay_within_one_budget() -> None:
    """60 runs, each at its per-run cap (scaled down 64x: 1 MiB a run), in an 8 MiB budget:
    the per-run cap alone let them hold 60 MiB."""
    budget = ByteBudget(8 * MiB)
    stores = [RunStacks(cap=MAX_RUN_STACKS_BYTES // 64, budget=budget) for _ in range(60)]
    for i, store in enumerate(stores):
        for rank in range(16):
            assert store.put_wire(big_dump(rank, 60 * 1024, salt=str(i)))
        assert budget.used <= budget.limit
        assert budget.used == held(stores)  # the budget's count is the stores' bytes
    assert held(stores) <= 8 * MiB
    # oldest answers dropped first: the newest runs keep every dump, the oldest none
    assert len(stores[-1]) == 16 and len(stores[-7]) == 16
    assert len(stores[0]) == 0 and len(stores[40]) == 0
    assert sum(s.over_budget for s in stores) == budget.dropped > 0


def test_a_closed_store_gives_its_bytes_back_and_is_never_asked_again() -> None:
    budget = ByteBudget(4 * MiB)
    a, b = RunStacks(budget=budget), RunStacks(budget=budget)
    a.put_wire(big_dump(0, MiB - 4096))
    b.put_wire(big_dump(0, MiB - 4096))
    a.close()
    assert budget.used == b.bytes and len(budget) == 1
    for rank in range(1, 4):
        b.put_wire(big_dump(rank, MiB - 4096))
    assert len(b) == 4 and budget.dropped == 0


def test_a_replaced_dump_is_refunded_and_shared_blobs_counted_once() -> None:
    budget = ByteBudget(64 * MiB)
    store = RunStacks(budget=budget)
    item = big_dump(0, MiB)
    store.put_wire(list(item))
    store.put_wire([1, "stall", "", 1.0, 1.0, 0, 0.0, list(item[7]), b""])  # same blob
    store.put_wire(big_dump(0, 2 * MiB))  # replaces rank 0's: the 1 MiB blob still shared
    assert budget.used == store.bytes and store.bytes < 3 * MiB + 4096


def ev(run: str, seq: int, kind: str, data: Any) -> list[bytes]:
    return feed.encode_event(run, SimpleNamespace(seq=seq, kind=kind, data=data))


def test_the_web_keeps_every_run_dumps_within_the_process_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The web's copy (web/stacksview.py): 40 runs of 1 MiB of dumps in a 6 MiB budget;
    a dropped run gives its bytes back."""
    budget = ByteBudget(6 * MiB)
    monkeypatch.setattr(budget_mod, "PROCESS_BUDGET", budget)
    hub = Hub()
    hub.next_request()
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 0))
    for i in range(40):
        run = f"run{i}"
        hub.handle_pub(ev(run, 1, "ranks", [{"rank": r, "host": "h", "status": "stalled"}
                                            for r in range(8)]))
        hub.handle_pub(ev(run, 2, "stacks", {"dumps": [big_dump(r, 128 * 1024, salt=run)
                                                       for r in range(8)], "gone": []}))
    stores = [d.store for d in hub.stacks.values()]
    assert budget.used == held(stores) <= 6 * MiB
    view = hub.stacks_view("run39")
    assert view is not None and len(view["dumps"]) == 8  # the newest run keeps all
    oldest = hub.stacks_view("run0")
    assert oldest is not None and oldest["dumps"] == []  # the oldest run's went first
    before = budget.used
    assert hub.drop_run("run39")
    assert budget.used < before
    assert budget.used == held([d.store for d in hub.stacks.values()])


def test_a_run_evicted_at_max_runs_gives_its_dumps_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker: Runs evicting a run (``--max-runs``) closes its store."""
    from broker.runs import Runs
    from rank_agent.protocol import encoder
    from tests.broker.test_stacks_sink import dump
    from tests.support.frames import register
    budget = ByteBudget(64 * MiB)
    monkeypatch.setattr(budget_mod, "PROCESS_BUDGET", budget)
    runs = Runs(max_runs=1)
    runs.ingest(encoder.encode(register(run="a")), 1.0)
    frame = dump(0, "main", "all_reduce", extra_threads=10, pad=150)
    frame.run = "a"
    runs.ingest(encoder.encode(frame), 2.0)
    assert budget.used > 100_000
    runs.ingest(encoder.encode(register(run="b")), 3.0)  # evicts run a
    assert budget.used == 0 and len(budget) == 0


def test_a_cached_stacks_answer_that_evicts_its_own_dumps_is_not_rebuilt_each_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The web's cached GET /stacks JSON is charged too; when that charge drops the run's
    own oldest dumps, the answer stays cached (rebuilt per read, it would churn)."""
    import json
    budget = ByteBudget(3 * MiB)
    monkeypatch.setattr(budget_mod, "PROCESS_BUDGET", budget)
    hub = Hub()
    hub.next_request()
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 0))
    hub.handle_pub(ev("r", 1, "ranks", [{"rank": r, "host": "h", "status": "stalled"}
                                         for r in range(8)]))
    hub.handle_pub(ev("r", 2, "stacks", {"dumps": [big_dump(r, 300 * 1024) for r in range(8)],
                                         "gone": []}))
    builds: list[int] = []

    def encode(view: Any) -> bytes:
        builds.append(1)
        return json.dumps(view).encode()

    first = hub.stacks_view_json("r", encode)
    assert budget.used <= budget.limit
    assert hub.stacks_view_json("r", encode) is first and len(builds) == 1
