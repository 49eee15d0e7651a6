"""Prometheus exposition of the hub's state, read at scrape time.

A custom :class:`prometheus_client.registry.Collector` on a per-app
:class:`~prometheus_client.CollectorRegistry` (no global registry: two apps in one process,
as in tests, never collide). Nothing is counted twice: the broker's totals come from its
latest heartbeat, the per-rank figures from the latest ``ranks`` event, the web's own from
the hub. Built off the event loop from a frozen view of the hub, per-rank and per-GPU
series bounded: :mod:`web.scrape`, :mod:`web.metricsranks` (issue 32, finding 4).
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from web.metricsranks import RankCollector, select
from web.scrape import FrozenRun, HubView, ScrapeRegistry
from web.shards import AnyHub

#: PROTOCOL 8.4's heartbeat ``journal`` keys that are families of their own, not kinds of
#: ``rankboard_journal_total`` (``failing`` is /healthz's, not a counter)
DATA_DIR_KEYS = frozenset({"data_dir_bytes", "runs_deleted_bytes", "runs_deleted_days",
                           "failing", "retain_bytes"})


def _data_dir_families(hb: Any) -> Iterator[Metric]:
    """PROTOCOL 8.4: ``rankboard_data_dir_bytes``, ``rankboard_journal_write_errors_total``,
    ``rankboard_runs_deleted_total{reason}`` (a web over shards: summed, as every broker
    counter is)."""
    size = GaugeMetricFamily(
        "rankboard_data_dir_bytes", "The runs' files in the broker's data dir, bytes on disk, "
        "as of its latest retention pass (--retain-bytes bounds it).")
    errors = CounterMetricFamily(
        "rankboard_journal_write_errors", "Journal writes that failed (a full disk, an I/O "
        "error) since the broker started; each is retried.")
    deleted = CounterMetricFamily(
        "rankboard_runs_deleted", "Ended runs deleted from the data dir since the broker "
        "started, by reason: bytes (--retain-bytes) or days (--retention-days).",
        labels=["reason"])
    bound = GaugeMetricFamily(
        "rankboard_data_dir_retain_bytes", "The broker's --retain-bytes (over shards: the "
        "sum); no series without one.")
    if hb is not None:
        j = hb.journal
        if "retain_bytes" in j:
            bound.add_metric([], j["retain_bytes"])
        size.add_metric([], j.get("data_dir_bytes", 0))
        errors.add_metric([], j.get("write_failures", 0))
        deleted.add_metric(["bytes"], j.get("runs_deleted_bytes", 0))
        deleted.add_metric(["days"], j.get("runs_deleted_days", 0))
    yield size
    yield bound
    yield errors
    yield deleted


class HubCollector(Collector):
    """The hub's own families (the broker's counters, the web's), from the scrape's view
    (:mod:`web.scrape`): O(runs), never per rank."""

    def __init__(self, hub: HubView) -> None:
        self.hub = hub

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
            "kind: write_failures (a read-only or full data dir), dropped_bytes, early_flushes, damaged_entries, runs_not_loaded, unreplayable_entries (set aside at start: applying them raised).",
            labels=["kind"])
        if hb is not None:
            hooks["sent"].add_metric([], hb.webhooks_sent)
            hooks["failed"].add_metric([], hb.webhooks_failed)
            hooks["dropped"].add_metric([], hb.webhooks_dropped)
            for kind, count in sorted(hb.journal.items()):
                if kind not in DATA_DIR_KEYS:
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
        yield from _data_dir_families(hb)

        steps_done = GaugeMetricFamily(
            "rankboard_run_steps_done", "The last closed step of each run that has one.",
            labels=["run"])
        step_rows = GaugeMetricFamily(
            "rankboard_run_steps_closed", "Closed steps each run holds.", labels=["run"])
        for state in hub.runs.values():
            last = state.last_step
            if last is not None:
                steps_done.add_metric([state.run], float(last))
                step_rows.add_metric([state.run], float(state.steps_rows))
        yield steps_done
        yield step_rows
        attempt = GaugeMetricFamily(  # 8.1
            "rankboard_run_attempt", "The current attempt of each run (0-based).",
            labels=["run"])
        for state in hub.runs.values():
            header = getattr(state, "header", None)
            k = header.get("attempt", 0) if isinstance(header, dict) else 0
            attempt.add_metric([state.run], float(k if isinstance(k, int) else 0))
        yield attempt
        yield from numbers_families(hub.runs.values())  # 8.3

        connected = GaugeMetricFamily(
            "rankboard_web_connected", "1 while the web has a current snapshot and fresh heartbeats.")
        connected.add_metric([], 1.0 if hub.connected else 0.0)
        yield connected
        shard_up = GaugeMetricFamily(  # PROTOCOL 7.3
            "rankboard_shard_connected", "1 while the web follows shard K's broker.",
            labels=["shard"])
        for entry in hub.shards:
            shard_up.add_metric([str(entry["shard"])], 1.0 if entry["connected"] else 0.0)
        yield shard_up
        suspect = GaugeMetricFamily(  # PROTOCOL 7.4
            "rankboard_host_suspect", "1 while the host is suspect (a GPU XID, ECC or row-remap "
            "incident, or incidents in 2 or more runs; see /api/hosts), else 0.",
            labels=["host"])
        for host, is_suspect in sorted(hub.suspects.items()):
            suspect.add_metric([host], 1.0 if is_suspect else 0.0)
        yield suspect

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



def numbers_families(states: Iterable[FrozenRun]) -> Iterator[GaugeMetricFamily]:
    """(8.3) Per run: ``rankboard_run_nonfinite`` (metrics that had a first non-finite
    value: the header's ``nonfinite`` entries plus ``nonfinite_more``) and
    ``rankboard_run_replica_divergence`` (closed steps at which a replica disagreed, summed
    over the replicated metrics: each ``replica_divergence`` entry's ``count``). A run whose
    header has neither (an older broker) is left out."""
    nonfinite = GaugeMetricFamily(
        "rankboard_run_nonfinite", "Step metrics of each run that had a first non-finite "
        "value (NaN or inf on some rank).", labels=["run"])
    diverged = GaugeMetricFamily(
        "rankboard_run_replica_divergence", "Closed steps of each run at which a replicated "
        "metric disagreed across ranks (summed over metrics).", labels=["run"])
    for state in states:
        header = state.header
        entries = header.get("nonfinite")
        if isinstance(entries, list):
            more = header.get("nonfinite_more")
            extra = more if isinstance(more, int) and not isinstance(more, bool) else 0
            nonfinite.add_metric([state.run], float(len(entries) + extra))
        div = header.get("replica_divergence")
        if isinstance(div, list):
            steps = sum(e.get("count", 0) for e in div
                        if isinstance(e, dict) and isinstance(e.get("count"), int))
            diverged.add_metric([state.run], float(steps))
    yield nonfinite
    yield diverged


def make_registry(hub: AnyHub) -> ScrapeRegistry:
    """A fresh registry over a view of ``hub``: the hub's own families and the bounded
    per-rank and per-GPU ones (:mod:`web.metricsranks`); ``latest()`` builds it off the loop."""
    registry = ScrapeRegistry(hub, prepare=select)
    registry.register(HubCollector(registry.view))  # type: ignore[arg-type]
    registry.register(RankCollector(registry.view))
    return registry
