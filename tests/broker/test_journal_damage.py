"""The journal under damage: torn tails, garbage, damaged entries, unreadable files, a newer
format or a second broker refused, and a real process SIGKILLed mid-run that loses nothing
it had reported."""
from __future__ import annotations

import json
import logging
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from broker.journal import codec
from broker.journal.journal import HEADER, Journal, JournalError
from broker.run.sink import RunSink
from rank_agent import protocol
from rank_agent.protocol import (
    Frame,
    Metrics,
    Register,
)
from tests.support.journalrun import (
    REPO,
    T0,
    Server,
    crash_copy,
    frame_entries,
    journal_path,
    reload,
    same,
    training,
)

# -- damaged files -----------------------------------------------------------------------


def _journal_with_sizes(data_dir: Path, n_epochs: int = 6) -> tuple[Server, list[Frame],
                                                                    list[int]]:
    """No resources frames, one flush per frame: the file size after each frame is known."""
    srv = Server(data_dir)
    frames: list[Frame] = [Register(run="r", rank=r, world_size=2, host="h", local_rank=r)
                           for r in range(2)]
    frames += [Metrics(run="r", rank=r, epoch=e, avg_loss=float(e), batches=2)
               for e in range(n_epochs) for r in range(2)]
    sizes = []
    for f in frames:
        srv.send(f)
        sizes.append(journal_path(data_dir, "r").stat().st_size)
    return srv, frames, sizes


def _reference(frames: list[Frame]) -> RunSink:
    sink = RunSink("r")
    for i, f in enumerate(frames):
        sink.apply(f, T0 + 0.5 * (i + 1))
    return sink


def test_truncated_tail_is_cut_with_one_warning(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    data_dir = tmp_path / "d"
    srv, frames, sizes = _journal_with_sizes(data_dir)
    issued = srv.issued["r"]
    crashed = crash_copy(data_dir, tmp_path)
    srv.close()
    path = journal_path(crashed, "r")
    keep = 9  # frames 0..8 survive; the 10th entry is cut in the middle
    os.truncate(path, sizes[keep - 1] + 13)

    caplog.set_level(logging.WARNING, logger="broker.journal.journal")
    j, sinks = reload(crashed)
    try:
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "truncated" in warnings[0].getMessage()
        assert str(path) in warnings[0].getMessage()
        ref = _reference(frames[:keep])
        assert same(sinks["r"].records, ref.records) and len(ref.records) == 3
        assert sinks["r"].seq > issued
        assert len(frame_entries(path)) == keep  # the torn entry is gone, the rest parses
    finally:
        j.close()

    # What is appended after the cut is readable on the next start.
    caplog.clear()
    srv2 = Server(crashed, now=T0 + 100)
    srv2.send(Metrics(run="r", rank=0, epoch=4, avg_loss=9.0, batches=2))
    srv2.send(Metrics(run="r", rank=1, epoch=4, avg_loss=9.0, batches=2))
    recs = srv2.sinks["r"].records
    srv2.close()
    j, sinks = reload(crashed)
    try:
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert same(sinks["r"].records, recs) and sinks["r"].records[-1]["epoch"] == 4
    finally:
        j.close()


@pytest.mark.parametrize("garbage", [
    b"\x00" * 3,
    b"\xff\xff\xff\xff" + b"\x00" * 20,                      # absurd length
    b"\x10\x00\x00\x00" + b"\x12\x34\x56\x78" + b"x" * 16,   # good length, bad crc
    random.Random(105).randbytes(4096),  # noise, the same every run (a failure reproduces)
], ids=["zeros", "absurd-length", "bad-crc", "noise"])
def test_garbage_tail_is_skipped_with_one_warning(tmp_path: Path, garbage: bytes,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    data_dir = tmp_path / "d"
    srv, frames, _ = _journal_with_sizes(data_dir)
    issued = srv.issued["r"]
    srv.close()
    with open(journal_path(data_dir, "r"), "ab") as f:
        f.write(garbage)
    caplog.set_level(logging.WARNING, logger="broker.journal.journal")
    j, sinks = reload(data_dir)
    try:
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert same(sinks["r"].records, _reference(frames).records)
        assert sinks["r"].record_seqs == srv.sinks["r"].record_seqs
        assert sinks["r"].seq > issued
    finally:
        j.close()


def test_damage_in_the_middle_costs_only_the_damaged_entry(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """PROTOCOL 6: one flipped byte in the middle loses that entry alone; its bytes are set
    aside beside the journal and every entry after it is kept (issue 19 finding 11)."""
    data_dir = tmp_path / "d"
    srv, frames, sizes = _journal_with_sizes(data_dir, n_epochs=12)
    issued = srv.issued["r"]
    srv.close()
    path = journal_path(data_dir, "r")
    data = bytearray(path.read_bytes())
    at = sizes[5]  # the 7th frame's entry starts here
    (length,) = codec.ENTRY_HEAD.unpack_from(data, at)[:1]
    data[at + 12] ^= 0xFF  # inside its body: the CRC no longer matches
    damaged = bytes(data[at:at + codec.ENTRY_HEAD.size + length])
    path.write_bytes(bytes(data))

    caplog.set_level(logging.WARNING, logger="broker.journal.journal")
    j, sinks = reload(data_dir)
    try:
        assert "checksum" in caplog.text and "damaged" in caplog.text
        kept = [(f, T0 + 0.5 * (i + 1)) for i, f in enumerate(frames) if i != 6]
        ref = RunSink("r")
        for f, t in kept:
            ref.apply(f, t)
        assert same(sinks["r"].records, ref.records)
        assert sinks["r"].records[-1]["epoch"] == 11  # the second half is back
        assert sinks["r"].seq > issued
        assert j.damaged_entries == 1
    finally:
        j.close()
    asides = sorted((data_dir / "runs").glob("r.journal.damaged-*"))
    assert len(asides) == 1 and asides[0].read_bytes() == damaged
    # The journal itself no longer holds the damage: the next start reads it cleanly.
    assert len(frame_entries(path)) == len(frames) - 1
    caplog.clear()
    j, sinks = reload(data_dir)
    try:
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert same(sinks["r"].records, ref.records)
    finally:
        j.close()
    assert len(list((data_dir / "runs").glob("r.journal.damaged-*"))) == 1


def test_damage_in_the_middle_and_a_torn_tail(tmp_path: Path) -> None:
    """Damage in the middle, then good entries, then a torn tail: the good ones in between
    are kept, the tail is cut as before."""
    data_dir = tmp_path / "d"
    srv, frames, sizes = _journal_with_sizes(data_dir, n_epochs=8)
    srv.close()
    path = journal_path(data_dir, "r")
    data = bytearray(path.read_bytes())
    data[sizes[3] + 20] ^= 0x01  # inside the 5th frame's entry
    path.write_bytes(bytes(data[:sizes[12] + 13]))  # the 14th entry is torn
    j, sinks = reload(data_dir)
    try:
        ref = RunSink("r")
        for i, f in enumerate(frames[:13]):
            if i != 4:
                ref.apply(f, T0 + 0.5 * (i + 1))
        assert same(sinks["r"].records, ref.records) and len(ref.records) >= 4
    finally:
        j.close()
    assert len(frame_entries(path)) == 12  # frames 0-12 less the damaged one


def test_unreadable_files_are_skipped_and_moved_aside(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    data_dir = tmp_path / "d"
    srv = Server(data_dir)
    training(srv, "good", ranks=1, epochs=2)
    srv.close()
    runs = data_dir / "runs"
    (runs / "alien.journal").write_bytes(b"PK\x03\x04 not a journal at all")
    (runs / "future.journal").write_bytes(b"rankboard journal v9\n" + b"\x00" * 50)
    (runs / "torn.journal").write_bytes(HEADER[:5])
    (runs / "empty.journal").write_bytes(HEADER)
    (runs / "notes.txt").write_text("ignored")
    caplog.set_level(logging.WARNING, logger="broker.journal.journal")
    j, sinks = reload(data_dir)
    try:
        assert set(sinks) == {"good"}
        text = caplog.text
        assert "alien.journal" in text and "future.journal" in text and "v9" in text
        left = sorted(p.name for p in runs.iterdir())
        assert any(n.startswith("alien.journal.unreadable-") for n in left)
        assert any(n.startswith("future.journal.unreadable-") for n in left)
        assert "empty.journal" not in left
        # The runs can start afresh.
        sink = RunSink("alien")
        f = Register(run="alien", rank=0, world_size=1, host="h")
        sink.apply(f, T0)
        j.accept(sink, protocol.encoder.encode(f), f, T0)
    finally:
        j.close()
    j, sinks = reload(data_dir)
    j.close()
    assert set(sinks) == {"good", "alien"}


def test_newer_data_dir_format_and_second_broker_are_refused(tmp_path: Path) -> None:
    j = Journal(tmp_path / "d")
    j.load()
    try:
        assert (tmp_path / "d" / "VERSION").read_text() == "rankboard-journal 1\n"
        with pytest.raises(JournalError, match="in use"):
            Journal(tmp_path / "d").load()
    finally:
        j.close()
    (tmp_path / "d" / "VERSION").write_text("rankboard-journal 2\n")
    with pytest.raises(JournalError, match="format"):
        Journal(tmp_path / "d").load()
    (tmp_path / "d" / "VERSION").write_text("rankboard-journal 1\n")
    j = Journal(tmp_path / "d")
    j.load()  # the refused ones left no lock behind
    j.close()


# -- a real SIGKILL ----------------------------------------------------------------------

CHILD = r"""
import json, sys
from broker.journal.journal import Journal
from broker.run.sink import RunSink
from rank_agent import protocol
from rank_agent.protocol import Metrics, Register, Resources, ResourceSample

j = Journal(sys.argv[1], seq_block=50)
sinks = j.load()
sink = RunSink("kill")
t = 1_800_000_000.0
issued = 0

def send(frame):
    global t, issued
    t += 0.25
    raw = protocol.encoder.encode(frame)
    f = protocol.decode(raw)
    events = sink.apply(f, t)
    j.accept(sink, raw, f, t)
    issued = max([issued] + [e.seq for e in events])
    return [e for e in events if e.kind == "epoch"]

for r in range(4):
    send(Register(run="kill", rank=r, world_size=4, host="h", local_rank=r))
for epoch in range(1_000_000):
    closed = []
    for r in range(4):
        send(Resources(run="kill", rank=r, sample=ResourceSample(cpu_percent=float(epoch % 97))))
        closed += send(Metrics(run="kill", rank=r, epoch=epoch, avg_loss=1.0 / (epoch + 1),
                               batches=r + 1, scalars={"acc": (0.1 * r, 1)}))
    issued = max([issued] + [e.seq for e in sink.tick(t)])
    j.note_seq(sink)
    j.flush()
    for ev in closed:
        print(json.dumps({"seq": ev.seq, "issued": issued, "record": ev.data}), flush=True)
    if epoch == 20:
        print("MARK", flush=True)
"""


def test_sigkill_loses_nothing_that_was_reported(tmp_path: Path) -> None:
    data_dir = tmp_path / "d"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(data_dir)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    reported: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, proc.stderr.read() if proc.stderr else ""
            if line.startswith("MARK"):
                break
            reported.append(json.loads(line))
        # Let it run on a little (mid-write when killed, most likely), then kill it.
        while len(reported) < 40:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None
            if not line.startswith("MARK"):
                reported.append(json.loads(line))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        reader.join(timeout=30)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    while True:  # lines printed before the kill
        try:
            line = lines.get_nowait()
        except queue.Empty:
            break
        if line is not None and not line.startswith("MARK"):
            reported.append(json.loads(line))
    assert proc.returncode == -signal.SIGKILL

    j, sinks = reload(data_dir)
    try:
        sink = sinks["kill"]
        got = dict(zip(sink.record_seqs, sink.records))
        assert len(sink.records) >= len(reported) >= 40
        for rep in reported:
            assert same(got[rep["seq"]], rep["record"])
        assert sink.seq > max(rep["issued"] for rep in reported)
    finally:
        j.close()
