"""Attempts survive a SIGKILLed broker (PROTOCOL 8.1: "A broker restarted on its data dir
keeps every run's attempts and superseded records").

A real ``rankboard broker`` process and a real ``rankboard web``, frames on a plain PUSH
socket: attempt 0 closes steps 0-29 and epochs 0-2, attempt 1 (new ``proc`` ids) resumes
from step 10 / epoch 1. Then SIGKILL and a restart on the same data dir and ports: the web
serves the same attempts, line and superseded records; a raw SSE client that stayed
connected through the crash sees attempt 1 go on, and one that resumes with
``Last-Event-ID`` replays the line (never a superseded record). Every wait polls against a
deadline.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from rank_agent.protocol import Metrics, Register, Steps
from tests.support.brokers import Pusher
from tests.support.http import SSEClient, fetch, get_json
from tests.support.polling import wait_for
from tests.support.procs import Proc, no_traceback, start_broker, start_web

RUN = "attempts-crash"


def reg(rank: int, proc: str) -> Register:
    return Register(run=RUN, rank=rank, world_size=2, host=f"h{rank}", proc=proc)


def steps(rank: int, lo: int, hi: int, loss: float) -> Steps:
    s = list(range(lo, hi))
    return Steps(run=RUN, rank=rank, steps=s, times=[time.time()] * len(s),
                 step_ms=[10.0 + rank] * len(s), metrics={"loss": [loss] * len(s)})


def epoch(rank: int, e: int, loss: float) -> Metrics:
    return Metrics(run=RUN, rank=rank, epoch=e, avg_loss=loss, batches=1)


def views(port: int) -> dict[str, Any]:
    """What the web serves of the run's attempts (times left out of the header's entries)."""
    body = get_json(port, f"/api/runs/{RUN}")
    return {
        "attempt": body["attempt"],
        "attempts": [{k: v for k, v in a.items() if k not in ("cause",)}
                     for a in body["attempts"]],
        "records": [(r["epoch"], r["attempt"], r["metrics"]["loss"]) for r in body["records"]],
        "csv": fetch(port, f"/api/runs/{RUN}/steps.csv").body,
        "csv0": fetch(port, f"/api/runs/{RUN}/steps.csv?attempt=0").body,
        "history0": get_json(port, f"/api/runs/{RUN}/history?attempt=0"),
        "steps_done": body["steps_done"],
    }


def test_broker_sigkill_keeps_attempts_line_and_superseded(
        spawn: Callable[..., Proc], tmp_path: Path) -> None:
    data = tmp_path / "data"
    broker, eps = start_broker(spawn, data)
    web = start_web(spawn, eps)
    pusher = Pusher(eps.ingest)
    live = None
    try:
        pusher.send(reg(0, "a0"), reg(1, "a1"))
        pusher.send(steps(0, 0, 30, 1.0), steps(1, 0, 30, 1.0))
        for e in range(3):
            pusher.send(epoch(0, e, 1.0), epoch(1, e, 1.0))
        wait_for(lambda: (r := fetch(web.port, f"/api/runs/{RUN}")).status == 200
                 and r.json()["steps_done"] == 29 and len(r.json()["records"]) == 3,
                 what="attempt 0", timeout=60)
        pusher.send(reg(0, "b0"), reg(1, "b1"))
        pusher.send(steps(0, 10, 20, 2.0), steps(1, 10, 20, 2.0))
        pusher.send(epoch(0, 1, 2.0), epoch(1, 1, 2.0))
        before = wait_for(lambda: (v := views(web.port))["steps_done"] == 19
                          and len(v["records"]) == 2 and v, what="attempt 1 rewound", timeout=60)
        assert before["records"] == [(0, 0, 1.0), (1, 1, 2.0)]
        assert before["attempts"][0]["superseded_steps"] == 20  # steps 10-29
        live = SSEClient(web.port, f"/api/runs/{RUN}/events",  # stays through the crash
                         timeout=3.0)
        first = live.next_event()
        assert first is not None and first["event"] == "run"

        broker.proc.kill()  # SIGKILL: no close(), no final flush
        broker.proc.wait(10)
        wait_for(lambda: fetch(web.port, "/healthz").status == 503,
                 what="the web to notice the broker is gone", timeout=60)
        broker2, _ = start_broker(spawn, data, endpoints=eps)
        wait_for(lambda: fetch(web.port, "/healthz").status == 200,
                 what="the web back on the restarted broker", timeout=60)
        # the restarted broker serves the same attempts, line and superseded records
        after = wait_for(lambda: (v := views(web.port)) == before and v,
                         what="the same views after the restart", timeout=60)
        assert after["attempt"] == 1
        # attempt 1 goes on after the restart: its processes' frames still count (sent
        # again until seen: frames queued on the PUSH socket's old connection may be lost)
        sent = [0.0]

        def attempt1_steps() -> Any:
            if time.monotonic() - sent[0] > 3.0:
                sent[0] = time.monotonic()
                pusher.send(steps(0, 20, 25, 3.0), steps(1, 20, 25, 3.0))
                pusher.send(epoch(0, 2, 3.0), epoch(1, 2, 3.0))
            try:
                ev = live.next_event()
            except TimeoutError:  # (nothing in 3 s: send again)
                return None
            if ev and ev.get("event") == "steps" and ev["data"]["steps"][-1]["step"] == 24:
                return ev
            return None
        ev = wait_for(attempt1_steps, what="the live client sees attempt 1 go on", timeout=60)
        assert {r["attempt"] for r in ev["data"]["steps"]} == {1}

        # a client resuming with Last-Event-ID replays the line: epochs 0 (attempt 0) and
        # 1, 2 (attempt 1); never attempt 0's superseded epochs 1 and 2
        with SSEClient(web.port, f"/api/runs/{RUN}/events", {"Last-Event-ID": "0"}) as c:
            got: list[tuple[int, int]] = []

            def three() -> Any:
                ev = c.next_event()
                if ev and ev.get("event") == "epoch":
                    got.append((ev["data"]["epoch"], ev["data"]["attempt"]))
                return len(got) >= 3
            wait_for(three, what="the line replayed", timeout=60)
            assert got == [(0, 0), (1, 1), (2, 1)]
        no_traceback(broker2, web)
    finally:
        if live is not None:
            live.close()
        pusher.sock.close()
        pusher.ctx.term()
