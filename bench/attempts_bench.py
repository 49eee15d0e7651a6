"""Attempts (PROTOCOL 8.1): what a restart costs the broker and the web.

* ``rewind_1m_steps_ms``: a run of 1,000,000 closed steps x 4 metrics (restored into a real
  :class:`broker.run.sink.RunSink` as the journal does); a new attempt (a ``register`` with a new
  ``proc``) then closes its first step 1,000 steps back: what is timed is the ``steps`` frame
  that closes it and the ``tick`` that publishes it, the superseding of the 1,000 later
  records of the older attempt included (copied out, the line cut). Median of 5 restarts
  (each a new attempt 10 s after the last, within ``attempt_rate``). ``rewind_to_0_ms`` in the
  details: the worst case, an attempt that starts again at step 0 (1,000,000 records
  superseded at once).
* ``steps_query_1m_rewound_p99_ms``: the web's ``/steps?metric=loss&points=1000`` over random
  ranges of that rewound line, through the real Flask app of ``rankboard web`` (its hub fed
  the broker's snapshot over the feed codec; Werkzeug's test client, no socket), p99 of 200.
  ``attempt_query_p99_ms`` in the details: ``?attempt=0`` (the attempt's own records, merged
  once per change of the line).
"""
from __future__ import annotations

import json
import random
import statistics
import time
from typing import Any

import numpy as np
from common import result

from broker import feed
from broker.run.sink import RunSink
from broker.run.steps.store import StepStore
from rank_agent.protocol import Register, Steps

RUN = "bench-attempts"
METRICS = ("loss", "lr", "grad_norm", "acc")


def big_block(n: int) -> dict[str, Any]:
    """A :meth:`StepStore.to_wire` block of ``n`` closed steps x 4 metrics."""
    store = StepStore()
    rows = np.arange(n, dtype=np.uint32)
    vals = np.linspace(2.0, 0.1, n)
    store.append_columns(
        np.arange(n, dtype=np.int64), 1e9 + np.arange(n, dtype=np.float64),
        np.ones(n, np.int32), np.zeros(n, np.int32), np.full(n, 32, np.int64),
        np.zeros(n, np.int64), (rows, np.full(n, 100.0), np.full(n, 100.0), np.full(n, 100.0)),
        iter([(name, rows, vals, vals, vals) for name in METRICS]),
        (np.empty(0, np.uint32), np.empty(0), np.empty(0), np.empty(0)))
    block = store.to_wire()
    block["published_at"] = 1.0
    return block


def frame(step: int) -> Steps:
    return Steps(run=RUN, rank=0, steps=[step], times=[2e9], step_ms=[100.0],
                 metrics={name: [1.0] for name in METRICS})


def rewinds(n: int, repeats: int) -> tuple[RunSink, list[float], float]:
    sink = RunSink(RUN, stale_after=1e9)
    sink.apply(Register(run=RUN, rank=0, world_size=1, host="h", proc="p0"), 1.0)
    sink.restore_steps(big_block(n))
    assert sink.steps.rows == n
    times = []
    now = 100.0
    step = n
    for k in range(1, repeats + 1):
        now += 10.0
        sink.apply(Register(run=RUN, rank=0, world_size=1, host="h", proc=f"p{k}"), now)
        step -= 1000
        t0 = time.perf_counter()
        sink.apply(frame(step), now)
        sink.tick(now + 1.0)
        times.append((time.perf_counter() - t0) * 1000.0)
        assert sink.steps.last_step == step, (sink.steps.last_step, step)
    worst = RunSink(RUN, stale_after=1e9)
    worst.apply(Register(run=RUN, rank=0, world_size=1, host="h", proc="w0"), 1.0)
    worst.restore_steps(big_block(n))
    worst.apply(Register(run=RUN, rank=0, world_size=1, host="h", proc="w1"), 50.0)
    t0 = time.perf_counter()
    worst.apply(frame(0), 50.0)
    worst.tick(51.0)
    to_zero = (time.perf_counter() - t0) * 1000.0
    assert worst.steps.rows == 1 and worst.line.n_superseded == n
    return sink, times, to_zero


def queries(sink: RunSink, n: int, count: int) -> tuple[list[float], list[float]]:
    from web.app import create_app
    from web.hub import Hub

    hub = Hub()
    hub.next_request()
    hub.handle_snapshot(feed.encode_run_snapshot(sink.snapshot()))
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 1))
    hub.handle_pub(feed.encode_heartbeat("i1", 0.0, 0, {}, 1))
    client = create_app(hub).test_client()
    rng = random.Random(7)
    last = int(sink.steps.last_step or 0)

    def timed(extra: str) -> float:
        a = rng.randrange(0, last)
        b = rng.randrange(a, last + 1)
        t0 = time.perf_counter()
        r = client.get(f"/api/runs/{RUN}/steps?metric=loss&points=1000&start={a}&end={b}"
                       + extra, headers={"Host": "localhost"})
        dt = (time.perf_counter() - t0) * 1000.0
        assert r.status_code == 200, r.data[:200]
        return dt

    line = [timed("") for _ in range(count)]
    own = [timed("&attempt=0") for _ in range(count)]
    return line, own


def p99(xs: list[float]) -> float:
    return float(np.percentile(np.array(xs), 99))


def run(quick: bool) -> list[dict[str, Any]]:
    n = 1_000_000
    sink, times, to_zero = rewinds(n, 5)
    line, own = queries(sink, n, 200)
    return [
        result("rewind_1m_steps_ms", round(statistics.median(times), 2), "ms", steps=n,
               rewound=1000, max_ms=round(max(times), 2), rewind_to_0_ms=round(to_zero, 1)),
        result("steps_query_1m_rewound_p99_ms", round(p99(line), 2), "ms", steps=n,
               p50_ms=round(statistics.median(line), 2), queries=len(line),
               attempt_query_p99_ms=round(p99(own), 2)),
    ]


if __name__ == "__main__":
    import sys

    for r in run("--quick" in sys.argv):
        print(json.dumps(r))
