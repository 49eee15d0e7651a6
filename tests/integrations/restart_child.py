"""A torchrun job for tests/integrations/test_restart_torchrun.py: two gloo ranks on CPU,
each with a ``RankAgent``, run under ``torchrun --max-restarts 1``. On the first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0) they log steps 0-19 and rank 1 then raises; torchrun
restarts both in new processes, which "resume from the checkpoint at step 10" and log steps
10-29, then finish. The broker must see one run with two attempts, the re-run steps 10-19
superseding the first attempt's.

    RANKBOARD_BROKER=... RANKBOARD_RUN=R torchrun --nproc-per-node 2 --max-restarts 1 \
        --monitor-interval 5 restart_child.py
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from rank_agent import RankAgent

CHECKPOINT = 10
FIRST_ATTEMPT_STEPS = 20
LAST_STEP = 29


def main() -> None:
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # the group's keys under a prefix of this attempt's: a restarted worker reading its peer's
    # address of the first attempt (a dead process) from the agent's store would fail to connect
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{restart}", store),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    agent = RankAgent.from_env(stall_after=0, control=False)
    t = torch.ones(4, 8)
    first = 0 if restart == 0 else CHECKPOINT
    last = FIRST_ATTEMPT_STEPS - 1 if restart == 0 else LAST_STEP
    for step in range(first, last + 1):
        dist.all_reduce(t)
        agent.log_step(step, {"loss": float(restart + 1)})
    if restart == 0:
        dist.barrier()
        if rank == 1:
            raise RuntimeError("simulated crash on the first attempt")
        dist.all_reduce(t)  # the peer is gone: gloo raises here
    agent.finish()
    agent.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
