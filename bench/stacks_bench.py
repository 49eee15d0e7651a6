"""Diagnosis benchmarks (issue 20): grouping 1,024 ranks' dumps, and what the stall watch
costs the training thread.

* ``stacks_groups_1024_ms``: the grouping of ``GET /api/runs/<run>/stacks`` for a run whose
  1,024 ranks each have a 60-frame ``stall`` dump (3 distinct stacks: 1,021 ranks in
  ``all_reduce``, two stragglers elsewhere), dumps in the dict form the feed and journal
  carry, plus encoding the groups as JSON; the median of the rounds (target <= 50 ms for the
  whole GET). Extra figures: the same from decoded ``Stacks`` Structs, and encoding the full
  response body (every dump as well as the groups) with msgspec's JSON encoder, which is
  what dominates the GET.
* ``stall_note_ns``: :meth:`rank_agent.stallwatch.StallWatch.note`, the training thread's
  whole cost per ``log_step``/``log_epoch``, in ns per call (the best of several rounds of
  a million calls; an empty method call measured alongside is the baseline).

    python bench/stacks_bench.py [--quick]
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgspec  # noqa: E402
from common import result  # noqa: E402

from broker.stackgroups import stack_groups  # noqa: E402
from rank_agent.protocol import Stacks, decoder, encoder  # noqa: E402
from rank_agent.stallwatch import StallWatch  # noqa: E402

RANKS = 1024
DEPTH = 60


def dumps(ranks: int = RANKS, depth: int = DEPTH) -> dict[int, dict[str, Any]]:
    """``rank -> stall dump`` as a dict; 3 distinct main-thread stacks."""
    base = [{"file": f"/opt/venv/lib/python3.11/site-packages/torch/module_{i}.py", "line": 100 + i,
             "function": f"fn_{i}", "code": f"return self.fn_{i + 1}(x)"} for i in range(depth - 1)]
    tails = [{"file": "/opt/venv/lib/python3.11/site-packages/torch/distributed/c10d.py",
              "line": 2050, "function": "all_reduce", "code": "work.wait()"},
             {"file": "/opt/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py",
              "line": 631, "function": "__next__", "code": "data = self._next_data()"},
             {"file": "/work/train.py", "line": 88, "function": "save_checkpoint",
              "code": "torch.save(state, path)"}]
    out = {}
    for rank in range(ranks):
        tail = tails[0] if rank not in (417, 1000) else tails[1 if rank == 417 else 2]
        worker = {"name": "pin_memory", "frames": base[:10]}
        out[rank] = {"type": "stacks", "run": "bench", "rank": rank, "reason": "stall",
                     "request_id": "", "taken_at": 1.0e9, "idle_s": 75.0,
                     "threads": [{"name": "MainThread", "main": True,
                                  "frames": [*base, tail]}, worker]}
    return out


def time_groups(stall: dict[int, Any], rounds: int) -> list[float]:
    stalled = set(stall)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        groups = stack_groups(stall, stalled, {}, None)
        json.dumps(groups)
        times.append((time.perf_counter() - t) * 1000)
    assert [len(g["ranks"]) for g in groups] == [RANKS - 2, 1, 1]
    return times


def note_ns(calls: int, rounds: int = 5) -> tuple[float, float]:
    watch = StallWatch(lambda frame: None, "bench", 0, 60)

    class Empty:
        def note(self) -> None:
            pass

    def best(note: Any) -> float:
        fastest = float("inf")
        for _ in range(rounds):
            t = time.perf_counter_ns()
            for _ in range(calls):
                note()
            fastest = min(fastest, (time.perf_counter_ns() - t) / calls)
        return fastest
    try:
        return best(watch.note), best(Empty().note)
    finally:
        watch.close()


def run(quick: bool) -> list[dict[str, Any]]:
    rounds = 5 if quick else 30
    stall = dumps()
    as_dicts = time_groups(stall, rounds)
    structs = {r: decoder.decode(encoder.encode(msgspec.convert(d, Stacks)))
               for r, d in stall.items()}
    as_structs = time_groups(structs, rounds)
    body = {"dumps": list(stall.values()), "groups": stack_groups(stall, set(stall), {}, None)}
    enc = msgspec.json.Encoder()
    t = time.perf_counter()
    data = enc.encode(body)
    body_ms = (time.perf_counter() - t) * 1000
    note, empty = note_ns(200_000 if quick else 1_000_000)
    return [
        result("stacks_groups_1024_ms", round(statistics.median(as_dicts), 2), "ms",
               ranks=RANKS, frames=DEPTH, distinct=3, p_max_ms=round(max(as_dicts), 2),
               structs_ms=round(statistics.median(as_structs), 2),
               full_body_json_ms=round(body_ms, 2), full_body_mib=round(len(data) / 2**20, 2)),
        result("stall_note_ns", round(note, 1), "ns", baseline=round(empty, 1),
               ratio=round(note / empty, 2) if empty else None),
    ]


if __name__ == "__main__":
    for line in run("--quick" in sys.argv):
        print(json.dumps(line))
