"""A job that restarts (PROTOCOL 8.1), as its ranks' frames: two ranks (``proc`` ids as the
agent sends them, one per process) close steps and epochs, rank 1 dies with an exception,
and new processes resume from an earlier step and epoch. The same frames feed the real
stack (the browser tests) or a :class:`~broker.sink.RunSink` (the saved report's test)."""
from __future__ import annotations

import time
from typing import Any, Callable, List

from rank_agent import protocol as wire

WORLD = 2
HOSTS = ("node-a", "node-b")
STEP_MS = 60_000.0  #: one step a minute: the cost line's GPU-hours are readable figures
CAUSE = ("RuntimeError", "CUDA error: an illegal memory access was encountered\n"
                         "CUDA kernel errors might be asynchronously reported")


def loss_of(attempt: int, step: int) -> float:
    """Each attempt's loss at ``step``: the re-run differs from the superseded values."""
    return 2.0 - 0.01 * step + (0.5 if attempt else 0.0)


def proc_of(attempt: int, rank: int) -> str:
    return f"proc-{attempt}-{rank}"


def register(send: Callable[[Any], None], run: str, attempt: int) -> None:
    for r in range(WORLD):
        send(wire.Register(run=run, rank=r, world_size=WORLD, host=HOSTS[r], local_rank=0,
                           total_epochs=6, proc=proc_of(attempt, r)))


def steps(send: Callable[[Any], None], run: str, attempt: int, first: int, last: int,
          t0: float | None = None) -> None:
    """Both ranks' points for steps ``first..last`` (inclusive) in ≤ 1024-point frames."""
    t0 = time.time() if t0 is None else t0
    todo: List[int] = list(range(first, last + 1))
    for i in range(0, len(todo), 1024):
        chunk = todo[i:i + 1024]
        for r in range(WORLD):
            send(wire.Steps(run=run, rank=r, steps=chunk,
                            times=[t0 + 0.001 * s for s in chunk], step_ms=[STEP_MS] * len(chunk),
                            samples=[32] * len(chunk),
                            metrics={"loss": [loss_of(attempt, s) for s in chunk]}))


def epochs(send: Callable[[Any], None], run: str, attempt: int, first: int, last: int) -> None:
    for e in range(first, last + 1):
        for r in range(WORLD):
            send(wire.Metrics(run=run, rank=r, epoch=e, avg_loss=loss_of(attempt, 10 * e),
                              batches=10, samples=320, epoch_ms=1000.0))


def die(send: Callable[[Any], None], run: str, at: float) -> None:
    """Rank 1 fails (the previous attempt's cause); rank 0 is killed with it (silent)."""
    send(wire.Finish(run=run, rank=1, status="error",
                     error=wire.ErrorInfo(type=CAUSE[0], message=CAUSE[1], at=at)))
