"""The journal: a broker rebuilt from its data dir serves the same runs (PROTOCOL 6).

No sockets: a small harness (``tests/support/journalrun.py``) plays the server's part with a
fake clock. A crash is simulated by copying the data dir after a flush (what a SIGKILL
leaves: the written bytes, not what was held in memory). Here: round trips, the resources'
coalescing, the ids across restarts. (Damaged files and a real SIGKILL:
``test_journal_damage.py``; retention, handles and write errors: ``test_journal_files.py``.)"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from broker.journal.journal import Journal
from broker.run.sink import Rejected, RunSink
from rank_agent import protocol
from rank_agent.protocol import (
    Finish,
    Frame,
    Hardware,
    Metrics,
    Register,
    Resources,
    Steps,
)
from tests.support.journalrun import (
    T0,
    Server,
    crash_copy,
    frame_entries,
    journal_path,
    reload,
    same,
    sample,
    training,
)
from tests.support.spying import spy

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


def test_a_flood_of_replaced_metadata_is_parsed_once_on_reload(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19 soak: a run evicted at --max-runs reloads on its next frame, on the broker's
    only thread; one that had received 40 large metadata blobs parsed all 40 again (a flood
    of 1 MiB blobs: seconds). Every journaled blob was valid and the last write wins, so the
    replaced ones are replayed as stand-ins carrying the last blob: parsed once, the same
    state (header, ranks seen, the first frame's time) as a full replay."""
    import broker.run.sink as sink_module
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
