"""The journal's byte bounds (PROTOCOL 2 "Limits", issue 19): it keeps a frame's known
fields only, no frame that changed nothing, a bounded write buffer, STEPS blocks that cost
what they hold, and a restart that loads the ``--max-runs`` most recently active runs.

Frames go through :class:`broker.runs.Runs` with the journal wired as the server wires it
(``recorder=journal.accept``, one ``flush`` per batch), so what is measured is what the
broker writes.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from broker.journal.journal import WRITE_BUFFER_BYTES, Journal
from broker.run.steps.store import Series
from broker.runs import Runs
from rank_agent import protocol
from rank_agent.protocol import Finish, Frame, Hardware, Metadata, Metrics, Register, Steps, Svg

T0 = 1_800_000_000.0


class Broker:
    """Runs + Journal as the server wires them, without sockets, on a fake clock."""

    def __init__(self, data_dir: Path, *, now: float = T0, max_runs: int = 1000,
                 **kw: Any) -> None:
        self.journal = Journal(data_dir, **kw)
        self.runs = Runs(max_runs=max_runs)
        self.runs.restore(self.journal.load(now=now, max_runs=max_runs))
        self.runs.recorder = self.journal.accept
        self.runs.loader = self.journal.load_run
        self.runs.on_evict = self.journal.forget
        self.now = now

    def send(self, frame: Frame | dict[str, Any], dt: float = 0.5, flush: bool = True) -> None:
        self.now += dt
        raw = (msgspec.msgpack.encode(frame) if isinstance(frame, dict)
               else protocol.encoder.encode(frame))
        before = self.runs.accepted
        self.runs.ingest(raw, self.now)
        assert self.runs.accepted == before + 1, self.runs.rejected
        if flush:
            self.journal.flush()

    def close(self) -> None:
        self.journal.close()


def journal_size(data_dir: Path, run: str) -> int:
    return (data_dir / "runs" / f"{run}.journal").stat().st_size


def started(b: Broker, run: str = "r", ranks: int = 2) -> None:
    for r in range(ranks):
        b.send(Register(run=run, rank=r, world_size=ranks, host="h", local_rank=r, port=8600))
        b.send(Hardware(run=run, rank=r, summary=f"cpu | gpu{r}"))
    b.send(Svg(run=run, rank=0, svg="<svg/>", label="net", hash="abc"))
    b.send(Metadata(run=run, rank=0, json='{"lr": 0.1}'))


# -- known fields only -------------------------------------------------------------------


def test_unknown_keys_are_not_journaled(tmp_path: Path) -> None:
    b = Broker(tmp_path)
    started(b)
    before = journal_size(tmp_path, "r")
    junk = "J" * 65536
    b.send({"type": "metadata", "run": "r", "rank": 0, "json": '{"lr": 0.2}', "junk": junk})
    b.send({"type": "metrics", "run": "r", "rank": 0, "epoch": 0, "avg_loss": 1.0,
            "extra": junk})
    b.close()
    grown = journal_size(tmp_path, "r") - before
    assert grown < 1024, grown
    assert b"JJJJ" not in (tmp_path / "runs" / "r.journal").read_bytes()
    # ... and what was kept is what the sink used.
    j = Journal(tmp_path)
    try:
        sink = j.load()["r"]
        assert sink.metadata == {"lr": 0.2}
    finally:
        j.close()


# -- no frame that changed nothing -------------------------------------------------------


def noop_frames(run: str = "r") -> list[Frame]:
    """Repeats of what :func:`started` sent: each changes nothing."""
    return [
        Metadata(run=run, rank=0, json='{"lr": 0.1}'),
        Svg(run=run, rank=0, svg="<svg/>", label="net", hash="abc"),
        Svg(run=run, rank=1, svg="<svg>other</svg>"),  # first non-empty already won
        Svg(run=run, rank=1, svg=""),
        Register(run=run, rank=0, world_size=2, host="h", local_rank=0, port=8600),
        Register(run=run, rank=1, world_size=2, host="h", local_rank=1, port=8600),
        Hardware(run=run, rank=1, summary="cpu | gpu1"),
    ]


def test_frames_that_change_nothing_cost_no_journal_bytes(tmp_path: Path) -> None:
    b = Broker(tmp_path)
    started(b)
    before = journal_size(tmp_path, "r")
    for _ in range(50):
        for f in noop_frames():
            b.send(f)
    assert journal_size(tmp_path, "r") == before
    # A frame that does change something is still kept.
    b.send(Metadata(run="r", rank=0, json='{"lr": 0.3}'))
    assert journal_size(tmp_path, "r") > before
    b.close()


def test_noop_memory_survives_a_restart(tmp_path: Path) -> None:
    b = Broker(tmp_path)
    started(b)
    b.close()
    b = Broker(tmp_path, now=b.now + 60)
    size = journal_size(tmp_path, "r")  # (the restart wrote its id reservation)
    for f in noop_frames():
        b.send(f)
    assert journal_size(tmp_path, "r") == size
    b.close()


def test_register_after_finish_is_kept_and_a_repeated_finish_is_not(tmp_path: Path) -> None:
    """A register reactivates a finished rank (PROTOCOL 2): not a no-op, even if identical."""
    b = Broker(tmp_path)
    started(b)
    b.send(Finish(run="r", rank=0))
    size = journal_size(tmp_path, "r")
    b.send(Finish(run="r", rank=0))
    assert journal_size(tmp_path, "r") == size
    b.send(Register(run="r", rank=0, world_size=2, host="h", local_rank=0, port=8600))
    assert journal_size(tmp_path, "r") > size
    live = b.runs.get("r")
    assert live is not None
    live_ranks = [r["status"] for r in live.ranks()]
    b.close()
    j = Journal(tmp_path)
    try:
        sink = j.load()["r"]
        assert [r["status"] for r in sink.ranks()] == live_ranks
        assert live_ranks[0] != "finished"
    finally:
        j.close()


def test_metrics_frames_are_all_kept(tmp_path: Path) -> None:
    """Only the rules that make repeats no-ops filter: per-epoch results are never dropped."""
    b = Broker(tmp_path)
    started(b)
    for e in range(3):
        for r in range(2):
            b.send(Metrics(run="r", rank=r, epoch=e, avg_loss=1.0 / (e + 1)))
    live = b.runs.get("r")
    assert live is not None
    records = live.records
    b.close()
    j = Journal(tmp_path)
    try:
        assert j.load()["r"].records == records and len(records) == 3
    finally:
        j.close()


# -- STEPS blocks cost what they hold ----------------------------------------------------


class CountingSeries(Series):
    """A Series that counts how often its point count is read: every visit of a series
    (``to_wire``'s filter, ``span``, ``extend``) reads it, so the count is the work."""

    __slots__ = ("_n",)
    reads = 0

    @property  # type: ignore[override]
    def n(self) -> int:
        CountingSeries.reads += 1
        return self._n

    @n.setter
    def n(self, value: int) -> None:
        self._n = value


def _wide_then_narrow(tmp_path: Path, names: int, blocks: int) -> tuple[Broker, int]:
    """A 1-rank run that names ``names`` metrics in its first steps (64 a frame), then
    ``blocks`` steps of ``loss`` alone, each published in a block of its own. Returns the
    broker and the series visits (reads of a series' point count) while the narrow steps
    were closed, published and journaled."""
    b = Broker(tmp_path)
    b.send(Register(run="s", rank=0, world_size=1, host="h"))
    step = 0
    for first in range(0, names, 64):
        metrics: dict[str, list[float | None]] = {
            f"m{i:05d}/{'x' * 40}": [float(i)] for i in range(first, min(first + 64, names))}
        b.send(Steps(run="s", rank=0, steps=[step], times=[b.now], step_ms=[10.0],
                     metrics=metrics))
        step += 1
    b.send(Steps(run="s", rank=0, steps=[step], times=[b.now], step_ms=[10.0],
                 metrics={"loss": [1.0]}))
    step += 1
    sink = b.runs.get("s")
    assert sink is not None and len(sink.steps.metrics) == names + 1
    reads = CountingSeries.reads
    rows = sink.steps.rows
    for _ in range(blocks):
        b.send(Steps(run="s", rank=0, steps=[step], times=[b.now], step_ms=[10.0],
                     metrics={"loss": [1.0 / step]}))
        step += 1
    assert sink.steps.rows == rows + blocks  # one more closed step per frame: one block each
    return b, CountingSeries.reads - reads


def test_a_steps_block_visits_what_it_holds_not_every_series(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19 finding 3: writing a STEPS block visited every series of the run (blocks x
    names). The work per block must not grow with the run's series count."""
    monkeypatch.setattr("broker.run.steps.store.Series", CountingSeries)
    small, few = _wide_then_narrow(tmp_path / "small", names=64, blocks=40)
    small.close()
    # 1,023 names + loss: the most a run may hold (MAX_RUN_STEP_METRICS)
    big, many = _wide_then_narrow(tmp_path / "big", names=1023, blocks=40)
    live = big.runs.get("s")
    assert live is not None
    assert isinstance(live.steps.step_ms, CountingSeries)  # (the count is real)
    state = msgspec.msgpack.encode(live.steps.to_wire())
    big.close()
    assert many == few, (few, many)
    # ... and the blocks still hold everything: the store comes back whole.
    j = Journal(tmp_path / "big")
    try:
        assert msgspec.msgpack.encode(j.load()["s"].steps.to_wire()) == state
    finally:
        j.close()


def test_a_steps_block_is_what_to_wire_gives(tmp_path: Path) -> None:
    """The journal builds STEPS blocks itself (journal_steps.wire_block): they hold what
    StepStore.to_wire holds for the same rows (series without a point there aside)."""
    from broker.journal.stepblocks import StepBlocks, wire_block
    b, _ = _wide_then_narrow(tmp_path, names=200, blocks=5)
    sink = b.runs.get("s")
    assert sink is not None
    store = sink.steps
    for start, end in [(0, store.rows), (1, 3), (store.rows - 2, store.rows), (2, 2)]:
        want = store.to_wire(start, end)
        want["metrics"] = {k: v for k, v in want["metrics"].items() if v[0]}
        got = wire_block(store, start, end, list(store.metrics), StepBlocks())
        assert got == want
    b.close()


# -- the write buffer is bounded in bytes ------------------------------------------------


def test_the_write_buffer_is_bounded_in_bytes_within_a_batch(tmp_path: Path) -> None:
    """Issue 19 finding 2: a batch of big frames was buffered whole before one write. Past
    WRITE_BUFFER_BYTES the journal writes at once, and counts it."""
    b = Broker(tmp_path)
    started(b)
    base = journal_size(tmp_path, "r")
    blob = "x" * (1024 * 1024 - 64)
    sent = 0
    for i in range(40):  # one batch: no flush between the frames
        text = f'{{"i": {i}, "blob": "{blob}"}}'
        b.send(Metadata(run="r", rank=0, json=text), flush=False)
        sent += len(text)
        held = base + sent - journal_size(tmp_path, "r")
        assert held <= WRITE_BUFFER_BYTES + 2 * len(text), held
    assert b.journal.counters()["early_flushes"] >= 2
    b.journal.flush()
    b.close()
    assert journal_size(tmp_path, "r") >= base + sent


# -- a restart loads the --max-runs most recently active runs ----------------------------


def _runs_on_disk(data_dir: Path, order: list[str]) -> None:
    """One finished run per name; ``order`` from least to most recently active (file
    mtimes set apart by a minute each, so the order does not hang on timer resolution)."""
    b = Broker(data_dir)
    for run in order:
        b.send(Register(run=run, rank=0, world_size=1, host="h"))
        b.send(Metrics(run=run, rank=0, epoch=0, avg_loss=1.0))
        b.send(Finish(run=run, rank=0))
    b.close()
    for i, run in enumerate(order):
        t = T0 - 3600 + 60 * i
        os.utime(data_dir / "runs" / f"{run}.journal", (t, t))


def test_a_restart_loads_only_the_max_runs_most_recently_active(tmp_path: Path) -> None:
    """PROTOCOL 6 / issue 19 finding 5: a broker started on a data dir holding more runs
    than --max-runs loads the N most recently active, not every run in the journal."""
    order = ["e", "a", "d", "b", "c"]  # least recently active first; not name order
    _runs_on_disk(tmp_path, order)
    j = Journal(tmp_path)
    try:
        sinks = j.load(max_runs=2)
        assert list(sinks) == ["b", "c"]  # least recently active first, as Runs keeps them
        assert j.counters()["runs_not_loaded"] == 3
        # The others stay on disk, and a frame for one brings it back whole.
        assert {p.name for p in (tmp_path / "runs").glob("*.journal")} == {
            f"{r}.journal" for r in order}
        back = j.load_run("e")
        assert back is not None and len(back.records) == 1 and back.complete is not None
    finally:
        j.close()
    j = Journal(tmp_path)
    try:
        assert set(j.load()) == set(order)  # no bound: every run
    finally:
        j.close()


def test_max_runs_skips_runs_that_cannot_be_loaded(tmp_path: Path) -> None:
    """A most recent file that turns out unreadable does not take a slot."""
    _runs_on_disk(tmp_path, ["a", "b", "c"])
    bad = tmp_path / "runs" / "z.journal"
    bad.write_bytes(b"not a journal")
    j = Journal(tmp_path)
    try:
        assert list(j.load(max_runs=2)) == ["b", "c"]
    finally:
        j.close()


def test_steps_rows_without_frames_behind_them_are_written_whole(tmp_path: Path) -> None:
    """Rows that did not come from the sink's own publishing (restored blocks, as
    bench/steps_bench.py builds a million-step run) have no frames to name their series:
    the journal writes every series for them, block after block."""
    from broker.run.sink import RunSink
    from broker.run.steps.store import StepStore

    j = Journal(tmp_path)
    j.load()
    sink = RunSink("w")
    reg = Register(run="w", rank=0, world_size=1, host="h")
    sink.apply(reg, T0)
    j.accept(sink, b"", reg, T0)
    source = StepStore()
    source.append([{"step": k, "time": T0 + k, "n": 1, "slowest_rank": None,
                    "samples": 0, "tokens": 0, "step_ms": [1.0, 1.0, 1.0],
                    "metrics": {f"m{k % 7}": [float(k), float(k), float(k)]}}
                   for k in range(60)])
    for base in range(0, 60, 10):
        sink.restore_steps(source.to_wire(base, base + 10))
        sink.seq += 1  # as a steps event would
        j.note_seq(sink)
        j.flush()
    state = msgspec.msgpack.encode(sink.steps.to_wire())
    j.close()
    j = Journal(tmp_path)
    try:
        assert msgspec.msgpack.encode(j.load()["w"].steps.to_wire()) == state
    finally:
        j.close()


def test_while_writes_fail_the_buffers_stay_bounded_and_drops_are_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that refuses writes (here: runs/ replaced by a file) must not grow the
    broker: past the bound a buffer is given up, logged and counted."""
    import shutil

    from broker.journal import writer as journal_writer
    monkeypatch.setattr(journal_writer, "_MAX_BUFFER", 64 * 1024)
    b = Broker(tmp_path)
    started(b)
    b.journal.forget("r")  # its handle is closed: the next write must open the file again
    runs = tmp_path / "runs"
    shutil.move(runs, tmp_path / "runs-away")
    runs.write_text("a file where the dir was")
    for i in range(40):
        b.send(Metadata(run="r", rank=0, json=f'{{"i": {i}, "pad": "{"p" * 8000}"}}'))
    assert b.journal.counters()["dropped_bytes"] > 0
    assert b.journal._buffered <= 64 * 1024 + 16 * 1024
    runs.unlink()
    shutil.move(tmp_path / "runs-away", runs)
    b.close()
