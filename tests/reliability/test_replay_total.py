"""Issue 38, item 1: one journaled entry can cost only itself, never the broker's start,
``rankboard export`` or another run.

The finding: a ``steps`` frame of 89 bytes (``data_ms`` 1e307 over ``step_ms`` 1) made the
data wait's percentage overflow; live that failed every publish of its run, and once its
closed step was journaled every restart raised in the replay (``rankboard up`` exited 1
until someone deleted the journal by hand). The overflow is fixed (broker/run/steps/datawait.py)
and the replay made total (broker/journal/replay.py, journal.py): an entry whose replay
raises is counted, logged once and set aside beside the journal as damaged bytes are.
The fuzz of replay is in tests/reliability/test_fuzz.py."""
from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Callable

import pytest

from broker.journal import codec
from broker.journal.journal import Journal
from rank_agent import protocol
from rankboard.export import load_run
from tests.support.brokers import Pusher
from tests.support.fuzzreplay import FRAME_89
from tests.support.http import fetch
from tests.support.journalrun import Server, journal_path, same, training
from tests.support.polling import wait_for
from tests.support.procs import Proc, no_traceback, start_broker, start_web


def has_steps_block(path: Path) -> bool:
    """Whether the journal at ``path`` holds a block of closed steps yet."""
    if not path.exists():
        return False
    data = path.read_bytes()
    return any(kind == codec.KIND_STEPS
               for kind, _ in codec.scan_entries(data[len(codec.HEADER):]).entries)


def test_the_89_byte_frame_neither_fails_live_nor_stops_a_restart_nor_export(
        spawn: Callable[..., Proc], tmp_path: Path) -> None:
    """A real ``rankboard broker`` fed the exact frame, SIGKILLed once its step is journaled,
    started again on the same data dir: it starts (no traceback, live or at start), and
    ``rankboard export`` of the run writes the report."""
    assert len(FRAME_89) == 89
    data = tmp_path / "data"
    broker, eps = start_broker(spawn, data, "--step-close-after", "0.5")
    pusher = Pusher(eps.ingest)
    try:
        pusher.sock.send(FRAME_89)
        wait_for(lambda: has_steps_block(journal_path(data, "run-01")), timeout=30,
                 what="the run's closed step in its journal")
    finally:
        pusher.close()
    broker.stop(signal.SIGKILL)
    no_traceback(broker)

    again, _ = start_broker(spawn, data)
    again.wait_line(r"journal .*: 1 runs restored", stream="stderr", timeout=30)
    assert again.proc.poll() is None
    no_traceback(again)
    again.stop()

    out = tmp_path / "report.html"
    export = spawn("export", "run-01", "--data-dir", str(data), "-o", str(out))
    assert export.proc.wait(60) == 0, export.output()
    assert out.stat().st_size > 0
    no_traceback(export)


def bad_block(data_dir: Path, run: str) -> bytes:
    """A whole STEPS entry like the run's first, but with ``metrics`` a list (its CRC good):
    restoring it raised AttributeError, which no one caught."""
    data = journal_path(data_dir, run).read_bytes()
    entries = codec.scan_entries(data[len(codec.HEADER):]).entries
    blocks = [codec.block_decoder.decode(p) for kind, p in entries if kind == codec.KIND_STEPS]
    block = blocks[0]
    block["base"] = sum(b["rows"] for b in blocks)  # (it follows the blocks before it)
    block["metrics"] = []
    return codec.entry(bytes([codec.KIND_STEPS]), codec.block_encoder.encode(block))


def two_bad_entries(data: Path) -> tuple[Path, int]:
    """Runs r1 and r2 journaled under ``data``; r1's journal then gains a block of steps
    that raises when restored and an id entry too short for its kind (both with good CRCs),
    and good frames after them (epoch 2). Returns r1's journal and its size."""
    srv = Server(data)
    training(srv, "r1", ranks=2, epochs=2)
    training(srv, "r2", ranks=2, epochs=2)
    for step in range(3):
        for rank in range(2):
            assert srv.send(protocol.Steps(run="r1", rank=rank, steps=[step], times=[1.0],
                                           step_ms=[10.0]))
    srv.now += 60.0
    srv.tick()
    srv.close()
    path = journal_path(data, "r1")
    assert has_steps_block(path)
    after = bytearray()  # good frames after them: epoch 2 of both ranks
    for rank in range(2):
        codec.append_frame(after, srv.now + 1.0, protocol.encoder.encode(protocol.Metrics(
            run="r1", rank=rank, epoch=2, avg_loss=0.5, batches=10, samples=100,
            epoch_ms=1000.0)))
    with open(path, "ab") as f:
        f.write(bad_block(data, "r1"))
        f.write(codec.entry(bytes([codec.KIND_SEQ_HI]), b"\x01\x02\x03\x04"))
        f.write(after)
    return path, path.stat().st_size


def test_an_entry_whose_replay_raises_costs_that_entry_only(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two runs, one with two entries that raise (:func:`two_bad_entries`): both runs load
    with everything else they had, the two entries are counted and moved to a ``.damaged-*``
    file, the next start meets them no more, and export reads the run."""
    data = tmp_path / "data"
    path, size = two_bad_entries(data)

    caplog.set_level(logging.WARNING)
    journal = Journal(data)
    sinks = journal.load()
    try:
        assert set(sinks) == {"r1", "r2"}
        assert [r["epoch"] for r in sinks["r1"].records] == [0, 1, 2]
        assert sinks["r1"].steps.rows == 3 and len(sinks["r2"].records) == 2
        assert journal.counters()["unreplayable_entries"] == 2
    finally:
        journal.close()
    aside = list(path.parent.glob("r1.journal.damaged-*"))
    assert len(aside) == 1 and aside[0].stat().st_size == len(bad_block(data, "r1")) + 13
    assert bad_block(data, "r1") not in path.read_bytes()  # (load appended a reservation)
    assert path.stat().st_size < size
    assert not list(path.parent.glob("*.unreadable-*"))

    caplog.clear()
    journal = Journal(data)
    again = journal.load()
    try:
        assert journal.counters()["unreplayable_entries"] == 0
        assert same(again["r1"].records, sinks["r1"].records)
    finally:
        journal.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r["epoch"] for r in load_run(data, "r1").records] == [0, 1, 2]


def test_a_real_broker_starts_past_them_and_the_web_counts_them(
        spawn: Callable[..., Proc], tmp_path: Path) -> None:
    """The same journal under a real ``rankboard broker``: it starts with both runs, and the
    web's ``/metrics`` counts the two entries set aside."""
    data = tmp_path / "data"
    two_bad_entries(data)
    broker, eps = start_broker(spawn, data)
    broker.wait_line(r"journal .*: 2 runs restored", stream="stderr", timeout=30)
    web = start_web(spawn, eps)
    line = 'rankboard_journal_total{kind="unreplayable_entries"} 2.0'
    wait_for(lambda: line in fetch(web.port or 0, "/metrics").text, timeout=30,
             what="the web's /metrics to count the entries set aside")
    assert fetch(web.port or 0, "/api/runs/r1").status == 200
    no_traceback(broker, web)
