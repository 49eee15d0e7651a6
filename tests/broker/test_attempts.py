"""Attempts (PROTOCOL 8.1): the attempt rule, rewinds of steps and epochs, the header's
``attempt``/``attempts``, the ``restart`` alert, and the journal keeping all of it.

Pure sink tests (no sockets) for the rules; the journal test goes through a real data dir
with the socket-free broker of tests/broker/test_journal_steps.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List

import msgspec
import pytest

from broker.run.attempts import MAX_ATTEMPTS_PER_MINUTE
from broker.run.events import Rejected
from broker.run.sink import RunSink
from rank_agent import protocol
from rank_agent.protocol import Finish, Metrics, Register, Resources, ResourceSample, Steps
from tests.broker.test_journal_steps import Broker

RUN = "r"


def reg(rank: int, ws: int, proc: str) -> Register:
    return Register(run=RUN, rank=rank, world_size=ws, host=f"h{rank}", proc=proc)


def steps(rank: int, lo: int, hi: int, loss: float, t: float = 0.0) -> Steps:
    s = list(range(lo, hi))
    return Steps(run=RUN, rank=rank, steps=s, times=[t] * len(s), step_ms=[10.0] * len(s),
                 metrics={"loss": [loss] * len(s)})


def epoch(rank: int, e: int, loss: float) -> Metrics:
    return Metrics(run=RUN, rank=rank, epoch=e, avg_loss=loss, batches=1)


def attempt0(sink: RunSink, ws: int = 2, upto: int = 100, t: float = 100.0) -> None:
    """Attempt 0: ``ws`` ranks close steps 0..upto-1 and epochs 0..upto/10-1."""
    for r in range(ws):
        sink.apply(reg(r, ws, f"a{r}"), t)
    for lo in range(0, upto, 10):
        for r in range(ws):
            sink.apply(steps(r, lo, lo + 10, 1.0, t), t + 1)
        for r in range(ws):
            sink.apply(epoch(r, lo // 10, 1.0), t + 1)
    sink.tick(t + 5)


def line_steps(sink: RunSink) -> List[int]:
    return sink.steps.column("step").tolist()


def test_rewind_of_steps_and_epochs_keeps_the_superseded_records() -> None:
    sink = RunSink(RUN)
    attempt0(sink)
    assert sink.header()["steps_done"] == 99
    # new processes: rank 0 starts attempt 1, resuming from step 50 / epoch 5
    sink.apply(reg(0, 2, "b0"), 200.0)
    sink.apply(reg(1, 2, "b1"), 200.0)
    for lo in (50, 60):
        for r in (0, 1):
            sink.apply(steps(r, lo, lo + 10, 2.0, 200.0), 201.0)
        for r in (0, 1):
            sink.apply(epoch(r, lo // 10, 2.0), 201.0)
    sink.tick(205.0)
    assert line_steps(sink) == list(range(70))  # the line: 0-49 of attempt 0, 50-69 of 1
    recs = sink.steps.records(0)
    assert {r["metrics"]["loss"][0] for r in recs[50:]} == {2.0}  # the re-run's values
    h = sink.header()
    assert h["steps_done"] == 69 and h["attempt"] == 1
    a0, a1 = h["attempts"]
    assert (a0["first_step"], a0["last_step"], a0["superseded_steps"]) == (0, 99, 50)
    assert (a0["first_epoch"], a0["last_epoch"], a0["superseded_epochs"]) == (0, 9, 5)
    assert (a1["first_step"], a1["last_step"], a1["superseded_steps"]) == (50, 69, 0)
    assert a0["ended_at"] == a1["started_at"] == 200.0 and a1["ended_at"] is None
    # attempt 0's own records, superseded ones included, unchanged
    own = sink.line.of_attempt(0)
    assert own.column("step").tolist() == list(range(100))
    assert {r["metrics"]["loss"][0] for r in own.records(0)} == {1.0}
    assert sink.line.of_attempt(1).column("step").tolist() == list(range(50, 70))
    assert [(r["epoch"], r["attempt"]) for r in sink.records] == \
        [(e, 0) for e in range(5)] + [(5, 1), (6, 1)]
    assert [r["epoch"] for r in sink.epoch_line.of_attempt(sink.records, 0)] == list(range(10))
    restart = [a for a in h["alerts"] if a["kind"] == "restart"]
    assert restart == [{"kind": "restart", "rank": None, "host": None, "at": 200.0,
                        "message": "restart 1: the previous attempt reached step 99"}]
    # late only against the current attempt: a point of attempt 1 at 65 is late, one at 70 not
    assert sink.late_steps == 0


def test_the_same_process_registering_again_starts_nothing() -> None:
    sink = RunSink(RUN)
    attempt0(sink)
    sink.apply(reg(0, 2, "a0"), 150.0)
    sink.apply(Register(run=RUN, rank=1, world_size=2, host="h1"), 150.0)  # proc "" = unknown
    assert sink.attempt == 0 and len(sink.header()["attempts"]) == 1
    assert line_steps(sink) == list(range(100))


def test_elastic_up_then_down() -> None:
    sink = RunSink(RUN)
    attempt0(sink, ws=2)
    # a larger job: rank 2 (>= world size 2, larger world) starts attempt 1 first
    sink.apply(reg(2, 3, "c2"), 200.0)
    assert sink.attempt == 1 and sink.world_size == 3
    assert [r["rank"] for r in sink.ranks()] == [2]  # only ranks heard since it began
    sink.apply(reg(0, 3, "c0"), 200.5)
    sink.apply(reg(1, 3, "c1"), 200.5)
    assert sink.attempt == 1 and [r["rank"] for r in sink.ranks()] == [0, 1, 2]
    with pytest.raises(Rejected) as exc:  # another world size without a new attempt
        sink.apply(Register(run=RUN, rank=1, world_size=4, host="h1", proc="c1"), 201.0)
    assert exc.value.reason == "world_size_mismatch"
    # smaller: rank 0's new process starts attempt 2 with world size 1
    sink.apply(reg(0, 1, "d0"), 300.0)
    assert sink.attempt == 2 and sink.world_size == 1
    assert [r["rank"] for r in sink.ranks()] == [0]
    assert [a["world_size"] for a in sink.header()["attempts"]] == [2, 3, 1]
    # the run ends by the current attempt's ranks alone
    sink.apply(Finish(run=RUN, rank=0), 301.0)
    assert sink.status == "complete"


def test_old_processes_frames_are_counted_and_change_nothing() -> None:
    sink = RunSink(RUN)
    attempt0(sink)
    sink.apply(reg(0, 2, "b0"), 200.0)
    seq = sink.seq
    with pytest.raises(Rejected) as exc:  # rank 1's old process registers again
        sink.apply(reg(1, 2, "a1"), 200.1)
    assert exc.value.reason == "old_proc"
    for frame in (steps(1, 100, 110, 9.0), epoch(1, 10, 9.0),
                  Resources(run=RUN, rank=1, sample=ResourceSample(cpu_percent=1.0))):
        with pytest.raises(Rejected) as exc:  # rank 1 has not registered in attempt 1
            sink.apply(frame, 200.2)
        assert exc.value.reason == "old_proc"
    assert sink.seq == seq and [r["rank"] for r in sink.ranks()] == [0]
    sink.apply(reg(1, 2, "b1"), 200.3)  # its new process joins attempt 1, starting nothing
    assert sink.attempt == 1
    sink.apply(steps(1, 0, 5, 3.0), 200.4)  # and is heard


def test_attempt_rate() -> None:
    sink = RunSink(RUN)
    sink.apply(reg(0, 1, "p0"), 0.0)
    for k in range(1, MAX_ATTEMPTS_PER_MINUTE + 1):
        sink.apply(reg(0, 1, f"p{k}"), float(k))
    assert sink.attempt == MAX_ATTEMPTS_PER_MINUTE
    with pytest.raises(Rejected) as exc:
        sink.apply(reg(0, 1, "too-many"), 30.0)
    assert exc.value.reason == "attempt_rate"
    assert sink.attempt == MAX_ATTEMPTS_PER_MINUTE
    sink.apply(reg(0, 1, "later"), 62.0)  # a minute after the first ones
    assert sink.attempt == MAX_ATTEMPTS_PER_MINUTE + 1


def test_proc_longer_than_64_is_schema() -> None:
    raw = protocol.encoder.encode(Register(run=RUN, rank=0, world_size=1, host="h",
                                           proc="x" * 65))
    with pytest.raises(msgspec.ValidationError):  # counted as ``schema`` by the ingest
        protocol.decode(raw)
    ok = protocol.encoder.encode(Register(run=RUN, rank=0, world_size=1, host="h", proc="x" * 64))
    assert protocol.decode(ok).proc == "x" * 64  # type: ignore[union-attr]


def test_restart_message_when_nothing_or_only_epochs_closed() -> None:
    sink = RunSink(RUN)
    sink.apply(reg(0, 1, "a"), 1.0)
    sink.apply(reg(0, 1, "b"), 2.0)
    sink.apply(epoch(0, 0, 1.0), 3.0)
    sink.apply(reg(0, 1, "c"), 4.0)
    msgs = [a["message"] for a in sink.header()["alerts"] if a["kind"] == "restart"]
    assert msgs == ["restart 2: the previous attempt reached epoch 0"]  # (latest message)
    assert sink.header()["attempts"][0]["cause"] is not None  # rank 0 never finished: silent


def test_a_restarted_broker_serves_the_same_attempts_line_and_superseded(tmp_path: Path) -> None:
    b = Broker(tmp_path / "d")
    t = b.now

    def send_all(frames: List[Any]) -> None:
        for f in frames:
            assert b.send(f), f

    send_all([reg(0, 2, "a0"), reg(1, 2, "a1")])
    for lo in range(0, 100, 10):
        send_all([steps(0, lo, lo + 10, 1.0, t), steps(1, lo, lo + 10, 1.0, t)])
        b.tick(0.5)
    send_all([reg(0, 2, "b0"), reg(1, 2, "b1")])
    for lo in (40, 50):
        send_all([steps(0, lo, lo + 10, 2.0, t), steps(1, lo, lo + 10, 2.0, t)])
        b.tick(0.5)
    sink = b.sinks[RUN]
    assert line_steps(sink) == list(range(60))
    header = sink.header()
    b.journal.close()  # (as a SIGKILL after the flush: nothing more is written)

    b2 = Broker(tmp_path / "d", now=b.now)
    try:
        s2 = b2.sinks[RUN]
        assert line_steps(s2) == list(range(60))
        assert s2.steps.records(0) == sink.steps.records(0)
        h2 = s2.header()
        assert h2["attempt"] == 1
        assert [{k: v for k, v in a.items() if k != "cause"} for a in h2["attempts"]] == \
            [{k: v for k, v in a.items() if k != "cause"} for a in header["attempts"]]
        assert s2.line.of_attempt(0).records(0) == sink.line.of_attempt(0).records(0)
        assert s2.line.of_attempt(0).rows == 100
        # attempt 1 goes on after the restart: a point at 60 closes, at 50 is late
        assert b2.send(reg(0, 2, "b0")) and b2.send(reg(1, 2, "b1"))
    finally:
        b2.close()


def test_rewinds_across_three_attempts_keep_each_attempts_own_records() -> None:
    """Attempt 2 rewinds below attempt 1's first step: the cut rows of both older attempts
    are superseded, each under its own attempt, once."""
    sink = RunSink(RUN)
    sink.apply(reg(0, 1, "a"), 1.0)
    sink.apply(steps(0, 0, 30, 1.0), 1.0)
    sink.tick(3.0)
    sink.apply(reg(0, 1, "b"), 10.0)
    sink.apply(steps(0, 20, 40, 2.0), 10.0)
    sink.tick(12.0)
    sink.apply(reg(0, 1, "c"), 20.0)
    sink.apply(steps(0, 15, 25, 3.0), 20.0)
    sink.tick(22.0)
    assert line_steps(sink) == list(range(25))
    assert sink.line.attempts_of(0, 25).tolist() == [0] * 15 + [2] * 10
    assert sink.line.of_attempt(0).column("step").tolist() == list(range(30))
    assert sink.line.of_attempt(1).column("step").tolist() == list(range(20, 40))
    assert sink.line.of_attempt(2).column("step").tolist() == list(range(15, 25))
    assert sink.line.n_superseded == 15 + 20
    assert [a["superseded_steps"] for a in sink.header()["attempts"]] == [15, 20, 0]


def test_attempts_past_the_1000th_are_counted_the_first_and_latest_999_listed() -> None:
    sink = RunSink(RUN)
    sink.apply(reg(0, 1, "p0"), 0.0)
    for k in range(1, 1201):
        sink.apply(reg(0, 1, f"p{k}"), 7.0 * k)  # (7 s apart: within attempt_rate)
    h = sink.header()
    assert h["attempt"] == 1200
    listed = [a["attempt"] for a in h["attempts"]]
    assert listed == [0] + list(range(202, 1201)) and len(listed) == 1000
    assert sink.attempts.entry(201) is None and sink.attempts.entry(202) is not None
    msgs = [a["message"] for a in h["alerts"] if a["kind"] == "restart"]
    assert msgs == ["restart 1200: the previous attempt closed nothing"]


def test_the_failure_is_the_current_attempts_and_the_cause_the_previous_ones() -> None:
    from rank_agent.protocol import ErrorInfo

    sink = RunSink(RUN)
    attempt0(sink, ws=2, upto=20)
    sink.apply(Finish(run=RUN, rank=1, status="error",
                      error=ErrorInfo(type="RuntimeError", message="boom\nmore", at=150.0)), 150.0)
    assert sink.header()["failure"]["first"]["rank"] == 1
    sink.apply(reg(0, 2, "b0"), 200.0)
    h = sink.header()
    assert h["failure"] is None  # the new attempt's ranks: nothing failed (yet)
    cause = h["attempts"][0]["cause"]
    # rank 0 never finished: counted silent at its last frame (101.0), before rank 1's error
    assert (cause["rank"], cause["kind"]) == (0, "silent") and "frames" not in cause
    assert h["attempts"][1]["cause"] is None


def test_data_share_is_the_current_attempts() -> None:
    sink = RunSink(RUN)
    sink.apply(reg(0, 1, "a"), 1.0)
    sink.apply(Steps(run=RUN, rank=0, steps=list(range(10)), times=[1.0] * 10,
                     step_ms=[100.0] * 10, data_ms=[50.0] * 10), 1.0)
    sink.tick(3.0)
    assert sink.header()["data_share"] == 0.5
    sink.apply(reg(0, 1, "b"), 10.0)
    sink.apply(Steps(run=RUN, rank=0, steps=[20], times=[10.0], step_ms=[100.0]), 10.0)
    sink.tick(12.0)
    assert sink.steps.last_step == 20
    assert sink.header()["data_share"] is None  # attempt 1 has no data wait (yet)


def test_epoch_ids_after_a_rewind_survive_a_restart(tmp_path: Path) -> None:
    """The record that replaced a superseded one keeps its event id across a restart (the
    journal notes the ids from the cut on again), so a client's Last-Event-ID stays valid."""
    b = Broker(tmp_path / "d")
    for f in (reg(0, 1, "a"), epoch(0, 0, 1.0), epoch(0, 1, 1.0), reg(0, 1, "b"),
              epoch(0, 1, 2.0)):
        assert b.send(f)
    seqs = list(b.sinks[RUN].record_seqs)
    assert [r["attempt"] for r in b.sinks[RUN].records] == [0, 1]
    b.journal.close()
    b2 = Broker(tmp_path / "d", now=b.now)
    try:
        assert b2.sinks[RUN].record_seqs == seqs
        assert [(r["epoch"], r["attempt"]) for r in b2.sinks[RUN].records] == [(0, 0), (1, 1)]
    finally:
        b2.close()
