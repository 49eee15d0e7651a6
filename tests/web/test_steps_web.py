"""Per-step streaming through real sockets and a real `rankboard web` (PROTOCOL 4, contract
v2): `/steps` and its 400s/404s, `/steps.csv` streamed, header `steps_done`/`step_metrics`,
ranks `step`/`step_ms`/`slowest_share`, live-only `steps` SSE events with no gap and no
overlap against the first `run` event's `steps_done`, `/metrics` step counters, a web that
starts (or restarts) against a broker already holding steps."""
from __future__ import annotations

import csv
import io
import time
from typing import Any, Callable, Optional

from rank_agent import protocol
from tests.support.brokers import Pusher
from tests.support.http import SSEClient, fetch, get_json
from tests.support.polling import wait_for
from tests.support.procs import Proc, start_web


def steps_frame(run: str, rank: int, steps: list[int], *, loss: Optional[list[Optional[float]]] = None,
                ms: float = 100.0, samples: int = 32, **metrics: list[Optional[float]]) -> Any:
    n = len(steps)
    now = time.time()
    m: dict[str, list[Optional[float]]] = {"loss": loss if loss is not None else [1.0] * n}
    m.update(metrics)
    return protocol.Steps(run=run, rank=rank, steps=steps, times=[now] * n,
                          step_ms=[ms] * n, samples=[samples] * n, metrics=m)


def start(p: Pusher, run: str, world: int = 2) -> None:
    for rank in range(world):
        p.register(run, rank, world, host=f"node-{rank}")


def push_steps(p: Pusher, run: str, first: int, last: int, world: int = 2,
               spike: Optional[int] = None) -> None:
    """Steps first..last from every rank, 50 points a frame; rank 1 is the slow one; rank 0
    reports a loss of 1000 at ``spike``."""
    for lo in range(first, last + 1, 50):
        steps = list(range(lo, min(last, lo + 49) + 1))
        for rank in range(world):
            loss = [1000.0 if s == spike and rank == 0 else 1.0 + rank for s in steps]
            p.send(steps_frame(run, rank, steps, loss=loss, ms=100.0 + 50 * rank))


def steps_done(port: int, run: str) -> Optional[int]:
    r = fetch(port, f"/api/runs/{run}")
    return r.json()["steps_done"] if r.status == 200 else None


def wait_steps(port: int, run: str, last: int) -> None:
    wait_for(lambda: steps_done(port, run) == last, what=f"steps_done == {last}")


def test_steps_series_header_and_ranks(web: Proc, pusher: Pusher) -> None:
    run = "steps-a"
    start(pusher, run)
    push_steps(pusher, run, 0, 199, spike=123)
    wait_steps(web.port, run, 199)
    body = get_json(web.port, f"/api/runs/{run}")
    assert body["status"] == "training"
    assert body["step_metrics"] == ["loss"]
    ranks = {r["rank"]: r for r in body["ranks"]}
    wait_for(lambda: {r["rank"]: r["step"] for r in get_json(web.port, f"/api/runs/{run}")["ranks"]}
             == {0: 199, 1: 199}, what="ranks step 199")
    ranks = {r["rank"]: r for r in get_json(web.port, f"/api/runs/{run}")["ranks"]}
    assert ranks[1]["step_ms"] == 150.0 and ranks[0]["step_ms"] == 100.0
    assert ranks[1]["slowest_share"] == 1.0 and ranks[0]["slowest_share"] == 0.0

    got = get_json(web.port, f"/api/runs/{run}/steps?metric=loss&points=10")
    assert (got["metric"], got["start"], got["end"]) == ("loss", None, None)
    buckets = got["buckets"]
    assert len(buckets) == 10 and sum(b[7] for b in buckets) == 200
    assert buckets[0][0] == 0 and buckets[-1][1] == 199
    spiked = [b for b in buckets if b[0] <= 123 <= b[1]]
    assert spiked[0][4] == (1000.0 + 2.0) / 2  # hi: the exact per-step mean at the spike
    assert spiked[0][6] == 1000.0  # rank_max
    assert all(b[3] == 1.5 for b in buckets)  # lo

    full = get_json(web.port, f"/api/runs/{run}/steps?metric=loss&start=120&end=125")["buckets"]
    assert [b[0] for b in full] == [120, 121, 122, 123, 124, 125]
    assert all(b[7] == 1 and b[0] == b[1] for b in full)
    assert get_json(web.port, f"/api/runs/{run}/steps?metric=step_ms&start=0&end=0")[
        "buckets"] == [[0, 0, 125.0, 125.0, 125.0, 100.0, 150.0, 1]]
    rate = get_json(web.port, f"/api/runs/{run}/steps?metric=samples_per_s&start=5&end=5")
    assert rate["buckets"] == [[5, 5, 64 / 0.15, 64 / 0.15, 64 / 0.15, 64 / 0.15, 64 / 0.15, 1]]
    assert rate["start"] == 5 and rate["end"] == 5
    assert get_json(web.port, f"/api/runs/{run}/steps?metric=never")["buckets"] == []
    assert get_json(web.port, f"/api/runs/{run}/steps?metric=tokens_per_s")["buckets"] == []


def test_steps_bad_queries_are_400_and_unknown_runs_404(web: Proc, pusher: Pusher) -> None:
    run = "steps-b"
    start(pusher, run)
    push_steps(pusher, run, 0, 9)
    wait_steps(web.port, run, 9)
    for query, needle in [
        ("", "metric"), ("metric=", "metric"), ("metric=loss&points=0", "points"),
        ("metric=loss&points=10001", "points"), ("metric=loss&points=abc", "points"),
        ("metric=loss&points=1.5", "points"), ("metric=loss&start=-1", "start"),
        ("metric=loss&end=-3", "end"), ("metric=loss&start=x", "start"),
        ("metric=loss&start=5&end=4", "start"),
    ]:
        r = fetch(web.port, f"/api/runs/{run}/steps?{query}")
        assert r.status == 400, query
        reason = r.json()["error"]
        assert needle in reason and "\n" not in reason, (query, reason)
    assert fetch(web.port, f"/api/runs/{run}/steps?metric=loss&points=10000").status == 200
    assert fetch(web.port, f"/api/runs/{run}/steps?metric=loss&start=4&end=4").status == 200
    assert fetch(web.port, "/api/runs/nope/steps?metric=loss").status == 404
    assert fetch(web.port, "/api/runs/nope/steps.csv").status == 404
    assert fetch(web.port, "/api/runs/bad%20id/steps?metric=loss").status == 404


def test_steps_csv_streamed_full_resolution(web: Proc, pusher: Pusher) -> None:
    run = "steps-c"
    start(pusher, run)
    for rank in range(2):
        pusher.send(protocol.Steps(
            run=run, rank=rank, steps=[0, 1, 2], times=[10.0, 11.0, 12.0],
            step_ms=[None, 20.0 + rank, 20.0], samples=[8, 8, 8], tokens=[],
            metrics={"loss": [float("nan"), 2.0, 3.0], "acc,1": [None, 0.5, None]}))
    wait_steps(web.port, run, 2)
    r = fetch(web.port, f"/api/runs/{run}/steps.csv")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/csv")
    assert r.headers.get("Content-Length") is None  # streamed, not built first
    assert "attachment" in r.headers["Content-Disposition"]
    rows = list(csv.reader(io.StringIO(r.text)))
    assert rows[0] == ["step", "time", "n", "acc,1_mean", "acc,1_min", "acc,1_max", "loss_mean",
                       "loss_min", "loss_max", "step_ms_mean", "step_ms_min", "step_ms_max",
                       "data_ms_mean", "data_ms_min", "data_ms_max",
                       "slowest_rank", "samples", "tokens", "samples_per_s", "tokens_per_s",
                       "attempt"]  # (v5, 8.1: the last column)
    assert rows[1] == ["0", "10.0", "2", "", "", "", "", "", "", "", "", "", "", "", "", "",
                       "16", "0", "", "", "0"]
    assert rows[2][:12] == ["1", "11.0", "2", "0.5", "0.5", "0.5", "2.0", "2.0", "2.0", "20.5",
                            "20.0", "21.0"]
    assert rows[2][12:] == ["", "", "", "1", "16", "0", repr(16 / 0.021), "", "0"]
    assert len(rows) == 4


def test_sse_steps_live_no_gap_no_overlap(web: Proc, pusher: Pusher) -> None:
    """A client that joins mid-run: /steps up to its first header's steps_done plus its
    live steps events hold every closed step exactly once; a reconnect the same."""
    run = "steps-d"
    start(pusher, run)
    push_steps(pusher, run, 0, 99)
    wait_steps(web.port, run, 99)

    def collect(c: SSEClient, until: int) -> tuple[int, list[int]]:
        first = c.next_event()
        assert first is not None and first["event"] == "run"
        done = first["data"]["steps_done"]
        live: list[int] = []
        events = c.events_until(lambda e: e["event"] == "steps"
                                and e["data"]["steps"][-1]["step"] >= until)
        for e in events:
            if e["event"] == "steps":
                live += [r["step"] for r in e["data"]["steps"]]
        return done, live

    with SSEClient(web.port, f"/api/runs/{run}/events") as c1:
        push_steps(pusher, run, 100, 299)
        done, live = collect(c1, 299)
    fetched = [b[0] for b in get_json(
        web.port, f"/api/runs/{run}/steps?metric=loss&end={done}&points=10000")["buckets"]]
    assert done >= 99
    assert sorted(fetched + live) == list(range(300)), "gap or overlap"
    assert live[0] == done + 1

    # A reconnect with Last-Event-ID: the header comes again with the current steps_done.
    with SSEClient(web.port, f"/api/runs/{run}/events", headers={"Last-Event-ID": "1"}) as c2:
        push_steps(pusher, run, 300, 349)
        done2, live2 = collect(c2, 349)
    assert done2 >= 299 and live2[0] == done2 + 1 and live2[-1] == 349


def test_late_steps_and_closed_steps_on_metrics(web: Proc, pusher: Pusher) -> None:
    run = "steps-e"
    start(pusher, run)
    push_steps(pusher, run, 0, 49)
    wait_steps(web.port, run, 49)
    pusher.send(steps_frame(run, 0, [10, 11, 50]))  # 10 and 11 are late, 50 is not
    pusher.send(steps_frame(run, 1, [50]))
    wait_steps(web.port, run, 50)

    def metric(name: str) -> Optional[float]:
        for line in fetch(web.port, "/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return None

    wait_for(lambda: metric("rankboard_late_steps_total") == 2.0, what="2 late steps")
    wait_for(lambda: (metric("rankboard_steps_closed_total") or 0) >= 51, what="51 closed")
    assert f'rankboard_run_steps_done{{run="{run}"}} 50.0' in fetch(web.port, "/metrics").text


def test_web_started_and_restarted_against_a_broker_holding_steps(
        spawn: Callable[..., Proc], broker: Any, pusher: Pusher) -> None:
    run = "steps-f"
    start(pusher, run)
    push_steps(pusher, run, 0, 499, spike=321)
    first = start_web(spawn, broker)
    wait_steps(first.port, run, 499)
    want = get_json(first.port, f"/api/runs/{run}/steps?metric=loss&points=7")
    assert any(b[4] == 501.0 for b in want["buckets"])  # the spike is in the snapshot
    first.stop()
    broker.restart()  # the journal brings the closed steps back
    second = start_web(spawn, broker)
    wait_steps(second.port, run, 499)
    assert get_json(second.port, f"/api/runs/{run}/steps?metric=loss&points=7") == want
    push_steps(pusher, run, 500, 549)
    wait_steps(second.port, run, 549)
