"""The journal: a broker rebuilt from its data dir serves the same runs (PROTOCOL 6).

No sockets: a small harness plays the server's part (``sink.apply``, then
``journal.record``, then ``journal.note_seq``, ``flush`` per batch) with a fake clock.
A crash is simulated by copying the data dir after a flush (what a SIGKILL leaves: the
written bytes, not what was held in memory); one test kills a real process.
"""
from __future__ import annotations

import json
import logging
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from broker.journal import codec as jmod
from broker.journal.journal import HEADER, Journal, JournalError, read_entries
from broker.sink import Rejected, RunSink
from rank_agent import protocol
from rank_agent.protocol import (
    Finish,
    Frame,
    GpuSample,
    Hardware,
    Metadata,
    Metrics,
    Register,
    Resources,
    ResourceSample,
    Steps,
    Svg,
)
from tests.support.spying import spy

REPO = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000.0


def same(a: Any, b: Any) -> bool:
    """Deep equality where NaN equals NaN (records keep a NaN loss as a float NaN)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def sample(rank: int, k: int) -> ResourceSample:
    return ResourceSample(
        cpu_percent=float(k % 100), ram_used_bytes=1000 + k, ram_total_bytes=10_000,
        gpu_util_percent=float((k * 7) % 100), vram_allocated_bytes=500 + k,
        vram_total_bytes=8000,
        gpus=[GpuSample(device_index=rank % 2, name="H200", util_percent=float(k % 50))],
    )


class Server:
    """The server's part, without sockets: apply, record, note_seq; flush per batch."""

    def __init__(self, data_dir: Path, *, now: float = T0, stale_after: float = 30.0,
                 **kw: Any) -> None:
        self.journal = Journal(data_dir, **kw)
        self.sinks: dict[str, RunSink] = self.journal.load(stale_after=stale_after)
        self.stale_after = stale_after
        self.now = now
        self.issued: dict[str, int] = {}  # highest id published per run
        self.events: list[tuple[str, Any]] = []

    def send(self, frame: Frame, *, dt: float = 0.5, flush: bool = True) -> bool:
        """One frame received ``dt`` seconds after the previous one; False if rejected."""
        self.now += dt
        raw = protocol.encoder.encode(frame)
        decoded = protocol.decode(raw)
        sink = self.sinks.get(decoded.run)
        if sink is None:
            sink = RunSink(decoded.run, stale_after=self.stale_after)
        try:
            events = sink.apply(decoded, self.now)
        except Rejected:
            return False
        self.sinks[decoded.run] = sink
        self.journal.accept(sink, raw, decoded, self.now)
        self._publish(sink, events)
        if flush:
            self.journal.flush()
        return True

    def tick(self) -> None:
        for sink in self.sinks.values():
            self._publish(sink, sink.tick(self.now))
        self.journal.flush()

    def _publish(self, sink: RunSink, events: list[Any]) -> None:
        for ev in events:
            assert ev.seq > self.issued.get(sink.run, 0)
            self.issued[sink.run] = ev.seq
            self.events.append((sink.run, ev))
        self.journal.note_seq(sink)

    def close(self) -> None:
        self.journal.close()


def crash_copy(data_dir: Path, tmp_path: Path, name: str = "after-crash") -> Path:
    """What a SIGKILL leaves behind: the bytes written so far (held ones are lost)."""
    dest = tmp_path / name
    shutil.copytree(data_dir, dest)
    return dest


def reload(data_dir: Path, **kw: Any) -> tuple[Journal, dict[str, RunSink]]:
    j = Journal(data_dir, **kw)
    return j, j.load()


def training(srv: Server, run: str = "r1", *, ranks: int = 3, epochs: int = 4,
             samples_per_epoch: int = 3, finish: bool = False) -> None:
    """A plausible run: registers, svg, metadata, hardware, sampling and metrics."""
    for r in range(ranks):
        assert srv.send(Register(run=run, rank=r, world_size=ranks, host=f"h{r // 2}",
                                 local_rank=r % 2, port=8600, total_epochs=epochs, pid=100 + r))
        assert srv.send(Hardware(run=run, rank=r, summary=f"cpu{r // 2} | gpu{r}"))
    assert srv.send(Svg(run=run, rank=0, svg="<svg/>", label="net", hash="abc"))
    assert srv.send(Metadata(run=run, rank=0, json='{"lr": 0.1}'))
    k = 0
    for e in range(epochs):
        for _ in range(samples_per_epoch):
            for r in range(ranks):
                k += 1
                assert srv.send(Resources(run=run, rank=r, sample=sample(r, k)), dt=0.2)
        srv.tick()
        for r in range(ranks):
            loss = math.nan if (e == 1 and r == 0) else 1.0 / (e + 1) + r
            assert srv.send(Metrics(run=run, rank=r, epoch=e, avg_loss=loss, batches=10 + r,
                                    samples=100, epoch_ms=1000.0 + r,
                                    scalars={"acc": (0.5 * (r + 1), 1)}))
    if finish:
        for r in range(ranks):
            assert srv.send(Finish(run=run, rank=r, status="error" if r == 2 else "ok"))


def frame_entries(path: Path) -> list[Frame]:
    data = path.read_bytes()
    assert data.startswith(HEADER)
    entries, _, problem = read_entries(data[len(HEADER):])
    assert problem is None
    return [protocol.decode(bytes(p[8:])) for kind, p in entries if kind == jmod.KIND_FRAME]


def journal_path(data_dir: Path, run: str) -> Path:
    return data_dir / "runs" / f"{run}.journal"


# -- round trips -------------------------------------------------------------------------


def test_reload_rebuilds_records_header_ranks_and_ids(tmp_path: Path) -> None:
    srv = Server(tmp_path / "d")
    training(srv, "r1", finish=True)
    training(srv, "r:2.b-x_", ranks=2, epochs=2)
    before = {run: s.snapshot() for run, s in srv.sinks.items()}
    issued = dict(srv.issued)
    srv.close()

    j, sinks = reload(tmp_path / "d")
    try:
        assert set(sinks) == {"r1", "r:2.b-x_"}
        for run, sink in sinks.items():
            snap = sink.snapshot()
            assert len(snap["records"]) == len(before[run]["records"]) > 0
            assert same(snap["records"], before[run]["records"])  # same records, same ids
            assert same(snap["header"], before[run]["header"])
            assert same(snap["ranks"], before[run]["ranks"])
            assert snap["complete"] == before[run]["complete"]
            assert sink.seq > issued[run]
        assert math.isnan(sinks["r1"].records[1]["metrics"]["loss"])
        assert sinks["r1"].complete is not None and sinks["r1"].complete[1] == "failed"
    finally:
        j.close()


def test_reload_after_crash_then_training_goes_on(tmp_path: Path) -> None:
    """Epoch 3 is pending (one rank missing) at the crash; after the reload that rank's
    metrics close it as an uninterrupted broker would have (bar the sample lost)."""
    frames: list[Frame] = []
    ref = Server(tmp_path / "ref")  # the broker that never stops
    srv = Server(tmp_path / "d")
    for r in range(3):
        frames.append(Register(run="r", rank=r, world_size=3, host="h", local_rank=r,
                               total_epochs=6))
    for e in range(4):
        for r in range(3):
            frames.append(Resources(run="r", rank=r, sample=sample(r, e)))
            if not (e == 3 and r == 2):
                frames.append(Metrics(run="r", rank=r, epoch=e, avg_loss=1.0 + e, batches=5,
                                      samples=50, epoch_ms=900.0,
                                      resources=sample(r, 100 + e) if r == 1 else None))
    for f in frames:
        assert srv.send(f)
        if f is frames[-1]:
            # The crash loses what is held in memory: the samples newer than the run's last
            # written frame (here rank 2's last one). The reference never got it.
            assert isinstance(f, Resources)
            ref.now += 0.5
        else:
            assert ref.send(f)
    issued = srv.issued["r"]
    assert len(srv.sinks["r"].records) == 3
    crashed = crash_copy(tmp_path / "d", tmp_path)
    srv.close()

    srv2 = Server(crashed, now=srv.now)
    try:
        sink = srv2.sinks["r"]
        assert same(sink.records, ref.sinks["r"].records)
        assert sink.record_seqs == ref.sinks["r"].record_seqs
        assert sink.seq > issued
        last = Metrics(run="r", rank=2, epoch=3, avg_loss=4.0, batches=5, samples=50,
                       epoch_ms=900.0)
        assert srv2.send(last) and ref.send(last)
        assert [ev.kind for run, ev in srv2.events].count("epoch") == 1
        assert len(sink.records) == 4
        assert same(sink.records, ref.sinks["r"].records)
        assert all(ev.seq > issued for _, ev in srv2.events)
    finally:
        srv2.close()
        ref.close()


def test_first_frame_is_kept_even_if_resources(tmp_path: Path) -> None:
    """started_at (and so elapsed_secs) comes from the run's first frame."""
    srv = Server(tmp_path / "d")
    srv.send(Resources(run="r", rank=0, sample=sample(0, 1)))
    started = srv.sinks["r"].header()["started_at"]
    srv.send(Register(run="r", rank=0, world_size=1, host="h"), dt=5)
    srv.send(Metrics(run="r", rank=0, epoch=0, avg_loss=1.0), dt=5)
    crashed = crash_copy(tmp_path / "d", tmp_path)
    srv.close()
    j, sinks = reload(crashed)
    try:
        assert sinks["r"].header()["started_at"] == started
        assert same(sinks["r"].records, srv.sinks["r"].records)
    finally:
        j.close()


def test_record_without_raw_bytes_encodes_the_frame(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.load()
    sink = RunSink("r")
    f = Register(run="r", rank=0, world_size=1, host="h")
    sink.apply(f, T0)
    j.accept(sink, b"", f, T0)
    j.close()
    j2, sinks = reload(tmp_path)
    j2.close()
    assert sinks["r"].header()["world_size"] == 1


# -- resources coalescing ----------------------------------------------------------------


def test_resources_are_coalesced_to_one_per_rank_per_epoch(tmp_path: Path) -> None:
    ranks, epochs, per_epoch = 4, 5, 40
    srv = Server(tmp_path / "d")
    for r in range(ranks):
        srv.send(Register(run="r", rank=r, world_size=ranks, host=f"h{r}"))
    k = 0
    sizes = []
    for e in range(epochs):
        for _ in range(per_epoch):
            for r in range(ranks):
                k += 1
                srv.send(Resources(run="r", rank=r, sample=sample(r, k)), dt=0.05)
        for r in range(ranks):
            srv.send(Metrics(run="r", rank=r, epoch=e, avg_loss=0.1 * e, batches=3))
        sizes.append(journal_path(tmp_path / "d", "r").stat().st_size)
    crashed = crash_copy(tmp_path / "d", tmp_path)
    srv.close()

    written = frame_entries(journal_path(crashed, "r"))
    n_resources = sum(isinstance(f, Resources) for f in written)
    assert n_resources <= ranks * epochs  # not ranks * epochs * per_epoch
    assert len(written) == ranks + n_resources + ranks * epochs
    growth = [b - a for a, b in zip(sizes, sizes[1:])]
    assert max(growth) - min(growth) < 64  # per-epoch growth does not depend on sampling

    j, sinks = reload(crashed)
    try:
        assert len(sinks["r"].records) == epochs
        assert same(sinks["r"].records, srv.sinks["r"].records)
    finally:
        j.close()


def test_held_samples_are_written_at_close_and_before_other_frames(tmp_path: Path) -> None:
    srv = Server(tmp_path / "d")
    srv.send(Register(run="r", rank=0, world_size=2, host="h"))
    srv.send(Resources(run="r", rank=0, sample=sample(0, 1)))
    srv.send(Resources(run="r", rank=0, sample=sample(0, 2)))
    srv.send(Resources(run="r", rank=1, sample=sample(1, 3)))
    # Ranks beyond world_size are discarded when a register fixes it: order matters.
    srv.send(Hardware(run="r", rank=1, summary="cpu | gpu"))
    srv.send(Resources(run="r", rank=1, sample=sample(1, 4)))
    written = frame_entries(journal_path(tmp_path / "d", "r"))
    assert [type(f).__name__ for f in written] == ["Register", "Resources", "Resources",
                                                   "Hardware"]
    assert isinstance(written[1], Resources) and written[1].sample == sample(0, 2)
    ranks_before = srv.sinks["r"].ranks()
    srv.close()  # a graceful stop writes the held sample too
    j, sinks = reload(tmp_path / "d")
    try:
        assert same(sinks["r"].ranks(), ranks_before)
    finally:
        j.close()


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
    os.urandom(4096),
])
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
    (length,) = jmod.ENTRY_HEAD.unpack_from(data, at)[:1]
    data[at + 12] ^= 0xFF  # inside its body: the CRC no longer matches
    damaged = bytes(data[at:at + jmod.ENTRY_HEAD.size + length])
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


# -- sequence numbers --------------------------------------------------------------------


def test_ids_stay_above_everything_issued_across_crashes(tmp_path: Path) -> None:
    """A small block forces many reservations; ticks issue ids the replay cannot see."""
    data_dir = tmp_path / "d"
    highest = 0
    for restart in range(4):
        srv = Server(data_dir, now=T0 + 1000 * restart, seq_block=10)
        sink = srv.sinks.get("r")
        if sink is not None:
            assert sink.seq > highest
            assert all(s <= highest for s in sink.record_seqs)
        for i in range(30):
            srv.send(Register(run="r", rank=0, world_size=2, host="h"), dt=40)
            srv.tick()  # rank 1 never speaks: stale alerts, "run" and "ranks" events
            srv.send(Metrics(run="r", rank=0, epoch=restart * 100 + i, avg_loss=1.0))
        highest = max(highest, srv.issued["r"])
        crashed = crash_copy(data_dir, tmp_path, f"c{restart}")
        srv.close()
        shutil.rmtree(data_dir)
        data_dir = crashed
    j, sinks = reload(data_dir)
    j.close()
    assert sinks["r"].seq > highest


def test_reload_without_new_events_still_moves_ids_up(tmp_path: Path) -> None:
    srv = Server(tmp_path)
    training(srv, "r", ranks=1, epochs=1)
    last = srv.issued["r"]
    srv.close()
    seqs = []
    for _ in range(3):
        j, sinks = reload(tmp_path)
        seqs.append(sinks["r"].seq)
        j.close()
    assert last < seqs[0] < seqs[1] < seqs[2]


def test_record_ids_are_kept_for_last_event_id(tmp_path: Path) -> None:
    """A web client's Last-Event-ID names a record: it must name the same one after a
    restart (ticks issue ids between records that the replay does not reproduce)."""
    srv = Server(tmp_path / "d")
    training(srv, "r", ranks=2, epochs=5, finish=True)
    seqs, complete = list(srv.sinks["r"].record_seqs), srv.sinks["r"].complete
    assert seqs != _reference_seqs(srv)  # the point: replay alone would renumber
    crashed = crash_copy(tmp_path / "d", tmp_path)
    srv.close()
    j, sinks = reload(crashed)
    j.close()
    assert sinks["r"].record_seqs == seqs
    assert sinks["r"].complete == complete


def _reference_seqs(srv: Server) -> list[int]:
    """The record ids a bare replay (no ticks) would give."""
    sink = RunSink("r")
    for f in frame_entries(journal_path(Path(srv.journal.data_dir), "r")):
        try:
            sink.apply(f, T0)
        except Rejected:
            pass
    return sink.record_seqs


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


# -- a real SIGKILL ----------------------------------------------------------------------

CHILD = r"""
import json, sys
from broker.journal.journal import Journal
from broker.sink import RunSink
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


def test_a_flood_of_replaced_metadata_is_parsed_once_on_reload(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19 soak: a run evicted at --max-runs reloads on its next frame, on the broker's
    only thread; one that had received 40 large metadata blobs parsed all 40 again (a flood
    of 1 MiB blobs: seconds). Every journaled blob was valid and the last write wins, so the
    replaced ones are replayed as stand-ins carrying the last blob: parsed once, the same
    state (header, ranks seen, the first frame's time) as a full replay."""
    import broker.sink as sink_module
    srv = Server(tmp_path / "d")
    srv.send(protocol.Metadata(run="md", rank=1, json=json.dumps({"i": -1})))  # small, first
    for i in range(40):
        blob = json.dumps({"i": i, "v": list(range(2000))})
        srv.send(protocol.Metadata(run="md", rank=i % 3, json=blob))
        if i == 20:
            srv.send(Register(run="md", rank=0, world_size=4, host="h0"))
            srv.send(protocol.Metadata(run="md", rank=2, json='{"small": true}'))
    before = srv.sinks["md"].snapshot()
    srv.close()
    parsed = spy(monkeypatch, sink_module, "parse_metadata")
    j, sinks = reload(tmp_path / "d")
    try:
        snap = sinks["md"].snapshot()
        assert snap["header"]["metadata"]["i"] == 39
        assert same(snap["header"], before["header"]) and same(snap["ranks"], before["ranks"])
        # the first small blob, the last large one where it first stands in, the small one
        # sent between, and the last large one again after it (it differs from the small)
        assert len(parsed) == 4
    finally:
        j.close()


def test_an_evicted_run_keeps_every_step_it_had_accepted(tmp_path: Path) -> None:
    """Issue 19 soak: a live run evicted at ``--max-runs`` (a flood of junk runs passing it
    during a pause) lost the steps closed but not yet published (one ``steps`` event per
    0.25 s) and the points of steps in flight: the journal keeps closed steps as published
    STEPS blocks only. Eviction now settles the run first (every pending step closes with
    the points it has, every closed step is published and journaled), through the server's
    own wiring of Runs and Journal."""
    from broker.server import BrokerServer
    any_port = "tcp://127.0.0.1:*"
    srv = BrokerServer(any_port, any_port, any_port, data_dir=tmp_path / "d", max_runs=2)
    srv.bind()
    try:
        runs, journal = srv.runs, srv._journal
        assert journal is not None
        now = T0

        def send(frame: Frame) -> None:
            runs.ingest(protocol.encoder.encode(frame), now)
            journal.flush()
        for r in range(2):
            send(Register(run="h", rank=r, world_size=2, host="x"))
        sent = 0
        for round_ in range(4):
            for _ in range(3):  # both ranks: closed by the watermark, published within 0.25 s
                for r in range(2):
                    send(Steps(run="h", rank=r, steps=[sent], times=[now], step_ms=[1.0],
                               metrics={"loss": [float(sent)]}))
                sent += 1
                now += 0.01
            send(Steps(run="h", rank=0, steps=[sent], times=[now], step_ms=[1.0],
                       metrics={"loss": [float(sent)]}))  # rank 1 never reports this one
            sent += 1
            now += 0.01
            send(Register(run=f"junk{round_}a", rank=0, world_size=1, host="j"))
            send(Register(run=f"junk{round_}b", rank=0, world_size=1, host="j"))  # h evicted
            assert "h" not in runs
        send(Finish(run="h", rank=0))  # back from the journal
        sink = runs.get("h")
        assert sink is not None
        steps = [int(s) for s in sink.steps.column("step")]
        assert steps == list(range(sent))
        n = [int(x) for x in sink.steps.column("n")]
        assert n == [2, 2, 2, 1] * 4  # the step rank 1 never sent closed with rank 0's point
        assert runs.evictions >= 4
    finally:
        srv.close()
