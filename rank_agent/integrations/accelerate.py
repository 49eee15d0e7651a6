"""Accelerate: ``Accelerator(log_with=[RankboardTracker()])``, or ``log_with="rankboard"``.

Accelerate calls trackers on the main process only, so the tracker reports the main process
as a one-rank reporter: a run of world size 1 that completes when ``end_training()`` calls
:meth:`RankboardTracker.finish` (PROTOCOL.md section 5). What it sends:

* at ``init_trackers``: ``register``, hardware, resource sampling, and the ``config`` given
  to ``init_trackers`` as metadata;
* every ``accelerator.log(values, step=...)``: ``log_step(step, <numeric values>)``
  (``step=None``: the previous step + 1); calls with the same step merge into one point;
  a device tensor among the values is read without a device sync (:mod:`._common`);
* ``end_training()``: ``finish("ok")``. A process that exits before it does reports
  ``finish("error")`` if an exception ended it, ``finish("ok")`` otherwise.

**Run id.** ``RankboardTracker(run="name")`` names it. Otherwise it is
``<prefix>-<job id>``: the prefix is ``accelerate`` (or, with ``log_with="rankboard"``,
the ``project_name`` given to ``init_trackers``) and the job id the launcher's shared id
(``RANKBOARD_RUN``, ``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``), else a timestamp and random
hex. The prefix keeps the tracker's one-rank run apart from the job's per-rank run, which
:meth:`rank_agent.RankAgent.from_env` names by the bare job id (a run has one world size).

**Per-rank step times** (the straggler board) need an agent on every process, which a
tracker cannot have; two lines in the training loop give them::

    agent = RankAgent.from_env()              # every process (README: "Accelerate")
    agent.log_step(step, samples=batch_size)  # each optimizer step

**``log_with="rankboard"``**: importing this module registers :class:`NamedRankboardTracker`
under that name where Accelerate has ``register_tracker_class`` (1.x releases from 2026 on;
:data:`REGISTERED` says whether it happened). Keyword arguments reach it through
``init_trackers(..., init_kwargs={"rankboard": {...}})``.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional

import accelerate
from accelerate.tracking import GeneralTracker

from ._common import (
    Reporter,
    check_agent_kwargs,
    jsonable,
    launcher_run_id,
    make_agent,
    new_run_id,
    numbers_only,
    optional_int,
)

log = logging.getLogger(__name__)

__all__ = ["RankboardTracker", "NamedRankboardTracker", "REGISTERED"]


class RankboardTracker(GeneralTracker):
    """An Accelerate tracker that streams ``accelerator.log`` values to rankboard.

    ``run``: the run id (default: module docstring, "Run id"); ``total_epochs``: sent with
    ``register`` when known; ``port``: a dashboard port to register (``rankboard up``);
    ``sample_interval``: seconds between resource samples (``None``: none);
    ``**agent_kwargs``: :class:`rank_agent.RankAgent` keyword arguments (``broker``,
    ``host``, ``local_rank``, ``sndhwm``, ``linger_ms``, ``step_flush``). Nothing is opened
    until Accelerate starts the tracker, on the main process."""

    name = "rankboard"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run: Optional[str] = None, *, total_epochs: int = 0, port: int = 0,
                 sample_interval: Optional[float] = 2.0, **agent_kwargs: Any) -> None:
        super().__init__()
        check_agent_kwargs(agent_kwargs, type(self).__name__)
        for fixed in ("rank", "world_size"):
            if fixed in agent_kwargs:
                raise TypeError(f"{type(self).__name__} reports the main process as rank 0 of "
                                f"1; {fixed}= does not apply (see the per-rank recipe)")
        self.run_name = run if run is None else str(run)
        self.prefix = "accelerate"
        self.total_epochs = int(total_epochs)
        self.port = int(port)
        self.sample_interval = sample_interval
        self.agent_kwargs: Dict[str, Any] = dict(agent_kwargs)
        self.reporter: Optional[Reporter] = None
        self._last_step = -1

    @property
    def tracker(self) -> Any:
        """The main process's :class:`rank_agent.RankAgent` (``None`` before ``start``)."""
        return self.reporter.agent if self.reporter is not None else None

    def _run_id(self) -> str:
        if self.run_name:
            return self.run_name
        shared = launcher_run_id()
        return f"{self.prefix}-{shared}" if shared else new_run_id(self.prefix)

    def start(self) -> None:
        """Open the agent and send the start frames (Accelerate calls this from
        ``init_trackers``; every other method calls it too, for releases that do not)."""
        if self.reporter is not None:
            return
        kwargs = dict(self.agent_kwargs)
        local_rank = kwargs.pop("local_rank", None)
        if local_rank is None:
            local_rank = optional_int(os.environ.get("LOCAL_RANK")) or 0
        agent = make_agent(run=self._run_id(), rank=0, world_size=1, local_rank=local_rank,
                           agent_kwargs=kwargs)
        self.reporter = Reporter(agent, clean_exit="ok")
        self.reporter.start(total_epochs=self.total_epochs, metadata=self._metadata(None),
                            port=self.port, sample_interval=self.sample_interval)

    def _metadata(self, config: Any) -> Dict[str, Any]:
        meta: Dict[str, Any] = {"framework": "accelerate",
                                "accelerate_version": accelerate.__version__}
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
        """``end_training()``: send what waits, ``finish("ok")``, close."""
        if self.reporter is not None:
            self.reporter.end("ok")


class NamedRankboardTracker(RankboardTracker):
    """What ``log_with="rankboard"`` builds: Accelerate passes ``init_trackers``'
    ``project_name`` first, which becomes the run id's prefix (a project name repeats across
    jobs, so it is not the run id itself); ``run=`` in ``init_kwargs`` still names the run."""

    def __init__(self, project_name: str = "accelerate", **kwargs: Any) -> None:
        super().__init__(kwargs.pop("run", None), **kwargs)
        self.prefix = str(project_name) or "accelerate"


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
