"""Hugging Face Trainer: ``Trainer(..., callbacks=[RankboardCallback()])`` on every process.

The Trainer calls its callbacks on every process, so each process has its own agent: rank,
world size and local rank come from ``TrainingArguments`` (``process_index``,
``world_size``, ``local_process_index``); the run id from the launcher's environment or,
failing that, rank 0's generated id broadcast over ``torch.distributed`` at
``on_train_begin`` (see :mod:`._common`).

What a ``trainer.train()`` sends (PROTOCOL.md section 5):

* at ``on_train_begin``: ``register`` (``total_epochs`` = ``state.num_train_epochs``,
  ``total_steps`` = ``state.max_steps``, 8.5),
  metadata (``TrainingArguments.to_dict()``, which hides tokens, and the model's config),
  hardware, and resource sampling;
* every optimizer step, at ``on_step_end``: a point for ``global_step`` with ``samples`` and
  ``tokens``, sent (``log_step``) at the next ``on_step_end`` or at the end, so that the
  numbers ``on_log`` gives for that step after ``on_step_end`` join it: sent at once, the
  step could close on the broker before them and they would be dropped as late. Every
  process reports its own step time (the straggler board), one step period each;
  ``samples`` is ``per_device_train_batch_size * gradient_accumulation_steps``, ``tokens``
  this process's share of the growth of ``state.num_input_tokens_seen`` (counted by the
  Trainer when ``include_num_input_tokens_seen`` is on; it is a job-wide count, so the
  shares add up to it); ``on_step_begin`` marks the batch in hand, so the point carries
  ``data_ms`` (the wait for the step's batches since the previous step, PROTOCOL 7.1).
  With ``average_tokens_across_devices`` on (the default when the model counts label
  tokens), the Trainer gathers each step's token count over the ranks after loading the
  batches and before ``on_step_begin``, so every rank waits there for the slowest loader
  and every rank's ``data_ms`` includes it: ``data_share`` shows the job waiting, but no
  rank stands out. Set it to ``False`` to see which rank's input is slow (logged once);
* every ``on_log``: its numbers (``loss``, ``learning_rate``, ``grad_norm``, eval metrics)
  as metrics of the current step, merged into its held point. The Trainer
  averages ``loss`` over processes before logging it, so every rank sends the same value.
  The end-of-training summary (``train_loss``, ``total_flos`` and friends) and the
  cumulative ``train_runtime`` and ``num_input_tokens_seen`` are not step metrics;
* every epoch: ``log_epoch`` with the step-weighted mean of the losses logged during the
  epoch (the last logged loss if it logged none), the epoch's micro-batches, samples and
  wall time, and the epoch's other logged numbers as scalars. It goes out when the next
  epoch begins or training ends, because the Trainer logs an epoch's last loss only after
  ``on_epoch_end``;
* ``finish("ok")`` at ``on_train_end``. The Trainer has no callback event for an exception:
  a process that exits before ``on_train_end`` (the exception propagates out of
  ``trainer.train()``) sends ``finish("error")`` from an ``atexit`` hook.

The Trainer itself reads the loss from the device at every logging step; this callback adds
no device read of its own.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Optional, Tuple

import transformers
from transformers import TrainerCallback

from ._common import (
    Reporter,
    agree_run_id,
    check_agent_kwargs,
    classify,
    make_agent,
    numbers_only,
)

log = logging.getLogger(__name__)

__all__ = ["RankboardCallback"]

#: ``on_log`` keys that are not per-step metrics (bookkeeping and cumulative counters).
_NOT_METRICS = frozenset({"epoch", "step", "total_flos", "num_input_tokens_seen",
                          "train_runtime"})


def _torch_broadcast() -> Optional[Callable[[str], str]]:
    """rank 0's object on every rank over ``torch.distributed``, when a process group exists."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None

    def broadcast(obj: str) -> str:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return broadcast


class _Epoch:
    """One epoch's tally while it runs and until its record goes out."""

    __slots__ = ("index", "t0", "ms", "start_step", "steps", "loss", "weight", "scalars")

    def __init__(self, index: int, start_step: int) -> None:
        self.index = index
        self.t0 = time.perf_counter()
        self.ms = 0.0
        self.start_step = start_step
        self.steps = 0
        self.loss = 0.0
        self.weight = 0
        self.scalars: Dict[str, Tuple[float, int]] = {}


class RankboardCallback(TrainerCallback):
    """Streams a ``Trainer`` run to rankboard from every process (module docstring).

    ``**agent_kwargs`` go to :class:`rank_agent.RankAgent` (``broker``, ``run``, ``rank``,
    ``world_size``, ``local_rank``, ``host``, ``sndhwm``, ``linger_ms``, ``step_flush``) and
    override what the Trainer and the environment say; ``port``: a dashboard port to
    register; ``sample_interval``: seconds between resource samples (``None``: none)."""

    def __init__(self, *, port: int = 0, sample_interval: Optional[float] = 2.0,
                 **agent_kwargs: Any) -> None:
        check_agent_kwargs(agent_kwargs, "RankboardCallback")
        self.port = int(port)
        self.sample_interval = sample_interval
        self.agent_kwargs: Dict[str, Any] = dict(agent_kwargs)
        self.reporter: Optional[Reporter] = None
        self._open: Optional[_Epoch] = None  # the epoch running now
        self._closed: Optional[_Epoch] = None  # ended, its record not sent yet
        self._last_loss: Optional[float] = None
        self._last_loss_step = 0
        self._tokens_seen = 0
        self._rank = 0
        self._world = 1
        self._accumulate = 1
        self._samples_per_step = 0

    @property
    def agent(self) -> Any:
        """This process's :class:`rank_agent.RankAgent` during training (``None`` otherwise)."""
        return self.reporter.agent if self.reporter is not None else None

    # -- start -------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kwargs: Any) -> None:
        if self.reporter is not None:  # a second train() on the same Trainer: a new run
            self.reporter.end("ok")
        rank, world = int(args.process_index), int(args.world_size)
        run = self.agent_kwargs.get("run")
        if run is None:
            prefix = args.run_name or (type(model).__name__ if model is not None else "trainer")
            run = agree_run_id(prefix, rank, world, _torch_broadcast())
        agent_kwargs = dict(self.agent_kwargs)
        if agent_kwargs.get("label") is None and args.run_name:  # section 7.5: its own name
            agent_kwargs["label"] = str(args.run_name)
        agent = make_agent(run=run, rank=rank, world_size=world,
                           local_rank=max(0, int(args.local_process_index)),
                           agent_kwargs=agent_kwargs)
        self.reporter = Reporter(agent)
        self._rank, self._world = agent.rank, agent.world_size
        self._accumulate = max(1, int(args.gradient_accumulation_steps))
        self._samples_per_step = int(args.per_device_train_batch_size) * self._accumulate
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self._last_loss_step = int(state.global_step)
        self._last_loss = None
        self._open = self._closed = None
        self.reporter.start(total_epochs=int(state.num_train_epochs or 0),
                            metadata=self._metadata(args, model), port=self.port,
                            sample_interval=self.sample_interval,
                            total_steps=getattr(state, "max_steps", 0))
        if world > 1 and rank == 0 and getattr(args, "average_tokens_across_devices", False):
            log.info("rankboard: average_tokens_across_devices gathers every step before "
                     "on_step_begin, so each rank's data_ms includes the slowest rank's "
                     "input wait; set it to False to see which rank's input is slow")

    @staticmethod
    def _metadata(args: Any, model: Any) -> Dict[str, Any]:
        meta: Dict[str, Any] = {
            "framework": "transformers",
            "transformers_version": transformers.__version__,
            "training_arguments": args.to_dict(),
        }
        if model is not None:
            meta["model"] = type(model).__name__
            config = getattr(model, "config", None)
            to_dict = getattr(config, "to_dict", None)
            if callable(to_dict):
                try:
                    meta["model_config"] = to_dict()
                except Exception as exc:
                    log.debug("rankboard: model config not sent: %r", exc)
        return meta

    # -- steps, logs, epochs -----------------------------------------------------------------

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.reporter is None:
            return
        self._send_closed()
        self._open = _Epoch(int(round(state.epoch or 0)), int(state.global_step))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The step's batches are in hand: the data wait (PROTOCOL 7.1) ends here."""
        if self.reporter is not None:
            self.reporter.batch_ready()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        reporter = self.reporter
        if reporter is None:
            return
        tokens = 0
        seen = getattr(state, "num_input_tokens_seen", 0)
        if seen and seen > self._tokens_seen:
            delta = int(seen) - self._tokens_seen
            self._tokens_seen = int(seen)
            tokens = delta // self._world + (1 if self._rank < delta % self._world else 0)
        # held until the next step: the Trainer logs this step's numbers (on_log) after
        # on_step_end, and both must arrive as one point (Reporter.hold_step)
        reporter.hold_step(int(state.global_step), samples=self._samples_per_step,
                           tokens=tokens)

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None,
               **kwargs: Any) -> None:
        reporter = self.reporter
        if reporter is None or not logs or ("total_flos" in logs and "train_loss" in logs):
            return  # the end-of-training summary is not a step's metrics
        step = int(state.global_step)
        values = numbers_only(logs, _NOT_METRICS)
        if not values:
            return
        reporter.step(step, values)
        tally = self._open if self._open is not None else self._closed
        for name, value in values.items():
            number, _ = classify(value)
            if number is None:
                continue
            if name == "loss":
                weight = max(1, step - self._last_loss_step)
                self._last_loss_step = step
                self._last_loss = float(number)
                if tally is not None:
                    tally.loss += float(number) * weight
                    tally.weight += weight
            elif tally is not None:
                total, count = tally.scalars.get(name, (0.0, 0))
                tally.scalars[name] = (total + float(number), count + 1)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        epoch = self._open
        if self.reporter is None or epoch is None:
            return
        epoch.ms = (time.perf_counter() - epoch.t0) * 1000.0
        epoch.steps = int(state.global_step) - epoch.start_step
        self._send_closed()
        self._closed, self._open = epoch, None

    def _send_closed(self) -> None:
        epoch, self._closed = self._closed, None
        if epoch is None or self.reporter is None:
            return
        if epoch.weight:
            avg_loss = epoch.loss / epoch.weight
        else:
            avg_loss = self._last_loss if self._last_loss is not None else 0.0
        self.reporter.epoch(epoch.index, avg_loss, batches=epoch.steps * self._accumulate,
                            samples=epoch.steps * self._samples_per_step, epoch_ms=epoch.ms,
                            scalars=epoch.scalars)

    # -- end ---------------------------------------------------------------------------------

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.reporter is None:
            return
        if self._open is not None:  # stopped without an epoch end
            self.on_epoch_end(args, state, control)
        self._send_closed()
        self.reporter.end("ok")
        self.reporter = None
