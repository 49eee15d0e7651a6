"""The cluster routes end to end (PROTOCOL 7.4): real wire frames into a real broker, a real
web subprocess, HTTP over loopback. A GPU that reports an XID, and a host whose ranks fail
in two jobs, become suspects on ``/api/hosts`` and ``/metrics``; ``/api/runs`` filters; a
run evicted at ``--max-runs`` leaves them."""
from __future__ import annotations

from typing import Any

from rank_agent import protocol
from tests.support.brokers import Pusher
from tests.support.http import fetch, get_json
from tests.support.polling import wait_for
from tests.support.procs import start_broker, start_web


def _xid_sample() -> protocol.ResourceSample:
    return protocol.ResourceSample(gpu_util_percent=90.0, gpus=[protocol.GpuSample(
        device_index=0, name="H100", util_percent=90.0, xid_errors=[79])])


def _hosts(port: int, pred: Any, what: str) -> list[dict[str, Any]]:
    def check() -> Any:
        hosts = get_json(port, "/api/hosts")
        return hosts if pred(hosts) else None
    return wait_for(check, what=what)


def test_hosts_runs_filters_and_the_suspect_metric(web: Any, pusher: Pusher) -> None:
    pusher.register("job-a", 0, 2, host="node-1")
    pusher.register("job-a", 1, 2, host="node-2", local_rank=0)
    pusher.send(protocol.Svg(run="job-a", rank=0, svg="<svg/>", label="ResNet sweep"))
    pusher.send(protocol.Resources(run="job-a", rank=1, sample=_xid_sample()))
    for run in ("job-b", "job-c"):  # rank 1 of 2 fails: half the run (8.5), its host's
        pusher.register(run, 0, 2, host="node-1")
        pusher.register(run, 1, 2, host="node-3")
        pusher.send(protocol.Finish(run=run, rank=1, status="error"))
        pusher.send(protocol.Finish(run=run, rank=0, status="ok"))

    hosts = _hosts(web.port, lambda hs: len(hs) == 3 and all(
        h["incidents"] for h in hs if h["host"] != "node-1")
        and sum(len(h["incidents"]) for h in hs) >= 3, "every incident on /api/hosts")
    by_name = {h["host"]: h for h in hosts}
    assert by_name["node-2"]["suspect"] is True
    assert by_name["node-2"]["reasons"] == ["gpu_xid in job-a"]
    assert by_name["node-2"]["runs"] == [{"run": "job-a", "ranks": [1]}]
    assert [(i["run"], i["rank"], i["kind"]) for i in by_name["node-2"]["incidents"]] == [
        ("job-a", 1, "gpu_xid")]
    node3 = by_name["node-3"]
    assert node3["suspect"] is True and node3["reasons"] == ["incidents in 2 runs"]
    assert node3["ranks"] == 2 and {r["run"] for r in node3["runs"]} == {"job-b", "job-c"}
    assert {(i["run"], i["kind"]) for i in node3["incidents"]} == {("job-b", "rank_error"),
                                                                   ("job-c", "rank_error")}
    assert by_name["node-1"]["suspect"] is False and by_name["node-1"]["incidents"] == []
    assert [h["host"] for h in hosts][-1] == "node-1"  # suspects first

    text = fetch(web.port, "/metrics").text
    assert 'rankboard_host_suspect{host="node-2"} 1.0' in text
    assert 'rankboard_host_suspect{host="node-3"} 1.0' in text
    assert 'rankboard_host_suspect{host="node-1"} 0.0' in text

    failed = wait_for(lambda: [r["run"] for r in get_json(web.port, "/api/runs?status=failed")]
                      or None, what="two failed runs")
    assert sorted(failed) == ["job-b", "job-c"]
    everything = get_json(web.port, "/api/runs")
    assert len(everything) == 3
    a = next(r for r in everything if r["run"] == "job-a")
    assert (a["shard"], a["alerts"], a["ranks_stale"], a["ranks_stalled"]) == (0, 1, 0, 0)
    assert [r["run"] for r in get_json(web.port, "/api/runs?q=resnet")] == ["job-a"]
    assert get_json(web.port, "/api/runs?limit=2&offset=1") == everything[1:3]
    assert get_json(web.port, "/api/runs?status=&q=&limit=&offset=") == everything

    bad = fetch(web.port, "/api/runs?status=running")
    assert bad.status == 400 and bad.json() == {
        "error": "unknown run status 'running' (one of waiting, training, complete, failed)"}
    assert fetch(web.port, "/api/runs?limit=10001").status == 400


def test_a_run_evicted_at_max_runs_leaves_the_hosts_and_the_metric(spawn: Any,
                                                                    tmp_path: Any) -> None:
    """``--max-runs`` (PROTOCOL 6) bounds the webs too: the evicted run's hosts and
    incidents go from ``/api/hosts``, ``/api/runs`` and ``rankboard_host_suspect``."""
    _, ends = start_broker(spawn, tmp_path / "data", "--max-runs", "2")
    web = start_web(spawn, ends)
    pusher = Pusher(ends.ingest)
    try:
        pusher.register("old", 0, 2, host="gone-host")  # half the run failed: its host's
        pusher.register("old", 1, 2, host="gone-host")
        pusher.send(protocol.Finish(run="old", rank=0, status="error"))
        pusher.send(protocol.Finish(run="old", rank=1, status="ok"))
        pusher.register("mid", 0, 1, host="kept-host")
        _hosts(web.port, lambda hs: {h["host"] for h in hs} == {"gone-host", "kept-host"}
               and any(h["incidents"] for h in hs), "both hosts, the old run's incident")
        assert 'rankboard_host_suspect{host="gone-host"}' in fetch(web.port, "/metrics").text
        pusher.register("new", 0, 1, host="new-host")  # a third run: the finished one goes
        hosts = _hosts(web.port, lambda hs: {h["host"] for h in hs} == {"kept-host", "new-host"},
                       "the evicted run's host gone")
        assert all(h["incidents"] == [] for h in hosts)
        assert {r["run"] for r in get_json(web.port, "/api/runs")} == {"mid", "new"}
        assert "gone-host" not in fetch(web.port, "/metrics").text
    finally:
        pusher.close()
