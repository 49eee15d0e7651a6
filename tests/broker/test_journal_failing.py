"""PROTOCOL 8.4, a journal whose writes fail, without sockets (Runs + Journal as the server
wires them): each failure counted, logged at most once a minute, the journal ``failing``
until a write succeeds; a buffer given up past its bound is said in frames of its run when
the run's writes work again, and its reservation survives it."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from broker.journal import writer as journal_writer
from broker.journal.journal import Journal
from rank_agent.protocol import Metadata, Metrics
from tests.broker.test_journal_limits import Broker, started


def _break(tmp_path: Path, b: Broker) -> Path:
    """runs/ replaced by a file: every write fails (as on a full or dead disk)."""
    b.journal.forget("r")  # its handle is closed: the next write must open the file again
    runs = tmp_path / "runs"
    shutil.move(runs, tmp_path / "runs-away")
    runs.write_text("a file where the dir was")
    return runs


def _mend(tmp_path: Path, runs: Path) -> None:
    runs.unlink()
    shutil.move(tmp_path / "runs-away", runs)


def test_failures_counted_logged_once_a_minute_and_failing_until_a_write_works(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    b = Broker(tmp_path)
    started(b, ranks=1)
    assert not b.journal.failing
    runs = _break(tmp_path, b)
    caplog.set_level(logging.ERROR, logger="broker.journal.journal")
    for e in range(20):
        b.send(Metrics(run="r", rank=0, epoch=e, avg_loss=1.0))
    assert b.journal.failing and b.journal.counters()["failing"] == 1
    assert b.journal.counters()["write_failures"] >= 20
    lines = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(lines) == 1 and "retrying" in lines[0]
    _mend(tmp_path, runs)
    b.journal.flush()
    assert not b.journal.failing and b.journal.counters()["failing"] == 0
    live = [r["epoch"] for r in b.runs.get("r").records]  # type: ignore[union-attr]
    assert live == list(range(20))
    b.close()
    j = Journal(tmp_path)
    try:
        sinks = j.load()
        assert [r["epoch"] for r in sinks["r"].records] == live  # nothing lost
    finally:
        j.close()


def test_a_dropped_buffer_is_said_in_frames_of_its_run_and_its_ids_stay_reserved(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_writer, "_MAX_BUFFER", 64 * 1024)
    b = Broker(tmp_path)
    started(b)
    runs = _break(tmp_path, b)
    caplog.set_level(logging.WARNING, logger="broker.journal.journal")
    for i in range(40):
        b.send(Metadata(run="r", rank=0, json=f'{{"i": {i}, "pad": "{"p" * 8000}"}}'))
    assert b.journal.counters()["dropped_bytes"] > 0
    issued = b.runs.get("r").seq  # type: ignore[union-attr]
    _mend(tmp_path, runs)
    b.send(Metrics(run="r", rank=0, epoch=0, avg_loss=1.0))
    missing = [r.getMessage() for r in caplog.records if "missing from disk" in r.getMessage()]
    assert len(missing) == 1 and "of run 'r'" in missing[0], missing
    assert int(missing[0].split("works again; ")[1].split()[0]) > 0  # how many frames
    b.close()
    j = Journal(tmp_path)
    try:
        assert j.load()["r"].seq > issued  # the reservation was kept with the drop
    finally:
        j.close()


def test_closing_while_writes_fail_says_what_is_missing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    b = Broker(tmp_path)
    started(b, ranks=1)
    runs = _break(tmp_path, b)
    b.journal.retry_interval = 1.0  # as the server sets it
    for e in range(5):
        b.send(Metrics(run="r", rank=0, epoch=e, avg_loss=1.0))
    caplog.set_level(logging.ERROR, logger="broker.journal.journal")
    b.close()
    lines = [r.getMessage() for r in caplog.records if "missing from disk" in r.getMessage()]
    assert lines == ["journal: 5 frames of run 'r' could not be written and are missing from "
                     "disk"]
    _mend(tmp_path, runs)


def test_closing_right_after_space_returns_writes_everything(tmp_path: Path) -> None:
    """The last flush is not held back by the retry interval."""
    b = Broker(tmp_path)
    started(b, ranks=1)
    runs = _break(tmp_path, b)
    b.journal.retry_interval = 3600.0
    for e in range(5):
        b.send(Metrics(run="r", rank=0, epoch=e, avg_loss=1.0))
    _mend(tmp_path, runs)
    live = [r["epoch"] for r in b.runs.get("r").records]  # type: ignore[union-attr]
    b.close()
    j = Journal(tmp_path)
    try:
        assert [r["epoch"] for r in j.load()["r"].records] == live == list(range(5))
    finally:
        j.close()
