"""A rank with a real :class:`~rank_agent.RankAgent` as a process of its own, for the control
channel's trust tests (``tests/reliability/test_control_trust.py``):
``python -m tests.support.trustrank INGEST CONTROL RUN``.

It makes one ``log_step`` (which starts the control channel, reading the control secret from
its environment as any rank does), prints ``{"ready": true}`` once the channel's socket is
subscribed, then answers each line on stdin with ``{"answered": n, "refused": {...}}`` (the
channel's counters) until stdin closes; then it closes the agent. Its main thread waits on
stdin, as a training loop blocked in a collective would: answers come from the agent's own
thread.
"""
from __future__ import annotations

import json
import sys

from rank_agent import RankAgent
from tests.support.agent import control_connected


def main(ingest: str, control: str, run: str) -> None:
    agent = RankAgent(ingest, run, 0, 1, stall_after=0, control=control, linger_ms=0)
    agent.log_step(0, {"loss": 1.0})
    channel = agent._control
    assert channel is not None
    if not control_connected(channel, 30):
        raise SystemExit("control channel did not connect")
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        print(json.dumps({"answered": channel.answered, "refused": channel.refused}), flush=True)
    agent.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
