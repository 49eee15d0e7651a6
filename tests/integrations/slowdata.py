"""A training job whose rank 1 has a slow ``Dataset`` (``__getitem__`` sleeps), for the data
wait's integration tests (PROTOCOL.md 7.1): run under torchrun on the CPU (gloo), 2 ranks.

    torchrun --nproc-per-node 2 tests/integrations/slowdata.py lightning
    torchrun --nproc-per-node 2 tests/integrations/slowdata.py transformers

Rank 1's loader sleeps ``--sleep-ms`` per sample in the training process (no loader
workers), so its loop waits for its batch every step while rank 0 waits for rank 1 inside
the gradient all-reduce: ``step_ms`` is the same on both ranks, ``data_ms`` is not, and the
broker must name rank 1 in ``data_stragglers``. The integration callbacks are the only
rankboard code here: they call ``batch_ready`` for the user.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import Dataset


class SlowOnRank1(Dataset):
    """Random regression data; on global rank 1 each item takes ``sleep_s`` to load."""

    def __init__(self, n: int, sleep_s: float, tokens: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)
        self.sleep_s = sleep_s if int(os.environ.get("RANK", "0")) == 1 else 0.0
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> object:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if self.tokens:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}
        return self.x[i], self.y[i]


def lightning(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from rank_agent.integrations.lightning import RankboardCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    loader = DataLoader(SlowOnRank1(args.samples, args.sleep_ms / 1000.0),
                        batch_size=args.batch_size)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs,
                         callbacks=[RankboardCallback()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Tiny(), loader)


def transformers(args: argparse.Namespace) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from rank_agent.integrations.transformers import RankboardCallback

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2))
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, num_train_epochs=args.epochs,
                                  per_device_train_batch_size=args.batch_size,
                                  learning_rate=1e-3, logging_steps=1, save_strategy="no",
                                  report_to="none", use_cpu=True, disable_tqdm=True,
                                  dataloader_num_workers=0,
                                  # the default (True) gathers each step's token count across
                                  # ranks before on_step_begin: every rank would then wait
                                  # for rank 1's load there (see the callback's docstring)
                                  average_tokens_across_devices=False)
        Trainer(model=model, args=targs,
                train_dataset=SlowOnRank1(args.samples, args.sleep_ms / 1000.0, tokens=True),
                callbacks=[RankboardCallback()]).train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("framework", choices=["lightning", "transformers"])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sleep-ms", type=float, default=15.0)
    args = parser.parse_args()
    (lightning if args.framework == "lightning" else transformers)(args)


if __name__ == "__main__":
    main()
