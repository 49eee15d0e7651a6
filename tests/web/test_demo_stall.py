"""``rankboard demo``'s step job stalls half-way (``rankboard/demo.py``): one rank's data
loader hangs while the others wait in ``all_reduce``; the real agents' stall watch dumps
them, the web groups them at ``GET /stacks`` and marks them ``stalled``, their simulated
Flight Recorder (``rankboard/demofr.py``) makes ``GET /collectives`` name the hung rank, a
request from the
web reaches the simulated ranks over their control channel, and every rank recovers."""
from __future__ import annotations

import http.client
import json
import signal
from typing import Any

from tests.support.demorun import newest_step_run
from tests.support.http import fetch, get_json
from tests.support.polling import wait_for


def test_demo_step_run_stalls_groups_answers_and_recovers(spawn: Any) -> None:
    demo = spawn("demo", "--port", "0", "--ranks", "4", "--hosts", "2", "--epochs", "2",
                 "--epoch-seconds", "0.5", "--no-browser")
    port = demo.wait_dashboard(timeout=30)
    run = wait_for(lambda: newest_step_run(port), timeout=30, what="the demo's step run")
    path = f"/api/runs/{run}/stacks"

    def grouped() -> Any:
        groups = get_json(port, path)["groups"]
        by_fn = {g["frames"][-1]["function"]: g["ranks"] for g in groups if g["reason"] == "stall"}
        return by_fn if by_fn.get("all_reduce") == [0, 2, 3] and by_fn.get("__next__") == [1] \
            else None

    groups = wait_for(grouped, timeout=40, what="the demo's stall groups")
    assert groups == {"all_reduce": [0, 2, 3], "__next__": [1]}
    view = get_json(port, path)
    collective = next(g for g in view["groups"] if g["frames"][-1]["function"] == "all_reduce")
    assert [f["function"] for f in collective["frames"]][-3:] == ["train_step", "backward",
                                                                "all_reduce"]
    # the hung rank's line is code, not a comment the demo left on it
    loader = next(g for g in view["groups"] if g["frames"][-1]["function"] == "__next__")
    assert loader["frames"][-1]["code"] == "time.sleep(self.hang_s)"
    # (the groups come with the dumps; the ranks array that marks them is refreshed about once
    # a second: with the demo's ranks in lockstep every dump lands at once, before it)
    def statuses() -> Any:
        return {r["rank"]: r["status"] for r in get_json(port, f"/api/runs/{run}")["ranks"]}
    wait_for(lambda: statuses()[1] == "stalled", timeout=5, what="rank 1 marked stalled")

    # the Flight Recorder's answer (issue 43 item 1), from the same wire a real job uses:
    # rank 1 has not entered the all-reduce the other three wait in
    def verdict() -> Any:
        groups = get_json(port, f"/api/runs/{run}/collectives")["groups"]
        return groups[0] if groups and groups[0]["behind"] else None
    group = wait_for(verdict, timeout=10, what="the collective verdict naming rank 1")
    assert [b["rank"] for b in group["behind"]] == [1]
    assert group["waiting"] == [0, 2, 3]
    assert group["op"] == "nccl:all_reduce" and group["desc"] == "default_pg"
    assert group["behind"][0]["last_enqueued"] == group["seq"] - 1
    wait_for(lambda: any(a["kind"] == "collective_behind" and a["rank"] == 1
                         for a in get_json(port, f"/api/runs/{run}")["alerts"]),
             timeout=10, what="the collective_behind alert of rank 1")

    # the page's "dump stacks" for rank 1 reaches the hung rank (its agent's own thread answers)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, body=json.dumps({"kind": "stacks", "ranks": [1]}),
                 headers={"Content-Type": "application/json"})
    answer = conn.getresponse()
    assert answer.status == 202, answer.read()
    request_id = json.loads(answer.read())["request_id"]
    conn.close()
    wait_for(lambda: [d["rank"] for d in get_json(port, path)["dumps"]
                      if d["reason"] == "request" and d["request_id"] == request_id] == [1],
             timeout=10, what="rank 1's answer")

    # and the stall ends: every rank steps again (ok), no stall group left
    def recovered() -> bool:
        ranks = get_json(port, f"/api/runs/{run}")["ranks"]
        stall = [g for g in get_json(port, path)["groups"] if g["reason"] == "stall"]
        return all(r["status"] in ("ok", "finished") for r in ranks) and not stall

    wait_for(recovered, timeout=40, what="the demo ranks to recover")

    # later in the run, rank 2 (its GPU reports an XID) computes a grad_norm 3 % off the
    # others': a replica that disagrees, named as silent data corruption is (8.3)
    def diverged() -> Any:
        found = get_json(port, f"/api/runs/{run}")["replica_divergence"]
        return found or None
    [entry] = wait_for(diverged, timeout=60, what="the demo's replica divergence")
    assert (entry["metric"], entry["ranks"]) == ("grad_norm", [2])
    assert entry["majority"] is not None
    assert fetch(port, "/healthz").status == 200
    assert demo.stop(signal.SIGINT, timeout=20) == 0
    assert "Traceback" not in demo.output()
