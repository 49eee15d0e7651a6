"""The first failure over shards and a worker pool (PROTOCOL 8.2, 7.3): two ``rankboard
broker --shard K/2`` processes and one ``rankboard web --workers 2`` over both, real
processes on 127.0.0.1; a failed run on each shard, each named by its own shard's broker and
served alike by both workers (``/api/runs/<run>``'s header ``failure`` and ranks ``error``)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from rank_agent import protocol
from rank_agent.shards import shard_of
from tests.support.brokers import Pusher
from tests.support.http import fetch
from tests.support.polling import wait_for
from tests.support.pool import worker_of
from tests.support.procs import Proc, no_traceback, start_broker

RUNS = {k: next(r for r in (f"died-{i}" for i in range(64)) if shard_of(r, 2) == k)
        for k in range(2)}


def test_each_shards_failed_run_is_named_by_every_worker(spawn: Callable[..., Proc],
                                                         tmp_path: Path) -> None:
    brokers = [start_broker(spawn, tmp_path / f"s{k}", "--shard", f"{k}/2") for k in range(2)]
    web = spawn("web", "--publish", ",".join(e.publish for _, e in brokers),
                "--snapshot", ",".join(e.snapshot for _, e in brokers),
                "--host", "127.0.0.1", "--port", "0", "--workers", "2")
    pushers = [Pusher(e.ingest) for _, e in brokers]
    try:
        port = web.wait_dashboard(timeout=60)
        t = time.time()
        for k, run in RUNS.items():
            for r in range(3):
                pushers[k].register(run, r, 3, host=f"node-{r}")
            # rank 2's finish arrives first, rank 1 failed first
            pushers[k].send(protocol.Finish(run=run, rank=2, status="error", error=protocol.ErrorInfo(
                type="torch.distributed.DistBackendError", message="peer 1 gone", at=t - 1.0)))
            pushers[k].send(protocol.Finish(run=run, rank=1, status="error", error=protocol.ErrorInfo(
                type=f"Shard{k}Error", message=f"shard {k}: bad batch\nmore", at=t - 5.0)))
        for k, run in RUNS.items():
            seen: set[Any] = set()

            def named(run: str = run, k: int = k, seen: set[Any] = seen) -> bool:
                resp = fetch(port, f"/api/runs/{run}")
                if resp.status != 200:
                    return False
                body: Any = resp.json()
                f = body.get("failure")
                if not f or len(f["groups"]) < 2:
                    return False
                assert body["shard"] == k
                assert (f["first"]["rank"], f["first"]["type"], f["first"]["host"]) == (
                    1, f"Shard{k}Error", "node-1")
                assert [r["error"]["type"] if r["error"] else None for r in body["ranks"]] == [
                    None, f"Shard{k}Error", "torch.distributed.DistBackendError"]
                seen.add(worker_of(resp))
                return len(seen) == 2  # both workers answered with it

            wait_for(named, 60, f"both workers naming the first failure of {run}")
        assert web.stop() == 0
        no_traceback(web, *(p for p, _ in brokers))
    finally:
        for p in pushers:
            p.close()
        web.close()
        for proc, _ in brokers:
            proc.close()
