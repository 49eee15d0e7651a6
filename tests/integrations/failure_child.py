"""A torchrun job for tests/integrations/test_failure_torchrun.py: two gloo ranks on CPU, each
with a ``RankAgent`` and no ``with`` block and no ``finish()`` (the exit rule of PROTOCOL 8.2
reports how each process ends), a few steps of ``all_reduce``; then the odd rank
(``FAILURE_ODD``) raises ``MemoryError`` while the other enters the next ``all_reduce`` and
fails there when the odd rank's process is gone (gloo: "Connection closed by peer"): the
cause and the noise after it, as a real job dies.

    RANKBOARD_BROKER=... RANKBOARD_RUN=R FAILURE_ODD=1 \
        torchrun --nproc-per-node 2 --monitor-interval 5 failure_child.py
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from rank_agent import RankAgent

STEPS = 3


def load_batch(step: int) -> torch.Tensor:
    """The odd rank runs out of memory here (what a too-large batch does)."""
    raise MemoryError(f"CUDA out of memory (simulated): tried to allocate 20.00 GiB at step {step}")


def main() -> None:
    odd = int(os.environ.get("FAILURE_ODD", "1"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    agent = RankAgent.from_env(stall_after=0, control=False)
    t = torch.ones(4, 8)
    for step in range(1, STEPS + 1):
        dist.all_reduce(t)
        agent.log_step(step, {"loss": 1.0 / step})
    print(f"failing {rank}", flush=True)
    if rank == odd:
        load_batch(STEPS + 1)
    dist.all_reduce(t)  # the peer is gone: gloo raises here


if __name__ == "__main__":
    main()
