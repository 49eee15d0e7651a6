"""The data wait's broker side (issue 28, PROTOCOL.md 7.1): what ``data_ms`` costs the close.

    python bench/datawait_bench.py [--quick] [--main /work/main]

* ``steps_close_per_s_data_ms``: ``steps_bench``'s ``steps_close_per_s`` (one rank sends
  200,000 steps x 4 metrics in frames of 1,000 points to a real broker and web, processes;
  steps/s from the first frame sent until ``/steps`` serves the last) with ``data_ms`` on
  every point.
* ``steps_close_ab_ratio``: the closing alone (a :class:`RunSteps`: the adds, the close,
  the store append and the ``steps`` event's block), in process, of 1,024 ranks x 1 step x
  4 metrics (the grid close, the live case) and of one rank's frames of 1,000 points (the
  general close), **with** ``data_ms`` on every point in this tree against the same frames
  without it in ``--main`` (a checkout of the tree before the data wait: its ``Steps``
  drops the field), each in a child process, alternated, best of the rounds; value: this
  tree's points/s over main's (1.0: the same cost); in the details the same frames without
  ``data_ms`` in this tree over main (``without_data_ms_ratio``: what the merge rule and the
  new field cost a run that does not send it).
* ``data_stragglers_1024_ms``: the run header's data-wait figures for 1,024 ranks (each with
  100 ``data_ms`` values) over a store of 10,000 closed steps: ``data_share``, the ranks'
  means and ``data_stragglers`` (:meth:`RunSteps.update_data_wait`'s work), median ms.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import steps_bench
from common import REPO, result

from rank_agent import protocol

RUN = steps_bench.RUN
METRICS = steps_bench.METRICS

#: the child's program: close the same frames ``rounds`` times, print points/s per shape
_CHILD = r"""
import sys, time, json
sys.path.insert(0, sys.argv[1])
from broker.run.steps.closer import RunSteps
from rank_agent import protocol
rounds, data = int(sys.argv[2]), sys.argv[3] == "1"
enc, dec = protocol.encoder.encode, protocol.decode
M = ("loss", "lr", "grad_norm", "acc")
def mk(rank, steps):
    kw = {"data_ms": [3.0 + rank % 5] * len(steps)} if data else {}
    raw = enc(protocol.Steps(run="b", rank=rank, steps=steps, times=[1.7e9 + s for s in steps],
        step_ms=[100.0 + rank % 7] * len(steps), samples=[32] * len(steps),
        tokens=[4096] * len(steps), metrics={m: [1.0 / (s + 1) + rank * 1e-6 for s in steps]
        for m in M}, **kw))
    return dec(raw)
grid = [[mk(r, [s]) for r in range(1024)] for s in range(rounds)]
long = [mk(0, list(range(s0, s0 + 1000))) for s0 in range(0, 1000 * rounds, 1000)]
out = {}
for name, batches in (("grid", grid), ("general", [[f] for f in long])):
    rs = RunSteps(close_after=1e9, interval=0.0)
    rs.closer.grace = 0.0
    best = None
    for frames in batches:
        t0 = time.perf_counter()
        for f in frames:
            rs.closer.add(f, 1.0, True)
        rs.close_all()
        rs.take(1.0)
        dt = time.perf_counter() - t0
        pts = sum(len(f.steps) for f in frames)
        best = pts / dt if best is None else max(best, pts / dt)
    out[name] = best
print(json.dumps(out))
"""


def _child(tree: Path, rounds: int, data: bool) -> dict[str, float]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    got = subprocess.run([sys.executable, "-c", _CHILD, str(tree), str(rounds),
                          "1" if data else "0"], check=True, capture_output=True, text=True,
                         cwd="/", env=env)
    return json.loads(got.stdout.strip().splitlines()[-1])


def close_ab(main: Path, rounds: int, tries: int) -> dict[str, Any]:
    """Best points/s per shape of this tree (with data_ms) and main (without), alternated."""
    here: dict[str, float] = {}
    plain: dict[str, float] = {}
    base: dict[str, float] = {}
    for _ in range(tries):
        for tree, data, into in ((REPO, True, here), (main, False, base), (REPO, False, plain)):
            for k, v in _child(tree, rounds, data).items():
                into[k] = max(into.get(k, 0.0), v)
    return {"here": here, "main": base, "plain": plain}


def close_rate_with_data(n: int) -> dict[str, Any]:
    """``steps_bench.close_rate`` with ``data_ms`` on every point."""
    plain = steps_bench._close_frames

    def frames(n: int, per: int) -> list[bytes]:
        out = []
        for raw in plain(n, per):
            f = protocol.decode(raw)
            out.append(protocol.encoder.encode(
                protocol.Steps(run=f.run, rank=f.rank, steps=f.steps, times=f.times,
                               step_ms=f.step_ms, samples=f.samples, tokens=f.tokens,
                               metrics=f.metrics, data_ms=[4.0] * len(f.steps))))
        return out

    steps_bench._close_frames = frames  # type: ignore[assignment]
    try:
        return steps_bench.close_rate(n)
    finally:
        steps_bench._close_frames = plain  # type: ignore[assignment]


def stragglers_1024(rounds: int) -> float:
    """Median ms of the header's data-wait figures for 1,024 ranks (see the docstring)."""
    from broker.run.sink import RunSink

    sink = RunSink(RUN, step_close_after=1e9)
    enc, dec = protocol.encoder.encode, protocol.decode
    sink.apply(dec(enc(protocol.Register(run=RUN, rank=0, world_size=1024, host="h"))), 0.0)
    rng = np.random.default_rng(0)
    for r in range(1024):
        data = rng.uniform(5, 15, 100).tolist()
        if r == 417:
            data = [310.0] * 100
        sink.apply(dec(enc(protocol.Steps(
            run=RUN, rank=r, steps=list(range(100)), times=[1.0] * 100,
            step_ms=[100.0] * 100, data_ms=data))), 1.0)
    sink.settle(2.0)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sink._update_data_wait(3.0, force=True)
        times.append(time.perf_counter() - t0)
    assert [e["rank"] for e in sink.header()["data_stragglers"]] == [417]
    return float(np.median(times)) * 1e3


def run(quick: bool, main: Path | None = None) -> list[dict[str, Any]]:
    out = [result("data_stragglers_1024_ms", round(stragglers_1024(20 if quick else 200), 3),
                  "ms", ranks=1024, values_per_rank=100)]
    n = 20_000 if quick else 200_000
    cr = close_rate_with_data(n)
    out.append(result("steps_close_per_s_data_ms", round(cr["per_s"]), "steps/s", steps=n,
                      points_per_frame=1000, metrics=len(METRICS),
                      broker_cpu_us_per_step=round(cr["broker_cpu_us_per_step"], 2)))
    if main is not None and (main / "broker" / "steps" / "closer.py").exists():
        ab = close_ab(main, 3 if quick else 10, 2 if quick else 3)
        for shape in ("grid", "general"):
            h, b, p = ab["here"][shape], ab["main"][shape], ab["plain"][shape]
            out.append(result(f"steps_close_ab_{shape}_ratio", round(h / b, 3), "ratio",
                              baseline=round(b), ratio=round(h / b, 3),
                              here_points_per_s=round(h), main_points_per_s=round(b),
                              here_without_data_ms_points_per_s=round(p),
                              without_data_ms_ratio=round(p / b, 3)))
    return out


if __name__ == "__main__":
    main_dir = None
    if "--main" in sys.argv:
        main_dir = Path(sys.argv[sys.argv.index("--main") + 1])
    for line in run("--quick" in sys.argv, main_dir):
        print(json.dumps(line), flush=True)
