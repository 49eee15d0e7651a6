"""failure_65536_ms: computing the header's ``failure`` (PROTOCOL 8.2) for 65,536 ranks that
all finished with an error.

A :class:`broker.run.sink.RunSink` of 65,536 registered ranks (8 a host) receives a ``finish``
with an ``ErrorInfo`` from every rank (through the real schema): most ranks fail in the
collective (one type, a 200-character message with the rank in it, 8 frames), every 64th
rank with one of 100 other types (101 groups: 64 listed), and rank 40,000 first (the earliest ``at``). What is timed
is the sink's recomputation of ``failure`` (:meth:`RunSink._refresh_failure`: one pass over
the ranks in rank order, grouping, ordering, bounding, the JSON-ready dict), the work a
header build pays after a rank's status changed; the figure is the median of repeats with
the collector on as in the broker. The header's JSON size with it is recorded as
``header_kib`` (the event bounds: well under an SSE client's 64 MiB queue).
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Any

from common import result

from broker.run.sink import RunSink
from rank_agent.protocol import ErrorInfo, Finish, Register, StackFrame, decode, encoder

RANKS_PER_HOST = 8


def build_sink(world: int) -> RunSink:
    sink = RunSink("bench", stale_after=1e9)
    for r in range(world):
        sink.apply(Register(run="bench", rank=r, world_size=world,
                            host=f"node{r // RANKS_PER_HOST:05d}",
                            local_rank=r % RANKS_PER_HOST), 1.0)
    frames = [StackFrame(file=f"/opt/conda/lib/python3.11/site-packages/torch/distributed/"
                              f"mod{i}.py", line=100 + i, function=f"call_{i}",
                         code="return work.wait()") for i in range(8)]
    for r in range(world):
        special = r % 64 == 0
        tp = f"pkg.Error{(r // 64) % 100}" if special else "torch.distributed.DistBackendError"
        at = 500.0 if r == 40_000 else 1000.0 + r * 1e-3
        info = ErrorInfo(type=tp, message=f"[rank {r}] recv from peer failed: " + "x" * 160,
                         at=at, frames=frames)
        sink.apply(decode(encoder.encode(Finish(run="bench", rank=r, status="error",
                                                error=info))), 2000.0)
    return sink


def failure_ms(world: int, repeats: int) -> dict[str, Any]:
    sink = build_sink(world)
    times = []
    for _ in range(repeats):
        sink._failure = None  # what a status change leaves: recompute from the ranks
        t0 = time.perf_counter()
        sink._refresh_failure()
        times.append((time.perf_counter() - t0) * 1000.0)
    f = sink.failure
    assert f is not None and f["first"]["rank"] == 40_000
    header_kib = len(json.dumps(sink.header())) / 1024
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "header_kib": round(header_kib, 1), "groups": len(f["groups"]),
            "groups_more": f["groups_more"]}


def run(quick: bool) -> list[dict[str, Any]]:
    m = failure_ms(65536, 5 if quick else 20)
    return [result("failure_65536_ms", round(m["median_ms"], 2), "ms", ranks=65536,
                   min_ms=round(m["min_ms"], 2), max_ms=round(m["max_ms"], 2),
                   header_kib=m["header_kib"], groups=m["groups"],
                   groups_more=m["groups_more"])]


if __name__ == "__main__":
    import sys

    for r in run("--quick" in sys.argv):
        print(json.dumps(r))
