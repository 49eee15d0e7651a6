"""Lightning: ``Trainer(callbacks=[RankboardCallback()])`` and every rank reports.

Lightning calls a callback's hooks on every rank, so each rank has its own agent: rank,
world size and local rank come from the trainer (``global_rank``, ``world_size``,
``local_rank``); the run id from the launcher's environment or, failing that, rank 0's
generated id broadcast through the strategy at set-up (see :mod:`._common`). Nothing is
opened in ``__init__``: ``ddp_spawn`` pickles callbacks into its workers, and an agent made
there would belong to the parent.

What a fit sends (PROTOCOL.md section 5):

* at ``on_fit_start``: ``register`` (``total_epochs`` = ``max_epochs`` when it is finite,
  ``total_steps`` = ``estimated_stepping_batches`` when finite, 8.5),
  metadata (the module's and datamodule's hyperparameters and the trainer's settings),
  hardware, and resource sampling every ``sample_interval`` seconds;
* every optimizer step (``global_step`` grew): ``log_step(global_step, {"loss": ...,
  <step-level logged metrics>}, samples=<batch size>)``; the loss is the mean over the
  step's accumulated batches (Lightning hands the callback each batch's loss divided by
  ``accumulate_grad_batches``, so their sum is that mean); ``on_train_batch_start`` marks
  the batch in hand, so each point carries the step's ``data_ms`` (the wait for its batch
  since the previous step, PROTOCOL 7.1);
* every training epoch: ``log_epoch`` with the mean batch loss, batches, samples, the
  epoch's wall time and the epoch-level metrics (``trainer.callback_metrics`` without the
  ``*_step`` forms) as scalars;
* ``finish("ok")`` at the end of the fit, ``finish(error=exception)`` from ``on_exception``.

No extra device synchronisation: the loss and logged values are tensors, on the GPU in a
GPU job; the callback never calls ``.item()`` on them per step but hands them to
:class:`~._common.StepPipeline` (asynchronous host copies, sent when done). Epoch ends read
the epoch's device-side loss sum once, where Lightning synchronises anyway.

Zero-config: with ``pip install rankboard[lightning]``, the entry point
``lightning.pytorch.callbacks_factory`` adds a ``RankboardCallback`` to every ``Trainer``
whenever ``RANKBOARD_BROKER`` is set (:func:`callbacks_factory`).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, List, Mapping

import lightning.pytorch as pl

from ._common import (
    Reporter,
    Sum,
    agree_run_id,
    check_agent_kwargs,
    classify,
    make_agent,
)
from .epochmetrics import epoch_scalars

log = logging.getLogger(__name__)

__all__ = ["RankboardCallback", "callbacks_factory"]

#: Trainer attributes sent as metadata (whichever the installed Lightning has).
_TRAINER_SETTINGS = (
    "max_epochs", "min_epochs", "max_steps", "min_steps", "accumulate_grad_batches",
    "gradient_clip_val", "gradient_clip_algorithm", "precision", "num_nodes", "num_devices",
    "world_size", "val_check_interval", "check_val_every_n_epoch", "log_every_n_steps",
    "limit_train_batches", "limit_val_batches", "num_sanity_val_steps",
)


def _batch_size(batch: Any, depth: int = 0) -> int:
    """The leading dimension of the first tensor-like in ``batch`` (0 if none): what
    Lightning's own batch-size inference finds for the usual batches, at a fraction of its
    cost (it runs every step)."""
    kind = type(batch)
    if kind is list or kind is tuple:
        if not batch or depth >= 3:
            return 0
        return _batch_size(batch[0], depth + 1)
    shape = getattr(batch, "shape", None)
    if shape is not None:
        try:
            return int(shape[0]) if len(shape) else 1
        except Exception:
            return 0
    if depth >= 3:
        return 0
    if isinstance(batch, Mapping):
        for value in batch.values():
            return _batch_size(value, depth + 1)
        return 0
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0], depth + 1)
    return 0


def _loss_of(outputs: Any) -> Any:
    """The loss in what ``training_step`` returned (a tensor, or a dict's ``"loss"``)."""
    if type(outputs) is dict:  # what Lightning's automatic optimization hands over
        return outputs.get("loss")
    if outputs is None:
        return None
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    return outputs


class RankboardCallback(pl.Callback):
    """Streams a Lightning fit to rankboard from every rank (module docstring).

    ``**agent_kwargs`` go to :class:`rank_agent.RankAgent` (``broker``, ``run``, ``rank``,
    ``world_size``, ``local_rank``, ``host``, ``sndhwm``, ``linger_ms``, ``step_flush``) and
    override what the trainer and the environment say. ``port``: a dashboard port to
    register (for ``rankboard up``); ``sample_interval``: seconds between resource samples
    (``None``: no sampling)."""

    def __init__(self, *, port: int = 0, sample_interval: float | None = 2.0,
                 **agent_kwargs: Any) -> None:
        check_agent_kwargs(agent_kwargs, "RankboardCallback")
        self.port = int(port)
        self.sample_interval = sample_interval
        self.agent_kwargs: Dict[str, Any] = dict(agent_kwargs)
        #: set by the zero-config factory: such a callback steps aside for an explicit one
        self.auto = False
        self._reset()

    def _reset(self) -> None:
        self.reporter: Reporter | None = None
        self._last_step = -1
        self._window = Sum()  # loss of the batches since the last optimizer step
        self._window_samples = 0
        self._epoch_loss = Sum()
        self._epoch_batches = 0
        self._epoch_samples = 0
        self._epoch_t0 = 0.0
        self._results: Any = None
        self._metrics_broken = False

    def __getstate__(self) -> Dict[str, Any]:
        """Pickle the configuration only (``ddp_spawn``): an agent belongs to its process."""
        state = dict(self.__dict__)
        for key in ("reporter", "_window", "_epoch_loss", "_results"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    @property
    def agent(self) -> Any:
        """This rank's :class:`rank_agent.RankAgent` during a fit (``None`` otherwise)."""
        return self.reporter.agent if self.reporter is not None else None

    # -- start -------------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.auto and any(isinstance(cb, RankboardCallback) and not cb.auto
                             for cb in trainer.callbacks):
            return  # the script added one itself; the zero-config one stays silent
        self._reset()
        rank, world = int(trainer.global_rank), int(trainer.world_size)
        run = self.agent_kwargs.get("run")
        if run is None:
            strategy = trainer.strategy

            def broadcast(obj: str) -> str:
                return strategy.broadcast(obj, src=0)

            run = agree_run_id(type(pl_module).__name__, rank, world, broadcast)
        agent = make_agent(run=run, rank=rank, world_size=world,
                           local_rank=int(trainer.local_rank), agent_kwargs=self.agent_kwargs)
        self.reporter = Reporter(agent)
        max_epochs = trainer.max_epochs
        self.reporter.start(
            total_epochs=max_epochs if max_epochs is not None and max_epochs > 0 else 0,
            metadata=self._metadata(trainer, pl_module), port=self.port,
            sample_interval=self.sample_interval, total_steps=_stepping_batches(trainer),
        )
        self._last_step = int(trainer.global_step)

    @staticmethod
    def _metadata(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Dict[str, Any]:
        settings: Dict[str, Any] = {}
        for name in _TRAINER_SETTINGS:
            try:
                settings[name] = getattr(trainer, name)
            except Exception:
                continue
        settings["strategy"] = type(trainer.strategy).__name__
        settings["accelerator"] = type(trainer.accelerator).__name__
        meta: Dict[str, Any] = {
            "framework": "lightning",
            "lightning_version": pl.__version__,
            "model": type(pl_module).__name__,
            "hyperparameters": dict(getattr(pl_module, "hparams", {}) or {}),
            "trainer": settings,
        }
        datamodule = getattr(trainer, "datamodule", None)
        dm_hparams = getattr(datamodule, "hparams", None) if datamodule is not None else None
        if dm_hparams:
            meta["datamodule_hyperparameters"] = dict(dm_hparams)
        return meta

    # -- steps and epochs --------------------------------------------------------------------

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.reporter is None:
            return
        try:  # the training loop's result collection: one object for the whole epoch
            self._results = trainer._results
        except Exception:
            self._results = None
        self._epoch_loss.reset()
        self._epoch_batches = 0
        self._epoch_samples = 0
        self._epoch_t0 = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        """The batch is in hand: the data wait (PROTOCOL 7.1) ends here."""
        if self.reporter is not None:
            self.reporter.batch_ready()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        reporter = self.reporter
        if reporter is None:
            return
        loss = _loss_of(outputs)
        if loss is not None:
            number, dev = classify(loss)  # once: a CPU loss becomes a float here
            loss = number if number is not None else dev
        samples = _batch_size(batch)
        self._epoch_batches += 1
        self._epoch_samples += samples
        self._window_samples += samples
        if loss is not None:
            self._epoch_loss.add(loss)
        step = trainer.global_step
        window = self._window
        if step == self._last_step:  # accumulating gradients: no optimizer step yet
            if loss is not None:
                window.add(loss)
            return
        self._last_step = step
        if window.count:  # the step's earlier batches were accumulated
            if loss is not None:
                window.add(loss)
            loss = window.take_raw()
        metrics = self._step_metrics() if self._results else {}
        if loss is not None:
            metrics["loss"] = loss
        reporter.step(step, metrics, samples=self._window_samples)
        self._window_samples = 0

    def _step_metrics(self) -> Dict[str, Any]:
        """What the module logged with ``on_step=True`` (and ``logger=True``) during this
        step: the tensors as logged, named as Lightning's loggers name them (``acc`` or
        ``acc_step``). Read straight from the training loop's result collection, which
        Lightning's logger connector reads right after this hook; not through
        ``trainer.logged_metrics``, which also turns progress-bar values into numbers
        (``.item()``: a device sync)."""
        if self._metrics_broken:
            return {}
        results = self._results
        try:
            out: Dict[str, Any] = {}
            for _, metric in results.valid_items():
                meta = metric.meta
                if not (meta.on_step and meta.logger):
                    continue
                value = metric._forward_cache
                if value is not None:
                    out[results._forked_name(metric, True)[1]] = value
            return out
        except Exception as exc:  # a Lightning whose internals moved: keep the loss going
            self._metrics_broken = True
            log.warning("rankboard: cannot read Lightning's step metrics (%r); sending the "
                        "loss only", exc)
            return {}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        reporter = self.reporter
        if reporter is None:
            return
        epoch_ms = (time.perf_counter() - self._epoch_t0) * 1000.0
        count = self._epoch_loss.count
        total = self._epoch_loss.take()  # one device read per epoch
        accumulate = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        avg_loss = total * accumulate / count if count else 0.0
        reporter.epoch(int(trainer.current_epoch), avg_loss, batches=self._epoch_batches,
                       samples=self._epoch_samples, epoch_ms=epoch_ms,
                       scalars=self._epoch_scalars(trainer))

    @staticmethod
    def _epoch_scalars(trainer: pl.Trainer) -> Dict[str, Any]:
        try:
            metrics = trainer.callback_metrics
        except Exception:
            return {}
        return epoch_scalars(metrics)  # one line per metric on the epoch chart

    # -- end ---------------------------------------------------------------------------------

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end("ok")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._end("error", exception)  # the exception itself goes with it (PROTOCOL 8.2)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """A fit that ended without on_fit_end or on_exception (should not happen) still
        ends its rank, as ok: nothing said it failed."""
        if stage == "fit":
            self._end("ok")

    def _end(self, status: str, error: BaseException | None = None) -> None:
        reporter = self.reporter
        if reporter is not None:
            reporter.end(status, error)


def callbacks_factory() -> List[RankboardCallback]:
    """The ``lightning.pytorch.callbacks_factory`` entry point: a ``RankboardCallback`` for
    every Trainer when ``RANKBOARD_BROKER`` is set, none otherwise (so installing rankboard
    changes nothing until a job asks for it). If the script adds a ``RankboardCallback``
    itself, that one reports and this one stays silent."""
    if not os.environ.get("RANKBOARD_BROKER", "").strip():
        return []
    callback = RankboardCallback()
    callback.auto = True
    return [callback]


def _stepping_batches(trainer: pl.Trainer) -> Any:
    """The fit's optimizer steps in all (8.5: the step-run ETA): Lightning's
    ``estimated_stepping_batches`` (``inf`` for an endless fit: unknown), 0 when it cannot
    say (it reads the train dataloader's length, which an iterable dataset may not have)."""
    try:
        return trainer.estimated_stepping_batches
    except Exception as exc:  # any failure of Lightning's estimate: the ETA is unknown
        log.debug("rankboard: no estimated_stepping_batches: %r", exc)
        return 0
