"""The ``collectives`` frames every run keeps share the process's byte budget with the dumps
(broker/budget.py; issue 32 finding 2's rule: a per-run cap times ``--max-runs`` bounds
nothing): oldest dropped first, the web told that a dropped frame's rank has none, a run that
leaves memory refunds what it kept."""
from __future__ import annotations

from typing import Any

import pytest

from broker import budget as budget_mod
from broker.budget import ByteBudget
from broker.runs import Runs
from broker.stacks.collectives import RunCollectives, held_bytes, wire_of
from broker.stacks.feed import STACKS_INTERVAL
from broker.stacks.store import RunStacks
from rank_agent import protocol
from rank_agent.protocol import CollectiveEntry, Collectives, ProcessGroupStatus, Register

KiB = 1024


def big(run: str, rank: int, reason: str = "stall") -> Collectives:
    """A frame of ~10 KiB encoded, ~65 KiB held (64 entries with 128-character ops)."""
    return Collectives(
        run=run, rank=rank, reason=reason, taken_at=1.0,  # type: ignore[arg-type]
        groups=[ProcessGroupStatus(pg="0", size=2, last_enqueued=70, last_completed=69)],
        entries=[CollectiveEntry(pg="0", seq=s, op=f"{s}:".ljust(128, "o"), input_sizes=[[4]])
                 for s in range(7, 71)])


#: what one :func:`big` frame is charged (what it holds, issue 38; its encoded size before)
ONE = held_bytes(wire_of(big("r", 0)))


def held(stores: list[RunCollectives]) -> int:
    return sum(s.bytes for s in stores)


def test_many_runs_of_frames_stay_within_one_budget_oldest_dropped_first() -> None:
    budget = ByteBudget(int(9.5 * ONE))
    stores = [RunCollectives(budget=budget) for _ in range(20)]
    for i, store in enumerate(stores):
        for rank in range(2):
            assert store.put(big(f"r{i}", rank))
        assert budget.used == held(stores) <= budget.limit
    # the newest runs keep both frames, the oldest none; what was dropped is said once
    assert len(stores[-1]) == 2 and len(stores[0]) == 0
    assert sum(s.over_budget for s in stores) == budget.dropped > 0
    assert stores[0].has_gone and stores[0].take_gone() == [(0, "stall"), (1, "stall")]
    assert not stores[0].has_gone and stores[0].take_gone() == []
    assert stores[0].latest == {}


def test_frames_and_dumps_share_the_budget_and_a_closed_store_refunds() -> None:
    budget = ByteBudget(64 * KiB)  # (the dump alone nearly fills it; the frame is ~65 KiB)
    coll = RunCollectives(budget=budget)
    dumps = RunStacks(budget=budget)
    assert coll.put(big("a", 0))
    code = "x" * (60 * KiB)
    dumps.put(protocol.Stacks(run="b", rank=0, reason="stall", taken_at=1.0, threads=[
        protocol.ThreadStack(name="t", main=True, frames=[
            protocol.StackFrame(file="f.py", line=1, function="f", code=code[:512])] * 120)]))
    # the dump came after the frame: the frame, the older, was dropped for it
    assert len(dumps) == 1 and len(coll) == 0 and coll.take_gone() == [(0, "stall")]
    assert coll.put(big("a", 1))
    dumps.close()
    coll.close()
    assert budget.used == 0 and len(budget) == 0


def test_a_replaced_frame_is_refunded_not_charged_twice() -> None:
    budget = ByteBudget(1024 * KiB)
    store = RunCollectives(budget=budget)
    for _ in range(50):
        assert store.put(big("a", 0))
    assert budget.used == store.bytes and len(budget) == 1 and budget.dropped == 0


@pytest.fixture
def small_budget(monkeypatch: pytest.MonkeyPatch) -> ByteBudget:
    budget = ByteBudget(3 * ONE)
    monkeypatch.setattr(budget_mod, "PROCESS_BUDGET", budget)
    return budget


def test_the_sink_tells_the_web_a_dropped_frames_rank_has_none(small_budget: ByteBudget) -> None:
    runs = Runs()
    events: list[Any] = []
    for run in ("a", "b"):
        for rank in range(2):
            runs.apply(Register(run=run, rank=rank, world_size=2, host="h"), 1.0)
    runs.apply(big("a", 0), 2.0)
    runs.apply(big("a", 1), 2.0)
    runs.tick(2.0 + STACKS_INTERVAL)
    runs.apply(big("b", 0), 3.0)  # the budget drops run a's oldest frames for these
    runs.apply(big("b", 1), 3.0)
    a = runs.get("a")
    assert a is not None and len(a._stack_feed.collectives) < 2
    events = runs.tick(3.0 + STACKS_INTERVAL)
    gone = [g for run, e in events if run == "a" and e.kind == "stacks"
            for g in e.data.get("collectives_gone", [])]
    assert sorted(map(tuple, gone)) == sorted(
        {(0, "stall"), (1, "stall")} - set(a._stack_feed.collectives.latest.items()))
    assert gone and small_budget.used <= small_budget.limit


def test_an_evicted_run_refunds_its_frames(small_budget: ByteBudget) -> None:
    runs = Runs(max_runs=1)
    runs.apply(Register(run="a", rank=0, world_size=1, host="h"), 1.0)
    runs.apply(big("a", 0), 2.0)
    assert small_budget.used > 0
    runs.apply(Register(run="b", rank=0, world_size=1, host="h"), 3.0)  # evicts run a
    assert runs.get("a") is None and small_budget.used == 0 and len(small_budget) == 0
