"""Hosts, fairly (PROTOCOL 8.5): an alert kind among ``stalled``, ``stale``, ``rank_error``,
``data_straggler`` and ``nonfinite`` raised by more than half of a run's world size (distinct
ranks, counted past the alert list's cap) is the run's, not a host's; an alert blames the
host its rank had when it was last raised. The broker's side (the alert's ``host``, the
distinct-rank count) through a real :class:`RunSink`; the web's rule over real
:class:`RunState` objects in a real :class:`Hub`. Pure: no sockets."""
from __future__ import annotations

from typing import Any

import pytest

from broker.run.alerts import MAX_ALERTS_PER_KIND, RunAlerts
from broker.run.sink import RunSink
from rank_agent.protocol import Finish, Register
from tests.support.sinkframes import wire
from web.cluster import alert_host, runs_own_kinds
from web.hub import Hub
from web.runstate import RunState


def _hub_with(*headers: dict[str, Any]) -> Hub:
    hub = Hub(clock=lambda: 1000.0)
    for header in headers:
        state = RunState(header["run"])
        state.set_header(header)
        hub.runs[header["run"]] = state
    return hub


def _sink_header(run: str, world: int, hosts: dict[int, str], errors: list[int]) -> dict:
    """A real sink's header: ``world`` ranks placed on ``hosts``, ``errors`` finishing with
    an error (``rank_error``), the others still training."""
    sink = RunSink(run)
    for rank in range(world):
        sink.apply(wire(Register(run=run, rank=rank, world_size=world, host=hosts[rank],
                                 local_rank=rank)), 1.0)
    for rank in errors:
        sink.apply(wire(Finish(run=run, rank=rank, status="error")), 2.0)
    return sink.header()


def _by_host(hub: Hub) -> dict[str, dict[str, Any]]:
    return {h["host"]: h for h in hub.cluster.hosts(hub)}


def test_more_than_half_is_the_runs_exactly_half_is_the_hosts() -> None:
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    most = _sink_header("most", 4, hosts, [0, 1, 2])  # 3 of 4: a job-wide failure
    half = _sink_header("half", 4, hosts, [2, 3])  # 2 of 4: exactly half still counts
    assert most["alert_ranks"] == {"rank_error": 3} and half["alert_ranks"] == {"rank_error": 2}
    assert runs_own_kinds(most) == {"rank_error"} and runs_own_kinds(half) == frozenset()
    table = _by_host(_hub_with(most, half))
    assert table["a"]["incidents"] == []  # "most" blames nobody
    assert [(i["run"], i["rank"]) for i in table["b"]["incidents"]] == [("half", 2), ("half", 3)]


def test_the_count_goes_past_the_alert_lists_cap() -> None:
    """1,500 of 2,000 ranks stalled: the list keeps 100 of them, the run still owns the kind."""
    alerts = RunAlerts()
    place = {r: (f"node-{r // 8}", r % 8) for r in range(2000)}.get
    for r in range(1500):
        alerts.raise_("big", "stalled", r, "stalled 70s in all_reduce", float(r), place, False)
    listed = alerts.listed()
    assert sum(a["kind"] == "stalled" and a["rank"] is not None for a in listed) \
        == MAX_ALERTS_PER_KIND
    assert alerts.ranks_raised() == {"stalled": 1500}
    header = {"run": "big", "world_size": 2000, "alerts": listed,
              "alert_ranks": alerts.ranks_raised(),
              "hosts": [{"host": f"node-{h}", "ranks": list(range(8 * h, 8 * h + 8))}
                        for h in range(250)]}
    assert runs_own_kinds(header) == {"stalled"}
    hub = _hub_with(header)
    assert all(not h["incidents"] for h in hub.cluster.hosts(hub))
    # without the broker's count (a header from before 8.5) the 100 listed ranks decide
    older = {**header, "alert_ranks": None}
    assert runs_own_kinds(older) == frozenset()


def test_a_re_raise_counts_a_rank_once_and_forgetting_ranks_uncounts_them() -> None:
    alerts = RunAlerts()
    for _ in range(3):
        for r in (1, 5, 9, 13):
            alerts.raise_("r", "stale", r, "silent", 1.0, lambda _: None, False)
    alerts.raise_("r", "stale", None, "run-wide", 1.0, lambda _: None, False)
    assert alerts.ranks_raised() == {"stale": 4}
    alerts.forget_ranks_from(9)  # ranks 9 and 13 turned out past the world size
    assert alerts.ranks_raised() == {"stale": 2}
    alerts.raise_("r", "stale", 10**9, "no such rank", 1.0, lambda _: None, False)
    assert alerts.ranks_raised() == {"stale": 2}  # bounded: never a giant bitmap


def test_the_rank_counts_survive_a_journal_round_trip() -> None:
    """What a journal of the alert list keeps beside its entries: the bitmaps, merged with
    whatever a replay raised again, each rank once."""
    alerts = RunAlerts()
    for r in range(0, 1200, 3):
        alerts.raise_("r", "stalled", r, "stalled", 1.0, lambda _: None, False)
    saved = alerts.ranks_state()
    again = RunAlerts()
    again.raise_("r", "stalled", 3, "stalled", 2.0, lambda _: None, False)  # replayed too
    again.raise_("r", "stalled", 1, "stalled", 2.0, lambda _: None, False)  # new since
    again.restore_ranks(saved)
    assert again.ranks_raised() == {"stalled": 400 + 1}
    again.restore_ranks({"stale": b"\xff" * 10_000})  # past 65,536 bits: cut there
    assert again.ranks_raised()["stale"] == 65_536


@pytest.mark.parametrize("kind", ["gpu_xid", "gpu_ecc", "gpu_row_remap", "gpu_throttle",
                                  "collective_behind"])
def test_gpu_health_and_collective_behind_are_always_their_hosts(kind: str) -> None:
    header = {"run": "r", "world_size": 2, "alert_ranks": {kind: 2},
              "hosts": [{"host": "a", "ranks": [0]}, {"host": "b", "ranks": [1]}],
              "alerts": [{"kind": kind, "rank": r, "message": "m", "at": 1.0, "host": h}
                         for r, h in ((0, "a"), (1, "b"))]}
    assert runs_own_kinds(header) == frozenset()
    table = _by_host(_hub_with(header))
    assert [i["kind"] for i in table["a"]["incidents"]] == [kind]
    assert [i["kind"] for i in table["b"]["incidents"]] == [kind]


def test_an_alert_blames_the_host_its_rank_had_when_last_raised() -> None:
    """A job requeued onto other nodes: the old node keeps its XID, the new one blames
    nobody for it; the broker keeps the host on the alert and updates it on a re-raise."""
    sink = RunSink("requeued")
    sink.apply(wire(Register(run="requeued", rank=0, world_size=2, host="old-node")), 1.0)
    sink.alerts.raise_("requeued", "gpu_xid", 0, "XID 79", 2.0, sink.topology.place.get, False)
    sink.apply(wire(Register(run="requeued", rank=0, world_size=2, host="new-node")), 3.0)
    header = sink.header()
    (alert,) = header["alerts"]
    assert alert["host"] == "old-node"
    hub = _hub_with(header)
    table = _by_host(hub)
    assert table["old-node"]["suspect"] is True
    assert table["old-node"]["runs"] == [] and table["old-node"]["ranks"] == 0
    assert table["new-node"]["incidents"] == [] and table["new-node"]["suspect"] is False
    assert hub.cluster.suspects(hub) == {
        "new-node": False, "old-node": True}
    sink.alerts.raise_("requeued", "gpu_xid", 0, "XID 79 again", 4.0, sink.topology.place.get,
                       False)
    assert sink.header()["alerts"][0]["host"] == "new-node"


def test_an_alert_without_a_host_falls_back_to_the_runs_topology() -> None:
    owner = {3: "n3"}
    assert alert_host({"kind": "stale", "rank": 3}, owner) == "n3"  # a pre-8.5 header
    assert alert_host({"kind": "stale", "rank": 3, "host": None}, owner) == "n3"
    assert alert_host({"kind": "stale", "rank": 3, "host": "n9"}, owner) == "n9"
    assert alert_host({"kind": "stale", "rank": 4, "host": None}, owner) is None


def test_an_unknown_world_size_judges_nothing_run_wide() -> None:
    header = {"run": "r", "world_size": None, "alert_ranks": {"stalled": 5},
              "alerts": [{"kind": "stalled", "rank": r, "at": 1.0} for r in range(5)]}
    assert runs_own_kinds(header) == frozenset()


def test_judged_in_the_attempt_the_alert_was_last_raised_against_its_world_size() -> None:
    """(8.1 with 8.5) Attempt 0 (4 ranks): 3 ranks fail, the job's trouble. Attempt 1, an
    elastic job of 8: one rank fails, its host's. Judged over the whole run, 4 distinct
    ranks of 8 would blame every host; judged per attempt, attempt 0's alerts stay the
    run's and attempt 1's one is its host's."""
    run = "elastic"
    sink = RunSink(run)
    for rank in range(4):
        sink.apply(wire(Register(run=run, rank=rank, world_size=4, host="a" if rank < 2 else "b",
                                 proc=f"p{rank}")), 1.0)
    for rank in (0, 1, 2):
        sink.apply(wire(Finish(run=run, rank=rank, status="error")), 2.0)
    for rank in range(8):
        sink.apply(wire(Register(run=run, rank=rank, world_size=8, host=f"n{rank // 2}",
                                 proc=f"q{rank}")), 10.0)
    assert sink.attempt == 1
    sink.apply(wire(Finish(run=run, rank=5, status="error")), 11.0)
    header = sink.header()
    assert header["alert_attempts"] == {"rank_error": [[0, 3], [1, 1]]}
    table = _by_host(_hub_with(header))
    blamed = {h: [(i["rank"], i["kind"]) for i in row["incidents"]] for h, row in table.items()}
    assert blamed.get("n2") == [(5, "rank_error")]  # attempt 1: 1 of 8, its host's
    assert not blamed.get("a") and not blamed.get("b")  # attempt 0: 3 of 4, the run's
