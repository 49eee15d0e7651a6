"""Closed steps in the journal (broker/journal/journal.py, KIND_STEPS blocks): they survive a
graceful close and a crash (torn tail included), ids keep increasing, and a restored run
keeps closing steps after the last restored one (PROTOCOL 2.4 "survive a broker restart
exactly as epoch records do", section 6 "Persistence").

No sockets: a harness plays the server's part as broker/server.py does it (``sink.apply``,
then ``journal.accept`` per frame, ``flush`` before publishing; ``tick`` events through
``note_seq`` and ``flush``) with a fake clock. A crash is a copy of the data dir after a
flush (what a SIGKILL leaves: the written bytes); a torn tail is a cut file.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import msgspec
import pytest

from broker.journal import codec
from broker.journal.journal import HEADER, Journal, read_entries
from broker.run.sink import Event, Rejected, RunSink
from broker.run.steps.closer import RunSteps
from broker.run.steps.store import SAMPLES_PER_S, STEP_MS, StepStore, wire_records
from rank_agent import protocol
from rank_agent.protocol import Finish, Frame, Register, Resources, ResourceSample, Steps

T0 = 1_800_000_000.0


def enc(x: Any) -> bytes:
    return msgspec.msgpack.encode(x)


class Broker:
    """The server's part without sockets (see the module docstring)."""

    def __init__(self, data_dir: Path, *, now: float = T0, step_close_after: float = 10.0,
                 stale_after: float = 30.0) -> None:
        self.journal = Journal(data_dir)
        self.kw = dict(stale_after=stale_after, step_close_after=step_close_after)
        self.sinks: dict[str, RunSink] = self.journal.load(
            now=now, **self.kw)  # type: ignore[arg-type]
        self.now = now
        self.issued: dict[str, int] = {}
        self.events: list[tuple[str, Event]] = []

    def send(self, frame: Frame, *, dt: float = 0.1) -> bool:
        self.now += dt
        raw = protocol.encoder.encode(frame)
        decoded = protocol.decode(raw)
        run = decoded.run
        sink = self.sinks.get(run)
        if sink is None:
            sink = RunSink(run, **self.kw)  # type: ignore[arg-type]
        try:
            events = sink.apply(decoded, self.now)
        except Rejected:
            return False
        self.sinks[run] = sink
        self.journal.accept(sink, raw, decoded, self.now)
        self.journal.flush()  # the batch is on disk before its events go out
        self._publish(sink, events)
        return True

    def tick(self, dt: float = 0.0) -> None:
        self.now += dt
        for sink in self.sinks.values():
            events = sink.tick(self.now)
            if events:
                self.journal.note_seq(sink)
                self.journal.flush()
                self._publish(sink, events)

    def _publish(self, sink: RunSink, events: list[Event]) -> None:
        for ev in events:
            assert ev.seq > self.issued.get(sink.run, 0)
            self.issued[sink.run] = ev.seq
            self.events.append((sink.run, ev))

    def published(self, run: str) -> list[dict[str, Any]]:
        """Every closed step record that went out in a steps event, in order."""
        return [r for rn, ev in self.events if rn == run and ev.kind == "steps"
                for r in wire_records(ev.data)]

    def close(self) -> None:
        self.journal.close()


def stp(run: str, rank: int, steps: range | list[int], *, t: float = T0,
        loss: Any = None, extra: Optional[dict[str, list[Optional[float]]]] = None) -> Steps:
    s = list(steps)
    metrics: dict[str, list[Optional[float]]] = {
        "loss": [loss if loss is not None else 1.0 / (k + 1) + rank for k in s],
        "acc": [None if k % 3 == 0 else 0.01 * k for k in s],
    }
    metrics.update(extra or {})
    return Steps(run=run, rank=rank, steps=s, times=[t + 0.01 * k for k in s],
                 step_ms=[100.0 + rank + (k % 5) for k in s], samples=[32] * len(s),
                 tokens=[32 * 128] * len(s), metrics=metrics)


def reg(run: str, rank: int, ws: int) -> Register:
    return Register(run=run, rank=rank, world_size=ws, host=f"h{rank}", local_rank=0)


def store_state(store: StepStore) -> bytes:
    names = store.metric_names()
    out: list[Any] = [len(store), store.last_step, names, store.slowest_ranks(),
                      "".join(store.csv_rows(chunk=50))]
    for m in names + [STEP_MS, SAMPLES_PER_S]:
        out.append(store.series(m, None, None, 10_000))
        out.append(store.series(m, None, None, 7))
    return enc(out)


def records_store(records: list[dict[str, Any]]) -> StepStore:
    s = StepStore()
    s.append(records)
    return s


def crash_copy(data_dir: Path, tmp_path: Path, name: str = "after-crash") -> Path:
    dest = tmp_path / name
    shutil.copytree(data_dir, dest)
    return dest


def journal_path(data_dir: Path, run: str) -> Path:
    return data_dir / "runs" / f"{run}.journal"


def entries(path: Path) -> list[tuple[int, bytes]]:
    data = path.read_bytes()
    assert data.startswith(HEADER)
    got, _, problem = read_entries(data[len(HEADER):])
    assert problem is None
    return [(kind, bytes(p)) for kind, p in got]


def entry_ends(path: Path) -> list[tuple[int, int]]:
    """(kind, file offset just past the entry) of every entry."""
    out = []
    pos = len(HEADER)
    for kind, payload in entries(path):
        pos += 8 + 1 + len(payload)
        out.append((kind, pos))
    return out


def training(b: Broker, run: str = "r", *, ranks: int = 2, upto: int = 60,
             per_frame: int = 10) -> None:
    """Registers, then every rank logs ``upto`` steps in frames of ``per_frame``, with ticks
    between, so several steps events (and STEPS blocks) go out."""
    for r in range(ranks):
        assert b.send(reg(run, r, ranks))
    for k in range(0, upto, per_frame):
        for r in range(ranks):
            loss = math.nan if (k == 20 and r == 0) else None
            assert b.send(stp(run, r, range(k, k + per_frame), t=b.now, loss=loss))
        b.tick(0.3)


def header_without_times(h: dict[str, Any]) -> dict[str, Any]:
    """The header bar ``updated_at`` and the alerts' ``at``: steps frames are not journaled,
    so the restored run has neither the time of its last steps frame nor the time a step's
    non-finite loss alert was raised (see the xfail tests at the end)."""
    out = {k: v for k, v in h.items() if k != "updated_at"}
    out["alerts"] = [{k: v for k, v in a.items() if k != "at"} for a in h["alerts"]]
    return out


# ---------------------------------------------------------------- round trips


def test_closed_steps_survive_close_and_reload(tmp_path: Path) -> None:
    b = Broker(tmp_path / "d")
    training(b, upto=60)
    sink = b.sinks["r"]
    published = b.published("r")
    assert [r["step"] for r in published] == list(range(60)) == list(sink.steps.column("step"))
    issued = b.issued["r"]
    header, ranks = sink.header(), sink.ranks()
    kinds = [k for k, _ in entries(journal_path(tmp_path / "d", "r"))]
    assert kinds.count(codec.KIND_STEPS) >= 3  # several blocks, one per steps event
    assert not any(k == codec.KIND_FRAME and isinstance(protocol.decode(p[8:]), Steps)
                   for k, p in entries(journal_path(tmp_path / "d", "r")))
    b.close()

    b2 = Broker(tmp_path / "d", now=b.now)
    try:
        s2 = b2.sinks["r"]
        assert store_state(s2.steps) == store_state(sink.steps)
        assert store_state(s2.steps) == store_state(records_store(published))
        assert s2.seq > issued
        h2 = s2.header()
        assert h2["steps_done"] == 59 and h2["step_metrics"] == ["acc", "loss"]
        assert h2["status"] == "training"
        assert enc(header_without_times(h2)) == enc(header_without_times(header))
        # slowest_share is restored; step/step_ms are not kept (documented in journal.py)
        assert [r["slowest_share"] for r in s2.ranks()] == [r["slowest_share"] for r in ranks]
        assert s2.late_steps == 0
    finally:
        b2.close()


def test_nonfinite_loss_alert_of_a_closed_step_is_restored(tmp_path: Path) -> None:
    b = Broker(tmp_path / "d")
    training(b, upto=40)
    alerts = b.sinks["r"].header()["alerts"]
    # (v5, 8.3: the first NaN of loss is also a ``nonfinite`` alert, restored with its entry)
    assert [a["kind"] for a in alerts] == ["nonfinite_loss", "nonfinite"]
    assert alerts[0]["message"] == "step 29: loss is nan"  # the frame's 20..29 are all NaN
    b.close()
    b2 = Broker(tmp_path / "d", now=b.now)
    try:
        got = b2.sinks["r"].header()["alerts"]
        assert [(a["kind"], a["rank"], a["message"]) for a in got] == [
            (a["kind"], a["rank"], a["message"]) for a in alerts]
    finally:
        b2.close()


def test_crash_keeps_every_published_step_and_ids_keep_increasing(tmp_path: Path) -> None:
    data = tmp_path / "d"
    b = Broker(data)
    training(b, upto=50)
    # rank 0 is ahead: 50..54 are pending (accepted, not closed) at the crash
    assert b.send(stp("r", 0, range(50, 55), t=b.now))
    published = b.published("r")
    issued = b.issued["r"]
    crashed = crash_copy(data, tmp_path)  # SIGKILL: written bytes only, no close()
    b.close()

    b2 = Broker(crashed, now=b.now + 1)
    try:
        s2 = b2.sinks["r"]
        assert store_state(s2.steps) == store_state(records_store(published))
        assert s2.steps.last_step == 49
        assert s2.seq > issued
        # the restored run keeps closing after its last restored step; a point at or below
        # it is late (counted), the rest of that frame applies
        assert b2.send(stp("r", 0, range(48, 60), t=b2.now))
        assert s2.late_steps == 2
        assert b2.send(stp("r", 1, range(50, 60), t=b2.now))
        b2.tick(1.5)  # past the start-up grace of the restarted closer
        after = b2.published("r")
        assert [r["step"] for r in after] == list(range(50, 60))
        assert all(r["n"] == 2 for r in after)
        assert all(ev.seq > issued for _, ev in b2.events)
        issued2 = b2.issued["r"]
        crashed2 = crash_copy(crashed, tmp_path, "second-crash")
    finally:
        b2.close()

    b3 = Broker(crashed2, now=b2.now + 1)
    try:
        s3 = b3.sinks["r"]
        assert [int(x) for x in s3.steps.column("step")] == list(range(60))
        assert store_state(s3.steps) == store_state(records_store(published + after))
        assert s3.seq > issued2
    finally:
        b3.close()


def test_torn_steps_block_is_cut_and_the_steps_before_it_are_kept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "d"
    b = Broker(data)
    training(b, upto=60)
    published = b.published("r")
    issued = b.issued["r"]
    crashed = crash_copy(data, tmp_path)
    b.close()
    path = journal_path(crashed, "r")
    ends = entry_ends(path)
    steps_blocks = [i for i, (k, _) in enumerate(ends) if k == codec.KIND_STEPS]
    last = steps_blocks[-1]
    start_of_last = ends[last - 1][1]
    os.truncate(path, start_of_last + (ends[last][1] - start_of_last) // 2)  # torn mid-entry
    # what the kept blocks hold: decode them
    kept = StepStore()
    for k, p in entries_prefix(path, start_of_last):
        if k == codec.KIND_STEPS:
            kept.extend_wire(msgspec.msgpack.decode(p))
    assert 0 < len(kept) < len(published)

    caplog.set_level(logging.WARNING, logger="broker.journal.journal")
    b2 = Broker(crashed, now=b.now + 1)
    try:
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "truncated" in warnings[0].getMessage()
        s2 = b2.sinks["r"]
        assert store_state(s2.steps) == store_state(records_store(published[:len(kept)]))
        assert s2.seq > issued
        # the run goes on after the cut (the torn block's steps were never published:
        # the flush comes before the event); the next steps close normally
        nxt = s2.steps.last_step + 1
        assert b2.send(stp("r", 0, range(nxt, nxt + 3), t=b2.now))
        assert b2.send(stp("r", 1, range(nxt, nxt + 3), t=b2.now))
        b2.tick(1.5)
        assert [r["step"] for r in b2.published("r")] == [nxt, nxt + 1, nxt + 2]
        total = len(s2.steps)
    finally:
        b2.close()
    caplog.clear()
    b3 = Broker(crashed, now=b2.now + 1)  # the cut file took the appends: it reads clean
    try:
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(b3.sinks["r"].steps) == total
    finally:
        b3.close()


def entries_prefix(path: Path, size: int) -> list[tuple[int, bytes]]:
    data = path.read_bytes()[:size]
    got, _, problem = read_entries(data[len(HEADER):])
    assert problem is None
    return [(k, bytes(p)) for k, p in got]


def test_many_steps_closed_at_once_go_in_several_blocks_and_a_torn_one_leaves_no_trace(
        tmp_path: Path) -> None:
    """3,072 steps with 64 metrics closed by one run end: more than one block's worth. A
    tail torn between two blocks keeps the first block's steps and only the metrics they
    have (header step_metrics = metrics seen in a closed step)."""
    data = tmp_path / "d"
    b = Broker(data)
    assert b.send(reg("big", 0, 2))  # rank 1 logs no steps: the grace holds them all
    assert b.send(reg("big", 1, 2))
    names = [f"m{i:02d}" for i in range(63)]
    for k in range(0, 3072, 1024):
        s = range(k, k + 1024)
        extra = {n: [float(x) for x in s] for n in names}
        # "zlate" only in the run's last 200 steps
        extra["zlate"] = [1.0 if x >= 2872 else None for x in s]
        frame = Steps(run="big", rank=0, steps=list(s), times=[T0] * 1024,
                      step_ms=[50.0] * 1024, metrics=extra)
        assert b.send(frame, dt=0.001)  # within the grace, and within STEPS_INTERVAL
    assert b.sinks["big"].steps.last_step is None
    assert b.send(Finish(run="big", rank=1), dt=0.001)
    assert b.sinks["big"].steps.last_step is None
    assert b.send(Finish(run="big", rank=0), dt=0.001)  # the run end closes all 3,072
    published = b.published("big")
    assert len(published) == 3072 and b.sinks["big"].status == "complete"
    crashed = crash_copy(data, tmp_path)
    b.close()
    path = journal_path(crashed, "big")
    ends = entry_ends(path)
    blocks = [i for i, (k, _) in enumerate(ends) if k == codec.KIND_STEPS]
    assert len(blocks) >= 2 and all(blocks[j + 1] == blocks[j] + 1 for j in range(len(blocks) - 1))

    b2 = Broker(crashed)
    try:
        s2 = b2.sinks["big"]
        assert store_state(s2.steps) == store_state(records_store(published))
        assert s2.header()["step_metrics"] == sorted(names + ["zlate"])
        assert s2.status == "complete" and s2.complete is not None
    finally:
        b2.close()

    os.truncate(path, ends[blocks[0]][1] + 5)  # torn just after the first block
    b3 = Broker(crashed)
    try:
        s3 = b3.sinks["big"]
        n = len(s3.steps)
        assert 0 < n < 2872
        assert store_state(s3.steps) == store_state(records_store(published[:n]))
        assert "zlate" not in s3.header()["step_metrics"]
    finally:
        b3.close()


def test_one_closed_step_larger_than_a_frame_survives_the_reload(tmp_path: Path) -> None:
    """One step can carry 64 names per rank, each rank its own (500 ranks x 64 names of
    their own, ~100 characters each, is a 5 MB block for one row, which no chunking can
    split): the reader must not take it for corruption and cut the run's journal there."""
    data = tmp_path / "d"
    b = Broker(data)
    assert b.send(reg("wide", 0, 1))
    assert b.send(stp("wide", 0, [0], t=b.now))
    b.tick(2.0)
    sink = b.sinks["wide"]
    assert sink.steps.last_step == 0
    names = {f"rank{r:05d}/{'m' * 100}-{i:02d}": [float(i), float(i), float(r)]
             for r in range(500) for i in range(64)}
    # what a publish of that step does: into the store, an id, then the journal's note
    sink.steps.append([{"step": 1, "time": T0, "n": 500, "metrics": names,
                        "step_ms": [1.0, 1.0, 1.0], "slowest_rank": 0, "samples": 0,
                        "tokens": 0, "samples_per_s": None, "tokens_per_s": None}])
    sink.seq += 1
    b.journal.note_seq(sink)
    b.journal.flush()
    assert b.send(stp("wide", 0, [2, 3], t=b.now))  # the run goes on after it
    assert b.send(Finish(run="wide", rank=0))
    assert [int(x) for x in sink.steps.column("step")] == [0, 1, 2, 3]
    path = journal_path(data, "wide")
    assert max(len(p) for _, p in entries(path)) > protocol.MAX_FRAME_BYTES
    state = enc(sink.steps.to_wire())
    b.close()
    b2 = Broker(data, now=b.now)
    try:
        s2 = b2.sinks["wide"]
        assert enc(s2.steps.to_wire()) == state
        assert s2.steps.metric_names() == sorted([*names, "acc", "loss"])
        assert s2.status == "complete"
    finally:
        b2.close()


def test_run_whose_first_frame_is_steps_restores_like_the_live_run(tmp_path: Path) -> None:
    data = tmp_path / "d"
    b = Broker(data)
    first = stp("f", 0, range(0, 5), t=T0)
    assert b.send(first, dt=1.0)
    started = b.sinks["f"].header()["started_at"]
    assert b.send(reg("f", 0, 1), dt=2.0)
    b.tick(0.5)
    assert b.send(stp("f", 0, range(5, 9), t=b.now))
    b.tick(0.5)
    sink = b.sinks["f"]
    assert [r["step"] for r in b.published("f")] == list(range(9))
    header, ranks = sink.header(), sink.ranks()
    crashed = crash_copy(data, tmp_path)
    b.close()
    # no steps frame (or its points) in the journal: the first frame is a stand-in
    frames = [protocol.decode(p[8:]) for k, p in entries(journal_path(crashed, "f"))
              if k == codec.KIND_FRAME]
    assert not any(isinstance(f, Steps) for f in frames)

    b2 = Broker(crashed, now=b.now)
    try:
        s2 = b2.sinks["f"]
        assert s2.header()["started_at"] == started
        assert store_state(s2.steps) == store_state(sink.steps)
        assert enc(header_without_times(s2.header())) == enc(header_without_times(header))
        # the rank as the live broker showed it, bar the step figures the journal does not
        # keep: no sample was ever sent, so none may appear
        keep = ("rank", "host", "local_rank", "status", "epoch", "hardware", "resources",
                "slowest_share")
        assert [{k: r[k] for k in keep} for r in s2.ranks()] == [
            {k: r[k] for k in keep} for r in ranks]
    finally:
        b2.close()


def test_steps_only_run_completed_then_reloaded(tmp_path: Path) -> None:
    b = Broker(tmp_path / "d")
    for r in range(2):
        assert b.send(reg("c", r, 2))
    assert b.send(stp("c", 0, range(10), t=b.now))
    assert b.send(stp("c", 1, range(7), t=b.now))
    assert b.send(Finish(run="c", rank=0))
    assert b.send(Finish(run="c", rank=1))  # closes 7..9 and completes
    sink = b.sinks["c"]
    assert [r["step"] for r in b.published("c")] == list(range(10))
    kinds = [ev.kind for _, ev in b.events]
    assert kinds[-4:] == ["steps", "run", "ranks", "complete"]
    complete = sink.complete
    b.close()
    b2 = Broker(tmp_path / "d", now=b.now)
    try:
        s2 = b2.sinks["c"]
        assert s2.status == "complete" and s2.complete == complete
        assert store_state(s2.steps) == store_state(sink.steps)
    finally:
        b2.close()


def test_forget_then_load_run_brings_the_steps_back(tmp_path: Path) -> None:
    b = Broker(tmp_path / "d")
    training(b, "e", upto=30)
    state = store_state(b.sinks["e"].steps)
    b.journal.forget("e")
    try:
        again = b.journal.load_run("e")
        assert again is not None and store_state(again.steps) == state
        assert again.seq > b.issued["e"]
    finally:
        b.close()


def test_a_steps_block_that_does_not_follow_is_skipped_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A block repeated (or out of order) in a file cannot double a step."""
    data = tmp_path / "d"
    b = Broker(data)
    training(b, upto=30)
    published = b.published("r")
    b.close()
    path = journal_path(data, "r")
    (first_block,) = [p for k, p in entries(path) if k == codec.KIND_STEPS][:1]
    with open(path, "ab") as f:
        f.write(codec.entry(bytes((codec.KIND_STEPS,)), first_block))
        f.write(codec.entry(bytes((codec.KIND_STEPS,)), first_block))
    caplog.set_level(logging.WARNING, logger="broker.journal.journal")
    b2 = Broker(data, now=b.now)
    try:
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "closed steps" in warnings[0].getMessage()
        assert store_state(b2.sinks["r"].steps) == store_state(records_store(published))
    finally:
        b2.close()


def test_resources_then_steps_first_frame_keeps_the_sample(tmp_path: Path) -> None:
    b = Broker(tmp_path / "d")
    sample = ResourceSample(cpu_percent=12.5)
    assert b.send(Resources(run="s", rank=0, sample=sample))
    assert b.send(stp("s", 0, range(3), t=b.now))
    assert b.send(reg("s", 0, 1))
    b.tick(2.0)
    ranks = b.sinks["s"].ranks()
    b.close()
    b2 = Broker(tmp_path / "d", now=b.now)
    try:
        assert b2.sinks["s"].ranks()[0]["resources"] == ranks[0]["resources"]
        assert ranks[0]["resources"]["cpu_percent"] == 12.5
    finally:
        b2.close()


# ---------------------------------------------------------------- known gaps (xfail, strict)


def _steps_only_run(b: Broker, seconds: float) -> None:
    for r in range(2):
        assert b.send(reg("r", r, 2))
    k = 0
    while b.now < T0 + seconds:
        for r in range(2):
            assert b.send(stp("r", r, range(k, k + 4), t=b.now), dt=0.1)
        b.tick(0.05)
        k += 4


def test_restart_of_a_steps_only_run_raises_no_stale_alert(tmp_path: Path) -> None:
    b = Broker(tmp_path / "d")
    _steps_only_run(b, 60.0)
    assert b.sinks["r"].header()["alerts"] == []
    b.close()  # even a graceful stop
    b2 = Broker(tmp_path / "d", now=b.now + 1)
    try:
        b2.tick(0.1)
        assert [r["status"] for r in b2.sinks["r"].ranks()] == ["ok", "ok"]
        assert b2.sinks["r"].header()["alerts"] == []
        # ... and each rank has stale_after (30 s) from the restart to report again.
        b2.tick(29.0)
        assert [r["status"] for r in b2.sinks["r"].ranks()] == ["ok", "ok"]
        b2.tick(1.0)
        assert [r["status"] for r in b2.sinks["r"].ranks()] == ["stale", "stale"]
    finally:
        b2.close()


def test_restored_header_times_equal_the_live_ones(tmp_path: Path) -> None:
    b = Broker(tmp_path / "d")
    training(b, upto=40)
    header = b.sinks["r"].header()
    b.close()
    b2 = Broker(tmp_path / "d", now=b.now)
    try:
        h2 = b2.sinks["r"].header()
        assert [a["at"] for a in h2["alerts"]] == [a["at"] for a in header["alerts"]]
        assert h2["updated_at"] == header["updated_at"]
    finally:
        b2.close()


def _named(step: int, names: list[str]) -> Steps:
    return Steps(run="r", rank=0, steps=[step], times=[1.0], step_ms=[None],
                 metrics={n: [1.0] for n in names})


def test_the_names_a_block_visits_are_those_the_takes_since_published() -> None:
    """The journal's STEPS blocks visit the series of ``RunSteps.named_since(row)``: every
    name with a point in the rows published from ``row`` on (a block missing one would lose
    its points), and none whose points all lie before (the cost of a block must not grow
    with names the run stopped logging)."""
    steps = RunSteps(close_after=1e9, interval=0.0)
    steps.closer.grace = 0.0
    published = []
    for step, names in enumerate([["loss", "lr"], ["acc"], ["lr", "loss"], [], ["acc"]]):
        frame = _named(step, names)
        if names:
            steps.admit(frame)
        steps.add(frame, 1.0, True, 1)
        steps.close(1.0, 1)
        steps.take(1.0)
        published.append(set(names))
    assert steps.store.rows == 5
    for row in range(6):
        want = set().union(*published[row:]) if row < 5 else set()
        got = steps.named_since(row)
        assert set(got) == want, row
        assert len(got) == len(want)  # each once
    assert steps.named_since(4) == ["acc"]
