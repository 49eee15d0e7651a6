"""The journal's files: retention at start, more runs than open handles, forgetting and
loading a run again, write errors logged and retried, and a constructor that does no I/O."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from broker.journal.journal import HEADER, Journal
from rank_agent.protocol import (
    Finish,
    Metrics,
)
from tests.support.journalrun import (
    T0,
    Server,
    journal_path,
    reload,
    same,
    training,
)

# -- retention, handles ------------------------------------------------------------------


def test_retention_deletes_only_old_finished_runs(tmp_path: Path) -> None:
    data_dir = tmp_path / "d"
    now = T0 + 30 * 86400
    old, recent = T0, now - 86400
    for run, start, done in [("old-done", old, True), ("old-open", old, False),
                             ("new-done", recent, True)]:
        srv = Server(data_dir, now=start)
        training(srv, run, ranks=1, epochs=1, finish=done)
        srv.close()
    j = Journal(data_dir, retention_days=7)
    sinks = j.load(now=now)
    j.close()
    assert set(sinks) == {"old-open", "new-done"}
    assert not journal_path(data_dir, "old-done").exists()
    j = Journal(data_dir)  # None keeps everything
    sinks = j.load(now=now + 1e9)
    j.close()
    assert set(sinks) == {"old-open", "new-done"}


def test_more_runs_than_open_handles(tmp_path: Path) -> None:
    srv = Server(tmp_path, max_open_files=3)
    for i in range(3):
        for n in range(10):
            training(srv, f"run{n}", ranks=1, epochs=1) if i == 0 else srv.send(
                Metrics(run=f"run{n}", rank=0, epoch=i, avg_loss=float(n), batches=1))
    assert len(srv.journal._handles.open) <= 3
    expect = {run: s.records for run, s in srv.sinks.items()}
    srv.close()
    j, sinks = reload(tmp_path)
    j.close()
    assert {run: len(s.records) for run, s in sinks.items()} == {f"run{n}": 3 for n in range(10)}
    assert all(same(sinks[run].records, recs) for run, recs in expect.items())


def test_forget_then_load_run(tmp_path: Path) -> None:
    srv = Server(tmp_path)
    training(srv, "r", ranks=2, epochs=2)
    before = srv.sinks["r"].snapshot()
    srv.journal.forget("r")
    sink = srv.journal.load_run("r")
    assert sink is not None and sink.seq > before["seq"]
    assert same(sink.snapshot()["records"], before["records"])
    srv.sinks["r"] = sink
    srv.send(Finish(run="r", rank=0))
    srv.send(Finish(run="r", rank=1))
    assert srv.sinks["r"].complete is not None
    srv.close()
    j, sinks = reload(tmp_path)
    j.close()
    assert sinks["r"].complete == srv.sinks["r"].complete


def test_load_run_of_an_unknown_run_is_none_and_writes_nothing(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.load()
    try:
        assert j.load_run("never-seen") is None
        assert list((tmp_path / "runs").iterdir()) == []
    finally:
        j.close()


def test_write_errors_are_logged_and_retried_never_raised(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    srv = Server(tmp_path, fsync_interval=0.0)
    training(srv, "r", ranks=1, epochs=1)
    runs = tmp_path / "runs"
    srv.journal.forget("r")  # its handle is closed: the next write must open the file again
    shutil.move(runs, tmp_path / "runs-away")
    runs.write_text("a file where the dir was")
    caplog.set_level(logging.ERROR, logger="broker.journal.journal")
    srv.send(Metrics(run="r", rank=0, epoch=1, avg_loss=1.0))  # a write that fails
    srv.send(Metrics(run="r", rank=0, epoch=2, avg_loss=1.0))
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1
    runs.unlink()
    shutil.move(tmp_path / "runs-away", runs)
    srv.journal.flush()  # what was held is written now, in order
    expect = srv.sinks["r"].records
    srv.close()
    j, sinks = reload(tmp_path)
    j.close()
    assert [r["epoch"] for r in sinks["r"].records] == [0, 1, 2]
    assert same(sinks["r"].records, expect)


def test_a_file_whose_first_entry_is_bad_is_no_run(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r.journal").write_bytes(HEADER + b"\x05\x00\x00\x00garbage")
    caplog.set_level(logging.WARNING, logger="broker.journal.journal")
    j, sinks = reload(tmp_path)
    j.close()
    assert sinks == {} and "dropping the last 11 bytes" in caplog.text
    assert not (tmp_path / "runs" / "r.journal").exists()


def test_constructor_does_no_io(tmp_path: Path) -> None:
    Journal(tmp_path / "nope")
    assert not (tmp_path / "nope").exists()
