"""A torchrun job for tests/integrations/test_collectives_torchrun.py: gloo on CPU, a
``RankAgent`` per rank with a 1 s stall watch, a few steps of ``all_reduce`` (each step
logged), then one rank does something else while the others enter the next ``all_reduce``:

* ``behind``: the odd rank (``COLLECTIVE_ODD``) sleeps (a rank stuck in Python, or in its data loader);
* ``mismatch``: the odd rank (``COLLECTIVE_ODD``) enters ``broadcast`` instead (the same sequence number,
  another collective);
* ``dies``: the odd rank (``COLLECTIVE_ODD``) is gone without a word to the broker: it stops itself
  (SIGSTOP). A rank that *exits* closes its gloo sockets and its peers fail at once
  ("Connection closed by peer"), so nothing hangs to be explained; a stopped one is what a
  dead rank is to NCCL peers (or a host that froze): the others wait, and it says nothing.

The others then wait in the collective until the test ends the job (or gloo's timeout).
Each rank prints ``waiting <rank>`` just before its last collective.

    RANKBOARD_BROKER=... RANKBOARD_RUN=R COLLECTIVE_CASE=behind COLLECTIVE_ODD=2 \
        torchrun --nproc-per-node 3 collective_child.py

(the environment, not options: torchrun's own parser would take ``--run`` for its
``--run-path``)
"""
from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from rank_agent import RankAgent

STEPS = 4


def main() -> None:
    case = os.environ["COLLECTIVE_CASE"]
    odd = int(os.environ.get("COLLECTIVE_ODD", "2"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    agent = RankAgent(os.environ["RANKBOARD_BROKER"], os.environ["RANKBOARD_RUN"], rank, world,
                      stall_after=1.0, control=False)
    t = torch.ones(4, 8)
    for step in range(1, STEPS + 1):
        dist.all_reduce(t)
        agent.log_step(step, {"loss": 1.0 / step})
    print(f"waiting {rank}", flush=True)
    if rank == odd:
        if case == "behind":
            time.sleep(300)
        elif case == "mismatch":
            dist.broadcast(t, src=0)
        else:
            time.sleep(0.5)  # its steps reach the broker; then it is gone
            os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(t)
    sys.exit(0)


if __name__ == "__main__":
    main()
