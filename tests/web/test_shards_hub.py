"""web/shards.py without sockets: N hubs read as one (PROTOCOL 7.3) — the home shard's copy
of a run id two shards hold, counters summed over the shards' last heartbeats, liveness by
shard; and the feed lists' pairing rule."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from broker import feed
from rank_agent.shards import shard_of
from web.app import create_app
from web.config import FeedError, feed_pairs
from web.hub import Hub
from web.metrics import make_registry
from web.runstate import RunState
from web.shards import ShardedHub, ShardHub, shard_states

NOW = 1000.0
RUN = next(r for r in (f"job-{i}" for i in range(64)) if shard_of(r, 2) == 1)
OTHER = next(r for r in (f"job-{i}" for i in range(64)) if shard_of(r, 2) == 0)


def _state(run: str, shard: int, started: float) -> RunState:
    state = RunState(run)
    state.set_header({"run": run, "status": "training", "shard": shard, "started_at": started})
    return state


def _beat(hub: Hub, instance: str, accepted: int, wrong: int) -> None:
    """A heartbeat through the hub's own handler, then its snapshot taken (connected)."""
    hub._on_heartbeat(feed.Heartbeat(instance=instance, time=NOW, accepted=accepted,
                                     rejected={"wrong_shard": wrong}, late_metrics=0, runs=1))
    hub.instance = instance


def _hubs() -> list[Hub]:
    return [ShardHub(clock=lambda: NOW) for _ in range(2)]


def test_a_run_two_shards_hold_is_the_home_shards() -> None:
    hubs = _hubs()
    hubs[0].runs[RUN] = _state(RUN, 0, 1.0)  # an old broker's journal still holds it
    hubs[1].runs[RUN] = _state(RUN, 1, 2.0)
    hubs[0].runs[OTHER] = _state(OTHER, 0, 3.0)
    sharded = ShardedHub(hubs)
    assert sharded.runs.get(RUN) is hubs[1].runs[RUN]
    assert sorted(sharded.runs) == sorted([RUN, OTHER]) and len(sharded.runs) == 2
    assert [s.run for s in sharded.runs_newest_first()] == [OTHER, RUN]
    assert sharded.shard_of_run(RUN) == 1 and sharded.shard_of_run("nope") is None
    del hubs[1].runs[RUN]  # its home shard does not hold it: the other copy is served
    assert sharded.runs.get(RUN) is hubs[0].runs[RUN]


def test_a_lone_register_on_the_new_shard_does_not_hide_the_live_run_on_the_old() -> None:
    """Issue 38: after N changed, the run's ranks still feed its old shard (whose journal
    holds it); one ``register`` sent to the shard the id hashes to now made a stub there,
    and the stub was served instead of the run. A stub (waiting, no record, no step) never
    shadows a copy holding more; once the new shard's copy holds more, it is the run."""
    hubs = _hubs()
    hubs[0].runs[RUN] = _state(RUN, 0, 1.0)  # the live run, on its old shard
    hubs[0].runs[RUN].records.append((1, {"epoch": 0}))
    stub = RunState(RUN)  # the lone register's copy, on the home shard
    stub.set_header({"run": RUN, "status": "waiting", "shard": 1, "started_at": 9.0})
    hubs[1].runs[RUN] = stub
    sharded = ShardedHub(hubs)
    assert sharded.runs.get(RUN) is hubs[0].runs[RUN] and sharded.shard_of_run(RUN) == 0
    assert [s for s in sharded.runs.values() if s.run == RUN] == [hubs[0].runs[RUN]]
    assert len(sharded.runs) == 1 and RUN in sharded.runs
    hubs[0].runs[RUN].set_header({"run": RUN, "status": "waiting", "shard": 0})
    hubs[0].runs[RUN].records.clear()  # two stubs: the home shard's, as before
    assert sharded.runs.get(RUN) is stub
    stub.set_header({"run": RUN, "status": "training", "shard": 1})
    assert sharded.runs.get(RUN) is stub and len(sharded.runs) == 1


def test_counters_summed_and_liveness_by_shard() -> None:
    hubs = _hubs()
    hubs[0].runs[OTHER] = _state(OTHER, 0, 1.0)
    hubs[1].runs[RUN] = _state(RUN, 1, 1.0)
    sharded = ShardedHub(hubs)
    assert sharded.heartbeat is None and not sharded.connected
    _beat(hubs[0], "a", 10, 1)
    _beat(hubs[1], "b", 5, 2)
    hb = sharded.heartbeat
    assert hb is not None and hb.accepted == 15 and hb.rejected == {"wrong_shard": 3}
    hubs[1].heartbeat_at = NOW - 60  # shard 1 went away: its last figures stay in the sum
    assert sharded.heartbeat.accepted == 15  # type: ignore[union-attr]
    _beat(hubs[1], "b2", 1, 0)  # it returned, a new instance counting from zero
    hb = sharded.heartbeat
    assert hb is not None and hb.accepted == 16 and hb.rejected == {"wrong_shard": 3}
    _beat(hubs[1], "b2", 4, 1)
    assert sharded.heartbeat.accepted == 19  # type: ignore[union-attr]
    hubs[1].heartbeat_at = NOW - 60
    assert sharded.connected and sharded.live(OTHER) and not sharded.live(RUN)
    assert shard_states(sharded) == [{"shard": 0, "connected": True},
                                     {"shard": 1, "connected": False}]
    text = generate_latest(make_registry(sharded)).decode()
    assert 'rankboard_shard_connected{shard="0"} 1.0' in text
    assert 'rankboard_shard_connected{shard="1"} 0.0' in text
    assert 'rankboard_frames_rejected_total{reason="wrong_shard"} 4.0' in text
    client = create_app(sharded, {"run_live": sharded.live}).test_client()
    health = client.get("/healthz")
    assert health.status_code == 200 and health.get_json()["shards"][1]["connected"] is False
    assert client.post(f"/api/runs/{RUN}/stacks").status_code == 503
    assert client.post("/api/runs/job-x/stacks").status_code == 404  # the 404 first
    hubs[0].heartbeat_at = NOW - 60
    assert client.get("/healthz").status_code == 503


def test_feed_pairs() -> None:
    assert feed_pairs("tcp://a:1", "tcp://a:2") == [("tcp://a:1", "tcp://a:2")]
    assert feed_pairs("tcp://a:1, tcp://b:1", "tcp://a:2,tcp://b:2") == [
        ("tcp://a:1", "tcp://a:2"), ("tcp://b:1", "tcp://b:2")]
    with pytest.raises(FeedError, match="--publish lists 2"):
        feed_pairs("tcp://a:1,tcp://b:1", "tcp://a:2")
    with pytest.raises(FeedError, match="empty endpoint"):
        feed_pairs("tcp://a:1,", "tcp://a:2,tcp://b:2")


def test_web_cli_refuses_lists_that_do_not_pair(capsys: pytest.CaptureFixture[str]) -> None:
    from rankboard import cli

    assert cli.main(["web", "--publish", "tcp://a:1,tcp://b:1", "--snapshot", "tcp://a:2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rankboard web: --publish lists 2")
    assert cli.main(["broker", "--publish", "tcp://a:1,tcp://b:1"]) == 2
    assert "one endpoint" in capsys.readouterr().err
