"""Pure epoch aggregation: the record of PROTOCOL.md section 2.3.

Everything here is a function of its arguments: no clock, no I/O, no state. The sink
(:mod:`broker.sink`) decides *when* an epoch closes and hands over what it has; this module
decides *what* the record says. Keeping the rules here, apart from the first-arrival and
last-write rules of the sink, means each of them is one small unit test.

Cost matters: a close at 4096 ranks must stay within a few milliseconds, so every function
is a single pass over its input with no per-rank lookups that scan other ranks. The
topology arrives already ordered (hosts in order, ranks in local-rank order) and the
placement of a rank is a dict lookup.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Sequence, Tuple

from rank_agent.protocol import GpuSample, Metrics, ResourceSample

#: How many of the most recent epoch durations the ETA averages.
ETA_WINDOW = 5

#: Keys of a ResourceSample dict, in the order of the wire schema (``gpus`` last).
SAMPLE_KEYS = (
    "cpu_percent",
    "ram_used_bytes",
    "ram_total_bytes",
    "gpu_util_percent",
    "vram_allocated_bytes",
    "vram_total_bytes",
)
#: Keys of a GpuSample dict, in the order of the wire schema.
GPU_KEYS = (
    "device_index",
    "name",
    "util_percent",
    "vram_allocated_bytes",
    "vram_total_bytes",
    "temperature_c",
    "power_w",
)

#: A rank's placement: (host, local rank).
Placement = Tuple[str, int]


def gpu_dict(gpu: GpuSample) -> Dict[str, Any]:
    """Every GpuSample field, absent ones as None (the Struct omits defaults on the wire)."""
    return {
        "device_index": gpu.device_index,
        "name": gpu.name,
        "util_percent": gpu.util_percent,
        "vram_allocated_bytes": gpu.vram_allocated_bytes,
        "vram_total_bytes": gpu.vram_total_bytes,
        "temperature_c": gpu.temperature_c,
        "power_w": gpu.power_w,
    }


def sample_dict(sample: ResourceSample) -> Dict[str, Any]:
    """A rank's sample as a JSON-ready dict with every key present (the ``ranks`` array)."""
    return {
        "cpu_percent": sample.cpu_percent,
        "ram_used_bytes": sample.ram_used_bytes,
        "ram_total_bytes": sample.ram_total_bytes,
        "gpu_util_percent": sample.gpu_util_percent,
        "vram_allocated_bytes": sample.vram_allocated_bytes,
        "vram_total_bytes": sample.vram_total_bytes,
        "gpus": [gpu_dict(g) for g in sample.gpus],
    }


def gpu_label(rank: int, placement: Placement | None) -> str:
    """The prefix of a rank's GPU name: ``"<host>:lr=<L> gr=<G> "``, or ``"gr=<G> "`` unplaced."""
    if placement is None:
        return f"gr={rank} "
    return f"{placement[0]}:lr={placement[1]} gr={rank} "


def rank_gpu(rank: int, placement: Placement | None, gpu: GpuSample) -> Dict[str, Any]:
    """A rank's first GPU relabelled for the cluster view.

    ``device_index`` becomes the global rank: a rank-local sampler reports index 0 on
    every rank when ``CUDA_VISIBLE_DEVICES`` is scoped, which would collapse all ranks
    into one chart series.
    """
    return {
        "device_index": rank,
        "name": gpu_label(rank, placement) + gpu.name,
        "util_percent": gpu.util_percent,
        "vram_allocated_bytes": gpu.vram_allocated_bytes,
        "vram_total_bytes": gpu.vram_total_bytes,
        "temperature_c": gpu.temperature_c,
        "power_w": gpu.power_w,
    }


def weighted_loss(reports: Sequence[Metrics]) -> float:
    """Batch-weighted mean of ``avg_loss``: 0 when no batches, NaN propagates.

    With zero batches every product ``loss * 0`` is 0 unless a loss is non-finite, so
    the sum is then NaN: a diverged rank stays visible even when it reported no batches.
    """
    num = 0.0
    den = 0
    for m in reports:
        num += m.avg_loss * m.batches
        den += m.batches
    if den:
        return num / den
    return math.nan if math.isnan(num) else 0.0


def mean_scalars(reports: Sequence[Metrics]) -> Dict[str, float]:
    """Each scalar: per-rank sum/count, then a batch-weighted mean over the reporting ranks.

    A count of 0 means the rank did not report the scalar. When the reporting ranks'
    batches sum to 0 the mean is unweighted. Returned sorted by name.
    """
    per_name: Dict[str, List[Tuple[float, int]]] = {}  # name -> [(value, batches)] rank order
    for m in reports:
        b = m.batches
        for name, (total, count) in m.scalars.items():
            if count:
                values = per_name.get(name)
                if values is None:
                    values = per_name[name] = []
                values.append((total / count, b))
    out: Dict[str, float] = {}
    for name in sorted(per_name):
        values = per_name[name]
        wsum = 0.0
        usum = 0.0
        bsum = 0
        for v, b in values:
            wsum += v * b
            usum += v
            bsum += b
        out[name] = wsum / bsum if bsum else usum / len(values)
    return out


def gpu_metrics(ranks: Sequence[int], reports: Sequence[Metrics]) -> List[Dict[str, Any]]:
    """Per reporting rank (rank order): throughput in samples/ms, batch share, shard size 0.

    Throughput uses ``share_complete_ms`` when the rank sent it (the time its share of the
    data took), else ``epoch_ms``; 0 when that time is 0. Batch shares are equal when no
    rank counted batches.
    """
    bsum = 0
    for m in reports:
        bsum += m.batches
    equal = 1.0 / len(reports) if reports else 0.0
    return [
        {
            "device_index": rank,
            "throughput": m.samples / d if (
                d := m.epoch_ms if m.share_complete_ms is None else m.share_complete_ms
            ) else 0.0,
            "chunk_ratio": m.batches / bsum if bsum else equal,
            "shard_size": 0,
        }
        for rank, m in zip(ranks, reports)
    ]


def max_epoch_ms(reports: Sequence[Metrics]) -> float:
    """The slowest rank's epoch time; a NaN from one rank does not hide the others."""
    best = -math.inf
    for m in reports:
        if m.epoch_ms > best:
            best = m.epoch_ms
    if best == -math.inf:  # nothing comparable: every time NaN (or no reports at all)
        return math.nan if reports else 0.0
    return best


def gpu_entries(
    samples: Mapping[int, ResourceSample], placement: Mapping[int, Placement]
) -> Dict[int, Dict[str, Any]]:
    """rank -> its relabelled first GPU, for every rank whose sample has a GPU.

    The sink keeps this map up to date as samples and registers arrive (so a close does
    not format thousands of names); this builds it from scratch, for tests and callers
    without such a cache.
    """
    return {
        rank: rank_gpu(rank, placement.get(rank), s.gpus[0])
        for rank, s in samples.items()
        if s.gpus
    }


def cluster_resources(
    samples: Mapping[int, ResourceSample],
    hosts: Sequence[Sequence[int]],
    gpus: Mapping[int, Dict[str, Any]],
) -> Dict[str, Any]:
    """The cluster-wide sample from every rank's latest sample.

    ``hosts`` lists, in topology order, each host's ranks in local-rank order; ranks with
    no host are in no list, so they are left out of CPU and RAM (which are per host: ranks
    on one host read the same /proc, so adding them up would double-count). GPU figures
    are per rank. A sum of 0 and a mean over nothing are None. ``gpus`` is the map of
    :func:`gpu_entries`; the record gets copies, in rank order.
    """
    cpu_sum = 0.0
    cpu_n = 0
    ram_used = 0
    ram_total = 0
    get = samples.get
    for members in hosts:
        cpu: float | None = None
        ram = False
        for rank in members:
            s = get(rank)
            if s is None:
                continue
            if cpu is None and s.cpu_percent is not None:
                cpu = s.cpu_percent
            if not ram and s.ram_used_bytes is not None and s.ram_total_bytes is not None:
                ram_used += s.ram_used_bytes
                ram_total += s.ram_total_bytes
                ram = True
            if ram and cpu is not None:
                break
        if cpu is not None:
            cpu_sum += cpu
            cpu_n += 1

    util_sum = 0.0
    util_n = 0
    vram_alloc = 0
    vram_total = 0
    for s in samples.values():  # integer sums: order does not matter; util: see below
        a = s.vram_allocated_bytes
        if a is not None:
            vram_alloc += a
        a = s.vram_total_bytes
        if a is not None:
            vram_total += a
    for rank in sorted(samples):  # float sum in rank order, so the result is reproducible
        u = samples[rank].gpu_util_percent
        if u is not None:
            util_sum += u
            util_n += 1
    return {
        "cpu_percent": cpu_sum / cpu_n if cpu_n else None,
        "ram_used_bytes": ram_used or None,
        "ram_total_bytes": ram_total or None,
        "gpu_util_percent": util_sum / util_n if util_n else None,
        "vram_allocated_bytes": vram_alloc or None,
        "vram_total_bytes": vram_total or None,
        "gpus": [gpus[rank].copy() for rank in sorted(gpus)],
    }


def eta_secs(durations: Sequence[float], total_epochs: int | None, epoch: int) -> float | None:
    """Mean of the last few durations times the epochs left; None when unknown or done."""
    if not total_epochs or not durations:
        return None
    remaining = total_epochs - epoch - 1
    if remaining <= 0:
        return None
    recent = durations[-ETA_WINDOW:]
    return sum(recent) / len(recent) * remaining


def epoch_record(
    *,
    epoch: int,
    world_size: int,
    reports: Mapping[int, Metrics],
    samples: Mapping[int, ResourceSample],
    hosts: Sequence[Sequence[int]],
    gpus: Mapping[int, Dict[str, Any]],
    total_epochs: int | None,
    past_durations: Sequence[float],
    elapsed_secs: float,
) -> Dict[str, Any]:
    """The record of one closed epoch (PROTOCOL.md 2.3 and the shape of section 4).

    ``reports`` maps rank -> that rank's last ``metrics`` frame for ``epoch``;
    ``past_durations`` are the ``duration_secs`` of the records already closed; ``gpus``
    is the map of :func:`gpu_entries` over ``samples``.
    """
    ranks: List[int] = []
    frames: List[Metrics] = []
    missing: List[int] = []
    get = reports.get
    for rank in range(world_size):
        m = get(rank)
        if m is None:
            missing.append(rank)
        else:
            ranks.append(rank)
            frames.append(m)
    metrics: Dict[str, float] = {"loss": weighted_loss(frames)}
    for name, value in mean_scalars(frames).items():
        if name != "loss":  # the aggregated loss owns the key; a scalar cannot shadow it
            metrics[name] = value
    duration = max_epoch_ms(frames) / 1000.0
    durations = list(past_durations[-(ETA_WINDOW - 1):]) if ETA_WINDOW > 1 else []
    durations.append(duration)
    return {
        "epoch": epoch,
        "total_epochs": total_epochs or None,
        "duration_secs": duration,
        "elapsed_secs": elapsed_secs,
        "eta_secs": eta_secs(durations, total_epochs, epoch),
        "metrics": metrics,
        "resources": cluster_resources(samples, hosts, gpus),
        "gpu_metrics": gpu_metrics(ranks, frames),
        "missing_ranks": missing,
    }
