"""``rankboard web --workers N`` and ``rankboard up --workers N``: real processes sharing one
port with SO_REUSEPORT, each a full web with its own feed subscription.

Every stream comparison first makes sure the two connections really landed on different
workers (the ``X-Rankboard-Worker`` header of the SSE response), since the kernel may put
any connection anywhere.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import time
from typing import Any, Callable

import psutil

from tests.support.brokers import Pusher
from tests.support.http import fetch
from tests.support.polling import wait_for
from tests.support.pool import (
    assert_increasing_ids,
    epoch_events,
    metric,
    metrics_ports,
    sse_on_worker,
    start_pool,
    wait_healthy_workers,
    worker_of,
    worker_pids,
)
from tests.support.procs import Proc

RUN = "pool"


def _records_everywhere(port: int, run: str, n: int, workers: int = 2) -> None:
    """Poll until every worker has ``n`` records of ``run`` (each keeps its own state)."""
    done: set[int] = set()

    def check() -> bool:
        r = fetch(port, f"/api/runs/{run}/history")
        slot = worker_of(r)
        if r.status == 200 and slot is not None and len(r.json()) >= n:
            done.add(slot)
        return len(done) == workers

    wait_for(check, what=f"{n} records of {run} on every worker")


def test_two_workers_serve_identical_gapless_streams(
        spawn: Callable[..., Proc], broker: Any, pusher: Pusher) -> None:
    pool = start_pool(spawn, broker)
    assert pool.port is not None
    assert len(worker_pids(pool)) == 2
    pusher.register(RUN, 0, 2)
    pusher.register(RUN, 1, 2, host="node-b")
    pusher.epoch(RUN, 0, 2)
    _records_everywhere(pool.port, RUN, 1)

    path = f"/api/runs/{RUN}/events"
    with sse_on_worker(pool.port, path, 1) as one, sse_on_worker(pool.port, path, 2) as two:
        for epoch in range(1, 10):
            pusher.epoch(RUN, epoch, 2, loss=1.0 / (epoch + 1))

        def last(ev: dict[str, Any]) -> bool:
            return ev["event"] == "epoch" and ev["data"]["epoch"] == 9

        got_one, got_two = one.events_until(last), two.events_until(last)
    for events in (got_one, got_two):
        assert events[0]["event"] == "run"
        assert_increasing_ids(events)
    epochs_one, epochs_two = epoch_events(got_one), epoch_events(got_two)
    assert [e for _, e, _ in epochs_one] == list(range(10))  # gapless, nothing twice
    assert epochs_one == epochs_two  # same ids, same records, byte for byte after JSON
    assert "Traceback" not in pool.output()


def test_a_dead_worker_is_restarted_and_logged_and_sigterm_stops_all(
        spawn: Callable[..., Proc], broker: Any, pusher: Pusher) -> None:
    pool = start_pool(spawn, broker)
    assert pool.port is not None
    pusher.register(RUN, 0, 1)
    pusher.epoch(RUN, 0, 1)
    _records_everywhere(pool.port, RUN, 1)
    pids = worker_pids(pool)
    survivor = sse_on_worker(pool.port, f"/api/runs/{RUN}/events", 2)
    try:
        assert survivor.events_until(lambda ev: ev["event"] == "epoch")
        victim = pids[1]
        psutil.Process(victim).kill()
        pool.wait_line(rf"web worker 1 \(pid {victim}\) was killed by SIGKILL; restarting it",
                       stream="stderr")
        restarted = pool.wait_line(r"web worker 1 restarted \(pid (\d+)\)", stream="stderr")
        new_pid = int(restarted.group(1))
        assert new_pid != victim and worker_pids(pool) == {1: new_pid, 2: pids[2]}
        wait_healthy_workers(pool.port, 2)
        # the new worker took its own snapshot; the other worker's stream never noticed
        _records_everywhere(pool.port, RUN, 1)
        pusher.epoch(RUN, 1, 1)
        ev = survivor.events_until(lambda ev: ev["event"] == "epoch")[-1]
        assert ev["data"]["epoch"] == 1
        _records_everywhere(pool.port, RUN, 2)
    finally:
        survivor.close()

    children = [psutil.Process(pid) for pid in worker_pids(pool).values()]
    started = time.monotonic()
    assert pool.stop(signal.SIGTERM, timeout=20) == 0
    assert time.monotonic() - started < 15
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive
    assert "Traceback" not in pool.output()
    refused = socket.socket()
    try:  # the port is free: nothing listens, nothing holds it
        assert refused.connect_ex(("127.0.0.1", pool.port)) != 0
    finally:
        refused.close()


def test_metrics_are_per_worker(spawn: Callable[..., Proc], broker: Any,
                                pusher: Pusher) -> None:
    # Streams opened on worker 2 while looking for one on worker 1 are closed by the client;
    # a worker notices a gone client only when it next writes (its ping): ping every 0.5 s.
    pool = start_pool(spawn, broker, "--metrics-port", "0",
                      env={**os.environ, "RANKBOARD_SSE_PING": "0.5"})
    assert pool.port is not None
    ports = metrics_ports(pool, 2)
    pusher.register(RUN, 0, 1)
    pusher.epoch(RUN, 0, 1)
    _records_everywhere(pool.port, RUN, 1)
    rank_epoch = 'rankboard_rank_epoch{host="node-a",rank="0",run="pool"} 0.0'
    # the broker publishes ranks at most once a second, so they may trail the record
    wait_for(lambda: all(rank_epoch in fetch(ports[k], "/metrics").text for k in (1, 2)),
             what="the rank's epoch in both workers' /metrics")
    with sse_on_worker(pool.port, f"/api/runs/{RUN}/events", 1) as client:
        assert client.next_event() is not None

        def counted() -> bool:
            one = fetch(ports[1], "/metrics").text
            two = fetch(ports[2], "/metrics").text
            return metric(one, "rankboard_sse_clients") == 1 and metric(
                two, "rankboard_sse_clients") == 0

        wait_for(counted, what="one SSE client on worker 1, none on worker 2")
        texts = [fetch(ports[k], "/metrics").text for k in (1, 2)]
    for text in texts:  # what comes from the broker is the same in every worker
        assert metric(text, "rankboard_web_connected") == 1
        assert rank_epoch in text
    for k in (1, 2):
        assert worker_of(fetch(ports[k], "/healthz")) == k
        assert fetch(ports[k], "/healthz").status == 200
        assert fetch(ports[k], "/").status == 404  # a scrape port, not a second dashboard
        assert fetch(ports[k], f"/api/runs/{RUN}").status == 404


def test_a_second_pool_on_the_same_port_is_refused(
        spawn: Callable[..., Proc], broker: Any) -> None:
    pool = start_pool(spawn, broker)
    other = spawn("web", "--publish", broker.publish, "--snapshot", broker.snapshot,
                  "--port", str(pool.port), "--workers", "2")
    assert other.proc.wait(30) == 1
    other.close()
    err = [line for line in other.lines["stderr"] if line.startswith("rankboard web:")]
    assert len(err) == 1 and "in use" in err[0] and str(pool.port) in err[0], other.lines


def test_a_port_held_by_another_program_is_a_one_line_error(
        spawn: Callable[..., Proc], broker: Any) -> None:
    holder = socket.socket()  # no SO_REUSEPORT: nobody may share it
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        port = holder.getsockname()[1]
        proc = spawn("web", "--publish", broker.publish, "--snapshot", broker.snapshot,
                     "--port", str(port), "--workers", "2")
        assert proc.proc.wait(30) == 1
        proc.close()
    finally:
        holder.close()
    err = [line for line in proc.lines["stderr"] if line.strip()]
    assert len(err) == 1 and err[0].startswith("rankboard web: cannot bind the web to")
    assert str(port) in err[0] and "in use" in err[0], err


def test_a_worker_that_cannot_start_fails_the_command(
        spawn: Callable[..., Proc], broker: Any) -> None:
    holder = socket.socket()  # worker 2's metrics port is taken (worker 1's is the one below)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        taken = holder.getsockname()[1]
        proc = spawn("web", "--publish", broker.publish, "--snapshot", broker.snapshot,
                     "--port", "0", "--workers", "2", "--metrics-port", str(taken - 1))
        assert proc.proc.wait(60) == 1
        proc.close()
    finally:
        holder.close()
    err = [line for line in proc.lines["stderr"] if line.startswith("rankboard web:")]
    assert len(err) == 1, proc.lines["stderr"]
    assert re.search(r"web worker \d failed to start: cannot bind the metrics listener", err[0])
    assert not proc.lines["stdout"]  # never announced a dashboard
    assert "Traceback" not in proc.output()


def test_up_with_workers_binds_lazily_and_stops_everything(
        spawn: Callable[..., Proc], tmp_path: Any) -> None:
    up = spawn("up", "--workers", "2", "--ingest", "tcp://127.0.0.1:*",
               "--publish", "tcp://127.0.0.1:*", "--snapshot", "tcp://127.0.0.1:*",
               "--data-dir", str(tmp_path / "data"), "--port-from-rank")
    try:
        processes = _up_with_workers_serves(up)
    finally:  # SIGINT, so that up stops its children (a SIGKILL would orphan them)
        code = up.stop(signal.SIGINT, timeout=20)
    assert code == 0
    gone, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive, alive
    assert "Traceback" not in up.output()


def _up_with_workers_serves(up: Proc) -> list[psutil.Process]:
    """The pool starts where the first rank's port says; returns up's child processes."""
    ingest = up.wait_line(r"broker ingest bound at (\S+)", stream="stderr").group(1)
    # a port that stays ours until the pool has it: SO_REUSEPORT lets the pool join it
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    pusher = Pusher(ingest)
    try:
        def bound() -> bool:
            pusher.register("launch", 0, 1, port=port)
            return any(line.startswith("dashboard:") for line in up.lines["stdout"])

        wait_for(bound, what="the lazy bind of the pool")
        assert up.wait_line(r"^dashboard: http://localhost:(\d+)$").group(1) == str(port)
        assert sum(line.startswith("dashboard:") for line in up.lines["stdout"]) == 1
        wait_healthy_workers(port, 2)
        assert fetch(port, "/api/runs").json()[0]["run"] == "launch"
    finally:
        pusher.close()
        holder.close()
    processes = psutil.Process(up.proc.pid).children(recursive=True)
    assert len(processes) == 3  # the broker and two workers
    return processes
