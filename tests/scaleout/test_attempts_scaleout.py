"""Attempts (PROTOCOL 8.1) where the web is more than one process or the broker more than one
shard: a restarted job is one run with its attempts, line and superseded records on every
worker of ``web --workers 2``, and through a web over two shards (the run on the shard its id
hashes to, the other shard holding nothing of it). Real processes, frames on a plain PUSH
socket as ranks send them; every wait polls against a deadline.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from rank_agent.protocol import Register, Steps
from rank_agent.shards import shard_of
from tests.support.brokers import Broker, Pusher
from tests.support.http import fetch
from tests.support.polling import wait_for
from tests.support.pool import start_pool, worker_of
from tests.support.procs import Proc, start_broker


def _attempts(pusher: Pusher, run: str) -> None:
    """Attempt 0 closes steps 0-29; attempt 1 (new ``proc`` ids) resumes from step 10."""
    def reg(rank: int, proc: str) -> Register:
        return Register(run=run, rank=rank, world_size=2, host=f"h{rank}", proc=proc)

    def steps(rank: int, lo: int, hi: int, loss: float) -> Steps:
        s = list(range(lo, hi))
        return Steps(run=run, rank=rank, steps=s, times=[time.time()] * len(s),
                     step_ms=[10.0] * len(s), metrics={"loss": [loss] * len(s)})

    pusher.send(reg(0, "a0"), reg(1, "a1"), steps(0, 0, 30, 1.0), steps(1, 0, 30, 1.0))
    pusher.send(reg(0, "b0"), reg(1, "b1"), steps(0, 10, 20, 2.0), steps(1, 10, 20, 2.0))


def _view(port: int, run: str) -> Any:
    """What one connection's worker serves of the run's attempts, with that worker's slot;
    None until it has all of attempt 1's steps."""
    r = fetch(port, f"/api/runs/{run}")
    if r.status != 200:
        return None
    body = r.json()
    if body.get("attempt") != 1 or body.get("steps_done") != 19:
        return None
    old = fetch(port, f"/api/runs/{run}/steps.csv?attempt=0").body.decode().splitlines()
    line = fetch(port, f"/api/runs/{run}/steps.csv").body.decode().splitlines()
    return worker_of(r), {
        "superseded": [a.get("superseded_steps") for a in body["attempts"]],
        "attempt0_rows": len(old) - 1,
        "line": [(row.split(",")[0], row.split(",")[-1]) for row in line[1:]],
    }


def _expected() -> dict[str, Any]:
    return {"superseded": [20, 0], "attempt0_rows": 30,
            "line": [(str(s), "0" if s < 10 else "1") for s in range(20)]}


def test_every_worker_serves_the_attempts(spawn: Callable[..., Proc], broker: Broker,
                                          pusher: Pusher) -> None:
    pool = start_pool(spawn, broker)
    assert pool.port is not None
    _attempts(pusher, "pool-attempts")
    seen: dict[Any, Any] = {}

    def both() -> bool:
        got = _view(pool.port, "pool-attempts")  # type: ignore[arg-type]
        if got is not None and got[0] is not None:
            seen[got[0]] = got[1]
        return len(seen) == 2

    wait_for(both, timeout=30, what="attempt 1 on both workers")
    assert list(seen.values()) == [_expected()] * 2


def test_a_web_over_two_shards_serves_the_attempts(spawn: Callable[..., Proc],
                                                  tmp_path: Path) -> None:
    run = next(r for r in (f"shard-attempts-{i}" for i in range(64)) if shard_of(r, 2) == 1)
    shards = [start_broker(spawn, tmp_path / f"shard-{k}", "--shard", f"{k}/2")[1]
              for k in range(2)]
    web = spawn("web", "--publish", ",".join(e.publish for e in shards),
                "--snapshot", ",".join(e.snapshot for e in shards),
                "--host", "127.0.0.1", "--port", "0")
    port = web.wait_dashboard()
    pusher = Pusher(shards[1].ingest)
    try:
        _attempts(pusher, run)
        got = wait_for(lambda: _view(port, run), timeout=30, what="attempt 1 through the web")
    finally:
        pusher.close()
    assert got[1] == _expected()
    assert fetch(port, f"/api/runs/{run}").json()["shard"] == 1
