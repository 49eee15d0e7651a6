"""The SSE stream of PROTOCOL 4 over real sockets: headers, replay, resume, live events,
pings, and a stalled client dropped without slowing the others."""
from __future__ import annotations

import json
import socket
from typing import Any

from rank_agent import protocol
from tests.support.brokers import Pusher
from tests.support.http import SSEClient, fetch
from tests.support.polling import wait_for
from tests.support.procs import start_web


def epochs(events: list[dict[str, Any]]) -> list[int]:
    return [e["data"]["epoch"] for e in events if e["event"] == "epoch"]


def ids(events: list[dict[str, Any]]) -> list[int]:
    return [int(e["id"]) for e in events]


def start_run(p: Pusher, run: str, world: int = 2, total: int = 10) -> None:
    for rank in range(world):
        p.register(run, rank, world, host="node-a", total_epochs=total)


def wait_records(port: int, run: str, n: int) -> None:
    wait_for(lambda: fetch(port, f"/api/runs/{run}").status == 200
             and len(fetch(port, f"/api/runs/{run}").json()["records"]) >= n, what=f"{n} records")


def test_late_client_gets_headers_retry_header_full_history_and_complete(
        web: Any, pusher: Pusher) -> None:
    start_run(pusher, "done", total=3)
    for e in range(3):
        pusher.epoch("done", e, 2)
    for rank in range(2):
        pusher.send(protocol.Finish(run="done", rank=rank))
    wait_for(lambda: fetch(web.port, "/api/runs/done").status == 200
             and fetch(web.port, "/api/runs/done").json()["status"] == "complete", what="complete")
    with SSEClient(web.port, "/api/runs/done/events") as c:
        assert c.status == 200
        assert c.headers["content-type"] == "text/event-stream"
        assert c.headers["cache-control"] == "no-store"
        assert c.headers["x-accel-buffering"] == "no"
        assert c.headers["x-content-type-options"] == "nosniff"
        first = c.next_block()
        assert first == "retry: 2000"
        got = c.events_until(lambda e: e["event"] == "complete")
        assert got[0]["event"] == "run" and got[0]["id"] == "0"
        assert got[0]["data"]["run"] == "done" and got[0]["data"]["status"] == "complete"
        assert epochs(got) == [0, 1, 2]
        assert got[-1]["data"] == {"status": "complete"}
        assert ids(got) == sorted(set(ids(got)))  # strictly increasing


def test_live_events_and_resume_with_last_event_id(web: Any, pusher: Pusher) -> None:
    run = "live"
    start_run(pusher, run)
    pusher.epoch(run, 0, 2)
    wait_records(web.port, run, 1)
    seen: list[dict[str, Any]] = []
    with SSEClient(web.port, f"/api/runs/{run}/events") as c:
        seen += c.events_until(lambda e: e["event"] == "epoch" and e["data"]["epoch"] == 0)
        pusher.epoch(run, 1, 2, loss=0.5)
        seen += c.events_until(lambda e: e["event"] == "epoch" and e["data"]["epoch"] == 1)
        pusher.send(protocol.Hardware(run=run, rank=0, summary="cpu | gpu"))
        seen += c.events_until(lambda e: e["event"] == "run" and "cpu" in e["data"]["hardware"])
        if not any(e["event"] == "ranks" for e in seen):  # at most one a second
            seen += c.events_until(lambda e: e["event"] == "ranks")
    assert ids(seen) == sorted(set(ids(seen)))
    assert epochs(seen) == [0, 1]
    for e in seen:
        if e["event"] == "ranks":
            assert all("loss" not in r for r in e["data"])
    position = seen[-1]["id"]

    # while disconnected: two more epochs
    pusher.epoch(run, 2, 2)
    pusher.epoch(run, 3, 2)
    wait_records(web.port, run, 4)
    with SSEClient(web.port, f"/api/runs/{run}/events", {"Last-Event-ID": position}) as c:
        assert c.next_block() == "retry: 2000"
        head = c.next_event()
        assert head is not None and head["event"] == "run" and head["id"] == position
        got = c.events_until(lambda e: e["event"] == "epoch" and e["data"]["epoch"] == 3)
        assert epochs(got) == [2, 3]  # none twice, none skipped
        assert all(int(e["id"]) > int(position) for e in got)
        assert ids([head, *got]) == sorted(set(ids([head, *got])))


def test_bad_or_future_last_event_id_means_full_replay(web: Any, pusher: Pusher) -> None:
    start_run(pusher, "rp")
    pusher.epoch("rp", 0, 2)
    pusher.epoch("rp", 1, 2)
    wait_records(web.port, "rp", 2)
    for bad in ("abc", "999999999", "-4", "1.5"):
        with SSEClient(web.port, "/api/runs/rp/events", {"Last-Event-ID": bad}) as c:
            assert c.status == 200
            got = c.events_until(lambda e: e["event"] == "epoch" and e["data"]["epoch"] == 1)
            assert got[0]["event"] == "run" and got[0]["id"] == "0", bad
            assert epochs(got) == [0, 1]
    assert "Traceback" not in web.output("stderr")


def test_pings_are_sent(spawn: Any, broker: Any, pusher: Pusher) -> None:
    web = start_web(spawn, broker, env={"RANKBOARD_SSE_PING": "0.2"})
    start_run(pusher, "quiet")
    wait_for(lambda: fetch(web.port, "/api/runs/quiet").status == 200, what="run")
    with SSEClient(web.port, "/api/runs/quiet/events") as c:
        blocks = []
        while ": ping" not in blocks:
            block = c.next_block()
            assert block is not None
            blocks.append(block)
        assert blocks[0] == "retry: 2000"


def test_a_stalled_client_is_dropped_while_another_keeps_receiving(
        spawn: Any, broker: Any, pusher: Pusher) -> None:
    web = start_web(spawn, broker, env={"RANKBOARD_SSE_QUEUE": "4"})
    run = "big"
    start_run(pusher, run)
    wait_for(lambda: fetch(web.port, f"/api/runs/{run}").status == 200, what="run")

    stalled = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", web.port))
    stalled.sendall(f"GET /api/runs/{run}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())

    def metric(name: str) -> float:
        for line in fetch(web.port, "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    try:
        with SSEClient(web.port, f"/api/runs/{run}/events") as good:
            wait_for(lambda: metric("rankboard_sse_clients") == 2, what="two clients")
            pad = "x" * 300_000
            dropped_at = None
            for i in range(80):
                # one big header change at a time, paced by the reading client
                pusher.send(protocol.Metadata(run=run, rank=0, json=json.dumps({"v": i, "pad": pad})))
                good.events_until(lambda e, i=i: e["event"] == "run"
                                  and (e["data"]["metadata"] or {}).get("v") == i)
                if metric("rankboard_sse_clients_dropped_total") >= 1:
                    dropped_at = i
                    break
            assert dropped_at is not None, "the stalled client was never dropped"
            # the reader is unaffected and still live
            pusher.send(protocol.Metadata(run=run, rank=0, json='{"v": "after"}'))
            good.events_until(lambda e: e["event"] == "run"
                              and (e["data"]["metadata"] or {}).get("v") == "after")
            wait_for(lambda: metric("rankboard_sse_clients") == 1, what="stalled client released")
            assert metric("rankboard_sse_clients_dropped_total") == 1
    finally:
        stalled.close()
    assert "Traceback" not in web.output("stderr")


def test_broker_restart_is_followed(web: Any, broker: Any, pusher: Pusher) -> None:
    start_run(pusher, "survivor", total=10)
    pusher.epoch("survivor", 0, 2)
    wait_records(web.port, "survivor", 1)
    with SSEClient(web.port, "/api/runs/survivor/events") as c:
        c.events_until(lambda e: e["event"] == "epoch")
        broker.restart()
        wait_for(lambda: fetch(web.port, "/healthz").status == 200, what="healthy after restart")
        pusher.epoch("survivor", 1, 2)
        got = c.events_until(lambda e: e["event"] == "epoch")
        assert epochs(got) == [1]
    body = fetch(web.port, "/api/runs/survivor").json()
    assert [r["epoch"] for r in body["records"]] == [0, 1]


def test_a_burst_reaches_a_reader_complete_and_in_order(web: Any, pusher: Pusher) -> None:
    run = "burst"
    start_run(pusher, run, world=2, total=400)
    wait_for(lambda: fetch(web.port, f"/api/runs/{run}").status == 200, what="run")
    with SSEClient(web.port, f"/api/runs/{run}/events") as c:
        c.events_until(lambda e: e["event"] == "run")
        for e in range(400):
            pusher.epoch(run, e, 2, loss=1.0 / (e + 1))
        got = c.events_until(lambda e: e["event"] == "epoch" and e["data"]["epoch"] == 399)
    assert epochs(got) == list(range(400))
    assert ids(got) == sorted(set(ids(got)))
