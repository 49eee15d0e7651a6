"""What the launcher (torchrun, Slurm, or none) tells a training process: rank, world size,
local rank, the run id every rank shares, the broker and the host (PROTOCOL.md section 5).

One definition, read by :meth:`rank_agent.RankAgent.from_env` and by the framework
integrations (:mod:`rank_agent.integrations._common`), so that a tracker, a callback and the
per-rank recipe of one job name its run alike. Pure: the environment is a mapping passed in
(``os.environ`` by default); nothing here opens a socket or imports a framework.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import time
from typing import Any, Dict, Mapping

from .protocol import DEFAULT_INGEST, MAX_RUN_ID, RUN_ID_CHARS

log = logging.getLogger(__name__)

#: The broker's ingest endpoint when ``RANKBOARD_BROKER`` does not name one.
DEFAULT_BROKER = DEFAULT_INGEST

_RUN_BAD = re.compile(rf"[^{RUN_ID_CHARS}]+")


def sanitize_run_id(run: str) -> str:
    """Make ``run`` a valid wire run id (1-128 of ``A-Z a-z 0-9 . _ : -``), deterministically.

    Runs of other characters become ``_`` (``"my run/1"`` -> ``"my_run_1"``). An id longer than
    128 characters keeps its first 119 and gains ``-`` plus 8 hex digits of a hash of the whole
    id, so long ids that differ only at the end stay distinct. Every rank computes the same
    result from the same input, so they all land in the same run. Empty input gives ``"run"``;
    an id of dots only (``.``, ``..``: no file or URL segment can name it) becomes ``_`` each.
    """
    text = _RUN_BAD.sub("_", str(run))
    if len(text) > MAX_RUN_ID:
        digest = hashlib.sha1(str(run).encode("utf-8", "surrogatepass")).hexdigest()[:8]
        text = f"{text[:MAX_RUN_ID - 9]}-{digest}"
    if text and not text.strip("."):
        text = "_" * len(text)
    return text or "run"


def env_int(env: Mapping[str, str], name: str) -> int | None:
    """``env[name]`` as an int, ``None`` when unset or blank; ``ValueError`` naming the
    variable when it is not an integer (a launcher misconfiguration, before training)."""
    value = env.get(name)
    if value is None or not value.strip():
        return None
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def launcher_run_id(env: Mapping[str, str] | None = None) -> str | None:
    """The run id a launcher gave every rank alike, or ``None``: ``RANKBOARD_RUN``, else
    torchrun's ``TORCHELASTIC_RUN_ID`` (unless it is torchrun's placeholder ``none``), else
    ``SLURM_JOB_ID``, with ``.<SLURM_STEP_ID>`` when set (``12345.0``, as ``sacct`` names a
    step, so two ``srun`` steps of one allocation are two runs). Never the
    ``MASTER_ADDR:MASTER_PORT`` fallback of :func:`launch_args`, which repeats across jobs."""
    env = os.environ if env is None else env
    run = env.get("RANKBOARD_RUN", "").strip()
    if run:
        return run
    elastic = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if elastic and elastic.lower() != "none":
        return elastic
    job = env.get("SLURM_JOB_ID", "").strip()
    if job:
        step = env.get("SLURM_STEP_ID", "").strip()
        return f"{job}.{step}" if step else job
    return None


def new_run_id(prefix: str = "run") -> str:
    """``<prefix>-<YYYYmmdd-HHMMSS>-<6 hex>`` in the wire's alphabet (unique per job)."""
    return sanitize_run_id(f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}")


def generated_run_id() -> str:
    """``run-<YYYYmmdd-HHMMSS>-<6 hex>``: the id of a process no launcher named."""
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def launch_ranks(env: Mapping[str, str]) -> tuple[int, int, int]:
    """(rank, world size, local rank): torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` when
    ``RANK`` is set, else Slurm's ``SLURM_PROCID``/``SLURM_NTASKS`` (or ``SLURM_NPROCS``)/
    ``SLURM_LOCALID``, else a single process: rank 0 of 1, local 0. A missing world size
    defaults to rank + 1 and a missing local rank to 0."""
    if env.get("RANK", "").strip():
        rank = env_int(env, "RANK")
        world = env_int(env, "WORLD_SIZE")
        local = env_int(env, "LOCAL_RANK")
    elif env.get("SLURM_PROCID", "").strip():
        rank = env_int(env, "SLURM_PROCID")
        world = env_int(env, "SLURM_NTASKS")
        if world is None:
            world = env_int(env, "SLURM_NPROCS")
        local = env_int(env, "SLURM_LOCALID")
    else:
        rank, world, local = 0, 1, 0
    rank = 0 if rank is None else rank
    world = rank + 1 if world is None else world
    local = 0 if local is None else local
    return rank, world, local


def launch_args(env: Mapping[str, str] | None = None, *, generate: bool = True) -> Dict[str, Any]:
    """The :class:`rank_agent.RankAgent` constructor arguments the environment gives
    (``broker``, ``run``, ``rank``, ``world_size``, ``local_rank``, ``host``); the rules are
    :meth:`rank_agent.RankAgent.from_env`'s docstring. The run id is :func:`launcher_run_id`,
    else for several ranks ``MASTER_ADDR:MASTER_PORT`` (warned about), else a generated
    ``run-<YYYYmmdd-HHMMSS>-<6 hex>`` (``generate=False``: ``None``, for a caller that first
    looks for an agent this process already has)."""
    env = os.environ if env is None else env
    rank, world, local = launch_ranks(env)
    run = launcher_run_id(env)
    if not run and world > 1:
        addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
        if addr and port:
            run = f"{addr}:{port}"
            log.warning(
                "no RANKBOARD_RUN, TORCHELASTIC_RUN_ID or SLURM_JOB_ID: run id %r from "
                "MASTER_ADDR:MASTER_PORT; set RANKBOARD_RUN to name the run", run)
        else:
            log.warning(
                "rank %d of %d has no shared run id (set RANKBOARD_RUN): each rank will "
                "appear as its own run", rank, world)
    if not run and generate:
        run = generated_run_id()
    return {
        "broker": env.get("RANKBOARD_BROKER", "").strip() or DEFAULT_BROKER,
        "run": run,
        "rank": rank,
        "world_size": world,
        "local_rank": local,
        "host": env.get("RANKBOARD_HOST", "").strip() or None,
    }
