"""Lightning + rankboard: a tiny regression model on random data, on the CPU.

    rankboard up &                                   # broker + dashboard
    python examples/lightning_example.py             # one process
    python examples/lightning_example.py --devices 2 # DDP, 2 processes (gloo)

The one rankboard line is ``callbacks=[RankboardCallback()]``; with ``--zero-config`` the
script adds nothing and the ``lightning.pytorch.callbacks_factory`` entry point adds the
callback because ``RANKBOARD_BROKER`` is set. ``--fail-epoch N`` raises in epoch N, to see
a failed run. The tests run this file (tests/integrations), so it stays runnable.
"""
from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_agent.integrations.lightning import RankboardCallback


class TinyRegressor(pl.LightningModule):
    def __init__(self, lr: float = 0.05, hidden: int = 16, fail_epoch: int = -1) -> None:
        super().__init__()
        self.save_hyperparameters()  # sent to the dashboard as metadata
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.current_epoch == self.hparams.fail_epoch:
            raise RuntimeError(f"failing on purpose in epoch {self.current_epoch}")
        x, y = batch
        pred = self.net(x)
        loss = nn.functional.mse_loss(pred, y)
        self.log("mae", (pred - y).abs().mean(), on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--fail-epoch", type=int, default=-1)
    parser.add_argument("--zero-config", action="store_true",
                        help="add no callback: rely on the entry point and RANKBOARD_BROKER")
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(args.samples, 8)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(args.samples, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        callbacks=[] if args.zero_config else [RankboardCallback()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyRegressor(fail_epoch=args.fail_epoch), loader)


if __name__ == "__main__":
    main()
