"""Prometheus exposition of the hub's state, read at scrape time.

A custom :class:`prometheus_client.registry.Collector` on a per-app
:class:`~prometheus_client.CollectorRegistry` (no global registry: two apps in one process,
as in tests, never collide). Nothing is counted twice: the broker's totals come from its
latest heartbeat, the per-rank figures from the latest ``ranks`` event, the web's own from
the hub.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from web.runstate import finite
from web.shards import AnyHub, shard_states

RANK_LABELS = ["run", "rank", "host"]
#: The per-GPU families (PROTOCOL 2 health fields): a rank's labels plus its GPU's index.
GPU_LABELS = RANK_LABELS + ["gpu"]
#: Clock event reasons exported as ``rankboard_gpu_throttle{reason}`` (1 active, 0 not).
THROTTLE_REASONS = ("sw_power_cap", "hw_slowdown", "hw_thermal", "hw_power_brake", "sw_thermal")
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


class HubCollector(Collector):
    """Builds every metric family from the hub when scraped."""

    def __init__(self, hub: AnyHub, clock: Callable[[], float] = time.time) -> None:
        self.hub = hub
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        hub = self.hub
        hb = hub.heartbeat
        accepted = CounterMetricFamily(
            "rankboard_frames_accepted", "Frames the broker accepted (since its start).")
        rejected = CounterMetricFamily(
            "rankboard_frames_rejected", "Frames the broker rejected, by reason (since its start).",
            labels=["reason"])
        late = CounterMetricFamily(
            "rankboard_late_metrics", "Accepted metrics frames dropped because their epoch had closed.")
        late_steps = CounterMetricFamily(
            "rankboard_late_steps", "Step points dropped because their step had closed.")
        closed = CounterMetricFamily(
            "rankboard_steps_closed", "Steps the broker closed and published (since its start).")
        hooks = {
            "sent": CounterMetricFamily(
                "rankboard_webhooks_sent", "Alert webhook POSTs delivered (since the broker's start)."),
            "failed": CounterMetricFamily(
                "rankboard_webhooks_failed",
                "Alert webhook attempts that did not deliver (a retried one each time)."),
            "dropped": CounterMetricFamily(
                "rankboard_webhooks_dropped", "Alert webhook POSTs given up undelivered (queue "
                "full, out of retries, refused)."),
        }
        journal = CounterMetricFamily(
            "rankboard_journal", "The broker journal's limits and repairs since its start, by "
            "kind: write_failures (a read-only or full data dir), dropped_bytes, early_flushes, damaged_entries, runs_not_loaded.",
            labels=["kind"])
        if hb is not None:
            hooks["sent"].add_metric([], hb.webhooks_sent)
            hooks["failed"].add_metric([], hb.webhooks_failed)
            hooks["dropped"].add_metric([], hb.webhooks_dropped)
            for kind, count in sorted(hb.journal.items()):
                journal.add_metric([kind], count)
            accepted.add_metric([], hb.accepted)
            for reason, count in sorted(hb.rejected.items()):
                rejected.add_metric([reason], count)
            late.add_metric([], hb.late_metrics)
            late_steps.add_metric([], hb.late_steps)
            closed.add_metric([], hb.steps_closed)
        yield accepted
        yield rejected
        yield late
        yield late_steps
        yield closed
        yield from hooks.values()
        yield journal

        steps_done = GaugeMetricFamily(
            "rankboard_run_steps_done", "The last closed step of each run that has one.",
            labels=["run"])
        step_rows = GaugeMetricFamily(
            "rankboard_run_steps_closed", "Closed steps each run holds.", labels=["run"])
        for state in hub.runs.values():
            last = state.steps.last_step
            if last is not None:
                steps_done.add_metric([state.run], float(last))
                step_rows.add_metric([state.run], float(state.steps.rows))
        yield steps_done
        yield step_rows

        connected = GaugeMetricFamily(
            "rankboard_web_connected", "1 while the web has a current snapshot and fresh heartbeats.")
        connected.add_metric([], 1.0 if hub.connected else 0.0)
        yield connected
        shard_up = GaugeMetricFamily(  # PROTOCOL 7.3
            "rankboard_shard_connected", "1 while the web follows shard K's broker.",
            labels=["shard"])
        for entry in shard_states(hub):
            shard_up.add_metric([str(entry["shard"])], 1.0 if entry["connected"] else 0.0)
        yield shard_up

        runs = GaugeMetricFamily("rankboard_runs", "Runs known to the web, by status.",
                                 labels=["status"])
        by_status: dict[str, int] = {}
        for state in hub.runs.values():
            status = str(state.header.get("status") or "unknown")
            by_status[status] = by_status.get(status, 0) + 1
        for status, n in sorted(by_status.items()):
            runs.add_metric([status], n)
        yield runs

        clients = GaugeMetricFamily("rankboard_sse_clients", "Open SSE streams.")
        clients.add_metric([], hub.client_count)
        yield clients
        dropped = CounterMetricFamily(
            "rankboard_sse_clients_dropped", "SSE clients dropped because their queue overflowed.")
        dropped.add_metric([], hub.clients_dropped)
        yield dropped
        limited = CounterMetricFamily(
            "rankboard_web_limited",
            "Times one of the web's hardening limits bit, by reason (SECURITY.md).",
            labels=["reason"])
        for reason, count in sorted(hub.limited.items()):
            limited.add_metric([reason], count)
        yield limited
        gaps = CounterMetricFamily(
            "rankboard_feed_gaps", "Sequence gaps in the broker feed (each healed by a snapshot).")
        gaps.add_metric([], hub.gaps)
        yield gaps

        yield from self._rank_families()
        yield from self._gpu_families()
        yield host_suspect_family(hub)

    def _rank_families(self) -> Iterator[Metric]:
        now = self.clock()
        families = {
            "cpu": GaugeMetricFamily("rankboard_rank_cpu_percent",
                                     "Host CPU utilisation in the rank's latest sample.", labels=RANK_LABELS),
            "gpu": GaugeMetricFamily("rankboard_rank_gpu_util_percent",
                                     "The rank's GPU utilisation.", labels=RANK_LABELS),
            "vram": GaugeMetricFamily("rankboard_rank_vram_used_bytes",
                                      "The rank's GPU memory in use.", labels=RANK_LABELS),
            "vram_total": GaugeMetricFamily("rankboard_rank_vram_total_bytes",
                                            "The rank's GPU memory in total.", labels=RANK_LABELS),
            "age": GaugeMetricFamily("rankboard_rank_last_seen_age_seconds",
                                     "Seconds since the rank's last accepted frame.", labels=RANK_LABELS),
            "epoch": GaugeMetricFamily("rankboard_rank_epoch",
                                       "The last epoch the rank reported.", labels=RANK_LABELS),
            "loss": GaugeMetricFamily("rankboard_rank_loss",
                                      "The rank's last reported average loss.", labels=RANK_LABELS),
            "stale": GaugeMetricFamily("rankboard_rank_stale",
                                       "1 while the rank is stale (silent for --stale-after "
                                       "seconds, e.g. hung), else 0.", labels=RANK_LABELS),
            "step": GaugeMetricFamily("rankboard_rank_step",
                                      "The highest step the rank reported.", labels=RANK_LABELS),
            "step_ms": GaugeMetricFamily("rankboard_rank_step_ms",
                                         "Mean of the rank's last 100 step times (ms).",
                                         labels=RANK_LABELS),
            "share": GaugeMetricFamily("rankboard_rank_slowest_share",
                                       "Fraction of the last 1000 closed steps in which the rank "
                                       "was the slowest (the straggler board).",
                                       labels=RANK_LABELS),
        }
        for state in self.hub.runs.values():
            for entry in state.ranks_full:
                if not isinstance(entry, dict):
                    continue
                labels = [state.run, str(entry.get("rank")), str(entry.get("host") or "")]
                res = entry.get("resources")
                if not isinstance(res, dict):
                    res = {}
                values: dict[str, float | None] = {
                    "cpu": finite(res.get("cpu_percent")),
                    "gpu": finite(res.get("gpu_util_percent")),
                    "vram": finite(res.get("vram_allocated_bytes")),
                    "vram_total": finite(res.get("vram_total_bytes")),
                    "epoch": finite(entry.get("epoch")),
                    "loss": finite(entry.get("loss")),
                    "step": finite(entry.get("step")),
                    "step_ms": finite(entry.get("step_ms")),
                    "share": finite(entry.get("slowest_share")),
                }
                values["stale"] = 1.0 if entry.get("status") == "stale" else 0.0
                seen = finite(entry.get("last_seen"))
                values["age"] = max(0.0, now - seen) if seen is not None else None
                for key, value in values.items():
                    if value is not None:
                        families[key].add_metric(labels, value)
        yield from families.values()


    def _gpu_families(self) -> Iterator[Metric]:
        """The GPU health of every rank's latest sample (PROTOCOL 2), one series per GPU,
        and the XID tallies the broker keeps (a sample holds only the XIDs since the
        previous one). A GPU whose sampler reads no health field exports none of these."""
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
        for state in self.hub.runs.values():
            for entry in state.ranks_full:
                if not isinstance(entry, dict):
                    continue
                res = entry.get("resources")
                gpus = res.get("gpus") if isinstance(res, dict) else None
                tallies = _xid_tallies(entry.get("gpu_xids"))
                if not gpus and not tallies:
                    continue
                base = [state.run, str(entry.get("rank")), str(entry.get("host") or "")]
                seen: set[str] = set()
                for gpu in gpus if isinstance(gpus, list) else ():
                    if not isinstance(gpu, dict) or not any(
                            gpu.get(f) is not None for f in _HEALTH_FIELDS):
                        continue
                    index = str(gpu.get("device_index"))
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


def host_suspect_family(hub: AnyHub) -> GaugeMetricFamily:
    """``rankboard_host_suspect{host}`` (PROTOCOL 7.4): one series per host of the runs the
    web holds (bounded by them), from the hub's cached cluster index, so a scrape re-reads
    only the runs whose header changed."""
    family = GaugeMetricFamily(
        "rankboard_host_suspect", "1 while the host is suspect (a GPU XID, ECC or row-remap "
        "incident, or incidents in 2 or more runs; see /api/hosts), else 0.", labels=["host"])
    for host, suspect in sorted(hub.cluster.suspects(hub).items()):
        family.add_metric([host], 1.0 if suspect else 0.0)
    return family


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


def make_registry(hub: AnyHub) -> CollectorRegistry:
    """A fresh registry holding only the hub collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HubCollector(hub))
    return registry
