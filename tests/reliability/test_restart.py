"""Nothing lost: a broker SIGKILLed mid-run and restarted on its data dir, a web SIGKILLed
under connected SSE clients, and a rank agent that keeps training through a broker outage.

Real ``rankboard`` processes, real signals, real sockets on 127.0.0.1 ephemeral ports; every
wait polls against a deadline.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from rank_agent import RankAgent
from rank_agent.protocol import Finish, Metrics
from tests.support.brokers import FeedClient, Pusher
from tests.support.http import SSEClient, fetch, get_json
from tests.support.polling import wait_for
from tests.support.procs import Proc, no_traceback, start_broker, start_web


def epochs(events: list[dict[str, Any]]) -> list[int]:
    return [e["data"]["epoch"] for e in events if e["event"] == "epoch"]


def ids(events: list[dict[str, Any]]) -> list[int]:
    return [int(e["id"]) for e in events]


def is_epoch(n: int) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "epoch" and e["data"]["epoch"] == n


def records(port: int, run: str) -> list[dict[str, Any]]:
    r = fetch(port, f"/api/runs/{run}")
    return r.json()["records"] if r.status == 200 else []


def snapshot_records(ctx: zmq.Context, eps: Any, run: str) -> list[tuple[int, int]]:
    """``[(seq, epoch)]`` of the run as the broker's snapshot ROUTER serves it."""
    client = FeedClient(ctx, eps.publish, eps.snapshot)
    try:
        snaps, _ = client.snapshot(run)
    finally:
        client.close()
    return [(int(seq), rec["epoch"]) for seq, rec in snaps[0]["records"]] if snaps else []


def metrics(run: str, rank: int, epoch: int, loss: float = 1.0) -> Metrics:
    return Metrics(run=run, rank=rank, epoch=epoch, avg_loss=loss, batches=10, samples=640,
                   epoch_ms=100.0)


def test_broker_sigkill_restart_keeps_records_ids_and_closes_epochs_after_it(
        spawn: Callable[..., Proc], tmp_path: Path, ctx: zmq.Context) -> None:
    data = tmp_path / "data"
    broker, eps = start_broker(spawn, data)
    web = start_web(spawn, eps)
    pusher = Pusher(eps.ingest)
    run = "crash"
    live = resumer = None
    try:
        for rank in (0, 1):
            pusher.register(run, rank, 2, total_epochs=20)
        for e in range(5):
            pusher.epoch(run, e, 2, loss=1.0 / (e + 1))
        wait_for(lambda: len(records(web.port, run)) == 5, what="5 records")
        live = SSEClient(web.port, f"/api/runs/{run}/events")      # stays through the crash
        resumer = SSEClient(web.port, f"/api/runs/{run}/events")   # leaves, comes back
        seen = live.events_until(is_epoch(4))
        last_resumer = resumer.events_until(is_epoch(4))[-1]["id"]
        resumer.close()
        # Rank 0's epoch 5 arrives before the crash (accepted, journaled, epoch still open):
        # wait until the broker has published its effect, so it is flushed to the journal.
        pusher.send(metrics(run, 0, 5))
        seen += live.events_until(lambda e: e["event"] == "ranks" and any(
            r["rank"] == 0 and r["epoch"] == 5 for r in e["data"]))
        before = records(web.port, run)
        issued = max(ids(seen))

        broker.proc.kill()  # SIGKILL: no close(), no final flush
        assert broker.proc.wait(10) == -9
        broker2, _ = start_broker(spawn, data, endpoints=eps)

        # the snapshot ROUTER serves every record closed before the crash, with its old id
        assert snapshot_records(ctx, eps, run) == [
            (int(e["id"]), e["data"]["epoch"]) for e in seen if e["event"] == "epoch"]

        # rank 1's epoch 5 arrives only after the restart: it closes epoch 5 (with rank 0's
        # pre-crash metrics, so nobody is missing); then a normal epoch 6.
        pusher.send(metrics(run, 1, 5))
        pusher.epoch(run, 6, 2)
        after = live.events_until(is_epoch(6))
        assert epochs(after) == [5, 6]
        assert min(ids(after)) > issued                      # sequence continued
        assert ids(seen + after) == sorted(set(ids(seen + after)))  # no duplicate id
        rec5 = next(e["data"] for e in after if e["event"] == "epoch")
        assert rec5["missing_ranks"] == []

        # a client resuming with Last-Event-ID gets exactly what it missed
        with SSEClient(web.port, f"/api/runs/{run}/events", {"Last-Event-ID": last_resumer}) as c:
            assert c.next_block() == "retry: 2000"
            head = c.next_event()
            assert head is not None and head["event"] == "run" and head["id"] == last_resumer
            got = c.events_until(is_epoch(6))
            assert epochs(got) == [5, 6]
            assert ids([head, *got]) == sorted(set(ids([head, *got])))

        history = get_json(web.port, f"/api/runs/{run}/history")
        assert [r["epoch"] for r in history] == list(range(7))
        assert history[:5] == before
        no_traceback(broker2, web)
    finally:
        for c in (live, resumer):
            if c is not None:
                c.close()
        pusher.close()


def test_web_sigkill_restart_sse_clients_resume_without_gap_or_duplicate(
        spawn: Callable[..., Proc], tmp_path: Path) -> None:
    _, eps = start_broker(spawn, tmp_path / "data")
    web = start_web(spawn, eps)
    port = web.port
    assert port is not None
    pusher = Pusher(eps.ingest)
    run = "webcrash"
    try:
        pusher.register(run, 0, 1, total_epochs=10)
        for e in range(3):
            pusher.epoch(run, e, 1)
        wait_for(lambda: len(records(port, run)) == 3, what="3 records")
        with SSEClient(port, f"/api/runs/{run}/events") as c:
            seen = c.events_until(is_epoch(2))
            web.proc.kill()
            web.proc.wait(10)
            while c.next_event() is not None:  # the stream ends with the process
                pass
        position = seen[-1]["id"]
        for e in (3, 4):  # the broker keeps going while no web runs
            pusher.epoch(run, e, 1)
        wait_for(lambda: len(_broker_records(eps, run)) == 5,
                 what="the broker to close epochs 3 and 4")

        # the new web on the same port rebuilds its history from the snapshot
        web2 = spawn("web", "--publish", eps.publish, "--snapshot", eps.snapshot,
                     "--host", "127.0.0.1", "--port", str(port))
        assert web2.wait_dashboard() == port
        wait_for(lambda: fetch(port, "/healthz").status == 200, what="web 2 healthy")
        # EventSource reconnects with the last id it saw
        with SSEClient(port, f"/api/runs/{run}/events", {"Last-Event-ID": position}) as c:
            assert c.next_block() == "retry: 2000"
            head = c.next_event()
            assert head is not None and head["event"] == "run" and head["id"] == position
            got = c.events_until(is_epoch(4))
            assert epochs(got) == [3, 4]
            pusher.epoch(run, 5, 1)
            got += c.events_until(is_epoch(5))
            assert epochs(got) == [3, 4, 5]
            all_ids = ids(seen + [head] + got)
            assert ids(seen + got) == sorted(set(ids(seen + got)))
            assert all_ids[-1] > int(position)
        assert [r["epoch"] for r in get_json(port, f"/api/runs/{run}/history")] == list(range(6))
        no_traceback(web2)
    finally:
        pusher.close()


def _broker_records(eps: Any, run: str) -> list[tuple[int, int]]:
    context = zmq.Context()
    try:
        return snapshot_records(context, eps, run)
    finally:
        context.term()


def test_agent_queues_to_its_hwm_through_a_broker_outage_then_drops_and_counts(
        spawn: Callable[..., Proc], tmp_path: Path, ctx: zmq.Context) -> None:
    data = tmp_path / "data"
    broker, eps = start_broker(spawn, data)
    hwm = 200
    run = "outage"
    agent = RankAgent(eps.ingest, run, 0, 1, host="h0", sndhwm=hwm, linger_ms=0)
    monitor = None
    try:
        assert agent.register()
        assert agent.log_epoch(0, 1.0, batches=1)
        wait_for(lambda: snapshot_records(ctx, eps, run), what="epoch 0 at the broker")
        # Watch the agent's own socket, so the test knows when the outage is visible to it
        # (frames written into a connection the kernel has not yet reported dead are lost
        # with the broker, as with any TCP peer that dies; see SECURITY.md).
        sock = agent._pusher._sock
        assert sock is not None
        # (a ZeroMQ socket has one monitor: the agent's own, which tells at close whether a
        # broker ever took the connection (rank_agent/reach.py), makes way for this one)
        reach = agent._pusher._reach
        assert reach is not None
        reach.close()
        agent._pusher._reach = None
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

        def outage(proc: Proc) -> None:
            proc.proc.kill()
            proc.proc.wait(10)
            assert monitor is not None and monitor.poll(10_000), "agent never saw the broker go"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED

        # outage 1, below the HWM: every frame is queued and delivered on return
        outage(broker)
        assert all(agent.log_epoch(e, 1.0, batches=1) for e in range(1, 151))
        assert agent.dropped == 0
        broker, _ = start_broker(spawn, data, endpoints=eps)
        wait_for(lambda: [ep for _, ep in snapshot_records(ctx, eps, run)] == list(range(151)),
                 what="all 150 queued epochs delivered after the restart")

        # outage 2, beyond the HWM: up to hwm queue, the rest are dropped and counted,
        # and no call waits
        outage(broker)
        durations, results = [], []
        for e in range(151, 1151):
            t0 = time.perf_counter()
            results.append(agent.log_epoch(e, 1.0, batches=1))
            durations.append(time.perf_counter() - t0)
        queued = sum(results)
        assert results == [True] * queued + [False] * (1000 - queued)  # drops are the tail
        # at most the HWM; libzmq credits the pipe in batches (its low-water mark), so after
        # a reconnect a few dozen slots may still count as in flight
        assert hwm // 2 <= queued <= hwm, queued
        assert agent.dropped == 1000 - queued and agent.errors == 0
        assert max(durations) < 0.05 and sum(durations) < 1.0, (max(durations), sum(durations))
        broker, _ = start_broker(spawn, data, endpoints=eps)
        want = list(range(151 + queued))
        wait_for(lambda: [ep for _, ep in snapshot_records(ctx, eps, run)] == want,
                 what="exactly the queued frames delivered")
        no_traceback(broker)
    finally:
        if monitor is not None:
            if agent._pusher._sock is not None:
                agent._pusher._sock.disable_monitor()
            monitor.close(linger=0)
        agent.close()


def _snapshot_runs(ctx: zmq.Context, eps: Any) -> dict[str, dict[str, Any]]:
    client = FeedClient(ctx, eps.publish, eps.snapshot)
    try:
        snaps, _ = client.snapshot()
    finally:
        client.close()
    return {s["run"]: s for s in snaps}


def test_broker_restart_loads_only_the_max_runs_most_recently_active(
        spawn: Callable[..., Proc], tmp_path: Path, ctx: zmq.Context) -> None:
    """PROTOCOL 6 (issue 19 finding 5): a broker started on a data dir holding more runs
    than ``--max-runs`` loads the N most recently active; a frame for another brings it
    back from its journal."""
    data = tmp_path / "data"
    broker, eps = start_broker(spawn, data)
    pusher = Pusher(eps.ingest)
    order = ["old", "older-name-newer", "mid", "new"]  # least recently active first
    try:
        for run in order:
            pusher.register(run, 0, 1)
            pusher.epoch(run, 0, 1, loss=0.5)
            pusher.send(Finish(run=run, rank=0))
        wait_for(lambda: all(s["complete"] for s in _snapshot_runs(ctx, eps).values())
                 and len(_snapshot_runs(ctx, eps)) == 4, what="4 finished runs")
    finally:
        pusher.close()
    assert broker.stop() == 0
    for i, run in enumerate(order):  # activity a minute apart (mtime is what load reads)
        t = time.time() - 3600 + 60 * i
        os.utime(data / "runs" / f"{run}.journal", (t, t))

    broker2, eps2 = start_broker(spawn, data, "--max-runs", "2")
    held = _snapshot_runs(ctx, eps2)
    assert set(held) == {"mid", "new"}
    pusher = Pusher(eps2.ingest)
    try:
        pusher.register("old", 0, 1)  # a frame for a run left on disk brings it back
        wait_for(lambda: "old" in _snapshot_runs(ctx, eps2), what="run 'old' back")
    finally:
        pusher.close()
    back = _snapshot_runs(ctx, eps2)
    assert len(back) == 2 and [r["epoch"] for _, r in back["old"]["records"]] == [0]
    no_traceback(broker, broker2)
