"""The cluster view's rules (PROTOCOL 7.4, ``web/cluster.py``) without sockets: the
``/api/runs`` filters and counts, ``/api/hosts`` (incidents, ``suspect``, ``reasons``, the
order) and ``rankboard_host_suspect``, over real :class:`RunState` objects in a real
:class:`Hub`, and through the app's test client for the HTTP answers (400s)."""
from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest

from web.app import create_app
from web.cluster import BadFilter, ClusterIndex, RunsFilter, parse_runs_filter
from web.hub import Hub
from web.metrics import make_registry
from web.runstate import RunState


def put(hub: Hub, run: str, *, started: float, status: str = "training",
        hosts: dict[str, list[int]] | None = None, alerts: list[tuple[str, int | None, float]] = (),
        ranks: dict[int, str] | None = None, label: str | None = None,
        shard: int | None = None, world: int | None = None) -> RunState:
    """A run as the hub holds it after the broker's ``run`` and ``ranks`` events."""
    state = RunState(run)
    header: dict[str, Any] = {
        "run": run, "status": status, "world_size": world, "label": label,
        "started_at": started, "updated_at": started + 1.0,
        "hosts": [{"host": h, "ranks": r} for h, r in (hosts or {}).items()],
        "alerts": [{"kind": k, "rank": r, "message": "m", "at": at} for k, r, at in alerts],
    }
    if shard is not None:
        header["shard"] = shard
    state.set_header(header)
    state.set_ranks([{"rank": r, "status": s} for r, s in (ranks or {}).items()], 1)
    hub.runs[run] = state
    return state


@pytest.fixture
def hub() -> Hub:
    return Hub(clock=lambda: 1000.0)


# ------------------------------------------------------------------- the filters
def test_a_query_without_filters_keeps_everything_and_empty_values_are_absent() -> None:
    assert parse_runs_filter({}) == RunsFilter()
    assert parse_runs_filter({"status": "", "q": "", "limit": "", "offset": ""}) == RunsFilter()
    assert parse_runs_filter({"token": "secret", "other": "x"}) == RunsFilter()


def test_filters_parse() -> None:
    f = parse_runs_filter({"status": "training, failed", "q": "ResNet", "limit": "20",
                           "offset": "40"})
    assert f == RunsFilter(statuses=frozenset({"training", "failed"}), q="resnet", limit=20,
                           offset=40)
    assert parse_runs_filter({"limit": "1"}).limit == 1
    assert parse_runs_filter({"limit": "10000"}).limit == 10_000
    assert parse_runs_filter({"offset": "0"}).offset == 0


@pytest.mark.parametrize("args, reason", [
    ({"status": "running"}, "unknown run status 'running'"),
    ({"status": "training,Failed"}, "unknown run status 'Failed'"),
    ({"limit": "0"}, "limit must be an integer from 1 to 10000"),
    ({"limit": "10001"}, "limit must be an integer from 1 to 10000"),
    ({"limit": "-5"}, "limit must be an integer from 1 to 10000"),
    ({"limit": "2.5"}, "limit must be an integer from 1 to 10000"),
    ({"limit": "abc"}, "limit must be an integer from 1 to 10000"),
    ({"offset": "-1"}, "offset must be an integer >= 0"),
    ({"offset": "1e3"}, "offset must be an integer >= 0"),
    ({"offset": "٣"}, "offset must be an integer >= 0"),  # a digit, but not an ASCII one
])
def test_bad_filter_values_are_refused_with_a_reason(args: dict[str, str], reason: str) -> None:
    with pytest.raises(BadFilter) as exc:
        parse_runs_filter(args)
    assert str(exc.value).startswith(reason)
    assert "\n" not in str(exc.value)


def test_runs_filtered_by_status_and_search_then_paged_newest_first(hub: Hub) -> None:
    for i in range(10):
        put(hub, f"job-{i}", started=float(i), status="failed" if i % 3 == 0 else "training",
            label="ResNet sweep" if i % 2 else None)
    index = hub.cluster
    assert [r["run"] for r in index.runs(hub, RunsFilter())] == [f"job-{i}" for i in range(9, -1, -1)]
    failed = index.runs(hub, parse_runs_filter({"status": "failed"}))
    assert [r["run"] for r in failed] == ["job-9", "job-6", "job-3", "job-0"]
    by_label = index.runs(hub, parse_runs_filter({"q": "resnet"}))
    assert [r["run"] for r in by_label] == ["job-9", "job-7", "job-5", "job-3", "job-1"]
    by_id = index.runs(hub, parse_runs_filter({"q": "JOB-4"}))
    assert [r["run"] for r in by_id] == ["job-4"]
    page = index.runs(hub, parse_runs_filter({"status": "training,failed", "limit": "3",
                                              "offset": "2"}))
    assert [r["run"] for r in page] == ["job-7", "job-6", "job-5"]
    assert index.runs(hub, parse_runs_filter({"offset": "10"})) == []
    assert index.runs(hub, parse_runs_filter({"status": "complete"})) == []


def test_run_entries_carry_the_counts_and_the_shard(hub: Hub) -> None:
    state = put(hub, "a", started=1.0, world=4, shard=2, alerts=[("stale", 1, 5.0),
                                                                 ("nonfinite_loss", None, 6.0)],
                ranks={0: "ok", 1: "stale", 2: "stalled", 3: "stalled"})
    state.steps.append([{"step": s, "time": 1.0, "n": 4, "metrics": {}, "step_ms": None,
                         "slowest_rank": None, "samples": 0, "tokens": 0} for s in (7, 8)])
    put(hub, "b", started=0.0)
    a, b = hub.cluster.runs(hub, RunsFilter())
    assert a == {"run": "a", "status": "training", "world_size": 4, "total_epochs": None,
                 "epochs_done": 0, "label": None, "started_at": 1.0, "updated_at": 2.0,
                 "shard": 2, "ranks_stalled": 2, "ranks_stale": 1, "alerts": 2,
                 "steps_done": 8, "attempt": 0}  # (8.1)
    assert (b["shard"], b["ranks_stalled"], b["ranks_stale"], b["alerts"], b["steps_done"]) == (
        0, 0, 0, 0, None)
    # a new ranks array is counted afresh (the cache keys on the array, not the run)
    state.set_ranks([{"rank": 0, "status": "stale"}], 2)
    assert hub.cluster.runs(hub, RunsFilter())[0]["ranks_stale"] == 1
    assert hub.cluster.runs(hub, RunsFilter())[0]["ranks_stalled"] == 0


# --------------------------------------------------------------------- the hosts
def test_hosts_incidents_suspects_and_reasons(hub: Hub) -> None:
    put(hub, "run-a", started=1.0, hosts={"n1": [1, 0], "n2": [2, 3]},
        alerts=[("gpu_xid", 0, 50.0), ("gpu_xid", 1, 40.0), ("stale", 2, 30.0),
                ("nonfinite_loss", None, 60.0), ("nonfinite_loss", 3, 61.0),
                ("collective_mismatch", 3, 62.0)])
    put(hub, "run-b", started=2.0, hosts={"n2": [0], "n3": [1]},
        alerts=[("stalled", 0, 45.0), ("gpu_ecc", 1, 10.0), ("data_straggler", 7, 70.0)])
    put(hub, "run-c", started=3.0, hosts={"n4": [0], "": [1]}, alerts=[("rank_error", 1, 5.0)])
    hosts = hub.cluster.hosts(hub)
    assert [h["host"] for h in hosts] == ["n1", "n2", "n3", "n4"]
    n1, n2, n3, n4 = hosts
    assert n1 == {
        "host": "n1", "runs": [{"run": "run-a", "ranks": [0, 1]}], "ranks": 2,
        "incidents": [{"run": "run-a", "rank": 0, "kind": "gpu_xid", "at": 50.0},
                      {"run": "run-a", "rank": 1, "kind": "gpu_xid", "at": 40.0}],
        "suspect": True, "reasons": ["gpu_xid in run-a"],
    }
    # newest run first; incidents of two runs make it suspect with no hardware kind
    assert n2["runs"] == [{"run": "run-b", "ranks": [0]}, {"run": "run-a", "ranks": [2, 3]}]
    assert n2["ranks"] == 3
    assert [(i["run"], i["kind"]) for i in n2["incidents"]] == [("run-b", "stalled"),
                                                                ("run-a", "stale")]
    assert (n2["suspect"], n2["reasons"]) == (True, ["incidents in 2 runs"])
    assert (n3["suspect"], n3["reasons"]) == (True, ["gpu_ecc in run-b"])
    # rank 7 is on no known host and rank 1 of run-c has none: nobody's incidents
    assert n4 == {"host": "n4", "runs": [{"run": "run-c", "ranks": [0]}], "ranks": 1,
                  "incidents": [], "suspect": False, "reasons": []}


def test_reasons_name_each_hardware_kind_and_run_once_newest_first_then_the_run_count(
        hub: Hub) -> None:
    put(hub, "r1", started=1.0, hosts={"n": [0, 1]},
        alerts=[("gpu_xid", 0, 10.0), ("gpu_xid", 1, 30.0), ("gpu_row_remap", 0, 20.0),
                ("gpu_throttle", 1, 99.0)])
    put(hub, "r2", started=2.0, hosts={"n": [0]}, alerts=[("gpu_xid", 0, 25.0)])
    (n,) = hub.cluster.hosts(hub)
    assert n["reasons"] == ["gpu_xid in r1", "gpu_xid in r2", "gpu_row_remap in r1",
                            "incidents in 2 runs"]
    assert [i["at"] for i in n["incidents"]] == [99.0, 30.0, 25.0, 20.0, 10.0]


def test_equal_times_order_by_run_rank_kind_and_hosts_by_suspect_count_name(hub: Hub) -> None:
    put(hub, "b", started=1.0, hosts={"x": [0, 1], "y": [2]},
        alerts=[("stale", 1, 5.0), ("stalled", 0, 5.0), ("stale", 0, 5.0), ("stale", 2, 1.0),
                ("gpu_pcie", 2, 2.0)])
    put(hub, "a", started=2.0, hosts={"x": [0], "z": [1], "w": [2]},
        alerts=[("rank_error", 0, 5.0), ("gpu_nvlink", 1, 1.0)])
    hosts = hub.cluster.hosts(hub)
    x = hosts[0]
    assert [(i["run"], i["rank"], i["kind"]) for i in x["incidents"]] == [
        ("a", 0, "rank_error"), ("b", 0, "stale"), ("b", 0, "stalled"), ("b", 1, "stale")]
    # x: suspect (2 runs); then the others by incidents (y: 2, z: 1, w: 0)
    assert [(h["host"], h["suspect"], len(h["incidents"])) for h in hosts] == [
        ("x", True, 4), ("y", False, 2), ("z", False, 1), ("w", False, 0)]


def test_one_run_with_many_soft_incidents_is_not_suspect(hub: Hub) -> None:
    put(hub, "r", started=1.0, hosts={"n": [0, 1]},
        alerts=[(k, 0, 1.0) for k in ("gpu_pcie", "gpu_nvlink", "gpu_throttle", "stalled",
                                      "stale", "rank_error", "data_straggler",
                                      "collective_behind")])
    (n,) = hub.cluster.hosts(hub)
    assert len(n["incidents"]) == 8 and n["suspect"] is False and n["reasons"] == []


def test_the_index_follows_new_headers_and_forgets_dropped_runs(hub: Hub) -> None:
    state = put(hub, "r", started=1.0, hosts={"n": [0]})
    put(hub, "s", started=2.0, hosts={"m": [0]})
    assert hub.cluster.hosts(hub)[0]["suspect"] is False
    header = dict(state.header, alerts=[{"kind": "gpu_ecc", "rank": 0, "message": "",
                                         "at": 3.0}])
    state.set_header(header)  # a new run event: a new header object
    assert hub.cluster.hosts(hub)[0]["reasons"] == ["gpu_ecc in r"]
    assert hub.cluster.suspects(hub) == {"n": True, "m": False}
    hub.drop_run("r")  # evicted (--max-runs) or gone from the snapshot
    assert [h["host"] for h in hub.cluster.hosts(hub)] == ["m"]
    assert hub.cluster.suspects(hub) == {"m": False}
    assert set(hub.cluster._hosts) == {"s"}


def test_an_alert_without_a_time_sorts_last_and_is_null(hub: Hub) -> None:
    put(hub, "r", started=1.0, hosts={"n": [0]})
    state = hub.runs["r"]
    state.set_header(dict(state.header, alerts=[
        {"kind": "stale", "rank": 0, "message": "", "at": None},
        {"kind": "stalled", "rank": 0, "message": "", "at": 2.0},
        {"kind": "stale", "rank": True, "message": "", "at": 3.0},  # not a rank
        "junk"]))
    (n,) = hub.cluster.hosts(hub)
    assert n["incidents"] == [{"run": "r", "rank": 0, "kind": "stalled", "at": 2.0},
                              {"run": "r", "rank": 0, "kind": "stale", "at": None}]


def test_suspects_agree_with_hosts(hub: Hub) -> None:
    put(hub, "a", started=1.0, hosts={"n1": [0], "n2": [1], "n3": [2]},
        alerts=[("gpu_xid", 0, 1.0), ("stale", 1, 1.0)])
    put(hub, "b", started=2.0, hosts={"n2": [0], "n3": [1]}, alerts=[("stale", 0, 1.0)])
    assert hub.cluster.suspects(hub) == {h["host"]: h["suspect"] for h in hub.cluster.hosts(hub)}
    assert hub.cluster.suspects(hub) == {"n1": True, "n2": True, "n3": False}


def test_host_suspect_metric(hub: Hub) -> None:
    put(hub, "a", started=1.0, hosts={'n"1': [0], "n2": [1]}, alerts=[("gpu_xid", 0, 1.0)])
    text = generate_latest(make_registry(hub)).decode()
    assert 'rankboard_host_suspect{host="n\\"1"} 1.0' in text
    assert 'rankboard_host_suspect{host="n2"} 0.0' in text


# -------------------------------------------------------------- through the app
@pytest.fixture
def client(hub: Hub) -> Any:
    app = create_app(hub, {"allowed_hosts": ["localhost"]})
    return app.test_client()


def test_api_runs_and_hosts_over_the_app(client: Any, hub: Hub) -> None:
    put(hub, "a", started=1.0, status="failed", hosts={"n": [0]}, alerts=[("gpu_ecc", 0, 2.0)])
    put(hub, "b", started=2.0)
    resp = client.get("/api/runs?status=failed", headers={"Host": "localhost"})
    assert resp.status_code == 200 and resp.headers["Cache-Control"] == "no-store"
    assert [r["run"] for r in resp.get_json()] == ["a"]
    assert [r["run"] for r in client.get("/api/runs", headers={"Host": "localhost"})
            .get_json()] == ["b", "a"]
    hosts = client.get("/api/hosts", headers={"Host": "localhost"})
    assert hosts.status_code == 200 and hosts.headers["Cache-Control"] == "no-store"
    assert hosts.get_json()[0]["reasons"] == ["gpu_ecc in a"]
    # the Host check guards the new routes as every other
    assert client.get("/api/hosts", headers={"Host": "evil.example"}).status_code == 421


@pytest.mark.parametrize("query", ["status=bogus", "limit=0", "limit=x", "offset=-1",
                                   "status=training,nope&limit=5"])
def test_bad_values_are_400_with_one_line(client: Any, query: str) -> None:
    resp = client.get(f"/api/runs?{query}", headers={"Host": "localhost"})
    assert resp.status_code == 400
    body = resp.get_json()
    assert set(body) == {"error"} and body["error"] and "\n" not in body["error"]
    assert "Traceback" not in resp.get_data(as_text=True)


def test_the_index_is_per_hub() -> None:
    assert Hub().cluster is not Hub().cluster
    assert isinstance(Hub().cluster, ClusterIndex)
