"""Issue 38, item 3: the byte budget counts what is held, not what was encoded.

Before, a ``collectives`` frame was charged its MessagePack size (+512) while it is held as
Python dicts, lists, ints and strings 3-9 times larger (a 64 x 64 frame of two sizes: 3.5 MB
held, 0.39 MB charged), and a tiny dump 2.6 times its charge: under a 256 MiB budget the
broker peaked near 1.85 GiB. The stores now charge :func:`broker.stacks.collectives.
held_bytes` and, for dumps, the exact-size blobs plus measured overheads. These tests flood
stores that share a small budget with frames of every shape and measure, with tracemalloc,
what the process really keeps."""
from __future__ import annotations

import gc
import random
import tracemalloc
from typing import Callable

from broker.budget import ByteBudget
from broker.stacks.collectives import RunCollectives, held_bytes, wire_of
from broker.stacks.store import RunStacks
from rank_agent import protocol as P

MiB = 1024 * 1024
BUDGET = 4 * MiB


def collectives(rng: random.Random, run: str, rank: int, most: int = 64) -> bytes:
    """A valid frame of a random shape: 0-``most`` groups, 0-``most`` entries a group, 0-16
    sizes of 0-16 dimensions, ASCII or wide text, small or large ints."""
    text = rng.choice(["", "x" * 20, "\u4e2d" * 30, "\U0001f600" * 40])
    groups = rng.choice([n for n in (0, 1, 2, 4, 16, 64) if n <= most])
    per = rng.choice([n for n in (0, 1, 4, 16, 64) if n <= most])
    sizes, dims = rng.choice([0, 1, 2, 16]), rng.choice([0, 1, 2, 4, 16])
    base = rng.choice([0, 100_000])
    return P.encoder.encode(P.Collectives(
        run=run, rank=rank, reason=rng.choice(["stall", "request"]), taken_at=1.0,
        request_id=text[:60], groups=[P.ProcessGroupStatus(
            pg=f"{g}{text}", desc="d" + text, size=8, last_enqueued=100 + rank,
            last_completed=99) for g in range(groups)],
        entries=[P.CollectiveEntry(pg=f"{g}{text}", seq=100 + i, op="nccl:all_reduce" + text,
                                   input_sizes=[[base + rank + i + d + k for d in range(dims)]
                                                for k in range(sizes)], state="scheduled")
                 for g in range(groups) for i in range(per)]))


def stacks(rng: random.Random, run: str, rank: int) -> bytes:
    """A dump of 0-8 threads of 0-64 frames, mostly tiny (their overhead dominates)."""
    threads = rng.choice([0, 1, 1, 2, 8])
    depth = rng.choice([0, 1, 2, 8, 64])
    return P.encoder.encode(P.Stacks(
        run=run, rank=rank, reason=rng.choice(["stall", "request"]), taken_at=1.0, idle_s=2.0,
        threads=[P.ThreadStack(name=f"t{t}", main=t == 0, frames=[
            P.StackFrame(file=f"/r{rank}/m.py", line=i, function=f"f{i}", code="x = y")
            for i in range(depth)]) for t in range(threads)]))


def flood(make: Callable[[random.Random, str, int], bytes], store: Callable[[ByteBudget], object],
          frames: int) -> tuple[int, ByteBudget]:
    """``frames`` frames of 40 runs of 64 ranks into stores sharing a BUDGET: the bytes
    tracemalloc sees kept (after a collection) and the budget."""
    rng = random.Random(38)
    raws = [(make(rng, f"run-{i % 40}", (i // 40) % 64), i % 40) for i in range(frames)]
    budget = ByteBudget(BUDGET)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        stores = [store(budget) for _ in range(40)]
        for raw, run in raws:
            stores[run].put(P.decode(raw))  # type: ignore[attr-defined]
        for s in stores:
            if isinstance(s, RunCollectives):  # a verdict's keys are part of what is held
                s.digests(range(64))
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return kept, budget


def test_a_flood_of_collectives_frames_holds_no_more_than_the_budget() -> None:
    kept, budget = flood(lambda r, run, rank: collectives(r, run, rank, most=16),
                         lambda b: RunCollectives(budget=b), 1200)
    assert budget.dropped > 0 and budget.used <= budget.limit
    assert kept <= budget.limit + 256 * 1024, (kept, budget.used)


def test_a_flood_of_small_dumps_holds_no_more_than_the_budget() -> None:
    kept, budget = flood(stacks, lambda b: RunStacks(budget=b), 8000)
    assert budget.dropped > 0 and budget.used <= budget.limit
    assert kept <= budget.limit + 256 * 1024, (kept, budget.used)


def test_held_bytes_bounds_what_one_frame_holds_and_counts_it_not_its_encoding() -> None:
    """The count is an upper bound of what a kept frame holds (tracemalloc), within 2.5x of
    it, for frames of every shape; a 64 x 64 frame is charged megabytes, not its ~0.4 MB
    encoding."""
    rng = random.Random(7)
    for _ in range(12):
        raw = collectives(rng, "r", 0)
        store = RunCollectives(budget=ByteBudget(1 << 40))
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for rank in range(4):
                frame = P.decode(raw)
                assert isinstance(frame, P.Collectives)
                frame.rank = rank
                store.put(frame)
            del frame
            store.digests(range(4))
            gc.collect()
            kept = (tracemalloc.get_traced_memory()[0] - before) / 4
        finally:
            tracemalloc.stop()
        charged = store.bytes / 4
        assert kept <= charged <= 2.5 * kept + 2048, (kept, charged, len(raw))
    maximal = P.decode(P.encoder.encode(P.Collectives(
        run="r", rank=0, reason="stall", taken_at=1.0,
        groups=[P.ProcessGroupStatus(pg=str(g)) for g in range(64)],
        entries=[P.CollectiveEntry(pg=str(g), seq=i, op="nccl:all_reduce",
                                   input_sizes=[[100_000 + i, 100_001 + i]] * 2)
                 for g in range(64) for i in range(64)])))
    assert isinstance(maximal, P.Collectives)
    assert held_bytes(wire_of(maximal)) > 3 * MiB > 8 * len(P.encoder.encode(maximal))
