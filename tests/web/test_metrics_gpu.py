"""web/metrics.py for issue 15 without sockets: the GPU health families (labelled like the
per-rank gauges plus ``gpu``, named as deploy/prometheus/rankboard-gpu.rules.yml uses them),
the XID tallies the broker sends as the feed-only ``gpu_xids``, the webhook counters of
PROTOCOL 3.1 and the journal's counters, both from the heartbeat."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import generate_latest

from broker import feed
from tests.support.gpuentry import health_gpu
from web.hub import Hub
from web.metrics import make_registry

RUN = "r1"

L = 'gpu="{g}",host="node-a",rank="3",run="r1"'
#: the throttle family's labels (the exposition sorts them)
T = 'gpu="{g}",host="node-a",rank="3",reason="{r}",run="r1"'


def ev(seq: int, kind: str, data: Any) -> list[bytes]:
    return feed.encode_event(RUN, SimpleNamespace(seq=seq, kind=kind, data=data))


def ready_hub() -> Hub:
    """A hub that took a snapshot of one run (seq 1) and a heartbeat."""
    hub = Hub()
    assert hub.next_request() == [b"SNAP"]
    hub.handle_snapshot(feed.encode_run_snapshot({
        "run": RUN, "seq": 1, "header": {"run": RUN, "status": "training"}, "ranks": [],
        "records": [], "complete": None, "svg": None}))
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 1))
    hub.handle_pub(feed.encode_heartbeat("i1", 0.0, 1, {}, 1))
    return hub


def scrape(ranks: list[dict[str, Any]], heartbeat: list[bytes] | None = None) -> str:
    hub = ready_hub()
    hub.handle_pub(ev(2, "ranks", ranks))
    if heartbeat is not None:
        hub.handle_pub(heartbeat)
    return generate_latest(make_registry(hub)).decode()


def entry(gpus: list[dict[str, Any]], xids: Any = None) -> dict[str, Any]:
    return {"rank": 3, "host": "node-a", "local_rank": 3, "status": "ok", "last_seen": 999.0,
            "epoch": 1, "hardware": None, "loss": 0.5, "gpu_xids": xids,
            "resources": {"cpu_percent": 1.0, "gpus": gpus}}


def test_gpu_health_gauges_per_gpu() -> None:
    text = scrape([entry([
        health_gpu(0, throttle_reasons=["sw_power_cap", "hw_thermal"], sm_clock_mhz=1410.0,
                   ecc_uncorrected=2, remapped_rows_pending=True, pcie_link_width=8,
                   pcie_link_gen=3, nvlink_errors=17),
        health_gpu(1)])], None)
    g0, g1 = L.format(g=0), L.format(g=1)
    assert f"rankboard_gpu_sm_clock_mhz{{{g0}}} 1410.0" in text
    assert f"rankboard_gpu_sm_clock_mhz{{{g1}}} 1980.0" in text
    assert f"rankboard_gpu_throttle{{{T.format(g=0, r='hw_thermal')}}} 1.0" in text
    assert f"rankboard_gpu_throttle{{{T.format(g=0, r='sw_power_cap')}}} 1.0" in text
    assert f"rankboard_gpu_throttle{{{T.format(g=0, r='hw_slowdown')}}} 0.0" in text
    assert f"rankboard_gpu_throttle{{{T.format(g=1, r='hw_thermal')}}} 0.0" in text
    assert f"rankboard_gpu_ecc_uncorrected{{{g0}}} 2.0" in text
    assert f"rankboard_gpu_remapped_rows_pending{{{g0}}} 1.0" in text
    assert f"rankboard_gpu_remapped_rows_pending{{{g1}}} 0.0" in text
    assert f"rankboard_gpu_remapped_rows_failed{{{g0}}} 0.0" in text
    assert f"rankboard_gpu_pcie_link_width{{{g0}}} 8.0" in text
    assert f"rankboard_gpu_pcie_link_width_max{{{g0}}} 16.0" in text
    assert f"rankboard_gpu_pcie_link_gen{{{g0}}} 3.0" in text
    assert f"rankboard_gpu_pcie_link_gen_max{{{g0}}} 5.0" in text
    assert f"rankboard_gpu_nvlink_errors_total{{{g0}}} 17.0" in text
    # every GPU that sends health fields has an XID counter, at 0 until one is seen
    assert f"rankboard_gpu_xid_errors_total{{{g0}}} 0.0" in text
    assert f"rankboard_gpu_xid_errors_total{{{g1}}} 0.0" in text
    assert "rankboard_gpu_last_xid{" not in text


def test_xid_tallies_come_from_the_broker_and_a_gpu_without_health_exports_nothing() -> None:
    plain = {"device_index": 1, "name": "old", "util_percent": 50.0}
    text = scrape([entry([health_gpu(0), plain],
                         xids=[{"gpu": 0, "count": 3, "last": 79}, {"gpu": 5, "count": 1, "last": 48}])])
    assert f"rankboard_gpu_xid_errors_total{{{L.format(g=0)}}} 3.0" in text
    assert f"rankboard_gpu_last_xid{{{L.format(g=0)}}} 79.0" in text
    # a GPU the latest sample left out keeps its tally
    assert f"rankboard_gpu_xid_errors_total{{{L.format(g=5)}}} 1.0" in text
    assert f"rankboard_gpu_last_xid{{{L.format(g=5)}}} 48.0" in text
    assert L.format(g=1) not in text


def test_webhook_and_journal_counters_from_the_heartbeat() -> None:
    beat = feed.encode_heartbeat("i1", 0.0, 10, {}, 1, webhooks_sent=4, webhooks_failed=2,
                                 webhooks_dropped=1,
                                 journal={"early_flushes": 5, "dropped_bytes": 0,
                                          "damaged_entries": 1, "runs_not_loaded": 2})
    text = scrape([], beat)
    assert "rankboard_webhooks_sent_total 4.0" in text
    assert "rankboard_webhooks_failed_total 2.0" in text
    assert "rankboard_webhooks_dropped_total 1.0" in text
    assert 'rankboard_journal_total{kind="early_flushes"} 5.0' in text
    assert 'rankboard_journal_total{kind="damaged_entries"} 1.0' in text
    assert 'rankboard_journal_total{kind="runs_not_loaded"} 2.0' in text
    assert 'rankboard_journal_total{kind="dropped_bytes"} 0.0' in text


def test_gpu_xids_are_feed_only() -> None:
    hub = ready_hub()
    hub.handle_pub(ev(2, "ranks", [entry([health_gpu(0)], xids=[{"gpu": 0, "count": 1, "last": 79}])]))
    state = hub.runs[RUN]
    assert "gpu_xids" not in state.ranks[0] and "loss" not in state.ranks[0]
    assert state.ranks_full[0]["gpu_xids"] == [{"gpu": 0, "count": 1, "last": 79}]
