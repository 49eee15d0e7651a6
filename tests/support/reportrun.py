"""A finished run for the report tests and ``bench/report_bench.py``: real wire frames fed to
a real :class:`~broker.run.sink.RunSink` and journaled by the real :class:`~broker.journal.journal.Journal`
code path (as the broker does), closed steps as STEPS blocks (as ``bench/steps_bench.py``
writes its million-step run), and strings a hostile rank could send in every place a
report shows text (metadata, metric names, host names, hardware, the graph)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from broker.journal.journal import Journal
from broker.run.sink import RunSink
from rank_agent import protocol
from rank_agent.protocol import GpuSample, ResourceSample

#: Markup in every string a rank controls: none of it may run or become an element.
HOSTILE = '</script><script>window.__pwned=1</script><!--<img src=x onerror="window.__pwned=2">'
#: A metric name that would end the data element if it were not escaped.
HOSTILE_METRIC = "</script><!--lr\u2028&amp;"
SVG = ('<svg xmlns="http://www.w3.org/2000/svg" width="120" height="40">'
       '<script>window.__pwned=3</script><rect width="120" height="40" fill="#5794f2"/>'
       '<text x="8" y="26">graph</text></svg>')
PER_HOST = 8


def host_of(rank: int) -> str:
    return f"node-{rank // PER_HOST:03d}"


def _sample(rank: int) -> ResourceSample:
    gib = 2**30
    util = 60.0 if rank == 3 else 92.0
    return ResourceSample(
        cpu_percent=30.0 + rank % 10, ram_used_bytes=180 * gib, ram_total_bytes=512 * gib,
        gpu_util_percent=util, vram_allocated_bytes=60 * gib, vram_total_bytes=80 * gib,
        gpus=[GpuSample(device_index=rank % PER_HOST, name="NVIDIA H100 80GB HBM3",
                        util_percent=util, vram_allocated_bytes=60 * gib,
                        vram_total_bytes=80 * gib)])


def steps_block(base: int, k: int, ranks: int, metrics: tuple[str, ...]) -> dict[str, Any]:
    """Closed steps ``base..base+k`` in StepStore's wire form; ``loss`` spikes to 50 at
    step 777 (a one-step spike the report's exact lo/hi must keep)."""
    steps = np.arange(base, base + k, dtype=np.int64)
    rows = steps.astype(np.uint32)
    out: dict[str, Any] = {
        "base": base, "rows": k, "step": steps.tobytes(),
        "time": (1.7e9 + steps * 0.1).astype(np.float64).tobytes(),
        "n": np.full(k, ranks, np.int32).tobytes(),
        "slowest": (steps % ranks).astype(np.int32).tobytes(),
        "samples": np.full(k, 2048, np.int64).tobytes(),
        "tokens": np.full(k, 2048 * 1024, np.int64).tobytes(),
    }
    ms = 100.0 + (steps % 13).astype(np.float64)
    out["step_ms"] = [rows.tobytes(), ms.tobytes(), (ms - 5).tobytes(), (ms + 5).tobytes()]
    out["metrics"] = {}
    for i, name in enumerate(metrics):
        mean = 2.0 / np.sqrt(steps + 1.0) + i
        if i == 0 and base <= 777 < base + k:
            mean[777 - base] = 50.0
        out["metrics"][name] = [rows.tobytes(), mean.tobytes(), (mean - 0.1).tobytes(),
                                (mean + 0.1).tobytes()]
    return out


def build_run(data_dir: Optional[Path], run: str = "report-run", *, ranks: int = 8,
              epochs: int = 5, steps: int = 5000, metrics: int = 4, hostile: bool = True,
              finish: bool = True, failed_rank: Optional[int] = None,
              t0: Optional[float] = None,
              errors: Optional[dict[int, protocol.ErrorInfo]] = None) -> RunSink:
    """The run, rebuilt by the real sink (``failed_rank`` finishes with an error: an alert); journaled under ``data_dir`` when given (the
    journal is closed, so a broker or ``rankboard export`` may read it next)."""
    journal = None
    if data_dir is not None:
        journal = Journal(str(data_dir))
        journal.load()
    sink = RunSink(run)
    t = time.time() - 3600.0 - 60.0 * epochs if t0 is None else t0

    def feed(frame: Any) -> None:
        sink.apply(frame, t)
        if journal is not None:
            journal.accept(sink, protocol.encoder.encode(frame), frame, t)
            journal.note_seq(sink)

    names = ("loss", HOSTILE_METRIC if hostile else "lr", "grad_norm", "acc")[:metrics]
    if metrics > 4:
        names = names + tuple(f"m{i}" for i in range(4, metrics))
    for rank in range(ranks):
        feed(protocol.Register(run=run, rank=rank, world_size=ranks, host=host_of(rank),
                               local_rank=rank % PER_HOST, total_epochs=epochs))
    feed(protocol.Hardware(run=run, rank=0, summary=("8x H100 " + HOSTILE) if hostile
                           else "8x NVIDIA H100 80GB HBM3, 2x EPYC 9654"))
    meta = {"lr": 3e-4, "model": HOSTILE if hostile else "llama", HOSTILE if hostile else
            "batch": 1024}
    feed(protocol.Metadata(run=run, rank=0, json=json.dumps(meta)))
    feed(protocol.Svg(run=run, rank=0, svg=SVG, label="model", hash="abc123"))
    for rank in range(ranks):
        feed(protocol.Resources(run=run, rank=rank, sample=_sample(rank)))
    scalar = HOSTILE_METRIC if hostile else "acc"
    for e in range(epochs):
        t += 60.0
        for rank in range(ranks):
            feed(protocol.Metrics(run=run, rank=rank, epoch=e, avg_loss=2.0 / (e + 1),
                                  batches=400, samples=102400,
                                  epoch_ms=42000.0 * (1.3 if rank == 3 else 1.0),
                                  scalars={scalar: (0.2 + 0.05 * e, 1)},
                                  resources=_sample(rank)))
    chunk = 65536
    for base in range(0, steps, chunk):
        sink.restore_steps(steps_block(base, min(chunk, steps - base), ranks, names))
        if journal is not None:
            sink.seq += 1  # as a steps event would
            journal.note_seq(sink)
            journal.flush()
    if finish:
        t += 1.0
        for rank in range(ranks):
            error = (errors or {}).get(rank)  # 8.2: the rank's exception
            feed(protocol.Finish(run=run, rank=rank, error=error,
                                 status="error" if rank == failed_rank or error else "ok"))
    if journal is not None:
        journal.close()
    return sink


def stacks(ranks: list[int]) -> dict[str, Any]:
    """A run's stack dumps in ``GET .../stacks``'s shape: one stall group of ``ranks`` stuck
    in a collective, with a hostile function name and source line."""
    frames = [{"file": "train.py", "line": 88, "function": "main", "code": "train()"},
              {"file": "train.py", "line": 41, "function": HOSTILE, "code": HOSTILE},
              {"file": "torch/distributed.py", "line": 2050, "function": "all_reduce",
               "code": "work.wait()"}]
    return {"dumps": [], "groups": [{"reason": "stall", "request_id": None, "frames": frames,
                                     "ranks": ranks}]}
