"""Accelerate: ``Accelerator(log_with=[RankboardTracker()])``, or ``log_with="rankboard"``.

**One run per job, named as** :meth:`rank_agent.RankAgent.from_env` **names it**
(PROTOCOL.md section 5, the Accelerate bullet): ``RANKBOARD_RUN``, torchrun's or Slurm's
id, no prefix. Every process of the job is its rank. Accelerate (1.15) calls every tracker
method on the main process only; only the tracker's constructor, in the
``log_with=[RankboardTracker()]`` form, runs on every process, so the constructor takes the
process's agent and sends what every rank sends:

* in every process, at construction: ``register`` (world size, rank, host from the
  launcher), hardware, resource sampling; the rank finishes when the process exits
  (``finish("ok")``, or ``"error"`` if an uncaught exception ended it);
* on the main process, at ``init_trackers``: the ``config`` as metadata (with
  ``project_name``); every ``accelerator.log(values, step=...)``: ``log_step(step, <numeric
  values>)`` (``step=None``: the previous step + 1), a device tensor read without a device
  sync (:mod:`._common`); ``end_training()``: ``finish("ok")``.

**One agent per process and run** (:mod:`rank_agent.shared`): the tracker and
``RankAgent.from_env()`` share it whichever comes first, so the per-rank recipe's step
times and the tracker's logged values land in the same run and merge per step::

    agent = RankAgent.from_env()              # every process (README: "Accelerate")
    agent.batch_ready()                       # the batch in hand: its wait is data_ms (7.1)
    agent.log_step(step, samples=batch_size)  # each optimizer step

The shared agent finishes and closes when its last user does (the tracker at
``end_training()`` or process exit, a ``with`` block at its end); the run completes when
every process has finished, and fails if any process failed.

**``log_with="rankboard"``**: importing this module registers :class:`NamedRankboardTracker`
under that name where Accelerate has ``register_tracker_class`` (:data:`REGISTERED` says
whether it happened). Accelerate builds it inside ``init_trackers``, on the main process
only: it adopts the process's agent if ``RankAgent.from_env()`` ran before (the per-rank
recipe makes every process appear); otherwise it reports the main process alone, as a
one-rank run under the same name. ``project_name`` is a metadata field, and names the run
only when no launcher gives an id (``<project_name>-<time>-<hex>``). Keyword arguments
reach it through ``init_trackers(..., init_kwargs={"rankboard": {...}})``.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import accelerate
from accelerate.tracking import GeneralTracker

from .. import shared
from ..agent import RankAgent
from ..launcher import launch_args, launcher_run_id, new_run_id, sanitize_run_id
from ._common import Reporter, check_agent_kwargs, jsonable, numbers_only

log = logging.getLogger(__name__)

__all__ = ["RankboardTracker", "NamedRankboardTracker", "REGISTERED"]


class RankboardTracker(GeneralTracker):
    """An Accelerate tracker that makes every process of the job a rank of one run, and
    streams ``accelerator.log`` values to it (module docstring).

    ``run``: the run id (default: as ``RankAgent.from_env`` names it); ``total_epochs``:
    sent with ``register`` when known; ``port``: a dashboard port to register
    (``rankboard up``); ``sample_interval``: seconds between resource samples (``None``:
    none); ``**agent_kwargs``: :class:`rank_agent.RankAgent` keyword arguments, overriding
    what the environment says (``broker``, ``host``, ``rank``, ``world_size``,
    ``local_rank``, ``sndhwm``, ``linger_ms``, ``step_flush``)."""

    name = "rankboard"
    requires_logging_directory = False
    main_process_only = True
    #: whether the constructor takes the process's agent (every process runs it); the
    #: ``log_with="rankboard"`` form is built on the main process only, by init_trackers
    _in_every_process = True

    def __init__(self, run: Optional[str] = None, *, total_epochs: int = 0, port: int = 0,
                 sample_interval: Optional[float] = 2.0, **agent_kwargs: Any) -> None:
        super().__init__()
        check_agent_kwargs(agent_kwargs, type(self).__name__)
        self.run_name = run if run is None else str(run)
        self.project_name: Optional[str] = None
        self.total_epochs = int(total_epochs)
        self.port = int(port)
        self.sample_interval = sample_interval
        self.agent_kwargs: Dict[str, Any] = dict(agent_kwargs)
        self.reporter: Optional[Reporter] = None
        self._started = False
        self._last_step = -1
        if self._in_every_process:
            self._attach()

    @property
    def tracker(self) -> Any:
        """This process's :class:`rank_agent.RankAgent` (Accelerate's name for the
        underlying object; ``None`` before it is taken)."""
        return self.reporter.agent if self.reporter is not None else None

    def _agent(self) -> RankAgent:
        """The process's shared agent for this job's run (made if none exists yet)."""
        kwargs = dict(self.agent_kwargs)
        if self.run_name:
            kwargs["run"] = self.run_name
        return RankAgent.from_env(**kwargs)

    def _attach(self) -> None:
        """Take the agent and send what every rank sends: register, hardware, samples."""
        if self.reporter is not None:
            return
        self.reporter = Reporter(self._agent(), clean_exit="ok")
        self.reporter.start(total_epochs=self.total_epochs, metadata=None, port=self.port,
                            sample_interval=self.sample_interval)

    def start(self) -> None:
        """The main process's start (Accelerate calls it from ``init_trackers``; every other
        method calls it too, for releases that do not): the run's metadata."""
        if self._started:
            return
        self._started = True
        self._attach()
        assert self.reporter is not None
        self.reporter.agent.set_metadata(self._metadata(None))

    def _metadata(self, config: Any) -> Dict[str, Any]:
        meta: Dict[str, Any] = {"framework": "accelerate",
                                "accelerate_version": accelerate.__version__}
        if self.project_name is not None:
            meta["project_name"] = self.project_name
        if config is not None:
            meta["config"] = jsonable(config)
        return meta

    def store_init_configuration(self, values: Dict[str, Any]) -> None:
        """``init_trackers``' ``config``: the run's metadata."""
        self.start()
        assert self.reporter is not None
        self.reporter.agent.set_metadata(self._metadata(values))

    def log(self, values: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """One ``accelerator.log`` call: its numbers (and one-element tensors) at ``step``."""
        self.start()
        assert self.reporter is not None
        if step is None:
            step = self._last_step + 1 if self._last_step >= 0 else 0
        elif type(step) is not int:
            step = int(step)
        if step < 0:
            return
        self._last_step = step
        self.reporter.step(step, numbers_only(values))

    def finish(self) -> None:
        """``end_training()``: send what waits, ``finish("ok")``, let go of the agent (it
        closes when its last user does)."""
        if self.reporter is not None:
            self.reporter.end("ok")


class NamedRankboardTracker(RankboardTracker):
    """What ``log_with="rankboard"`` builds, on the main process only, inside
    ``init_trackers``: Accelerate passes ``project_name`` first (a metadata field; the run's
    name only when no launcher gives an id); ``run=`` in ``init_kwargs`` still names the run.
    It adopts the process's agent if ``RankAgent.from_env()`` ran before, and otherwise
    reports the main process alone as a one-rank run under the same name."""

    _in_every_process = False

    def __init__(self, project_name: str = "accelerate", **kwargs: Any) -> None:
        super().__init__(kwargs.pop("run", None), **kwargs)
        self.project_name = str(project_name) or "accelerate"

    def _agent(self) -> RankAgent:
        run = self.run_name or launcher_run_id()
        env = launch_args(generate=False)
        rank = int(self.agent_kwargs.get("rank", env["rank"]))
        found = shared.find(sanitize_run_id(run) if run else None, rank)
        if isinstance(found, RankAgent) and shared.adopt(found):
            return found
        # alone: the main process as a one-rank run, kept out of the registry (a later
        # from_env of this process is the per-rank recipe, with the job's world size)
        args: Dict[str, Any] = {**env, "run": run or new_run_id(self.project_name or "accelerate"),
                                "rank": 0, "world_size": 1}
        args.update({k: v for k, v in self.agent_kwargs.items() if k not in ("rank", "world_size")})
        if args.get("label") is None:  # section 7.5: Accelerate's own name for the run
            args["label"] = self.project_name
        return RankAgent(**args)


def _register() -> bool:
    try:
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS, register_tracker_class
    except ImportError:  # an Accelerate without register_tracker_class
        return False
    if LOGGER_TYPE_TO_CLASS.get(NamedRankboardTracker.name) is not NamedRankboardTracker:
        register_tracker_class(NamedRankboardTracker)
    return True


#: Whether ``log_with="rankboard"`` works with the installed Accelerate.
REGISTERED = _register()
