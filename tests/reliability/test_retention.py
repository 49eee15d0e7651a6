"""``--retention-days``: a broker started with it deletes ended runs whose last frame is
older, keeps recent ones and live ones; without it, everything is kept. (v5, PROTOCOL 8.4:
an unfinished run whose latest frame is more than ``--stale-after`` older than the newest
frame in the data dir is ended too; one as new as the newest is not, however old.)"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import pytest
import zmq

from broker.journal.journal import Journal
from broker.runs import Runs
from rank_agent import protocol as P
from tests.support.brokers import FeedClient
from tests.support.procs import Proc, start_broker

DAY = 86400.0


def write_journal(data: Path, *, new: bool = True) -> None:
    """old-done (finished 3 days ago), old-open (unfinished, 3 days), new-done (finished now,
    unless not ``new``)."""
    journal = Journal(data)
    journal.load()
    runs = Runs(recorder=journal.accept)
    now = time.time()
    for run, at, done in (("old-done", now - 3 * DAY, True), ("old-open", now - 3 * DAY, False),
                          ("new-done", now, True))[:3 if new else 2]:
        runs.ingest(P.encoder.encode(P.Register(run=run, rank=0, world_size=1, host="h")), at)
        runs.ingest(P.encoder.encode(P.Metrics(run=run, rank=0, epoch=0, avg_loss=1.0)), at)
        if done:
            runs.ingest(P.encoder.encode(P.Finish(run=run, rank=0)), at)
    journal.flush()
    journal.close()


@pytest.mark.parametrize("flags, new, kept", [
    # old-open's only rank fell silent 3 days before new-done's frames: ended (8.4)
    (["--retention-days", "1"], True, ["new-done"]),
    ([], True, ["new-done", "old-done", "old-open"]),
    # a data dir left for 3 days (a long upgrade): old-open's frames are the newest there,
    # so it is not ended and stays; old-done finished and goes
    (["--retention-days", "1"], False, ["old-open"]),
])
def test_retention_days_deletes_old_finished_runs_at_start(
        spawn: Callable[..., Proc], tmp_path: Path, flags: list[str], new: bool,
        kept: list[str]) -> None:
    data = tmp_path / "data"
    write_journal(data, new=new)
    _, eps = start_broker(spawn, data, *flags)
    ctx = zmq.Context()
    client = FeedClient(ctx, eps.publish, eps.snapshot)
    try:
        snaps, _ = client.snapshot()
    finally:
        client.close()
        ctx.term()
    assert sorted(s["run"] for s in snaps) == kept
    assert all(len(s["records"]) == 1 for s in snaps)
    assert sorted(p.name for p in (data / "runs").glob("*.journal")) == [
        f"{run}.journal" for run in kept]
