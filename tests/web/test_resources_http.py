"""``GET /api/runs/<run>/resources`` through a real broker and a real ``rankboard web``
(issue 34, item 5): the cluster's resources over time, a point per ranks update from the
ranks' samples as they change, for a run that logs steps and no epoch; 404 for a run the web
does not hold."""
from __future__ import annotations

from typing import Any

from rank_agent import protocol
from tests.support.brokers import Pusher
from tests.support.http import fetch, get_json
from tests.support.polling import wait_for
from tests.support.procs import Proc
from tests.web.test_report import data_of

GIB = 1 << 30


def sample(cpu: float, util: float, vram_gib: int) -> protocol.ResourceSample:
    return protocol.ResourceSample(cpu_percent=cpu, ram_used_bytes=16 * GIB, ram_total_bytes=64 * GIB,
                                   gpu_util_percent=util, vram_allocated_bytes=vram_gib * GIB,
                                   vram_total_bytes=80 * GIB)


def test_a_step_runs_resources_over_time(web: Proc, pusher: Pusher) -> None:
    run = "res-steps"
    for rank in range(2):  # two hosts
        pusher.register(run, rank, 2, host=f"node-{rank}")
    path = f"/api/runs/{run}/resources"
    wait_for(lambda: fetch(web.port, path).status == 200, 15, "the run")

    def last_is(values: list[float]) -> Any:
        body = get_json(web.port, path)
        return body if body["points"] and body["points"][-1][1:] == values else None

    pusher.send(protocol.Resources(run=run, rank=0, sample=sample(20.0, 40.0, 20)),
                protocol.Resources(run=run, rank=1, sample=sample(40.0, 60.0, 60)))
    # CPU and RAM per host, GPU and VRAM per rank (a ranks update may come between the two
    # samples: then a point of rank 0's alone comes first)
    first = wait_for(lambda: last_is([30.0, 25.0, 50.0, 50.0]), 15, "a point of both samples")
    t = first["points"][-1][0]
    assert first["columns"] == ["time", "cpu_percent", "ram_percent", "gpu_util_percent",
                                "vram_percent"]
    # the samples change: a later point (at least ``every_s`` later) shows them
    pusher.send(protocol.Resources(run=run, rank=0, sample=sample(80.0, 90.0, 40)),
                protocol.Resources(run=run, rank=1, sample=sample(100.0, 100.0, 80)))

    body = wait_for(lambda: last_is([90.0, 25.0, 95.0, 75.0]), 15, "a point of the new samples")
    times = [p[0] for p in body["points"]]
    assert times == sorted(times) and times[-1] - t >= body["every_s"]
    assert get_json(web.port, f"/api/runs/{run}")["steps_done"] is None  # no epoch, no step
    # the one-file report carries the series as the web held it
    report = fetch(web.port, f"/api/runs/{run}/report.html")
    embedded = data_of(report.body.decode("utf-8"))["resources"]
    assert embedded["points"][: len(body["points"])] == body["points"]
    missing = fetch(web.port, "/api/runs/no-such-run/resources")
    assert missing.status == 404
