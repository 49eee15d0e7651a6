"""Attempts over the wire (PROTOCOL 8.1): a real broker and web on ephemeral ports, frames
pushed over ZeroMQ, the routes' ``?attempt=``, ``/steps.csv``'s last column, the header and
``/api/runs`` ``attempt``, and a raw SSE client across a restart."""
from __future__ import annotations

import csv
import io
from typing import Any

from rank_agent import protocol
from tests.support.brokers import Pusher
from tests.support.http import SSEClient, fetch, get_json
from tests.support.polling import wait_for

RUN = "att-run"


def reg(rank: int, ws: int, proc: str) -> protocol.Register:
    return protocol.Register(run=RUN, rank=rank, world_size=ws, host=f"h{rank}", proc=proc)


def steps(rank: int, lo: int, hi: int, loss: float) -> protocol.Steps:
    s = list(range(lo, hi))
    return protocol.Steps(run=RUN, rank=rank, steps=s, times=[1.0e9 + k for k in s],
                          step_ms=[10.0] * len(s), metrics={"loss": [loss] * len(s)})


def epoch(rank: int, e: int, loss: float, scalars: Any = None) -> protocol.Metrics:
    return protocol.Metrics(run=RUN, rank=rank, epoch=e, avg_loss=loss, batches=1,
                            scalars=scalars or {})


def header(port: int) -> dict[str, Any]:
    return get_json(port, f"/api/runs/{RUN}")


def test_a_restart_over_the_wire(web: Any, pusher: Pusher) -> None:
    port = web.port
    pusher.send(reg(0, 2, "a0"), reg(1, 2, "a1"))
    pusher.send(steps(0, 0, 20, 1.0), steps(1, 0, 20, 1.0))
    old = {"old_acc": (0.5, 1)}  # a metric only the superseded epoch has
    pusher.send(epoch(0, 0, 1.0), epoch(1, 0, 1.0), epoch(0, 1, 1.0, old), epoch(1, 1, 1.0, old))
    pusher.send(protocol.Finish(run=RUN, rank=0), protocol.Finish(run=RUN, rank=1))
    wait_for(lambda: (h := fetch(port, f"/api/runs/{RUN}")).status == 200
             and h.json()["steps_done"] == 19 and h.json()["status"] == "complete",
             what="attempt 0 closed", timeout=60)

    sse = SSEClient(port, f"/api/runs/{RUN}/events")
    try:
        # attempt 1: new processes resume from step 10 / epoch 1
        pusher.send(reg(0, 2, "b0"), reg(1, 2, "b1"))
        pusher.send(steps(0, 10, 15, 2.0), steps(1, 10, 15, 2.0))
        pusher.send(epoch(0, 1, 2.0), epoch(1, 1, 2.0))
        body = wait_for(lambda: (b := header(port))["attempt"] == 1 and b["steps_done"] == 14
                        and b["records"][-1].get("attempt") == 1 and b, what="attempt 1",
                        timeout=60)
        assert body["status"] == "training"
        assert [(r["epoch"], r["attempt"]) for r in body["records"]] == [(0, 0), (1, 1)]
        a0, a1 = body["attempts"]
        assert (a0["last_step"], a0["superseded_steps"], a0["superseded_epochs"]) == (19, 10, 1)
        assert (a1["first_step"], a1["last_step"]) == (10, 14)
        assert any(a["kind"] == "restart" and a["message"] ==
                   "restart 1: the previous attempt reached step 19" for a in body["alerts"])
        runs = get_json(port, "/api/runs")
        assert [r["attempt"] for r in runs if r["run"] == RUN] == [1]

        # the SSE stream: steps records carry attempt 1, from step 10 on (a rewind)
        def rewound() -> Any:
            ev = sse.next_event()
            if ev and ev.get("event") == "steps":
                recs = ev["data"]["steps"]
                if recs and recs[0].get("attempt") == 1:
                    return recs
            return None
        recs = wait_for(rewound, what="a steps event of attempt 1", timeout=60)
        assert recs[0]["step"] == 10
    finally:
        sse.close()

    # the line and ?attempt=
    line = fetch(port, f"/api/runs/{RUN}/steps.csv")
    rows = list(csv.reader(io.StringIO(line.body.decode())))
    assert rows[0][-1] == "attempt"
    assert [(r[0], r[-1]) for r in rows[1:]] == \
        [(str(s), "0") for s in range(10)] + [(str(s), "1") for s in range(10, 15)]
    own0 = list(csv.reader(io.StringIO(fetch(port, f"/api/runs/{RUN}/steps.csv?attempt=0")
                                       .body.decode())))
    assert [r[0] for r in own0[1:]] == [str(s) for s in range(20)]
    assert {r[-1] for r in own0[1:]} == {"0"}
    b0 = get_json(port, f"/api/runs/{RUN}/steps?metric=loss&attempt=0")["buckets"]
    assert b0[0][0] == 0 and b0[-1][1] == 19 and {b[2] for b in b0} == {1.0}
    b = get_json(port, f"/api/runs/{RUN}/steps?metric=loss")["buckets"]
    assert b[-1][1] == 14 and b[-1][2] == 2.0
    assert get_json(port, f"/api/runs/{RUN}/steps?metric=loss&attempt=")["buckets"] == b
    assert [r["epoch"] for r in get_json(port, f"/api/runs/{RUN}/history?attempt=0")] == [0, 1]
    assert [r["epoch"] for r in get_json(port, f"/api/runs/{RUN}/history")] == [0, 1]
    hist = list(csv.reader(io.StringIO(fetch(port, f"/api/runs/{RUN}/history.csv").body.decode())))
    assert "old_acc" in hist[0] and len(hist) == 3  # the line's 2 epochs, all metric names
    for bad in ("x", "-1", "1.0", "%D9%A1"):  # (the last: an Arabic-Indic 1)
        assert fetch(port, f"/api/runs/{RUN}/steps?attempt={bad}").status == 400, bad
        assert fetch(port, f"/api/runs/{RUN}/history.csv?attempt={bad}").status == 400, bad
    assert fetch(port, f"/api/runs/{RUN}/steps.csv?attempt=7").status == 404
    assert fetch(port, f"/api/runs/{RUN}/history?attempt=2").status == 404
    metrics = fetch(port, "/metrics").body.decode()
    assert f'rankboard_run_attempt{{run="{RUN}"}} 1.0' in metrics

    # an old process's frames: counted, nothing else (rank 1's attempt-0 process)
    pusher.send(reg(1, 2, "a1"))
    wait_for(lambda: 'rankboard_frames_rejected_total{reason="old_proc"} 1.0'
             in fetch(port, "/metrics").body.decode(), what="old_proc counted", timeout=60)
    assert header(port)["steps_done"] == 14

    # attempt 2 (rank 0's new process) has closed nothing: empty answers, a CSV header alone
    pusher.send(reg(0, 2, "c0"))
    wait_for(lambda: header(port)["attempt"] == 2, what="attempt 2", timeout=60)
    assert get_json(port, f"/api/runs/{RUN}/steps?metric=loss&attempt=2")["buckets"] == []
    assert get_json(port, f"/api/runs/{RUN}/history?attempt=2") == []
    only = fetch(port, f"/api/runs/{RUN}/steps.csv?attempt=2").body.decode()
    assert only.count("\r\n") == 1 and only.rstrip().endswith(",attempt")
    hist = fetch(port, f"/api/runs/{RUN}/history.csv?attempt=2")
    assert hist.status == 200 and hist.body.decode().count("\n") <= 1
