"""The per-rank and per-GPU families of ``/metrics``, bounded (issue 32, finding 4).

Unbounded, a 65,536-rank run is ~720,000 per-rank series (112 MiB of text) and a hostile
1,024 ranks x 64 GPUs ~1.1 million per-GPU ones. So per scrape:

* **per-rank series** (``rankboard_rank_*``, and ``rankboard_rank_stalled`` of
  :class:`web.stacksapi.StacksCollector`, which reads the same selection) for every rank
  while the web holds at most :data:`MAX_RANK_SERIES` ranks in all; beyond that only for the
  *notable* ranks (stale, stalled, errored, or with an unhealthy GPU or an XID), up to
  :data:`MAX_RANK_SERIES`;
* **per-GPU series** (``rankboard_gpu_*``) for every GPU (that sends health fields) of the
  exported ranks while they hold at most :data:`MAX_GPU_SERIES`; beyond that only for the
  unhealthy ones (:func:`unhealthy`), up to :data:`MAX_GPU_SERIES`;
* **aggregates** per run, always: ``rankboard_run_ranks{run,status}`` (ranks by status),
  ``rankboard_run_rank_stat{run,field,stat}`` (min/mean/max of each per-rank figure over
  every rank), ``rankboard_run_gpus{run,health}`` (GPUs sending health fields, healthy or
  not), ``rankboard_run_gpu_xid_errors_total{run}`` (every XID tallied); and
  ``rankboard_metrics_omitted{kind}`` (ranks and GPUs left out of the per-series families
  by this scrape: non-zero = the caps bit).

What an operator loses past the caps (SECURITY.md): the per-rank figures of ordinary ranks
and the per-GPU gauges (SM clock, PCIe, ...) of healthy GPUs, only their run's aggregates
remain; and a GPU's first XID appears as a new series already at its count, which
``increase()`` does not see (``rankboard_run_gpu_xid_errors_total`` rises instead).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from web.runstate import finite
from web.scrape import FrozenRun, HubView

#: Ranks (over all runs) that export per-rank series before only notable ones do.
MAX_RANK_SERIES = 4096
#: GPUs (of the exported ranks, over all runs) that export per-GPU series before only
#: unhealthy ones do.
MAX_GPU_SERIES = 4096
#: Rank statuses that make a rank notable (exported per rank past the cap).
NOTABLE_STATUS = frozenset(("stale", "stalled", "error"))

RANK_LABELS = ["run", "rank", "host"]
#: The per-GPU families (PROTOCOL 2 health fields): a rank's labels plus its GPU's index.
GPU_LABELS = RANK_LABELS + ["gpu"]
#: Clock event reasons exported as ``rankboard_gpu_throttle{reason}`` (1 active, 0 not).
THROTTLE_REASONS = ("sw_power_cap", "hw_slowdown", "hw_thermal", "hw_power_brake", "sw_thermal")
#: Reasons that make a GPU unhealthy (sw_power_cap is normal at full load).
_BAD_THROTTLE = frozenset(THROTTLE_REASONS) - {"sw_power_cap"}
#: Health fields whose presence marks a GPU whose sampler reads health (section 2).
_HEALTH_FIELDS = ("sm_clock_mhz", "ecc_uncorrected", "remapped_rows_pending",
                  "remapped_rows_failed", "pcie_link_gen", "pcie_link_gen_max", "pcie_link_width",
                  "pcie_link_width_max", "nvlink_errors")
#: gauge key -> (family name, help, GpuSample field) of the per-GPU gauges read as is.
_GPU_GAUGES = {
    "sm_clock": ("rankboard_gpu_sm_clock_mhz", "The GPU's SM clock (MHz).", "sm_clock_mhz"),
    "ecc": ("rankboard_gpu_ecc_uncorrected",
            "Volatile uncorrected ECC errors of the GPU (since its last reset).", "ecc_uncorrected"),
    "remap_pending": ("rankboard_gpu_remapped_rows_pending",
                      "1 while a row remapping is pending on the GPU (reset it), else 0.",
                      "remapped_rows_pending"),
    "remap_failed": ("rankboard_gpu_remapped_rows_failed",
                     "1 if a row remapping failed on the GPU (replace it), else 0.",
                     "remapped_rows_failed"),
    "pcie_gen": ("rankboard_gpu_pcie_link_gen", "The GPU's current PCIe link generation.",
                 "pcie_link_gen"),
    "pcie_gen_max": ("rankboard_gpu_pcie_link_gen_max", "The GPU's maximum PCIe link generation.",
                     "pcie_link_gen_max"),
    "pcie_width": ("rankboard_gpu_pcie_link_width", "The GPU's current PCIe link width (lanes).",
                   "pcie_link_width"),
    "pcie_width_max": ("rankboard_gpu_pcie_link_width_max",
                       "The GPU's maximum PCIe link width (lanes).", "pcie_link_width_max"),
}
#: per-rank family key -> (name, help)
_RANK_FAMILIES = {
    "cpu": ("rankboard_rank_cpu_percent", "Host CPU utilisation in the rank's latest sample."),
    "gpu": ("rankboard_rank_gpu_util_percent", "The rank's GPU utilisation."),
    "vram": ("rankboard_rank_vram_used_bytes", "The rank's GPU memory in use."),
    "vram_total": ("rankboard_rank_vram_total_bytes", "The rank's GPU memory in total."),
    "age": ("rankboard_rank_last_seen_age_seconds", "Seconds since the rank's last accepted frame."),
    "epoch": ("rankboard_rank_epoch", "The last epoch the rank reported."),
    "loss": ("rankboard_rank_loss", "The rank's last reported average loss."),
    "stale": ("rankboard_rank_stale", "1 while the rank is stale (silent for --stale-after "
              "seconds, e.g. hung), else 0."),
    "step": ("rankboard_rank_step", "The highest step the rank reported."),
    "step_ms": ("rankboard_rank_step_ms", "Mean of the rank's last 100 step times (ms)."),
    "share": ("rankboard_rank_slowest_share", "Fraction of the last 1000 closed steps in which "
              "the rank was the slowest (the straggler board)."),
}
#: per-rank keys summarised per run in ``rankboard_run_rank_stat{field}`` (field = the key)
_STAT_KEYS = ("cpu", "gpu", "vram", "age", "epoch", "step", "step_ms", "share")


def health_gpus(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPUs of a ranks entry's latest sample that send health fields."""
    res = entry.get("resources")
    gpus = res.get("gpus") if isinstance(res, dict) else None
    if not isinstance(gpus, list):
        return []
    return [g for g in gpus if isinstance(g, dict)
            and any(g.get(f) is not None for f in _HEALTH_FIELDS)]


def unhealthy(gpu: dict[str, Any]) -> bool:
    """A GPU the GPU alert rules would fire on: a throttle reason other than the power cap,
    uncorrected ECC errors, a row remap pending or failed, a link below its width, NVLink
    errors."""
    reasons = gpu.get("throttle_reasons")
    if isinstance(reasons, list) and not _BAD_THROTTLE.isdisjoint(r for r in reasons
                                                                  if isinstance(r, str)):
        return True
    ecc, errors = finite(gpu.get("ecc_uncorrected")), finite(gpu.get("nvlink_errors"))
    if (ecc or 0) > 0 or (errors or 0) > 0:
        return True
    if gpu.get("remapped_rows_pending") is True or gpu.get("remapped_rows_failed") is True:
        return True
    width, width_max = finite(gpu.get("pcie_link_width")), finite(gpu.get("pcie_link_width_max"))
    return width is not None and width_max is not None and width < width_max


def _xid_tallies(value: object) -> dict[str, tuple[float, float | None]]:
    """A ranks entry's ``gpu_xids`` (``[{gpu, count, last}]``) as gpu -> (count, last)."""
    out: dict[str, tuple[float, float | None]] = {}
    if isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                count = finite(item.get("count"))
                if count is not None:
                    out[str(item.get("gpu"))] = (count, finite(item.get("last")))
    return out


def _notable(entry: dict[str, Any]) -> bool:
    return (entry.get("status") in NOTABLE_STATUS or bool(entry.get("gpu_xids"))
            or any(unhealthy(g) for g in health_gpus(entry)))


def select(view: HubView) -> None:
    """Set each run's ``ranks_full`` (the ranks exported per rank) and ``gpu_cap`` (only
    unhealthy GPUs exported) by the caps of the module docstring. In the build thread."""
    runs = list(view.runs.values())
    total = sum(len(r.ranks_all) for r in runs)
    room = MAX_RANK_SERIES
    for frozen in runs:
        if total <= MAX_RANK_SERIES:
            frozen.ranks_full = [e for e in frozen.ranks_all if isinstance(e, dict)]
            continue
        chosen: list[Any] = []
        for entry in frozen.ranks_all:
            if room <= 0:
                break
            if isinstance(entry, dict) and _notable(entry):
                chosen.append(entry)
                room -= 1
        frozen.ranks_full = chosen
    gpus = sum(len(health_gpus(e)) for r in runs for e in r.ranks_full)
    for frozen in runs:
        frozen.gpu_cap = gpus > MAX_GPU_SERIES


class RankCollector:
    """The bounded per-rank and per-GPU families and the per-run aggregates over a view."""

    def __init__(self, view: HubView, clock: Callable[[], float] = time.time) -> None:
        self.view = view
        self.clock = clock
        #: ranks and GPUs left out of the series by the scrape being built
        self._left: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        runs = list(self.view.runs.values())
        self._left = {"ranks": 0, "gpus": 0}
        yield from self._aggregates(runs)
        yield from self._rank_families(runs)
        yield from self._gpu_families(runs)
        omitted = GaugeMetricFamily(
            "rankboard_metrics_omitted", "Ranks and GPUs this scrape left out of the per-rank "
            "and per-GPU series (the cardinality caps, SECURITY.md).", labels=["kind"])
        for kind, n in sorted(self._left.items()):
            omitted.add_metric([kind], n)
        yield omitted

    def _aggregates(self, runs: list[FrozenRun]) -> Iterator[Metric]:
        now = self.clock()
        by_status = GaugeMetricFamily("rankboard_run_ranks", "Ranks of each run by status.",
                                      labels=["run", "status"])
        stat = GaugeMetricFamily(
            "rankboard_run_rank_stat", "min, mean and max over every rank of the run of a "
            "per-rank figure (field: cpu, gpu, vram, age, epoch, step, step_ms, share, as the "
            "rankboard_rank_* gauges).", labels=["run", "field", "stat"])
        health = GaugeMetricFamily("rankboard_run_gpus", "GPUs of the run that send health "
                                   "fields, by health (healthy, unhealthy).",
                                   labels=["run", "health"])
        xids = CounterMetricFamily("rankboard_run_gpu_xid_errors", "XID errors the run's "
                                   "GPUs reported since the broker started.", labels=["run"])
        left = self._left
        for frozen in runs:
            statuses: dict[str, int] = {}
            sums: dict[str, list[float]] = {k: [0.0, 0.0, float("inf"), float("-inf")]
                                            for k in _STAT_KEYS}
            good = bad = 0
            xid_total = 0.0
            for entry in frozen.ranks_all:
                if not isinstance(entry, dict):
                    continue
                status = str(entry.get("status"))
                statuses[status] = statuses.get(status, 0) + 1
                for key, value in _rank_values(entry, now).items():
                    acc = sums.get(key)
                    if acc is not None and value is not None:
                        acc[0] += 1
                        acc[1] += value
                        acc[2] = min(acc[2], value)
                        acc[3] = max(acc[3], value)
                for gpu in health_gpus(entry):
                    if unhealthy(gpu):
                        bad += 1
                    else:
                        good += 1
                for count, _ in _xid_tallies(entry.get("gpu_xids")).values():
                    xid_total += count
            for status, count in sorted(statuses.items()):
                by_status.add_metric([frozen.run, status], count)
            for key, (n, total, low, high) in sums.items():
                if n:
                    stat.add_metric([frozen.run, key, "min"], low)
                    stat.add_metric([frozen.run, key, "mean"], total / n)
                    stat.add_metric([frozen.run, key, "max"], high)
            health.add_metric([frozen.run, "healthy"], good)
            health.add_metric([frozen.run, "unhealthy"], bad)
            xids.add_metric([frozen.run], xid_total)
            left["ranks"] += sum(1 for e in frozen.ranks_all if isinstance(e, dict)) - len(
                frozen.ranks_full)
            left["gpus"] += good + bad  # less those exported (_gpu_families)
        yield by_status
        yield stat
        yield health
        yield xids

    def _rank_families(self, runs: list[FrozenRun]) -> Iterator[Metric]:
        now = self.clock()
        families = {key: GaugeMetricFamily(name, text, labels=RANK_LABELS)
                    for key, (name, text) in _RANK_FAMILIES.items()}
        for frozen in runs:
            for entry in frozen.ranks_full:
                labels = [frozen.run, str(entry.get("rank")), str(entry.get("host") or "")]
                for key, value in _rank_values(entry, now).items():
                    if value is not None:
                        families[key].add_metric(labels, value)
        yield from families.values()

    def _gpu_families(self, runs: list[FrozenRun]) -> Iterator[Metric]:
        """The GPU health of every exported rank's latest sample (PROTOCOL 2), one series
        per GPU, and the XID tallies the broker keeps (a sample holds only the XIDs since
        the previous one). A GPU whose sampler reads no health field exports none of these;
        past the cap only unhealthy GPUs and GPUs with XIDs do."""
        gauges = {key: GaugeMetricFamily(name, text, labels=GPU_LABELS)
                  for key, (name, text, _) in _GPU_GAUGES.items()}
        throttle = GaugeMetricFamily(
            "rankboard_gpu_throttle", "1 while the clock event reason is active on the GPU "
            "(sw_power_cap is normal at full load), else 0.", labels=GPU_LABELS + ["reason"])
        nvlink = CounterMetricFamily(
            "rankboard_gpu_nvlink_errors", "NVLink CRC, replay and recovery errors of the GPU, "
            "summed over its links.", labels=GPU_LABELS)
        xid = CounterMetricFamily(
            "rankboard_gpu_xid_errors", "XID errors the GPU reported since the broker started.",
            labels=GPU_LABELS)
        last_xid = GaugeMetricFamily(
            "rankboard_gpu_last_xid", "The latest XID code the GPU reported.", labels=GPU_LABELS)
        room = MAX_GPU_SERIES
        for frozen in runs:
            for entry in frozen.ranks_full:
                gpus = health_gpus(entry)
                tallies = _xid_tallies(entry.get("gpu_xids"))
                if not gpus and not tallies:
                    continue
                base = [frozen.run, str(entry.get("rank")), str(entry.get("host") or "")]
                seen: set[str] = set()
                for gpu in gpus:
                    index = str(gpu.get("device_index"))
                    if frozen.gpu_cap and (room <= 0 or (
                            not unhealthy(gpu) and index not in tallies)):
                        continue
                    room -= 1
                    self._left["gpus"] -= 1
                    labels = base + [index]
                    for key, (_, _, field) in _GPU_GAUGES.items():
                        raw = gpu.get(field)
                        value = float(raw) if isinstance(raw, bool) else finite(raw)
                        if value is not None:
                            gauges[key].add_metric(labels, value)
                    reasons = gpu.get("throttle_reasons")
                    active = set(reasons) if isinstance(reasons, list) else set()
                    for reason in THROTTLE_REASONS:
                        throttle.add_metric(labels + [reason], 1.0 if reason in active else 0.0)
                    errors = finite(gpu.get("nvlink_errors"))
                    if errors is not None:
                        nvlink.add_metric(labels, errors)
                    seen.add(index)
                    count, last = tallies.get(index, (0, None))
                    xid.add_metric(labels, count)
                    if last is not None:
                        last_xid.add_metric(labels, last)
                for index, (count, last) in tallies.items():
                    if index not in seen:  # an XID from a GPU the latest sample left out
                        xid.add_metric(base + [index], count)
                        if last is not None:
                            last_xid.add_metric(base + [index], last)
        yield from gauges.values()
        yield throttle
        yield nvlink
        yield xid
        yield last_xid


def _rank_values(entry: dict[str, Any], now: float) -> dict[str, float | None]:
    """The per-rank gauges' values of one ranks entry (None: no series)."""
    res = entry.get("resources")
    if not isinstance(res, dict):
        res = {}
    seen = finite(entry.get("last_seen"))
    return {
        "cpu": finite(res.get("cpu_percent")),
        "gpu": finite(res.get("gpu_util_percent")),
        "vram": finite(res.get("vram_allocated_bytes")),
        "vram_total": finite(res.get("vram_total_bytes")),
        "age": max(0.0, now - seen) if seen is not None else None,
        "epoch": finite(entry.get("epoch")),
        "loss": finite(entry.get("loss")),
        "stale": 1.0 if entry.get("status") == "stale" else 0.0,
        "step": finite(entry.get("step")),
        "step_ms": finite(entry.get("step_ms")),
        "share": finite(entry.get("slowest_share")),
    }
