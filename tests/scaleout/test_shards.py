"""Shards for real (PROTOCOL 7.3): three ``rankboard broker --shard K/3`` processes, one
``rankboard web`` over all three, ranks given the broker list; a misconfigured rank; one shard
SIGKILLed (its runs stay listed and readable, ``POST …/stacks`` for them is 503, the other
shards' runs go on live) and restarted on its data dir (its runs continue).

Real processes, real signals, real sockets on 127.0.0.1 ephemeral ports; every wait polls.
"""
from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

from rank_agent import RankAgent
from rank_agent.shards import shard_of
from tests.support.brokers import Pusher
from tests.support.http import Resp, SSEClient, fetch, get_json
from tests.support.polling import wait_for
from tests.support.procs import Proc, no_traceback, start_broker

N = 3
#: two runs per shard
RUNS = {k: [r for r in (f"job-{i}" for i in range(64)) if shard_of(r, N) == k][:2]
        for k in range(N)}


def _records(port: int, run: str) -> int:
    r = fetch(port, f"/api/runs/{run}")
    return len(r.json()["records"]) if r.status == 200 else -1


def _post_json(port: int, path: str, body: dict[str, object]) -> Resp:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return Resp(r.status, r.headers, r.read())
    finally:
        conn.close()


def _metric(port: int, name: str) -> dict[str, float]:
    """``{labels: value}`` of one family on the web's /metrics."""
    text = fetch(port, "/metrics").body.decode()
    out = {}
    for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


def test_three_shards_a_wrong_rank_a_sigkill_and_a_return(
        spawn: Callable[..., Proc], tmp_path: Path) -> None:
    brokers = []
    for k in range(N):
        proc, eps = start_broker(spawn, tmp_path / f"shard-{k}", "--shard", f"{k}/{N}")
        proc.wait_line(rf"^shard {k}/{N}$")
        brokers.append((proc, eps))
    web = spawn("web", "--publish", ",".join(e.publish for _, e in brokers),
                "--snapshot", ",".join(e.snapshot for _, e in brokers),
                "--host", "127.0.0.1", "--port", "0")
    port = web.wait_dashboard()
    agents: dict[str, RankAgent] = {}
    stray = Pusher(brokers[0][1].ingest)
    stream: SSEClient | None = None
    try:
        wait_for(lambda: fetch(port, "/healthz").json() == {"ok": True, "shards": [
            {"shard": k, "connected": True, "journal": "ok"} for k in range(N)],
            "journal": "ok"}, what="every shard connected")
        # the ranks are given the list: each reaches its run's own shard
        broker_list = ",".join(e.ingest for _, e in brokers)
        # the control channels follow the shard too: the same position of the publish list
        controls = ",".join(e.publish for _, e in brokers)
        for k, runs in RUNS.items():
            for run in runs:
                agent = agents[run] = RankAgent(broker_list, run, 0, 1, control=controls,
                                                stall_after=0, linger_ms=0)
                assert agent.shard == k
                agent.register(total_epochs=10)
                agent.log_epoch(0, 1.0)

        def listed() -> dict[str, int]:
            return {r["run"]: r["shard"] for r in get_json(port, "/api/runs")}

        want = {run: k for k, runs in RUNS.items() for run in runs}
        wait_for(lambda: listed() == want, what="every run listed with its shard")
        assert get_json(port, f"/api/runs/{RUNS[2][0]}")["shard"] == 2
        # POST …/stacks reaches the run's own shard, which forwards it to the run's rank
        target = RUNS[2][0]
        asked = _post_json(port, f"/api/runs/{target}/stacks", {"kind": "stacks"})
        assert asked.status == 202, asked.body
        wait_for(lambda: get_json(port, f"/api/runs/{target}/stacks")["dumps"],
                 what="the rank's answer, through shard 2")

        # a misconfigured rank (another list): its frames reach shard 0 with a run of shard 1
        wrong = next(r for r in (f"stray-{i}" for i in range(64)) if shard_of(r, N) == 1)
        stray.register(wrong, 0, 1)
        wait_for(lambda: _metric(port, "rankboard_frames_rejected_total").get(
            '{reason="wrong_shard"}') == 1.0, what="wrong_shard counted on the web's /metrics")
        assert wrong not in listed() and fetch(port, f"/api/runs/{wrong}").status == 404
        assert not (tmp_path / "shard-0" / "runs" / f"{wrong}.journal").exists()
        wait_for(lambda: _metric(port, "rankboard_frames_accepted_total")[""]
                 == 2 * len(want) + 1,  # (+ the stacks answer)
                 what="accepted frames summed over the shards")

        # a stream of a shard-1 run opened before its shard dies goes on after it returns
        stream = SSEClient(port, f"/api/runs/{RUNS[1][0]}/events")
        first = stream.events_until(lambda e: e["event"] == "epoch")
        assert first[0]["event"] == "run" and first[0]["data"]["shard"] == 1

        # shard 1 dies: its runs stay listed and readable, the others stay live
        killed, eps1 = brokers[1]
        killed.stop(signal.SIGKILL)
        wait_for(lambda: fetch(port, "/healthz").json()["shards"][1] == {
            "shard": 1, "connected": False, "journal": "ok"}, what="shard 1 seen gone")
        assert fetch(port, "/healthz").status == 200
        assert _metric(port, "rankboard_shard_connected") == {
            '{shard="0"}': 1.0, '{shard="1"}': 0.0, '{shard="2"}': 1.0}
        assert listed() == want
        assert _records(port, RUNS[1][0]) == 1
        # no body at all: the 503 comes before the body is read
        assert fetch(port, f"/api/runs/{RUNS[1][0]}/stacks", method="POST").status == 503
        assert fetch(port, f"/api/runs/{RUNS[0][0]}/stacks", method="POST").status != 503
        assert _metric(port, "rankboard_frames_rejected_total").get(
            '{reason="wrong_shard"}') == 1.0  # the lost shard's figures stay in the sum
        for run in RUNS[0] + RUNS[2]:
            agents[run].log_epoch(1, 0.5)
        for run in RUNS[0] + RUNS[2]:
            wait_for(lambda run=run: _records(port, run) == 2, what=f"{run} live")

        # shard 1 returns on its ports and data dir: its runs continue
        back, _ = start_broker(spawn, tmp_path / "shard-1", "--shard", f"1/{N}",
                               endpoints=eps1)
        brokers[1] = (back, eps1)
        wait_for(lambda: fetch(port, "/healthz").json()["shards"][1]["connected"],
                 what="shard 1 back")
        for run in RUNS[1]:
            agents[run].log_epoch(1, 0.5)
        for run in RUNS[1]:
            wait_for(lambda run=run: _records(port, run) == 2, what=f"{run} continued")
        assert stream.events_until(lambda e: e["event"] == "epoch")[-1]["data"]["epoch"] == 1
        assert listed() == want
        # the returned shard counts from zero again; the web's sum never goes back
        # (without the old instance's 4 frames kept, the sum would read 14)
        total = 2 * len(want) + 1 + len(RUNS[0] + RUNS[2]) + len(RUNS[1])
        wait_for(lambda: _metric(port, "rankboard_frames_accepted_total")[""] == total,
                 what="accepted frames summed across the restart")
        no_traceback(web, *(proc for proc, _ in brokers))
    finally:
        if stream is not None:
            stream.close()
        stray.close()
        for agent in agents.values():
            agent.close()
        web.close()
        for proc, _ in brokers:
            proc.close()


def test_up_shards_starts_n_brokers_and_one_web(spawn: Callable[..., Proc],
                                               tmp_path: Path) -> None:
    up = spawn("up", "--shards", "2", "--ingest", "tcp://127.0.0.1:*", "--publish",
               "tcp://127.0.0.1:*", "--snapshot", "tcp://127.0.0.1:*",
               "--data-dir", str(tmp_path), "--port", "0", "--host", "127.0.0.1",
               "--retain-bytes", "1G")
    try:
        up.wait_line(r"^shard 0/2$")
        up.wait_line(r"^shard 1/2$")
        # PROTOCOL 8.4: each shard bounds its own data dir by SIZE / N, and up says so
        up.wait_line(r"^--retain-bytes 1073741824 split evenly: 536870912 bytes for each "
                     r"shard's data dir$")
        line = up.wait_line(r"^RANKBOARD_BROKER=(\S+)$").group(1)
        ingests = line.split(",")
        assert len(ingests) == 2 and ingests[0] != ingests[1]
        port = up.wait_dashboard()
        wait_for(lambda: fetch(port, "/healthz").json() == {"ok": True, "shards": [
            {"shard": 0, "connected": True, "journal": "ok"},
            {"shard": 1, "connected": True, "journal": "ok"}], "journal": "ok"},
            what="both shards connected")
        runs = [next(r for r in (f"up-{i}" for i in range(64)) if shard_of(r, 2) == k)
                for k in range(2)]
        agents = [RankAgent(line, run, 0, 1, control=False, linger_ms=0) for run in runs]
        try:
            for agent in agents:
                agent.register(total_epochs=2)
            wait_for(lambda: {r["run"]: r["shard"] for r in get_json(port, "/api/runs")}
                     == {runs[0]: 0, runs[1]: 1}, what="a run on each shard")
        finally:
            for agent in agents:
                agent.close()
        for k in range(2):  # each shard journals in its own directory
            wait_for(lambda k=k: (tmp_path / f"shard-{k}" / "runs" / f"{runs[k]}.journal")
                     .exists(), what=f"shard-{k}'s journal")
        assert up.stop() == 0
        no_traceback(up)
    finally:
        up.close()


def test_demo_on_two_shards(spawn: Callable[..., Proc]) -> None:
    demo = spawn("demo", "--shards", "2", "--no-browser", "--port", "0", "--ranks", "2",
                 "--hosts", "1", "--epochs", "3", "--epoch-seconds", "0.3")
    try:
        port = demo.wait_dashboard(timeout=60)
        wait_for(lambda: [s["connected"] for s in fetch(port, "/healthz").json()["shards"]]
                 == [True, True], what="the demo's two shards connected")

        def runs() -> list[dict[str, object]]:
            return [r for r in get_json(port, "/api/runs") if r["world_size"] == 2]

        wait_for(lambda: len(runs()) >= 2, timeout=60, what="both demo jobs running")
        for entry in runs():  # every run on the shard its id hashes to: the ranks' list works
            assert entry["shard"] == shard_of(str(entry["run"]), 2)
        assert demo.stop() == 0
        no_traceback(demo)
    finally:
        demo.close()


def test_a_worker_pool_follows_every_shard(spawn: Callable[..., Proc], tmp_path: Path) -> None:
    """``web --workers 2`` over two shards, as the Kubernetes web Deployment runs it."""
    brokers = [start_broker(spawn, tmp_path / f"s{k}", "--shard", f"{k}/2") for k in range(2)]
    web = spawn("web", "--publish", ",".join(e.publish for _, e in brokers),
                "--snapshot", ",".join(e.snapshot for _, e in brokers),
                "--host", "127.0.0.1", "--port", "0", "--workers", "2")
    try:
        port = web.wait_dashboard(timeout=60)
        both = [{"shard": 0, "connected": True, "journal": "ok"},
                {"shard": 1, "connected": True, "journal": "ok"}]
        for _ in range(4):  # the kernel spreads the connections over the workers
            wait_for(lambda: fetch(port, "/healthz").json()["shards"] == both,
                     what="a worker connected to both shards")
        assert web.stop() == 0
        no_traceback(web)
    finally:
        web.close()
        for proc, _ in brokers:
            proc.close()


def test_up_shards_over_an_unsharded_data_dir_says_so(spawn: Callable[..., Proc],
                                                      tmp_path: Path) -> None:
    """Issue 43 item 6: ``up --shards 2`` on a data dir an unsharded broker journaled into
    used to hide that broker's runs without a word; it says so at start, and they stay
    exportable."""
    ephemeral = ["--ingest", "tcp://127.0.0.1:*", "--publish", "tcp://127.0.0.1:*",
                 "--snapshot", "tcp://127.0.0.1:*", "--data-dir", str(tmp_path),
                 "--port", "0", "--host", "127.0.0.1"]
    one = spawn("up", *ephemeral)
    try:
        line = one.wait_line(r"^RANKBOARD_BROKER=(\S+)$").group(1)
        port = one.wait_dashboard()
        # (a linger: the frames, the finish last, are sent as the agent closes; with none
        # a close before the connection was up dropped them, and the run never completed)
        with RankAgent(line, "unsharded-1", 0, 1, control=False, linger_ms=5000) as agent:
            agent.log_epoch(0, 0.5, batches=1)
        wait_for(lambda: b'"status":"complete"' in fetch(port, "/api/runs/unsharded-1").body,
                 what="the unsharded broker's run complete")
        assert one.stop() == 0
    finally:
        one.close()
    two = spawn("up", "--shards", "2", *ephemeral)
    try:
        note = two.wait_line(r"^note: .*$").group(0)
        assert "holds 1 run(s) of an unsharded broker" in note
        assert "rankboard export RUN --data-dir" in note
        assert two.stop() == 0
        no_traceback(two)
    finally:
        two.close()
    out = tmp_path / "unsharded-1.html"
    done = subprocess.run([sys.executable, "-m", "rankboard", "export", "unsharded-1",
                           "--data-dir", str(tmp_path), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "unsharded-1" in out.read_text(encoding="utf-8")
