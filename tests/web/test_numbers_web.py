"""Numbers that go wrong (PROTOCOL.md 8.3) through real sockets: a real broker (with its
journal) and a real ``rankboard web``: the header's ``nonfinite`` and ``replica_divergence``,
their alerts, ``/api/hosts`` (both kinds as incidents, a diverging host ``suspect``),
``/metrics`` per-run counts, ``report.html``, and all of it again after the broker restarts
on its data dir."""
from __future__ import annotations

import math
import subprocess
import sys
import time
from typing import Any, Callable, Optional

from rank_agent import protocol
from tests.support.brokers import Pusher
from tests.support.http import fetch, get_json
from tests.support.polling import wait_for
from tests.support.procs import Proc, start_web

RUN = "numbers-web"
WORLD = 4
HOSTS = ["node-a", "node-a", "node-b", "node-c"]


def push(p: Pusher, first: int, last: int) -> None:
    """Steps first..last of every rank: ``loss`` NaN on ranks 1 and 2 from step 30, inf on
    rank 0 from 40; ``grad_norm`` (replicated) off on rank 3 (node-c) from step 20."""
    now = time.time()
    steps = list(range(first, last + 1))
    for rank in range(WORLD):
        loss = [math.inf if (rank == 0 and s >= 40) else
                math.nan if (rank in (1, 2) and s >= 30) else 1.0 + rank for s in steps]
        gn = [2.75 if (rank == 3 and s >= 20) else 2.5 for s in steps]
        p.send(protocol.Steps(run=RUN, rank=rank, steps=steps, times=[now] * len(steps),
                              step_ms=[100.0] * len(steps),
                              metrics={"loss": loss, "grad_norm": gn}))  # type: ignore[dict-item]


def header(port: int) -> Optional[dict[str, Any]]:
    r = fetch(port, f"/api/runs/{RUN}")
    return r.json() if r.status == 200 else None


def settled(port: int) -> Optional[dict[str, Any]]:
    """The header once steps up to 59 closed and both kinds of alert are listed."""
    h = header(port)
    if not h or h["steps_done"] != 59:
        return None
    kinds = {a["kind"] for a in h["alerts"]}
    return h if {"nonfinite", "replica_divergence"} <= kinds else None


def metric(port: int, line_start: str) -> Optional[float]:
    for line in fetch(port, "/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def check(port: int) -> dict[str, Any]:
    h = wait_for(lambda: settled(port), what="steps closed and 8.3 alerts listed")
    assert h["nonfinite"] == [{"metric": "loss", "step": 30, "rank": 1, "host": "node-a",
                               "ranks": [1, 2], "attempt": 0}]
    assert h["nonfinite_more"] == 0
    assert h["replica_divergence"] == [{"metric": "grad_norm", "first_step": 20,
                                        "last_step": 59, "count": 40, "ranks": [3],
                                        "majority": 2.5}]
    mine = sorted((a["kind"], a["rank"], a["message"]) for a in h["alerts"]
                  if a["kind"] in ("nonfinite", "replica_divergence"))
    assert mine == [
        ("nonfinite", 1, "loss is nan at step 30: first non-finite loss (2 ranks)"),
        ("replica_divergence", 3, "grad_norm = 2.75 at step 20, the majority of 4 ranks has 2.5")]
    hosts = {row["host"]: row for row in get_json(port, "/api/hosts")}
    assert hosts["node-c"]["suspect"] is True
    assert hosts["node-c"]["reasons"] == [f"replica_divergence in {RUN}"]
    assert [(i["rank"], i["kind"]) for i in hosts["node-c"]["incidents"]] == [
        (3, "replica_divergence")]
    assert (1, "nonfinite") in [(i["rank"], i["kind"]) for i in hosts["node-a"]["incidents"]]
    assert hosts["node-a"]["suspect"] is False and hosts["node-b"]["suspect"] is False
    assert metric(port, f'rankboard_run_nonfinite{{run="{RUN}"}}') == 1.0
    assert metric(port, f'rankboard_run_replica_divergence{{run="{RUN}"}}') == 40.0
    report = fetch(port, f"/api/runs/{RUN}/report.html")
    assert report.status == 200
    assert b'"nonfinite":[{"metric":"loss","step":30,"rank":1' in report.body
    assert b'"replica_divergence":[{"metric":"grad_norm","first_step":20' in report.body
    return h


def test_numbers_reach_the_web_and_survive_a_broker_restart(
        spawn: Callable[..., Proc], broker: Any, pusher: Pusher) -> None:
    for rank in range(WORLD):
        pusher.register(RUN, rank, WORLD, host=HOSTS[rank],
                        replicated=["grad_norm"] if rank == 0 else [])
    push(pusher, 0, 59)
    web = start_web(spawn, broker)
    before = check(web.port)
    web.stop()
    broker.restart()  # the journal brings the steps, the entries and the alerts back
    again = start_web(spawn, broker)
    after = check(again.port)
    assert [(a["kind"], a["rank"], a["message"], a["at"]) for a in after["alerts"]
            if a["kind"] in ("nonfinite", "replica_divergence")] == [
        (a["kind"], a["rank"], a["message"], a["at"]) for a in before["alerts"]
        if a["kind"] in ("nonfinite", "replica_divergence")]
    # `rankboard export` reads the same from the journal (a broker running on it or not)
    out = broker.data_dir.parent / "numbers.html"
    done = subprocess.run([sys.executable, "-m", "rankboard", "export", RUN, "-o", str(out),
                           "--data-dir", str(broker.data_dir)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    exported = out.read_bytes()
    assert b'"nonfinite":[{"metric":"loss","step":30,"rank":1' in exported
    assert b'"replica_divergence":[{"metric":"grad_norm","first_step":20' in exported
    # and the rules go on after the restart: a later step extends the divergence only
    push(pusher, 60, 64)
    wait_for(lambda: (header(again.port) or {}).get("steps_done") == 64, what="step 64")
    wait_for(lambda: (header(again.port) or {})["replica_divergence"][0]["count"] == 45,
             what="the divergence counted on")
    h = header(again.port)
    assert h is not None and h["nonfinite"] == before["nonfinite"]


def test_a_diverging_replica_makes_its_host_suspect_listed_with_the_gpu_reasons() -> None:
    from web.cluster import host_verdict

    incidents = [(30.0, "run-b", 3, "replica_divergence", 30.0),
                 (20.0, "run-b", 3, "nonfinite", 20.0),
                 (10.0, "run-b", 2, "gpu_xid", 10.0)]  # newest first, as /api/hosts sorts
    assert host_verdict(incidents) == (True, ["replica_divergence in run-b", "gpu_xid in run-b"])
    assert host_verdict([(20.0, "run-b", 3, "nonfinite", 20.0)]) == (False, [])


def test_a_divergence_without_a_majority_blames_no_host() -> None:
    from web.cluster import _run_hosts

    header = {"hosts": [{"host": "node-a", "ranks": [0]}, {"host": "node-b", "ranks": [1]}],
              "alerts": [
                  {"kind": "replica_divergence", "rank": 0, "at": 5.0,
                   "message": "loss = 1 at step 3, no majority among 2 ranks"},
                  {"kind": "replica_divergence", "rank": 1, "at": 6.0,
                   "message": "grad_norm = 2 at step 4, the majority of 3 ranks has 1"}]}
    derived = _run_hosts("r", header)
    assert "node-a" not in derived.incidents
    assert [i[3] for i in derived.incidents["node-b"]] == ["replica_divergence"]
