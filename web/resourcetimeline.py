"""A run's cluster resources over time (issue 34, item 5): CPU, RAM, GPU utilisation and
VRAM of the whole run as a time series of the ranks' samples, not one point per epoch (a
step-only run had none, an epoch of an hour one point for the hour).

Why in the web: every ``ranks`` update of the broker's feed carries each rank's latest
sample, so the web sees the cluster's samples as they change without a new feed message or
a second copy of the samples in the broker. The point is figured as the broker figures an
epoch record's ``resources`` (:func:`broker.run.aggregate.cluster_resources`): CPU and RAM per
host (the ranks of a host read the same ``/proc``), GPU utilisation and VRAM per rank; RAM
and VRAM as a share of their totals.

Bounded in time whatever the run's size: above :data:`MAX_RANKS_A_POINT` ranks a point is
figured from that many ranks spread over the array (one at random from each run of k), an
estimate of the means and of the used/total shares (~6-9 ms a point instead of ~77 ms at
65,536 ranks, in the web's event loop, once a second).

Bounded in bytes whatever the run's length: a point at most every ``every`` seconds, and when
:data:`MAX_POINTS` are held, neighbours merge pairwise (their mean) and ``every`` doubles, so
the series keeps an even resolution over the whole run (1 s for the first ~17 minutes, then
2 s, ...). A web that starts while a run trains has the run's resources from then on.
"""
from __future__ import annotations

import math
import random
from array import array
from typing import Any, Iterable, Optional

__all__ = ["MAX_POINTS", "FIRST_EVERY_S", "MAX_RANKS_A_POINT", "ResourceTimeline", "cluster_point"]

#: The most points a run keeps (40 bytes each: 40 KiB a run; ~50 KiB as JSON).
MAX_POINTS = 1024
#: Seconds between points until the first merge (the broker's ranks interval).
FIRST_EVERY_S = 1.0
#: The most ranks a point is figured from (module docstring).
MAX_RANKS_A_POINT = 4096

Point = tuple[float, Optional[float], Optional[float], Optional[float], Optional[float]]
#: What a point holds, in order (the JSON answer's ``columns``).
COLUMNS = ("time", "cpu_percent", "ram_percent", "gpu_util_percent", "vram_percent")
_NAN = float("nan")


def _num(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _share(used: float, total: float) -> Optional[float]:
    """``used`` as a percentage of ``total``; None where either sums to 0, as the epoch
    record's sums of 0 are None (PROTOCOL 2.3)."""
    return 100.0 * used / total if used and total > 0 else None


def cluster_point(ranks: Iterable[Any]) -> Optional[tuple[Optional[float], ...]]:
    """``(cpu %, ram %, gpu util %, vram %)`` of the ranks' latest samples (a ``ranks``
    array), or None when no rank has a sample: CPU the mean and RAM the sum over hosts (a
    host's first rank in the array that reports each), GPU utilisation the mean and VRAM the
    sums over ranks, as :func:`broker.run.aggregate.cluster_resources` figures an epoch's."""
    cpu_by_host: dict[Any, float] = {}
    ram_by_host: dict[Any, tuple[float, float]] = {}
    utils: list[float] = []
    vram_used: list[float] = []
    vram_total: list[float] = []
    seen = False
    for entry in ranks:
        if not isinstance(entry, dict):
            continue
        s = entry.get("resources")
        if not isinstance(s, dict):
            continue
        seen = True
        host = entry.get("host")
        if host is not None:
            cpu = _num(s.get("cpu_percent"))
            if cpu is not None and host not in cpu_by_host:
                cpu_by_host[host] = cpu
            used, total = _num(s.get("ram_used_bytes")), _num(s.get("ram_total_bytes"))
            if used is not None and total is not None and host not in ram_by_host:
                ram_by_host[host] = (used, total)
        util = _num(s.get("gpu_util_percent"))
        if util is not None:
            utils.append(util)
        used, total = _num(s.get("vram_allocated_bytes")), _num(s.get("vram_total_bytes"))
        if used is not None:  # summed apart, as the epoch record's are
            vram_used.append(used)
        if total is not None:
            vram_total.append(total)
    if not seen:
        return None
    cpus = list(cpu_by_host.values())
    return (
        math.fsum(cpus) / len(cpus) if cpus else None,
        _share(math.fsum(u for u, _ in ram_by_host.values()),
               math.fsum(t for _, t in ram_by_host.values())),
        math.fsum(utils) / len(utils) if utils else None,
        _share(math.fsum(vram_used), math.fsum(vram_total)),
    )


def _spread_sample(ranks: list[Any], t: float) -> list[Any]:
    """At most :data:`MAX_RANKS_A_POINT` of ``ranks``: one at random from each run of k
    (k = len / MAX rounded up). Not every k-th: a stride that is a multiple of the ranks a
    host has would pick the same local rank (GPU 0) everywhere. Seeded by the point's time,
    so a point is the same however often it is figured."""
    n = len(ranks)
    k = -(-n // MAX_RANKS_A_POINT)
    rand = random.Random(int(t)).random
    return [ranks[i + int(rand() * min(k, n - i))] for i in range(0, n, k)]


def _mean(a: float, b: float) -> float:
    """The mean of two figures, or the one that is not NaN (NaN: no rank had it)."""
    if a != a:
        return b
    if b != b:
        return a
    return (a + b) / 2.0


class ResourceTimeline:
    """One run's cluster resources over time (module docstring): five columns of float64
    (NaN for a figure no rank had), 40 bytes a point, at most :data:`MAX_POINTS` points."""

    __slots__ = ("cols", "every")

    def __init__(self) -> None:
        #: unix time, cpu %, ram %, gpu util %, vram %: one array each, oldest first
        self.cols: list[array[float]] = [array("d") for _ in COLUMNS]
        self.every = FIRST_EVERY_S

    def __len__(self) -> int:
        return len(self.cols[0])

    @property
    def points(self) -> list[Point]:
        """The points as tuples, None for a figure no rank had."""
        return [tuple(None if v != v else v for v in p) for p in zip(*self.cols)]  # type: ignore[misc]

    def add(self, t: float, ranks: Iterable[Any]) -> bool:
        """The cluster's point at ``t`` from a ``ranks`` array; False when none was kept (no
        sample yet, or less than ``every`` seconds after the last point)."""
        times = self.cols[0]
        if times and t - times[-1] < self.every:
            return False
        if isinstance(ranks, list) and len(ranks) > MAX_RANKS_A_POINT:
            ranks = _spread_sample(ranks, t)
        p = cluster_point(ranks)
        if p is None:
            return False
        for col, v in zip(self.cols, (t, *p)):
            col.append(_NAN if v is None else v)
        if len(times) >= MAX_POINTS:
            self._merge()
        return True

    def _merge(self) -> None:
        """Neighbours merge pairwise, each figure the mean of the two (or the one there); an
        odd last point stays as it is; ``every`` doubles."""
        merged = []
        for col in self.cols:
            out = array("d", map(_mean, col[0:len(col) - 1:2], col[1::2]))
            if len(col) % 2:
                out.append(col[-1])
            merged.append(out)
        self.cols = merged
        # the merged points' own spacing where updates came slower than ``every``: new points
        # then come as far apart as the old ones now are
        times = merged[0]
        span = (times[-1] - times[0]) / max(1, len(times) - 1)
        self.every = max(self.every * 2.0, span)

    def to_json(self) -> dict[str, Any]:
        """``{"every_s", "columns", "points"}``: the answer of
        ``GET /api/runs/<run>/resources``."""
        return {"every_s": self.every, "columns": list(COLUMNS),
                "points": [list(p) for p in self.points]}
