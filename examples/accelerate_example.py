"""Accelerate + rankboard: a tiny regression model on random data, on the CPU.

    rankboard up &
    python examples/accelerate_example.py                                # one process
    torchrun --standalone --nproc-per-node 2 examples/accelerate_example.py   # two (gloo)

Two things report here. The tracker, ``Accelerator(log_with=[RankboardTracker()])``, sends
what ``accelerator.log`` logs from the main process (Accelerate calls trackers there only),
as a one-rank run named ``accelerate-<job id>``. The per-rank recipe, ``RankAgent.from_env()``
plus ``agent.log_step`` in the loop, gives every process's step time (the straggler board)
as the run ``<job id>``. ``--by-name`` uses ``log_with="rankboard"`` instead of an instance.
The tests run this file (tests/integrations), so it stays runnable.
"""
from __future__ import annotations

import argparse

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
    args = parser.parse_args()

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

    with RankAgent.from_env() as agent:  # the per-rank recipe: every process
        agent.register(total_epochs=args.epochs)
        step = 0
        for _ in range(args.epochs):
            for xb, yb in loader:
                loss = nn.functional.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                agent.log_step(step, samples=len(xb))  # this process's step time, no device sync
                # the tracker takes the tensor as it is: no .item(), no device sync
                accelerator.log({"loss": loss.detach(), "lr": 0.05}, step=step)
    accelerator.end_training()


if __name__ == "__main__":
    main()
