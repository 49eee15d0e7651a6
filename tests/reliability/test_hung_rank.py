"""A hung rank: a real rank process stopped with SIGSTOP turns ``stale`` (alert in the run
header, status in ``ranks``, ``rankboard_rank_stale`` on /metrics) within stale_after + 2 s,
and ``ok`` again after SIGCONT. The measured times are printed (``pytest -s``)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.support import REPO
from tests.support.http import fetch
from tests.support.polling import wait_for
from tests.support.procs import Proc, no_traceback, start_broker, start_web

STALE_AFTER = 1.0

#: A training rank: registers, then "trains" one epoch every 0.2 s until SIGTERM.
RANK_SCRIPT = """
import signal, time
from rank_agent import RankAgent
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
agent = RankAgent.from_env()
agent.register(total_epochs=0)
epoch = 0
while not stop:
    agent.log_epoch(epoch, 1.0, batches=1, samples=1, epoch_ms=200.0)
    epoch += 1
    time.sleep(0.2)  # the training step
agent.close()
"""


@pytest.fixture
def ranks() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()  # also ends a stopped process
        p.wait(10)


def rank_status(port: int, run: str) -> dict[int, str]:
    r = fetch(port, f"/api/runs/{run}")
    if r.status != 200:
        return {}
    return {entry["rank"]: entry["status"] for entry in r.json()["ranks"]}


def stale_gauge(port: int, run: str, rank: int) -> float | None:
    prefix = "rankboard_rank_stale{"
    for line in fetch(port, "/metrics").text.splitlines():
        if line.startswith(prefix) and f'rank="{rank}"' in line and f'run="{run}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_sigstopped_rank_turns_stale_in_time_and_ok_after_sigcont(
        spawn: Callable[..., Proc], tmp_path: Path, ranks: list[subprocess.Popen[bytes]]) -> None:
    broker, eps = start_broker(spawn, tmp_path / "data", "--stale-after", str(STALE_AFTER))
    web = start_web(spawn, eps)
    port = web.port
    assert port is not None
    run = "hung"
    for rank in (0, 1):
        env = dict(os.environ, RANKBOARD_BROKER=eps.ingest, RANKBOARD_RUN=run, RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK=str(rank), RANKBOARD_HOST="node-a",
                   PYTHONPATH=str(REPO))
        ranks.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], cwd=REPO, env=env))
    wait_for(lambda: rank_status(port, run) == {0: "ok", 1: "ok"}, what="both ranks ok")
    wait_for(lambda: stale_gauge(port, run, 1) == 0.0, what="stale gauge 0 for rank 1")

    victim = ranks[1]
    victim.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    wait_for(lambda: rank_status(port, run).get(1) == "stale", timeout=STALE_AFTER + 10,
             what="rank 1 stale", interval=0.02)
    detected = time.monotonic() - stopped_at
    header = fetch(port, f"/api/runs/{run}").json()
    assert any(a["kind"] == "stale" and a["rank"] == 1 for a in header["alerts"]), header["alerts"]
    assert rank_status(port, run)[0] == "ok"  # the healthy rank is not blamed
    wait_for(lambda: stale_gauge(port, run, 1) == 1.0, what="stale gauge 1", interval=0.02)
    gauge_at = time.monotonic() - stopped_at
    assert stale_gauge(port, run, 0) == 0.0

    victim.send_signal(signal.SIGCONT)
    resumed_at = time.monotonic()
    wait_for(lambda: rank_status(port, run).get(1) == "ok", what="rank 1 ok again", interval=0.02)
    recovered = time.monotonic() - resumed_at
    wait_for(lambda: stale_gauge(port, run, 1) == 0.0, what="stale gauge back to 0")
    print(f"\nhung rank: stale_after={STALE_AFTER:.1f}s, stale over HTTP after {detected:.2f}s, "
          f"on /metrics after {gauge_at:.2f}s, ok again {recovered:.2f}s after SIGCONT")
    assert detected <= STALE_AFTER + 2.0, detected
    assert gauge_at <= STALE_AFTER + 2.0, gauge_at
    # the alert stays listed after recovery (PROTOCOL 3)
    assert any(a["kind"] == "stale" and a["rank"] == 1
               for a in fetch(port, f"/api/runs/{run}").json()["alerts"])

    for p in ranks:
        p.send_signal(signal.SIGTERM)
    for p in ranks:
        assert p.wait(15) == 0
    no_traceback(broker, web)


