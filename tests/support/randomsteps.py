"""Random closed step records and the stores fed them, for the step store's tests
(:mod:`tests.broker.test_step_store`, :mod:`tests.broker.test_step_store_wire`): sparse metrics,
NaN/inf values, null step times, zero counts, gaps in the steps."""
from __future__ import annotations

import csv
import io
import math
import random
from typing import Any, Optional

from broker.run.steps.encodings import csv_columns
from broker.run.steps.store import StepStore
from rank_agent.protocol import Steps
from tests.support.steprecords import step_record


def csv_header(metric_names: list[str]) -> str:
    """The header line, CSV-quoted (the web's adds only the formula guard)."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\r\n").writerow(csv_columns(metric_names))
    return out.getvalue()



NONFINITE = (math.nan, math.inf, -math.inf)




def point(rank: int, step: int, *, ms: Optional[float], metrics: dict[str, Optional[float]],
          samples: int, tokens: int, time: float) -> Steps:
    return Steps(run="r", rank=rank, steps=[step], times=[time], step_ms=[ms],
                 samples=[samples], tokens=[tokens],
                 metrics={k: [v] for k, v in metrics.items()})


def value(rng: random.Random, p_none: float = 0.2, p_bad: float = 0.05) -> Optional[float]:
    x = rng.random()
    if x < p_none:
        return None
    if x < p_none + p_bad:
        return rng.choice(NONFINITE)
    return round(rng.uniform(-1000, 1000), rng.randrange(0, 6))


def random_records(rng: random.Random, n: int, names: list[str], *, first: int = 0,
                   ranks: int = 3) -> list[dict[str, Any]]:
    """``n`` closed step records built by step_record from random per-rank points: sparse
    metrics (absent at many steps), NaN/inf values, null step times, zero counts."""
    out = []
    step = first
    p_metric = {name: rng.choice((0.1, 0.5, 0.9, 1.0)) for name in names}
    for _ in range(n):
        reps = {}
        present = [m for m in names if rng.random() < p_metric[m]]
        for r in rng.sample(range(ranks), rng.randrange(1, ranks + 1)):
            ms = value(rng, 0.15, 0.05)
            if ms is not None and ms == ms and math.isfinite(ms):
                ms = abs(ms) if rng.random() < 0.9 else 0.0
            reps[r] = point(r, step, ms=ms, metrics={m: value(rng) for m in present},
                            samples=rng.choice((0, 0, 8, 32, 2**40)),
                            tokens=rng.choice((0, 1000, 4096)),
                            time=rng.choice((1e9 + step, 1e9 + step + 0.5, math.nan)))
        out.append(step_record(step, reps))
        step += rng.choice((1, 1, 1, 2, 10, 1000))
    return out


def store_of(records: list[dict[str, Any]], *, batches: int = 3) -> StepStore:
    """A store fed the records in a few append() calls (batch boundaries must not matter)."""
    s = StepStore()
    cuts = sorted({0, len(records), *(len(records) * k // batches for k in range(1, batches))})
    for a, b in zip(cuts, cuts[1:]):
        s.append(records[a:b])
    return s
