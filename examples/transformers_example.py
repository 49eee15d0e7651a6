"""Hugging Face Trainer + rankboard: a tiny GPT-2 built from a config (no download) trained
on random tokens, on the CPU.

    rankboard up &
    python examples/transformers_example.py                               # one process
    torchrun --nproc-per-node 2 examples/transformers_example.py          # two (gloo)

The one rankboard line is ``callbacks=[RankboardCallback()]``; ``--fail-step N`` raises
after step N, to see a failed run. The tests run this file
(tests/integrations), so it stays runnable.
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from rank_agent.integrations.transformers import RankboardCallback


class FailAtStep(TrainerCallback):
    """``--fail-step N``: raise after optimizer step N, to see a failed run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            raise RuntimeError(f"failing on purpose at step {self.step}")


class RandomTokens(Dataset):
    def __init__(self, n: int, length: int = 16, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--fail-step", type=int, default=-1)
    args = parser.parse_args()

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out,
            num_train_epochs=args.epochs,
            per_device_train_batch_size=args.batch_size,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            include_num_input_tokens_seen="all",
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=RandomTokens(args.samples),
                          callbacks=[RankboardCallback(), FailAtStep(args.fail_step)])
        trainer.train()


if __name__ == "__main__":
    main()
