"""What the per-rank number rules (PROTOCOL.md 8.3) cost a step's close.

``replica_check_overhead_ratio``: closing 1,024-rank steps whose frames carry ``loss`` (a
different value on every rank) and ``grad_norm`` (the same on every rank, up to a rounding
difference of 1e-12 on some ranks, as an all-reduce leaves it), with ``grad_norm`` declared
replicated, over closing the same steps without it: two runs' :class:`~broker.run.steps.closer.
RunSteps` fed the same decoded frames, in alternating rounds of the same process (so both
see the same machine load), each round every rank's one-point frame added and the step
closed and taken into the store as the sink does (the rules run inside the close). The
figure is the ratio of the medians of the CPU time (``thread_time``) of the close and take
(``--quick``'s 10 rounds are too few for the ratio on a loaded machine: use the full run).
``rules_us_with``/``rules_us_without``: the rules alone on one closed step, a call.
Without a replicated metric the rules cost one ``isfinite`` over the batch's means; with one,
a few vectorised comparisons of each step's min and max (no per-rank scan while every rank
agrees within the tolerance). Also printed: ``nonfinite_first_close_ms``, the close of a step
where 3 of the 1,024 ranks hold a NaN for the first time (the one close that looks at ranks).

    python bench/numbers_bench.py [--quick]
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, List

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import result  # noqa: E402

from broker.run.steps.closer import RunSteps  # noqa: E402
from rank_agent import protocol  # noqa: E402

RUN = "bench-numbers"
RANKS = 1024


def frames(rounds: int, nan_at: int = -1) -> List[List[Any]]:
    enc, dec = protocol.encoder.encode, protocol.decode
    out = []
    for s in range(rounds):
        row = []
        for r in range(RANKS):
            gn = 2.0 / (s + 1)
            if r % 5 == 0:
                gn *= 1 + 1e-12  # a rounding difference: agrees
            loss = math.nan if (s == nan_at and r in (13, 400, 900)) else 1.0 / (s + 1) + r * 1e-6
            row.append(dec(enc(protocol.Steps(
                run=RUN, rank=r, steps=[s], times=[1.7e9 + s], step_ms=[100.0 + r % 7],
                samples=[32], tokens=[4096], metrics={"loss": [loss], "grad_norm": [gn]}))))
        out.append(row)
    return out


def close_times(rounds: int) -> tuple[list[float], list[float]]:
    data = frames(rounds)
    plain = RunSteps(close_after=1e9, interval=0.0)
    checked = RunSteps(close_after=1e9, interval=0.0)
    checked.numbers.declare(["grad_norm"])
    for steps in (plain, checked):
        steps.closer.grace = 0.0
    without: list[float] = []
    with_: list[float] = []
    for s in range(rounds):
        order = (plain, checked) if s % 2 else (checked, plain)
        for steps in order:
            for f in data[s]:
                steps.closer.add(f, 1.0, True)
            t0 = time.thread_time()
            steps.close(1.0, RANKS)
            block = steps.take(1.0)
            dt = time.thread_time() - t0
            if block["rows"] != 1:
                raise RuntimeError(f"round {s}: {block['rows']} steps closed")
            (with_ if steps is checked else without).append(dt)
    if checked.numbers.divergence or checked.numbers.nonfinite:
        raise RuntimeError("the bench's replicas must agree")
    return without, with_


def nonfinite_close(rounds: int) -> float:
    """CPU ms of the close of the step holding the first NaNs (3 ranks of 1,024)."""
    at = rounds - 1
    data = frames(rounds, nan_at=at)
    steps = RunSteps(close_after=1e9, interval=0.0)
    steps.closer.grace = 0.0
    took = 0.0
    for s in range(rounds):
        for f in data[s]:
            steps.closer.add(f, 1.0, True)
        t0 = time.thread_time()
        steps.close(1.0, RANKS)
        steps.take(1.0)
        took = time.thread_time() - t0
    if [e["ranks"] for e in steps.numbers.nonfinite] != [[13, 400, 900]]:
        raise RuntimeError("the first NaN was not found")
    return took * 1e3


def check_us(repeat: int) -> tuple[float, float]:
    """The rules alone on one closed 1,024-rank step (the batch the close hands them), in
    microseconds a call: without a replicated metric, and with ``grad_norm`` replicated."""
    import timeit

    from broker.run.steps.numbers import RunNumbers

    steps = RunSteps(close_after=1e9, interval=0.0)
    steps.closer.grace = 0.0
    for f in frames(1)[0]:
        steps.closer.add(f, 1.0, True)
    batch = steps.closer.ready_batch(1.0, RANKS)
    assert batch is not None
    plain, checked = RunNumbers(), RunNumbers()
    checked.declare(["grad_norm"])
    return (timeit.timeit(lambda: plain.check(batch), number=repeat) / repeat * 1e6,
            timeit.timeit(lambda: checked.check(batch), number=repeat) / repeat * 1e6)


def run(quick: bool) -> list[dict[str, Any]]:
    rounds = 10 if quick else 200
    without, with_ = close_times(rounds)
    a, b = float(np.median(without)), float(np.median(with_))
    plain_us, checked_us = check_us(200 if quick else 5000)
    return [
        result("replica_check_overhead_ratio", round(b / a, 3), "ratio", baseline=1.0,
               ratio=round(b / a, 3), ranks=RANKS, rounds=rounds,
               close_ms_without=round(a * 1e3, 3), close_ms_with=round(b * 1e3, 3),
               metrics=2, replicated=1, rules_us_without=round(plain_us, 2),
               rules_us_with=round(checked_us, 2)),
        result("nonfinite_first_close_ms", round(nonfinite_close(min(rounds, 20)), 3), "ms",
               ranks=RANKS, nan_ranks=3),
    ]


if __name__ == "__main__":
    for line in run("--quick" in sys.argv):
        print(json.dumps(line))
