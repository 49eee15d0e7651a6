"""lightning_step_overhead_us: what ``RankboardCallback`` costs a Lightning training step.

A tiny model (8 -> 32 -> 1 MLP, batches of 32, one CPU thread) is fitted on the CPU in one
process, reporting to a real broker process (``python -m rankboard broker`` on ephemeral
ports). Within each fit the callback's per-step hook runs on alternate blocks of 10 steps
(with, without, with, ...), and every step period (one batch start to the next) is timed;
the figure is the median period with the hook minus the median period without, in
microseconds per step, pooled over the fits after a warm-up fit. Comparing adjacent blocks
rather than separate fits cancels what drifts on a shared 2-core machine (load, caches,
frequency): separate fits differed by +-400 us per step here, far more than the cost.

What the figure covers: the callback's ``on_train_batch_end`` (loss and logged-metric
collection, the device-sync-free pipeline, ``log_step``) on the training thread, which is
what a step pays. The agent's step-flusher thread (a frame every 0.25 s) and sampler thread
(every 2 s) run all through the fit, so their GIL share falls on both kinds of block alike;
``mean_diff_us`` (means instead of medians) keeps the rare slow steps in. ``hook_us`` is the
median wall time of the hook itself (timed around the call), ``baseline`` the median step
period without it, ``ratio`` with / without, ``fit_diffs_us`` the figure of each fit alone.

Needs lightning (and torch), so it runs in the integrations env, not in ``run_all.py``::

    .tox/integrations/bin/python bench/lightning_overhead.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, List, Optional

import lightning.pytorch as pl
import torch
from common import Stack, result
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rank_agent.integrations.lightning import RankboardCallback


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Interleave(pl.Callback):
    """Runs the real callback's hooks on alternate blocks of ``block`` steps and times every
    step period (one batch start to the next, so a step's ``on_train_batch_end`` is in its
    own period). Adjacent blocks share the machine's state at that moment (load, caches,
    frequency), which separate fits do not: their difference is the callback's cost."""

    def __init__(self, inner: RankboardCallback, block: int) -> None:
        self.inner = inner
        self.block = block
        self.on = False
        self.last: Optional[float] = None
        self.periods: dict[bool, List[float]] = {True: [], False: []}
        self.hook_ns: List[int] = []

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.inner.on_fit_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.inner.on_train_epoch_start(trainer, pl_module)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.periods[self.on].append(now - self.last)
        self.last = now
        self.on = (batch_idx // self.block) % 2 == 1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.on:
            t = time.perf_counter_ns()
            self.inner.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            self.hook_ns.append(time.perf_counter_ns() - t)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.inner.on_train_epoch_end(trainer, pl_module)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.inner.on_fit_end(trainer, pl_module)


def fit(loader: DataLoader, callback: pl.Callback) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )
    trainer.fit(Tiny(), loader)


def lightning_overhead(quick: bool) -> dict[str, Any]:
    os.environ.pop("RANKBOARD_BROKER", None)  # no zero-config callback beside ours
    steps, fits, block = (1000, 2, 10) if quick else (4000, 4, 10)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(steps * 32, 8)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32)
    periods: dict[bool, List[float]] = {True: [], False: []}
    hook_ns: List[int] = []
    fit_diffs: List[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp), web=False)
        try:
            for i in range(fits + 1):
                probe = Interleave(RankboardCallback(broker=stack.ingest, run=f"bench-{i}"), block)
                fit(loader, probe)
                if i == 0:
                    continue  # warm-up: first-fit costs
                for on in (True, False):
                    periods[on].extend(probe.periods[on])
                hook_ns.extend(probe.hook_ns)
                fit_diffs.append((statistics.median(probe.periods[True])
                                  - statistics.median(probe.periods[False])) * 1e6)
        finally:
            stack.close()
    base_us = statistics.median(periods[False]) * 1e6
    with_us = statistics.median(periods[True]) * 1e6
    return result(
        "lightning_step_overhead_us", round(with_us - base_us, 2), "us",
        baseline=round(base_us, 2), ratio=round(with_us / base_us, 4),
        hook_us=round(statistics.median(hook_ns) / 1e3, 2),
        hook_p99_us=round(sorted(hook_ns)[int(0.99 * (len(hook_ns) - 1))] / 1e3, 2),
        mean_diff_us=round((statistics.fmean(periods[True])
                            - statistics.fmean(periods[False])) * 1e6, 2),
        fit_diffs_us=[round(d, 1) for d in fit_diffs],
        step_us_with=round(with_us, 2), fits=fits, steps=steps, block=block,
        lightning=pl.__version__, torch=torch.__version__,
    )


def run(quick: bool) -> list[dict[str, Any]]:
    return [lightning_overhead(quick)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    for line in run(parser.parse_args().quick):
        print(json.dumps(line))
