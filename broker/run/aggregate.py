"""Pure epoch aggregation: the record of PROTOCOL.md section 2.3.

No clock, no I/O: the sink (:mod:`broker.run.sink`) decides *when* an epoch closes and hands
over what it has; this module decides *what* the record says. Keeping the rules here, apart
from the first-arrival and last-write rules of the sink, makes each one a small unit test.
The only state is :class:`EpochReports`, a pending epoch's reports, which the sink fills as
frames arrive.

Cost matters: a close at 4096 ranks must stay within a few milliseconds. The per-report
work is done as each report arrives (:meth:`EpochReports.put`), the topology arrives
already ordered, relabelled GPU entries arrive prebuilt, and what is left for the close is
a few passes over the ranks. Float sums are exact (``math.fsum``), so a record does not
depend on the order in which ranks reported. Records share dicts with the sink's caches:
event data is read-only.
"""
from __future__ import annotations

import math
from functools import partial
from itertools import starmap
from operator import attrgetter, is_not, itemgetter, mul
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import msgspec

from rank_agent.protocol import GpuSample, Metrics, ResourceSample

_asdict = msgspec.structs.asdict
_first = itemgetter(0)
_second = itemgetter(1)
_not_none = partial(is_not, None)
_gpu_util = attrgetter("gpu_util_percent")
_vram_alloc = attrgetter("vram_allocated_bytes")
_vram_total = attrgetter("vram_total_bytes")

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

#: The v2 fields of a GpuSample, read in one C call (an epoch record's GPU entry keeps only
#: these; the v3 health fields ride in the ``ranks`` array, PROTOCOL 3).
_gpu_v2 = attrgetter(*GPU_KEYS)

#: A rank's placement: (host, local rank).
Placement = Tuple[str, int]


def gpu_dict(gpu: GpuSample) -> Dict[str, Any]:
    """Every GpuSample field (v3 health fields included), absent ones as None (the Struct
    omits defaults on the wire): a rank's GPUs as the ``ranks`` array carries them."""
    return _asdict(gpu)


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


def rank_gpu(rank: int, placement: Placement | None, gpu: GpuSample,
             label: str | None = None) -> Dict[str, Any]:
    """A rank's first GPU relabelled for the cluster view.

    ``device_index`` becomes the global rank: a rank-local sampler reports index 0 on
    every rank when ``CUDA_VISIBLE_DEVICES`` is scoped, which would collapse all ranks
    into one chart series. ``label`` is :func:`gpu_label` of the rank if the caller has
    it cached.
    """
    entry = dict(zip(GPU_KEYS, _gpu_v2(gpu)))  # the v2 fields only, in schema order
    entry["device_index"] = rank
    entry["name"] = (gpu_label(rank, placement) if label is None else label) + gpu.name
    return entry


def exact_sum(values: Sequence[float]) -> float:
    """Correctly rounded sum (``math.fsum``), so a record does not depend on the order in
    which ranks reported. Non-finite inputs keep IEEE meaning: inf - inf is NaN."""
    try:
        return math.fsum(values)
    except ValueError:  # inf + -inf
        return math.nan
    except OverflowError:  # finite values whose exact sum overflows: plain IEEE sum
        total = 0.0
        for v in values:
            total += v
        return total


#: Per scalar name, rank -> (that rank's value sum/count, its batches).
ScalarValues = Dict[str, Dict[int, Tuple[float, int]]]


class EpochReports:
    """The reports of one pending epoch, with each report's per-rank figures worked out as
    it arrives.

    A close must stay O(world size) with a small constant at thousands of ranks, so the
    per-report work (loss times batches, scalar means, throughput, the ``gpu_metrics``
    entry) is done in :meth:`put`, one frame at a time, and the close is left with a few
    C-level passes (exact sums, a sort of rank ids). Everything is keyed by rank, so a
    repeated report of a rank replaces its earlier one exactly (last write wins), and sums
    are correctly rounded (:func:`exact_sum`), so the order ranks reported in does not
    change a record.
    """

    __slots__ = ("frames", "scalars", "_lossb", "_batches", "_epoch_ms", "_gpu")

    def __init__(self) -> None:
        #: rank -> its last ``metrics`` frame for the epoch.
        self.frames: Dict[int, Metrics] = {}
        #: scalar name -> rank -> (sum/count, batches), for counts above 0.
        self.scalars: ScalarValues = {}
        self._lossb: Dict[int, float] = {}
        self._batches: Dict[int, int] = {}
        self._epoch_ms: Dict[int, float] = {}
        self._gpu: Dict[int, Dict[str, Any]] = {}

    def put(self, rank: int, frame: Metrics) -> bool:
        """Store ``rank``'s report; True if it is the rank's first for this epoch."""
        frames = self.frames
        old = frames.get(rank)
        if old is not None:
            self._forget_scalars(rank, old)
        frames[rank] = frame
        b = frame.batches
        ms = frame.epoch_ms
        self._lossb[rank] = frame.avg_loss * b
        self._batches[rank] = b
        self._epoch_ms[rank] = ms
        # Throughput uses share_complete_ms when sent (the time the rank's share of the
        # data took), else epoch_ms; 0 when that time is 0. chunk_ratio is set at close.
        share = frame.share_complete_ms
        d = ms if share is None else share
        self._gpu[rank] = {
            "device_index": rank,
            "throughput": frame.samples / d if d else 0.0,
            "chunk_ratio": 0.0,
            "shard_size": 0,
        }
        if frame.scalars:
            scalars = self.scalars
            for name, (total, count) in frame.scalars.items():
                if count:  # a count of 0: the rank did not report this scalar
                    try:
                        scalars[name][rank] = (total / count, b)
                    except KeyError:
                        scalars[name] = {rank: (total / count, b)}
        return old is None

    def pop(self, rank: int) -> Metrics | None:
        """Forget ``rank``'s report (a rank that turned out to be out of range)."""
        old = self.frames.pop(rank, None)
        if old is not None:
            self._forget_scalars(rank, old)
            del self._lossb[rank], self._batches[rank], self._epoch_ms[rank], self._gpu[rank]
        return old

    def _forget_scalars(self, rank: int, old: Metrics) -> None:
        for name in old.scalars:
            values = self.scalars.get(name)
            if values is not None and values.pop(rank, None) is not None and not values:
                del self.scalars[name]

    def __len__(self) -> int:
        return len(self.frames)

    def __contains__(self, rank: object) -> bool:
        return rank in self.frames

    def loss(self) -> float:
        """Batch-weighted mean of ``avg_loss``: 0 when no batches, NaN propagates.

        With zero batches every product ``loss * 0`` is 0 unless a loss is non-finite, so
        the sum is then NaN: a diverged rank stays visible even when it counted no batches.
        """
        num = exact_sum(list(self._lossb.values()))
        den = sum(self._batches.values())
        if den:
            return num / den
        return math.nan if math.isnan(num) else 0.0

    def scalar_means(self) -> Dict[str, float]:
        """Each scalar's mean over the ranks that reported it, weighted by their batches
        (unweighted when those batches sum to 0); sorted by name."""
        out: Dict[str, float] = {}
        for name in sorted(self.scalars):
            pairs = self.scalars[name].values()
            # (C-level passes: starmap/map over the pairs instead of comprehensions.)
            bsum = sum(map(_second, pairs))
            if bsum:
                out[name] = exact_sum(list(starmap(mul, pairs))) / bsum
            else:
                out[name] = exact_sum(list(map(_first, pairs))) / len(pairs)
        return out

    def epoch_ms(self) -> float:
        """The slowest rank's epoch time; a NaN from one rank does not hide the others."""
        times = list(self._epoch_ms.values())
        if any(map(math.isnan, times)):
            times = [t for t in times if t == t]
        if times:
            return max(times)
        return math.nan if self._epoch_ms else 0.0

    def gpu_metrics(self, ranks: Sequence[int]) -> List[Dict[str, Any]]:
        """The ``gpu_metrics`` entries of ``ranks`` (rank order), with each rank's batch
        share filled in (equal shares when no rank counted batches). Hands over the
        entries: call once, at close."""
        gpu = self._gpu
        batches = self._batches
        bsum = sum(batches.values())
        out = list(map(gpu.__getitem__, ranks))
        if bsum:
            for entry, rank in zip(out, ranks):
                entry["chunk_ratio"] = batches[rank] / bsum
        elif out:
            equal = 1.0 / len(out)
            for entry in out:
                entry["chunk_ratio"] = equal
        return out


def gpu_metrics(ranks: Sequence[int], reports: Sequence[Metrics]) -> List[Dict[str, Any]]:
    """The ``gpu_metrics`` entries of ``reports`` sent by ``ranks`` (same order)."""
    gathered = EpochReports()
    for rank, m in zip(ranks, reports):
        gathered.put(rank, m)
    return gathered.gpu_metrics(list(ranks))


def cluster_resources(
    samples: Mapping[int, ResourceSample],
    hosts: Sequence[Sequence[int]],
    gpus: Mapping[int, Dict[str, Any]],
) -> Dict[str, Any]:
    """The cluster-wide sample from every rank's latest sample.

    ``hosts`` lists, in topology order, each host's ranks in local-rank order; ranks with
    no host are in no list, so they are left out of CPU and RAM (which are per host: ranks
    on one host read the same /proc, so adding them up would double-count). GPU figures
    are per rank. A sum of 0 and a mean over nothing are None. ``gpus`` is rank -> its
    :func:`rank_gpu` (the sink's cache of them); the record shares its dicts (event data is read-only), in rank
    order.
    """
    cpus: List[float] = []
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
            cpus.append(cpu)

    every = samples.values()
    # C-level passes (map/filter) over thousands of samples; None is skipped, and so is 0
    # in the sums, where it adds nothing.
    utils = list(filter(_not_none, map(_gpu_util, every)))
    vram_alloc = sum(filter(None, map(_vram_alloc, every)))
    vram_total = sum(filter(None, map(_vram_total, every)))
    return {
        "cpu_percent": exact_sum(cpus) / len(cpus) if cpus else None,
        "ram_used_bytes": ram_used or None,
        "ram_total_bytes": ram_total or None,
        "gpu_util_percent": exact_sum(utils) / len(utils) if utils else None,
        "vram_allocated_bytes": vram_alloc or None,
        "vram_total_bytes": vram_total or None,
        "gpus": list(map(gpus.__getitem__, sorted(gpus))),
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
    reports: Mapping[int, Metrics] | EpochReports,
    samples: Mapping[int, ResourceSample],
    hosts: Sequence[Sequence[int]],
    gpus: Mapping[int, Dict[str, Any]],
    total_epochs: int | None,
    past_durations: Sequence[float],
    elapsed_secs: float,
) -> Dict[str, Any]:
    """The record of one closed epoch (PROTOCOL.md 2.3 and the shape of section 4).

    ``reports`` maps rank -> that rank's last ``metrics`` frame for ``epoch`` (or is the
    :class:`EpochReports` the sink gathered them in);
    ``past_durations`` are the ``duration_secs`` of the records already closed; ``gpus``
    is rank -> :func:`rank_gpu` of each rank of ``samples`` with a GPU (the sink's cache).
    """
    if isinstance(reports, EpochReports):
        gathered = reports
    else:
        gathered = EpochReports()
        for rank in sorted(reports):
            if rank < world_size:
                gathered.put(rank, reports[rank])
    ranks = sorted(gathered.frames)
    if len(ranks) == world_size:
        missing: List[int] = []
    else:
        frames = gathered.frames
        missing = [rank for rank in range(world_size) if rank not in frames]
    metrics: Dict[str, float] = {"loss": gathered.loss()}
    for name, value in gathered.scalar_means().items():
        if name != "loss":  # the aggregated loss owns the key; a scalar cannot shadow it
            metrics[name] = value
    duration = gathered.epoch_ms() / 1000.0
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
        "gpu_metrics": gathered.gpu_metrics(ranks),
        "missing_ranks": missing,
    }
