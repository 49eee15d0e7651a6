"""epoch_close_4096_ms and epoch_close_scaling: the pure cost of closing one epoch.

A :class:`broker.run.sink.RunSink` is fed what a real run sends: every rank registers (8 ranks per
host, so 4,096 ranks sit on 512 hosts), sends a hardware summary and a resource sample with
one GPU; then, per epoch, every rank but the last sends its metrics (4 scalars each). What is
timed is the ``apply`` of the last rank's metrics frame: the close itself (aggregation and
record building), plus the bookkeeping of that frame. The first epoch is left out (it also
turns the run from ``waiting`` to ``training`` and so builds a header); the figure is the
median over the remaining epochs, with the garbage collector left on as in the broker.

Scaling: the same measurement at 8 ranks (one host), cost per rank at 4,096 divided by cost
per rank at 8. A close is O(world size), so this stays near or below 1 unless something in
it grows faster than linearly.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from common import result

from broker.run.sink import RunSink
from rank_agent.protocol import GpuSample, Hardware, Metrics, Register, Resources, ResourceSample

RANKS_PER_HOST = 8


def _frames(world: int, epoch: int) -> list[Metrics]:
    return [
        Metrics(run="bench", rank=r, epoch=epoch, avg_loss=1.0 / (epoch + 1) + r * 1e-6,
                batches=100 + r % 7, samples=6400, epoch_ms=1000.0 + r % 13,
                share_complete_ms=900.0 + r % 11,
                scalars={"acc": (0.9 * 100, 100), "grad_norm": (1.5, 1), "lr": (1e-3, 1),
                         "tokens_per_s": (12345.0, 1)})
        for r in range(world)
    ]


def build_sink(world: int) -> RunSink:
    sink = RunSink("bench")
    now = 1_000_000.0
    for r in range(world):
        host = f"node-{r // RANKS_PER_HOST:04d}"
        sink.apply(Register(run="bench", rank=r, world_size=world, host=host,
                            local_rank=r % RANKS_PER_HOST, total_epochs=1000), now)
    for r in range(world):
        sink.apply(Hardware(run="bench", rank=r,
                            summary="Intel Xeon (96 threads, 1024 GB) | NVIDIA H100 80GB HBM3 (80 GB)"), now)
        gpu = GpuSample(device_index=r % RANKS_PER_HOST, name="NVIDIA H100 80GB HBM3",
                        util_percent=97.0, vram_allocated_bytes=60 << 30, vram_total_bytes=80 << 30,
                        temperature_c=61.0, power_w=650.5)
        sample = ResourceSample(cpu_percent=42.5, ram_used_bytes=500 << 30, ram_total_bytes=1 << 40,
                                gpu_util_percent=97.0, vram_allocated_bytes=60 << 30,
                                vram_total_bytes=80 << 30, gpus=[gpu])
        sink.apply(Resources(run="bench", rank=r, sample=sample), now)
    return sink


def close_times(world: int, epochs: int) -> list[float]:
    """Seconds of the closing apply, per epoch (the first epoch excluded)."""
    sink = build_sink(world)
    now = 1_000_001.0
    out: list[float] = []
    for e in range(epochs + 1):
        frames = _frames(world, e)
        last = frames.pop()
        for f in frames:
            sink.apply(f, now)
        t0 = time.perf_counter()
        events = sink.apply(last, now)
        dt = time.perf_counter() - t0
        assert any(ev.kind == "epoch" for ev in events), "the last rank's metrics must close the epoch"
        if e:
            out.append(dt)
        now += 1.0
    return out


def run(quick: bool) -> list[dict[str, Any]]:
    big = close_times(4096, 10 if quick else 30)
    small = close_times(8, 200 if quick else 2000)
    big_ms = statistics.median(big) * 1000.0
    per_rank_big = statistics.median(big) / 4096
    per_rank_small = statistics.median(small) / 8
    return [
        result("epoch_close_4096_ms", round(big_ms, 3), "ms",
               min_ms=round(min(big) * 1000, 3), max_ms=round(max(big) * 1000, 3), epochs=len(big)),
        result("epoch_close_scaling", round(per_rank_big / per_rank_small, 3), "x",
               baseline=round(per_rank_small * 1e6, 3), ratio=round(per_rank_big / per_rank_small, 3),
               per_rank_4096_us=round(per_rank_big * 1e6, 3),
               per_rank_8_us=round(per_rank_small * 1e6, 3)),
    ]


if __name__ == "__main__":
    import json

    for line in run(True):
        print(json.dumps(line))
