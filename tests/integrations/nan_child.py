"""A torchrun job for tests/integrations/test_nan_torchrun.py: plain PyTorch DDP on CPU
(gloo), a ``RankAgent`` per rank that declares ``grad_norm`` replicated (8.3), and one rank
whose batch is poisoned with a NaN at a known step (``NAN_RANK``, ``NAN_STEP``).

Each step logs the rank's own ``loss`` (not replicated: every rank has its own batch) and the
gradient norm ``clip_grad_norm_`` returns after DDP's all-reduce (replicated: the same on
every rank). At ``NAN_STEP`` only the poisoned rank's loss is NaN; the all-reduce then
spreads the NaN into every rank's gradients (so ``grad_norm`` is NaN everywhere at that
step) and the update into every rank's weights (every loss is NaN after it): the job a
board must answer "which rank first?" for.

    RANKBOARD_BROKER=... RANKBOARD_RUN=R NAN_RANK=1 NAN_STEP=17 \
        torchrun --nproc-per-node 3 nan_child.py
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from rank_agent import RankAgent

STEPS = 30


def main() -> None:
    bad_rank = int(os.environ["NAN_RANK"])
    bad_step = int(os.environ["NAN_STEP"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts them anyway)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    with RankAgent.from_env(replicated=["grad_norm"], step_flush=0.05) as agent:
        agent.register(total_epochs=1)
        for step in range(STEPS):
            x = torch.randn(16, 8, generator=gen)
            y = torch.randn(16, 1, generator=gen)
            if rank == bad_rank and step == bad_step:
                x[3, 5] = float("nan")  # a bad sample in this rank's batch
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # DDP all-reduces the gradients: the NaN reaches every rank
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            agent.log_step(step, {"loss": loss.item(), "grad_norm": norm.item()})
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
