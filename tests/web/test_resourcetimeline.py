"""The cluster's resources over time (web/resourcetimeline.py, issue 34 item 5), pure: the
point of a ``ranks`` array against the broker's own epoch aggregation of the same samples
(:func:`broker.run.aggregate.cluster_resources`), the spacing of points and the bound in points
(neighbours merge, the spacing doubles) whatever the run's length."""
from __future__ import annotations

import math
import random
from typing import Any, Optional

import pytest

from broker.run.aggregate import cluster_resources, sample_dict
from rank_agent.protocol import ResourceSample
from web.resourcetimeline import (
    FIRST_EVERY_S,
    MAX_POINTS,
    MAX_RANKS_A_POINT,
    ResourceTimeline,
    cluster_point,
)

GIB = 1 << 30


def _pct(used: Optional[int], total: Optional[int]) -> Optional[float]:
    return 100.0 * used / total if used is not None and total else None


def _random_sample(rng: random.Random) -> Optional[ResourceSample]:
    if rng.random() < 0.1:
        return None
    maybe = lambda v: v if rng.random() < 0.8 else None  # noqa: E731 - a field may be absent
    return ResourceSample(
        cpu_percent=maybe(rng.uniform(0, 100)), ram_used_bytes=maybe(rng.randrange(1, 64) * GIB),
        ram_total_bytes=maybe(64 * GIB), gpu_util_percent=maybe(rng.uniform(0, 100)),
        vram_allocated_bytes=maybe(rng.randrange(0, 80) * GIB), vram_total_bytes=maybe(80 * GIB))


def _close(a: Optional[float], b: Optional[float]) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-9)


@pytest.mark.parametrize("seed", range(30))
def test_a_point_is_the_brokers_epoch_aggregation_of_the_same_samples(seed: int) -> None:
    """CPU and RAM per host (its first rank that reports each), GPU and VRAM per rank, as an
    epoch record's ``resources``; RAM and VRAM as shares of their totals."""
    rng = random.Random(seed)
    n_hosts, per = rng.randrange(1, 5), rng.randrange(1, 5)
    hosts = [[h * per + i for i in range(per)] for h in range(n_hosts)]
    samples = {r: s for r in range(n_hosts * per) if (s := _random_sample(rng)) is not None}
    entries: list[dict[str, Any]] = [
        {"rank": r, "host": f"node-{r // per}", "local_rank": r % per,
         "resources": sample_dict(samples[r]) if r in samples else None}
        for r in range(n_hosts * per)]
    rng.shuffle(entries)  # a host's first reporting rank is by local rank, not array order
    entries.sort(key=lambda e: e["rank"])
    want = cluster_resources(samples, hosts, {})
    got = cluster_point(entries)
    if not samples:
        assert got is None
        return
    assert got is not None
    cpu, ram, gpu, vram = got
    assert _close(cpu, want["cpu_percent"])
    assert _close(ram, _pct(want["ram_used_bytes"], want["ram_total_bytes"]))
    assert _close(gpu, want["gpu_util_percent"])
    assert _close(vram, _pct(want["vram_allocated_bytes"], want["vram_total_bytes"]))


def test_junk_in_a_ranks_array_is_skipped() -> None:
    ranks: list[Any] = [None, "x", {"rank": 0}, {"rank": 1, "host": "a", "resources": {
        "cpu_percent": float("nan"), "gpu_util_percent": True, "vram_allocated_bytes": 1,
        "vram_total_bytes": 0}}]
    assert cluster_point(ranks) == (None, None, None, None)
    assert cluster_point([{"rank": 0, "resources": None}]) is None


def entry(cpu: float, gpu: float = 50.0) -> list[dict[str, Any]]:
    return [{"rank": 0, "host": "a", "resources": {"cpu_percent": cpu, "gpu_util_percent": gpu}}]


def test_a_point_at_most_every_interval_and_none_without_samples() -> None:
    tl = ResourceTimeline()
    assert not tl.add(100.0, [{"rank": 0, "host": "a", "resources": None}])
    assert tl.add(100.0, entry(10.0))
    assert not tl.add(100.0 + FIRST_EVERY_S / 2, entry(20.0))
    assert tl.add(100.0 + FIRST_EVERY_S, entry(30.0))
    assert [p[:2] for p in tl.points] == [(100.0, 10.0), (100.0 + FIRST_EVERY_S, 30.0)]
    body = tl.to_json()
    assert body["columns"] == ["time", "cpu_percent", "ram_percent", "gpu_util_percent",
                               "vram_percent"]
    assert body["points"][0] == [100.0, 10.0, None, 50.0, None]


def test_a_week_long_run_stays_within_max_points_at_an_even_spacing() -> None:
    """A sample every 3 s for 7 days, CPU rising steadily from 0 % to 100 %: at most
    MAX_POINTS points, about evenly spaced over the whole run (the first and the last moments
    still in), and the ramp still a ramp (merged points are means of neighbours)."""
    tl = ResourceTimeline()
    t0 = 1_700_000_000.0
    seconds = 7 * 24 * 3600
    for s in range(0, seconds, 3):
        tl.add(t0 + s, entry(100.0 * s / seconds))
    pts = tl.points
    assert MAX_POINTS // 4 < len(pts) < MAX_POINTS  # bounded by merging, not by dropping
    gaps = [b[0] - a[0] for a, b in zip(pts, pts[1:])]
    assert min(gaps) > 0 and max(gaps) <= 2 * tl.every and max(gaps) / min(gaps) <= 2.5, (
        min(gaps), max(gaps), tl.every)
    assert pts[0][0] - t0 < tl.every and t0 + seconds - pts[-1][0] <= 2 * tl.every
    cpus = [p[1] for p in pts]
    assert cpus == sorted(cpus) and cpus[0] < 1.0 and cpus[-1] > 99.0
    for (t, cpu, *_rest) in pts:  # each point's CPU is the ramp's at its time, about
        assert abs(cpu - 100.0 * (t - t0) / seconds) < 100.0 * tl.every / seconds


def test_merging_keeps_a_missing_figure_missing_and_a_present_one() -> None:
    tl = ResourceTimeline()
    for i in range(MAX_POINTS):
        res: dict[str, Any] = {"cpu_percent": 10.0} if i % 2 else {"gpu_util_percent": 70.0}
        tl.add(float(i), [{"rank": 0, "host": "a", "resources": res}])
    assert len(tl.points) == MAX_POINTS // 2 and tl.every == 2 * FIRST_EVERY_S
    assert all(p[1] == 10.0 and p[3] == 70.0 and p[2] is None for p in tl.points)


def test_a_65536_rank_point_is_figured_from_4096_ranks_spread_over_the_run() -> None:
    """Above MAX_RANKS_A_POINT ranks (the web figures a point in its event loop, once a
    second) the point comes from one rank of each run of 16: the means and shares stay within
    a few percent of the exact ones, also where a figure follows the local rank (a stride of
    16 would read GPU 0 of every host alone)."""
    n, per = 65_536, 8
    ranks = [{"rank": r, "host": f"node-{r // per}", "resources": {
        "cpu_percent": float((r // per) % 100), "ram_used_bytes": ((r // per) % 64 + 1) * GIB,
        "ram_total_bytes": 128 * GIB, "gpu_util_percent": float(r % 97),
        "vram_allocated_bytes": (r % 80) * GIB, "vram_total_bytes": 80 * GIB}} for r in range(n)]
    assert -(-n // MAX_RANKS_A_POINT) == 16  # 16 ranks a run: two hosts, one rank of each
    exact = cluster_point(ranks)
    tl = ResourceTimeline()
    assert tl.add(1.0, ranks)
    got = tl.points[0][1:]
    assert exact is not None and all(e is not None and g is not None for e, g in zip(exact, got))
    for e, g in zip(exact, got):
        assert abs(g - e) <= 0.05 * e, (got, exact)
