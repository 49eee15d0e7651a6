"""Training with no broker says once where its frames went (rank_agent/reach.py): a real
process whose broker endpoint nobody serves logs one line naming it; one whose frames a
broker took says nothing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
from rank_agent import RankAgent
with RankAgent.from_env(run="reach") as agent:
    for step in range(50):
        agent.log_step(step, {"loss": 1.0 / (step + 1)})
    agent.log_epoch(0, 0.5)
print("trained")
"""


def _train(endpoint: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKBOARD_")}
    env.update(RANKBOARD_BROKER=endpoint, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, timeout=60)


def test_no_broker_is_said_once_with_the_endpoint(dead_endpoint: str) -> None:
    done = _train(dead_endpoint)
    assert done.returncode == 0 and done.stdout.strip() == "trained"
    lines = [ln for ln in done.stderr.splitlines() if "no broker answered" in ln]
    assert len(lines) == 1, done.stderr
    assert dead_endpoint in lines[0] and "rankboard up" in lines[0] and "RANKBOARD_BROKER" in lines[0]


def test_a_broker_that_took_the_frames_means_no_such_line(receiver) -> None:
    done = _train(receiver.endpoint)
    assert done.returncode == 0, done.stderr
    receiver.wait_for(lambda fs: any(type(f).__name__ == "Finish" for f in fs))
    assert "no broker answered" not in done.stderr


def test_a_connection_up_before_the_agent_looks_still_counts(receiver, monkeypatch, caplog) -> None:
    """ZeroMQ connects in its own I/O thread as soon as ``connect`` returns; on a busy
    machine the connection could be up before a monitor attached after ``connect`` began to
    listen, and that monitor never heard of it: the rank said, wrongly, that its frames went
    nowhere (the demo's Ctrl-C test caught it under load). Forced here: the agent's monitor is
    attached only once this process holds an established connection to the receiver, or
    after 1 s without one, which is what the monitor-first order gives."""
    import logging
    import time

    import psutil

    import rank_agent.pusher as pusher
    from rank_agent import RankAgent

    port = int(receiver.endpoint.rsplit(":", 1)[1])
    real = pusher.Reach

    def connected() -> bool:
        return any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
                   for c in psutil.Process().net_connections(kind="tcp"))

    def late(sock):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 1.0
        while not connected() and time.monotonic() < deadline:
            time.sleep(0.005)  # a poll interval: the forced order, not a synchronisation
        return real(sock)

    monkeypatch.setattr(pusher, "Reach", late)
    with caplog.at_level(logging.WARNING, logger="rank_agent"):
        with RankAgent(broker=receiver.endpoint, run="reach-late", rank=0, world_size=1) as agent:
            agent.log_epoch(0, 0.5)
        receiver.wait_for(lambda fs: any(type(f).__name__ == "Finish" for f in fs))
    assert "no broker answered" not in caplog.text, caplog.text
