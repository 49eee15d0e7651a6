"""PROTOCOL 8.4, a full disk: a broker whose data dir sits on a small tmpfs that fills up
while a run streams keeps serving the run on every web, ``/healthz`` stays 200 and says
``journal: "failing"``, ``/metrics`` counts the failed writes; when space is freed the
journal continues (``"ok"`` again) and a broker restarted on it serves what was sent after
(and, since the writes were retried, what was sent while they failed). Real processes, a
real filesystem (the tests run as root: mounted and unmounted here)."""
from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import zmq

from broker import feed
from tests.support.brokers import FeedClient, Pusher
from tests.support.http import fetch, get_json
from tests.support.polling import wait_for
from tests.support.procs import Proc, no_traceback, start_broker, start_web


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted at teardown."""
    where = tmp_path / "disk"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(path: Path) -> None:
    """Write ``path`` until the filesystem says ENOSPC."""
    chunk = b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
        small = b"\0" * 512
        while True:  # the last bytes too, so a journal's next page cannot be had
            try:
                f.write(small)
            except OSError:
                return


def epochs_of(port: int, run: str) -> list[int]:
    got = fetch(port, f"/api/runs/{run}")
    if got.status != 200:  # not (yet, or again after a restart) known to the web
        return []
    body: Any = got.json()
    return [r["epoch"] for r in body["records"]]


def metric(port: int, name: str) -> float:
    text = fetch(port, "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_a_full_disk_keeps_the_run_live_and_the_journal_continues_when_space_returns(
        spawn: Callable[..., Proc], small_disk: Path) -> None:
    data = small_disk / "data"
    broker, eps = start_broker(spawn, data)
    web = start_web(spawn, eps)
    port = web.port
    assert port is not None
    pusher = Pusher(eps.ingest)
    run = "full"
    pad = {f"pad-{i:03d}": (float(i), 1) for i in range(40)}  # bigger entries: pages fill sooner
    try:
        pusher.register(run, 0, 1)
        for e in range(3):
            pusher.epoch(run, e, 1, scalars=pad)
        wait_for(lambda: epochs_of(port, run) == [0, 1, 2], timeout=60, what="3 epochs")
        assert get_json(port, "/healthz")["journal"] == "ok"

        fill(small_disk / "filler")
        epoch = 3

        def failing() -> bool:
            nonlocal epoch
            pusher.epoch(run, epoch, 1, scalars=pad)  # the run streams on
            epoch += 1
            health = fetch(port, "/healthz")
            return health.status == 200 and health.json()["journal"] == "failing"

        wait_for(failing, timeout=60, what="/healthz journal failing")
        body = get_json(port, "/healthz")
        assert body["ok"] is True and body["shards"][0]["journal"] == "failing"
        while_failing = epoch
        for _ in range(5):
            pusher.epoch(run, epoch, 1, scalars=pad)
            epoch += 1
        # every epoch is live on the web while nothing reaches the disk
        wait_for(lambda: epochs_of(port, run) == list(range(epoch)), timeout=60,
                 what="the epochs sent while writes fail, on the web")
        assert metric(port, "rankboard_journal_write_errors_total") > 0

        os.unlink(small_disk / "filler")  # space returns
        wait_for(lambda: get_json(port, "/healthz")["journal"] == "ok", timeout=60,
                 what="/healthz journal ok again")
        after = list(range(epoch, epoch + 3))
        for e in after:
            pusher.epoch(run, e, 1, scalars=pad)
        epoch += 3
        wait_for(lambda: epochs_of(port, run)[-3:] == after, timeout=60, what="epochs after")
        assert broker.stop() == 0
        broker2, _ = start_broker(spawn, data, endpoints=eps)
        # the restarted broker serves what was sent after space returned, and what was
        # sent while writes failed (retried, not lost), with no corrupt entry between
        wait_for(lambda: epochs_of(port, run) == list(range(epoch)), timeout=60,
                 what="every epoch after the restart")
        assert while_failing < epoch
        assert "damaged" not in broker2.output("stderr")
        assert "dropping the last" not in broker2.output("stderr")
        errors = [line for line in broker.output("stderr").splitlines()
                  if "cannot write" in line]
        assert 1 <= len(errors) <= 2, errors  # at most once a minute (and its first one)
        no_traceback(broker, broker2, web)
    finally:
        pusher.close()


def test_ids_after_a_sigkill_while_writes_fail_stay_above_every_id_issued(
        spawn: Callable[..., Proc], small_disk: Path, ctx: zmq.Context) -> None:
    """PROTOCOL 8.4/8.5: the ids issued while nothing reached the disk (more than a
    reservation's worth) are above what a broker restarted after SIGKILL starts from."""
    data = small_disk / "data"
    broker, eps = start_broker(spawn, data)
    pusher = Pusher(eps.ingest)
    client = FeedClient(ctx, eps.publish, eps.snapshot)
    run = "ids"
    try:
        hb, _ = client.until(lambda u: isinstance(u, feed.Heartbeat), what="the feed")
        first = hb.instance  # type: ignore[union-attr]
        pusher.register(run, 0, 1)
        pusher.epoch(run, 0, 1)
        client.events(run, lambda u: u.kind == "epoch")
        fill(small_disk / "filler")
        issued = 0
        for e in range(1, 1500):  # ~2 ids an epoch: past the 1,000-id reservation on disk
            pusher.epoch(run, e, 1)
        for u in client.events(run, lambda u: u.kind == "epoch" and u.data["epoch"] == 1499,
                               timeout=60):
            issued = max(issued, u.seq)
        assert issued > 1000
        wait_for(lambda: "cannot write" in broker.output("stderr"), what="writes failing")
        broker.proc.kill()
        assert broker.proc.wait(10) == -9
        os.unlink(small_disk / "filler")
        broker2, _ = start_broker(spawn, data, endpoints=eps)
        client.until(lambda u: isinstance(u, feed.Heartbeat) and u.instance != first,
                     timeout=30, what="the restarted broker's feed")
        pusher.epoch(run, 1500, 1)
        got = client.events(run, lambda u: u.kind == "epoch" and u.data["epoch"] == 1500,
                            timeout=30)
        assert got[-1].seq > issued
        no_traceback(broker2)
    finally:
        client.close()
        pusher.close()
