"""Accelerate + rankboard: a tiny regression model on random data, on the CPU.

    rankboard up &
    python examples/accelerate_example.py                                # one process
    RANKBOARD_RUN=exp42 torchrun --standalone --nproc-per-node 2 examples/accelerate_example.py

One run per job, named as ``RankAgent.from_env()`` names it (``RANKBOARD_RUN``, else
torchrun's or Slurm's id), with every process as its rank. The tracker,
``Accelerator(log_with=[RankboardTracker()])``, is built in every process and makes each one
a rank (register, hardware, resources, finish at exit); what ``accelerator.log`` logs comes
from the main process, where Accelerate calls trackers. The per-rank recipe,
``RankAgent.from_env()`` plus ``agent.log_step`` in the loop, adds every process's step time
(the straggler board) to the same run: the tracker and the recipe share one agent per
process, and both calls for one step merge into one point. ``--by-name`` uses
``log_with="rankboard"`` instead of an instance (the recipe's agent, made first, is what
makes every process appear then); ``--no-recipe`` leaves the recipe out; ``--fail-rank N``
makes process N raise once every process has trained. The tests run this file
(tests/integrations), so it stays runnable.
"""
from __future__ import annotations

import argparse
import contextlib

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_agent import RankAgent
from rank_agent.integrations.accelerate import RankboardTracker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--by-name", action="store_true", help='log_with="rankboard"')
    parser.add_argument("--no-recipe", action="store_true", help="the tracker alone")
    parser.add_argument("--fail-rank", type=int, default=-1,
                        help="this process raises after training (-1: none)")
    args = parser.parse_args()

    # the per-rank recipe: every process; made before init_trackers so that the
    # log_with="rankboard" tracker (built on the main process only) adopts it
    agent = None if args.no_recipe else RankAgent.from_env()
    accelerator = Accelerator(cpu=True, log_with="rankboard" if args.by_name else [RankboardTracker()])
    accelerator.init_trackers("tiny-accelerate", config={"lr": 0.05, "batch_size": args.batch_size,
                                                         "epochs": args.epochs})
    torch.manual_seed(0)
    x = torch.randn(args.samples, 8)
    y = x.sum(dim=1, keepdim=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    with agent if agent is not None else contextlib.nullcontext():
        step = 0
        for _ in range(args.epochs):
            for xb, yb in loader:
                loss = nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                if agent is not None:
                    agent.log_step(step, samples=len(xb))  # this process's step time, no device sync
                # the tracker takes the tensor as it is: no .item(), no device sync
                accelerator.log({"loss": loss.detach(), "lr": 0.05}, step=step)
    if args.fail_rank >= 0:
        accelerator.wait_for_everyone()  # every process has trained
        if accelerator.process_index == args.fail_rank:
            raise RuntimeError(f"process {args.fail_rank} failing on purpose")
    accelerator.end_training()


if __name__ == "__main__":
    main()
