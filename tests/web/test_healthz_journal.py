"""PROTOCOL 8.4 on a web, without sockets: ``/healthz`` ``journal`` (``"failing"`` while any
connected shard's broker says its journal writes fail; each ``shards`` entry its own) and the
data dir families on ``/metrics`` (summed over shards, as every broker counter)."""
from __future__ import annotations

from prometheus_client import generate_latest

from broker import feed
from web.app import create_app
from web.hub import Hub
from web.metrics import make_registry
from web.shards import ShardedHub, ShardHub

NOW = 1000.0


def _beat(hub: Hub, instance: str, **journal: int) -> None:
    hub._on_heartbeat(feed.Heartbeat(instance=instance, time=NOW, accepted=0, rejected={},
                                     late_metrics=0, runs=0, journal=journal))
    hub.instance = instance


def test_a_failing_shard_makes_the_web_journal_failing_while_it_is_connected() -> None:
    hubs = [ShardHub(clock=lambda: NOW) for _ in range(2)]
    sharded = ShardedHub(hubs)
    client = create_app(sharded, {"run_live": sharded.live}).test_client()
    _beat(hubs[0], "a", failing=0)
    _beat(hubs[1], "b", failing=1, write_failures=7)
    body = client.get("/healthz")
    assert body.status_code == 200
    assert body.get_json() == {"ok": True, "journal": "failing", "shards": [
        {"shard": 0, "connected": True, "journal": "ok"},
        {"shard": 1, "connected": True, "journal": "failing"}]}
    hubs[1].heartbeat_at = NOW - 60  # shard 1 is gone: only connected shards count
    body = client.get("/healthz").get_json()
    assert body["journal"] == "ok" and body["shards"][1]["journal"] == "failing"
    _beat(hubs[1], "b", failing=0, write_failures=7)  # its writes work again
    assert client.get("/healthz").get_json()["journal"] == "ok"


def test_one_broker_healthz_journal_and_the_data_dir_families() -> None:
    hub = Hub(clock=lambda: NOW)
    client = create_app(hub).test_client()
    _beat(hub, "a", failing=1, write_failures=3, data_dir_bytes=4096, runs_deleted_bytes=2,
          runs_deleted_days=1, retain_bytes=8192)
    body = client.get("/healthz")
    assert body.status_code == 200 and body.get_json()["journal"] == "failing"
    text = generate_latest(make_registry(hub)).decode()
    assert "rankboard_data_dir_bytes 4096.0" in text
    assert "rankboard_data_dir_retain_bytes 8192.0" in text
    assert "rankboard_journal_write_errors_total 3.0" in text
    assert 'rankboard_runs_deleted_total{reason="bytes"} 2.0' in text
    assert 'rankboard_runs_deleted_total{reason="days"} 1.0' in text
    assert 'kind="data_dir_bytes"' not in text and 'kind="failing"' not in text
    _beat(hub, "a", failing=0)
    assert client.get("/healthz").get_json()["journal"] == "ok"
    text = generate_latest(make_registry(hub)).decode()
    assert "\nrankboard_data_dir_retain_bytes " not in text  # no bound: no series
