"""A training rank for the end-to-end diagnosis tests, run as
``python -m tests.diag.stall_child BROKER RUN RANK WORLD WHERE``: a real :class:`RankAgent`
(stall watch at 1 s, control channel on the broker's publish port + 1, as by default) whose
loop logs steps, then hangs in a function named by ``WHERE`` (``collective``:
``hang_in_all_reduce``; ``loader``: ``hang_in_next_batch``) until a line arrives on stdin,
then trains again until stdin closes. It prints ``hanging`` (inside the named function),
``recovered`` (stepping again) and ``closed`` at the end (after ``close()``).
"""
from __future__ import annotations

import sys
import threading
import time

from rank_agent import RankAgent

STEP_S = 0.02


def train(agent: RankAgent, first: int, n: int) -> int:
    for step in range(first, first + n):
        agent.log_step(step, {"loss": 1.0})
        time.sleep(STEP_S)  # the step's work
    return first + n


def hang_in_all_reduce() -> None:
    print("hanging", flush=True)
    sys.stdin.readline()  # blocks releasing the GIL, as a collective waiting on a peer does


def hang_in_next_batch() -> None:
    print("hanging", flush=True)
    sys.stdin.readline()


def main() -> None:
    broker, run, rank, world, where = sys.argv[1:6]
    agent = RankAgent(broker, run, int(rank), int(world), stall_after=1.0, step_flush=0.05)
    agent.register()
    step = train(agent, 0, 10)
    (hang_in_all_reduce if where == "collective" else hang_in_next_batch)()
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    step = train(agent, step, 5)
    print("recovered", flush=True)
    while not done.is_set():
        step = train(agent, step, 5)
    agent.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main()
