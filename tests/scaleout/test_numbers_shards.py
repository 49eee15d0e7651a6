"""Numbers that go wrong (PROTOCOL.md 8.3) over shards and a worker pool: ``rankboard up
--shards 2 --workers 2``, a run on each shard fed by real agents given the broker list; every
web worker answers each run's first non-finite rank and diverging replica, and counts them on
``/metrics``. Real processes and sockets on 127.0.0.1 ephemeral ports; every wait polls."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional

from rank_agent import RankAgent
from rank_agent.shards import shard_of
from tests.support.http import fetch
from tests.support.polling import wait_for
from tests.support.procs import Proc, no_traceback

WORLD = 3


def header(port: int, run: str) -> Optional[dict[str, Any]]:
    r = fetch(port, f"/api/runs/{run}")
    if r.status != 200:
        return None
    h = r.json()
    return h if h["steps_done"] == 9 and h["nonfinite"] and h["replica_divergence"] else None


def test_each_shards_run_tells_its_numbers_through_every_worker(
        spawn: Callable[..., Proc], tmp_path: Path) -> None:
    up = spawn("up", "--shards", "2", "--workers", "2", "--ingest", "tcp://127.0.0.1:*",
               "--publish", "tcp://127.0.0.1:*", "--snapshot", "tcp://127.0.0.1:*",
               "--data-dir", str(tmp_path), "--port", "0", "--host", "127.0.0.1")
    try:
        brokers = up.wait_line(r"^RANKBOARD_BROKER=(\S+)$").group(1)
        port = up.wait_dashboard(timeout=60)
        runs = [next(r for r in (f"nums-{i}" for i in range(64)) if shard_of(r, 2) == k)
                for k in range(2)]
        for k, run in enumerate(runs):  # run k: rank 1's loss NaN from step 4 + k
            agents = [RankAgent(brokers, run, r, WORLD, host=f"node-{r}", control=False,
                                linger_ms=1000, replicated=["grad_norm"]) for r in range(WORLD)]
            try:
                for agent in agents:
                    agent.register()
                for step in range(10):
                    for r, agent in enumerate(agents):
                        loss = math.nan if (r == 1 and step >= 4 + k) else 1.0 + r
                        gn = 3.0 if (r == 2 and step >= 6) else 2.0
                        agent.log_step(step, {"loss": loss, "grad_norm": gn})
            finally:
                for agent in agents:
                    agent.close()
        for _ in range(4):  # the kernel spreads the connections over the workers
            for k, run in enumerate(runs):
                h = wait_for(lambda run=run: header(port, run), 30.0, f"{run}'s numbers")
                assert h["shard"] == k
                assert [(e["metric"], e["step"], e["rank"], e["ranks"]) for e in h["nonfinite"]] \
                    == [("loss", 4 + k, 1, [1])]
                assert [(e["metric"], e["first_step"], e["ranks"], e["majority"])
                        for e in h["replica_divergence"]] == [("grad_norm", 6, [2], 2.0)]
            text = fetch(port, "/metrics").text
            for run in runs:
                assert f'rankboard_run_nonfinite{{run="{run}"}} 1.0' in text
                assert f'rankboard_run_replica_divergence{{run="{run}"}} 4.0' in text
        assert up.stop() == 0
        no_traceback(up)
    finally:
        up.close()
