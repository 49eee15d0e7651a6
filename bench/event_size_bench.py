"""largest_sse_event_mib (issue 32, finding 5): the largest single SSE event a web sends for
a run of 65,536 ranks, every one stalled (a stall dump with a long path: a ``stalled`` alert
each) and sending a distinct 4 KB hardware summary (``--gpus 1``: and a one-GPU resource
sample each, ``--gpus 8``: eight GPUs a sample, every field an NVML sampler fills: ~4 KB
a sample, ~270 MiB of samples an event at 65,536 ranks before ``web/ranksbound.py``).

The real broker sink (``RunSink``) takes the frames; its ``run`` and ``ranks`` events go
through the real feed codec into a real ``Hub`` with one SSE subscriber, for ``--ticks``
seconds of the sink's clock; the figure is the largest SSE chunk queued for it (target
≤ 16 MiB; in the issue 65-80 MiB ``run`` events and ~256 MiB ``ranks`` events, past the
64 MiB a client may queue).

    python bench/event_size_bench.py [--ranks 65536] [--ticks 4] [--gpus 8]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import result  # noqa: E402

from broker import feed  # noqa: E402
from broker.run.sink import RunSink  # noqa: E402
from rank_agent.protocol import (  # noqa: E402
    GpuSample,
    Hardware,
    Register,
    Resources,
    ResourceSample,
    StackFrame,
    Stacks,
    ThreadStack,
)
from web import sse  # noqa: E402
from web.hub import Hub  # noqa: E402

RUN = "wide"


def sample(rank: int, gpus: int) -> ResourceSample:
    """A realistic sample: every field an NVML sampler fills, figures that differ by rank."""
    return ResourceSample(
        cpu_percent=12.5 + rank % 7, ram_used_bytes=412_345_678_912 + rank,
        ram_total_bytes=2_164_211_490_816, gpu_util_percent=0.0,
        vram_allocated_bytes=71_234_567_890 + rank, vram_total_bytes=85_520_809_984,
        gpus=[GpuSample(device_index=i, name="NVIDIA H100 80GB HBM3", util_percent=0.0,
                        vram_allocated_bytes=71_234_567_890 + rank * 8 + i,
                        vram_total_bytes=85_520_809_984, temperature_c=41.0 + (rank + i) % 9,
                        power_w=118.25 + (rank + i) % 13, sm_clock_mhz=1980.0,
                        throttle_reasons=["sw_power_cap"] if i == 3 else [], ecc_uncorrected=0,
                        remapped_rows_pending=False, remapped_rows_failed=False,
                        pcie_link_gen=5, pcie_link_gen_max=5, pcie_link_width=16,
                        pcie_link_width_max=16, nvlink_errors=0)
              for i in range(gpus)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=65536)
    parser.add_argument("--ticks", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=0)
    args = parser.parse_args()
    for line in measure(args.ranks, args.ticks, args.gpus):
        print(json.dumps(line))


def run(quick: bool) -> list[dict[str, Any]]:
    """For ``run_all.py``'s full run: 65,536 stalled ranks (about a minute)."""
    return measure(65536, 4, 0)


def measure(n: int, ticks: int, gpus: int) -> list[dict[str, Any]]:
    """The largest SSE event of each kind a client of an ``n``-rank hang is sent."""
    t0 = time.perf_counter()
    sink = RunSink(RUN)
    sink.live = True
    hub = Hub()
    hub.next_request()
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 0))
    largest = {"run": 0, "ranks": 0}

    def publish(events: list[Any]) -> None:
        for e in events:
            hub.handle_pub(feed.encode_event(RUN, e))

    path = "/very/long/path/" + "p" * 200 + "/train.py"
    for r in range(n):
        publish(sink.apply(Register(run=RUN, rank=r, world_size=n, host=f"node-{r // 8:05d}"
                                    + "h" * 40, local_rank=r % 8), 1.0))
        publish(sink.apply(Hardware(run=RUN, rank=r, summary=f"{r:06d} " + "c" * 4089), 1.0))
        if gpus:
            publish(sink.apply(Resources(run=RUN, rank=r, sample=sample(r, gpus)), 1.0))
        if r == 0:
            sub, _, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
        publish(sink.apply(Stacks(run=RUN, rank=r, reason="stall", taken_at=2.0, idle_s=70.0,
                                  threads=[ThreadStack(name="MainThread", main=True, frames=[
                                      StackFrame(file=path, line=i, function=f"f{i}" + "g" * 60,
                                                 code="x = y") for i in range(8)])]), 2.0))
    for tick in range(ticks):
        publish(sink.tick(3.0 + tick))
    while True:
        try:
            item = sub.queue.get_nowait()
        except Exception:
            break
        if item is None:
            print("the subscriber was dropped", file=sys.stderr)
            break
        _, data = item
        kind = data.split(b"\nevent: ", 1)[1].split(b"\n", 1)[0].decode()
        largest[kind] = max(largest.get(kind, 0), len(data))
    # the web's cost of one ranks event now (samples unchanged: every one encoded and
    # compared), against encoding the whole array as before, in the same run
    state = hub.runs[RUN]
    t1 = time.perf_counter()
    sse.json_event("ranks", 0, state.ranks)
    t2 = time.perf_counter()
    state.ranks_event(0)
    t3 = time.perf_counter()
    return [result("largest_sse_event_mib", round(max(largest.values()) / 2**20, 2),
                   "MiB", ranks=n, gpus=gpus,
                   ranks_event_ms=round((t3 - t2) * 1000),
                   whole_encode_ms=round((t2 - t1) * 1000),
                   by_kind_mib={k: round(v / 2**20, 2) for k, v in largest.items()},
                   dropped=hub.clients_dropped,
                   seconds=round(time.perf_counter() - t0, 1))]


if __name__ == "__main__":
    main()
