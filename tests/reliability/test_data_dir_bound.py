"""PROTOCOL 8.4 with real brokers and real journals: ``--retain-bytes`` at start (a broker
process) and while running, ``--retention-days`` while running, the live run kept, a deleted
run leaving every web as an eviction does and starting afresh on its next frame; bad flag
values are one line naming the flag, exit 2."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import pytest
import zmq

from broker import feed
from broker.journal.journal import Journal
from broker.runs import Runs
from broker.server import BrokerServer
from rank_agent import protocol as P
from tests.support.brokers import LOOPBACK_ANY, FeedClient, Pusher, RunningBroker
from tests.support.http import fetch, get_json
from tests.support.polling import wait_for
from tests.support.procs import Endpoints, Proc, start_broker, start_web


def _disk_bytes(path: Path) -> int:
    st = os.stat(path)
    return st.st_blocks * 512


def write_runs(data: Path, runs: list[tuple[str, float, bool]], epochs: int = 3) -> None:
    """Journals as a broker writes them: ``(run, time of its frames, finished)`` each."""
    journal = Journal(data)
    journal.load()
    held = Runs(recorder=journal.accept)
    for run, at, done in runs:
        held.ingest(P.encoder.encode(P.Register(run=run, rank=0, world_size=1, host="h")), at)
        for epoch in range(epochs):
            held.ingest(P.encoder.encode(P.Metrics(run=run, rank=0, epoch=epoch, avg_loss=1.0,
                                                   scalars={"x" * 40: (1.0, 1)})), at)
        if done:
            held.ingest(P.encoder.encode(P.Finish(run=run, rank=0)), at)
    journal.flush()
    journal.close()


def test_retain_bytes_at_start_deletes_ended_runs_oldest_first_and_keeps_the_live_one(
        spawn: Callable[..., Proc], tmp_path: Path) -> None:
    data = tmp_path / "data"
    now = time.time()
    # done-0 is the least recently updated; "live" is unfinished and the newest (it is
    # the largest too, so that a bound by size alone would take it first)
    write_runs(data, [(f"done-{i}", now - 600 + 60 * i, True) for i in range(4)])
    write_runs(data, [("live", now, False)], epochs=60)
    sizes = {p.name[:-len(".journal")]: _disk_bytes(p) for p in (data / "runs").glob("*.journal")}
    bound = sizes["live"] + sizes["done-2"] + sizes["done-3"]
    proc, eps = start_broker(spawn, data, "--retain-bytes", str(bound))
    ctx = zmq.Context()
    client = FeedClient(ctx, eps.publish, eps.snapshot)
    try:
        snaps, _ = client.snapshot()
    finally:
        client.close()
        ctx.term()
    assert sorted(s["run"] for s in snaps) == ["done-2", "done-3", "live"]
    assert sorted(p.name for p in (data / "runs").glob("*.journal")) == [
        "done-2.journal", "done-3.journal", "live.journal"]
    err = proc.output("stderr")
    assert "deleted ended run 'done-0'" in err and "deleted ended run 'done-1'" in err


def _serve(data: Path, **kw: object) -> RunningBroker:
    server = BrokerServer(LOOPBACK_ANY, LOOPBACK_ANY, LOOPBACK_ANY, data_dir=data,
                          stale_after=30.0, retention_interval=0.2, **kw)  # type: ignore[arg-type]
    return RunningBroker(server)


def _journal_counters(client: FeedClient) -> dict[str, int]:
    hb, _ = client.until(lambda u: isinstance(u, feed.Heartbeat), what="a heartbeat")
    assert isinstance(hb, feed.Heartbeat)
    return dict(hb.journal)


@pytest.mark.parametrize("rule", ["bytes", "days"])
def test_while_running_an_ended_run_goes_within_a_pass_and_the_live_one_stays(
        spawn: Callable[..., Proc], tmp_path: Path, ctx: zmq.Context, rule: str) -> None:
    """The bound applied while the broker runs (not only at start): a run that finishes
    is deleted on the next pass (every web sees it evicted), the streaming run is kept
    although it alone exceeds the bound, and the deleted run's next frame starts it afresh."""
    data = tmp_path / "data"
    kw: dict[str, object] = ({"retain_bytes": 1} if rule == "bytes"
                             else {"retention_days": 1.0 / 86400})  # one second
    broker = _serve(data, **kw)
    client = FeedClient(ctx, broker.endpoints["publish"], broker.endpoints["snapshot"])
    pusher = Pusher(broker.endpoints["ingest"])
    web = start_web(spawn, Endpoints(**broker.endpoints))
    assert web.port is not None
    port = web.port
    try:
        client.until(lambda u: isinstance(u, feed.Heartbeat), what="the feed")
        pusher.register("done", 0, 1)
        pusher.epoch("done", 0, 1)
        pusher.send(P.Finish(run="done", rank=0))
        wait_for(lambda: fetch(port, "/api/runs/done").status == 200, what="done on the web")
        pusher.register("live", 0, 1)
        deadline = time.monotonic() + 60
        epoch = 0
        evicted = False
        while not evicted:
            assert time.monotonic() < deadline, "the ended run was not deleted"
            pusher.epoch("live", epoch, 1)  # the live run streams on meanwhile
            epoch += 1
            end = time.monotonic() + 0.2
            while not evicted and time.monotonic() < end:
                if client.sub.poll(50):
                    u = feed.decode_update(client.sub.recv_multipart())
                    evicted = (isinstance(u, feed.EventUpdate) and u.run == "done"
                               and u.kind == "evicted")
        assert not (data / "runs" / "done.journal").exists()
        assert (data / "runs" / "live.journal").exists()
        snaps, _ = client.snapshot()
        assert [s["run"] for s in snaps] == ["live"]
        # and the web dropped it, as it drops a run evicted at --max-runs
        wait_for(lambda: [r["run"] for r in get_json(port, "/api/runs")] == ["live"],
                 timeout=30, what="the web to drop the deleted run")
        counters = _journal_counters(client)
        assert counters[f"runs_deleted_{rule}"] == 1
        assert counters["data_dir_bytes"] > 0
        # the deleted run's next frame starts it afresh: nothing of before
        pusher.register("done", 0, 1)
        pusher.epoch("done", 7, 1)
        got = wait_for(lambda: [s for s in client.snapshot("done")[0] if s["records"]],
                       what="the run started afresh")
        assert [r["epoch"] for _, r in got[0]["records"]] == [7]
    finally:
        pusher.close()
        client.close()
        broker.stop()


def test_live_runs_alone_over_the_bound_are_logged_and_kept(
        tmp_path: Path, ctx: zmq.Context, caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "data"
    broker = _serve(data, retain_bytes=1)
    pusher = Pusher(broker.endpoints["ingest"])
    try:
        pusher.register("live", 0, 1)
        pusher.epoch("live", 0, 1)
        wait_for(lambda: "live runs alone exceed --retain-bytes 1" in caplog.text,
                 what="the log line")
        assert (data / "runs" / "live.journal").exists()
        assert caplog.text.count("live runs alone exceed") == 1
    finally:
        pusher.close()
        broker.stop()


@pytest.mark.parametrize("command", ["broker", "up"])
@pytest.mark.parametrize("value", ["0", "-5", "1.5G", "10P", "ten", "5 G", ""])
def test_bad_retain_bytes_is_one_line_naming_the_flag(
        spawn: Callable[..., Proc], tmp_path: Path, command: str, value: str) -> None:
    proc = spawn(command, "--data-dir", str(tmp_path / "d"), "--retain-bytes", value)
    assert proc.proc.wait(30) == 2
    proc.close()
    err = [line for line in proc.lines["stderr"] if line.strip()]
    assert len(err) == 1 and "--retain-bytes" in err[0], err
    assert "Traceback" not in err[0]


@pytest.mark.parametrize("value", ["0", "-1", "x", "inf"])
def test_bad_retention_days_is_one_line_naming_the_flag(
        spawn: Callable[..., Proc], tmp_path: Path, value: str) -> None:
    proc = spawn("broker", "--data-dir", str(tmp_path / "d"), "--retention-days", value)
    assert proc.proc.wait(30) == 2
    proc.close()
    err = [line for line in proc.lines["stderr"] if line.strip()]
    assert len(err) == 1 and "--retention-days" in err[0], err
