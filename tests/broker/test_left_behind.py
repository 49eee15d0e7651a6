"""What a run leaves behind (PROTOCOL.md 8.5), in memory and through a real journal on disk:
the alert list of every kind, the GPU rules' counters, ``collectives_last`` and the ranks'
step figures rebuilt exactly by a restart; the rules of ``collectives_last``; a journal
written before STATE entries existed still loading as it did.

The broker-process test (SIGKILL, a real webhook receiver, the web's answers) is
``tests/reliability/test_left_behind_restart.py``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import msgspec
import pytest

from broker.journal import statenotes
from broker.journal.journal import Journal
from broker.run.alerts import MAX_ALERTS_PER_KIND, RunAlerts
from broker.run.collectivelast import MAX_GROUPS, MAX_RANKS, LastVerdict, kept_form
from broker.run.sink import RunSink
from broker.stacks.feed import STACKS_INTERVAL
from rank_agent.protocol import (
    CollectiveEntry,
    Collectives,
    Finish,
    GpuSample,
    ProcessGroupStatus,
    Register,
    Resources,
    ResourceSample,
    StackFrame,
    Stacks,
    Steps,
    ThreadStack,
)
from tests.support.journalrun import crash_copy

RUN = "left-1"


def nowhere(rank: int) -> tuple[str, int] | None:
    return None


# ------------------------------------------------------------------ the alert list


def test_the_alert_list_comes_back_exactly_with_its_cap_order_and_counts() -> None:
    a = RunAlerts()
    for r in range(MAX_ALERTS_PER_KIND + 30):  # past the cap: the count and its summary line
        a.raise_(RUN, "stalled", r, f"stalled {r}s in f (t.py:1)", 10.0 + r, nowhere, False)
    a.raise_(RUN, "gpu_xid", 3, "XID 79 on GPU 1", 50.0, nowhere, False)
    a.raise_(RUN, "stalled", 30, "stalled again", 60.0, nowhere, False)  # the oldest, again
    a.raise_(RUN, "restart", None, "attempt 2 started", 61.0, nowhere, False)
    data = msgspec.msgpack.decode(msgspec.msgpack.encode(a.state()))  # through the journal's codec
    b = RunAlerts()
    b.restore(data)
    assert b.listed() == a.listed()
    # the cap drops the same alert next in both: the least recently raised
    for x in (a, b):
        x.raise_(RUN, "stalled", 999, "new", 70.0, nowhere, False)
    assert b.listed() == a.listed()
    assert [e["rank"] for e in b.listed() if e["kind"] == "stalled"][:2] == [30, 32]


def test_a_bad_alert_state_leaves_the_list_as_it_was() -> None:
    a = RunAlerts()
    a.raise_(RUN, "stale", 1, "rank 1 silent for 30s", 5.0, nowhere, False)
    before = a.listed()
    with pytest.raises((ValueError, TypeError, KeyError)):
        a.restore({"alerts": [{"kind": "stale", "rank": "one", "message": "m", "at": 1.0}],
                   "recent": {}, "raised": {}})
    assert a.listed() == before


# ------------------------------------------------------------------ collectives_last


def group(pg: str = "0", waiting: list[int] | None = None, behind: list[int] | None = None,
          seq: int = 101) -> dict[str, Any]:
    return {"pg": pg, "desc": "default_pg", "size": 3, "seq": seq, "op": "gloo:all_reduce",
            "waiting": waiting or [], "behind": [{"rank": r, "last_enqueued": seq - 1, "op": ""}
                                                for r in (behind or [])],
            "absent": [], "mismatched": []}


def test_within_a_hang_the_verdict_with_most_waiting_is_kept_latest_among_equals() -> None:
    last = LastVerdict()
    assert last.offer([group(waiting=[0, 1], behind=[2])], True, 10.0)
    assert last.value is not None and last.value["at"] == 10.0
    # ranks step again one by one as the hang ends: fewer waiting, the answer stays
    assert not last.offer([group(waiting=[0], behind=[2])], True, 11.0)
    assert last.value["groups"][0]["waiting"] == [0, 1]
    # as many waiting, later: it replaces
    assert last.offer([group(waiting=[0, 1], behind=[2], seq=102)], True, 12.0)
    assert (last.value["at"], last.value["groups"][0]["seq"]) == (12.0, 102)
    # the same verdict formed again keeps its time
    assert not last.offer([group(waiting=[0, 1], behind=[2], seq=102)], True, 13.0)
    assert last.value["at"] == 12.0
    # a verdict naming nobody changes nothing; no current frame ends the hang
    assert not last.offer([], True, 14.0)
    assert not last.offer([], False, 15.0)
    assert last.value["groups"][0]["seq"] == 102
    # the first naming verdict of a later hang replaces it, however few wait
    assert last.offer([group(waiting=[], behind=[1], seq=500)], True, 20.0)
    assert (last.value["at"], last.value["groups"][0]["seq"]) == (20.0, 500)


def test_the_kept_verdict_is_bounded_and_counts_what_it_cut() -> None:
    groups = [group(pg=str(i), waiting=list(range(i)), behind=[5000]) for i in range(20)]
    groups[3]["waiting"] = list(range(3000))
    kept = kept_form(groups)
    assert len(kept) == MAX_GROUPS
    assert [g["pg"] for g in kept[:3]] == ["3", "19", "18"]  # most waiting first
    assert len(kept[0]["waiting"]) == MAX_RANKS and kept[0]["waiting"][-1] == MAX_RANKS - 1
    assert kept[0]["counts"] == {"waiting": 3000, "behind": 1, "absent": 0, "mismatched": 0}


def test_a_restored_verdict_is_replaced_by_the_next_hang() -> None:
    last = LastVerdict()
    last.offer([group(waiting=[0, 1], behind=[2])], True, 10.0)
    again = LastVerdict()
    again.restore(msgspec.msgpack.decode(msgspec.msgpack.encode(last.state())))
    assert again.value == last.value
    assert again.offer([group(waiting=[0], behind=[1], seq=7)], True, 30.0)  # a new hang


# ------------------------------------------------------------------ through a journal


@pytest.fixture
def no_intervals(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """STATE parts written at every change (the intervals are about load, not meaning)."""
    monkeypatch.setattr(statenotes, "STATE_INTERVAL", 0.0)
    monkeypatch.setattr(statenotes, "FIGURES_INTERVAL", 0.0)
    monkeypatch.setattr(statenotes, "AT_INTERVAL", 0.0)
    yield


class Live:
    """A live sink and its journal, fed as the broker's server feeds them."""

    def __init__(self, data: Path) -> None:
        self.journal = Journal(data)
        self.journal.load()
        self.sink = RunSink(RUN, stale_after=5.0)
        self.sink.live = True

    def feed(self, frame: Any, now: float) -> None:
        self.sink.apply(frame, now)
        if type(frame) is Resources:
            self.sink.gpu_health(frame.rank, frame.sample, now)
        self.journal.accept(self.sink, b"", frame, now)
        self.journal.note_seq(self.sink)
        self.journal.flush()

    def tick(self, now: float) -> None:
        self.sink.tick(now)
        self.journal.note_seq(self.sink)
        self.journal.flush()


def gpu(rank: int, *, ecc: int = 0, xid: list[int] | None = None) -> Resources:
    return Resources(run=RUN, rank=rank, sample=ResourceSample(gpus=[GpuSample(
        device_index=0, name="H100", ecc_uncorrected=ecc, xid_errors=xid or [])]))


def coll(rank: int, enqueued: int) -> Collectives:
    return Collectives(run=RUN, rank=rank, reason="stall", taken_at=100.0 + rank, groups=[
        ProcessGroupStatus(pg="0", desc="default_pg", size=3, last_enqueued=enqueued,
                           last_completed=enqueued - 1)],
        entries=[CollectiveEntry(pg="0", seq=enqueued, op="gloo:all_reduce", input_sizes=[[4]])])


def stall(rank: int) -> Stacks:
    return Stacks(run=RUN, rank=rank, reason="stall", taken_at=90.0, idle_s=61.0, threads=[
        ThreadStack(name="MainThread", main=True, frames=[
            StackFrame(file="train.py", line=3, function="all_reduce", code="")])])


def a_run_with_every_kind(live: Live) -> None:
    """Three ranks on three hosts: steps with a slow rank 2, GPU health on ranks 0 and 1, a
    gloo hang where rank 2 never enters #101, stall dumps, a rank that goes stale, a rank
    that finishes with an error, and a kind another part raises (``restart``)."""
    for r in range(3):
        live.feed(Register(run=RUN, rank=r, world_size=3, host=f"n{r}"), 1.0)
    for r in range(3):
        live.feed(Steps(run=RUN, rank=r, steps=[0, 1, 2, 3], times=[2.0] * 4,
                        step_ms=[100.0 + 50 * r] * 4, data_ms=[5.0 + 40 * r] * 4), 2.0)
    live.tick(2.5)
    live.feed(gpu(0, ecc=3), 3.0)  # gpu_ecc: 3 uncorrected
    live.feed(gpu(1, xid=[79]), 3.1)  # gpu_xid
    live.feed(coll(0, 101), 4.0)
    live.feed(coll(1, 101), 4.0)
    live.feed(coll(2, 100), 4.0)
    live.tick(4.0 + STACKS_INTERVAL + 0.01)  # the verdict: collective_behind for rank 2
    live.feed(stall(0), 5.0)
    live.feed(stall(1), 5.0)
    live.sink._raise("restart", None, "attempt 2 of the run started", 5.5)
    live.feed(Finish(run=RUN, rank=1, status="error"), 6.0)
    live.feed(Steps(run=RUN, rank=0, steps=[4], times=[7.0], step_ms=[100.0]), 7.0)
    live.tick(12.5)  # rank 2 silent for 5 s: stale (rank 0 too, since 7.0 + 5 < 12.5)
    live.tick(13.0)


def test_a_restart_rebuilds_every_alert_the_verdict_and_the_figures(
        tmp_path: Path, no_intervals: None) -> None:
    live = Live(tmp_path / "d")
    a_run_with_every_kind(live)
    before = live.sink.header()
    kinds = {a["kind"] for a in before["alerts"]}
    assert {"gpu_ecc", "gpu_xid", "collective_behind", "stalled", "restart", "rank_error",
            "stale", "data_straggler"} <= kinds, kinds
    assert before["collectives_last"]["groups"][0]["behind"][0]["rank"] == 2
    ranks_before = [{k: r[k] for k in ("rank", "step", "step_ms", "data_ms", "slowest_share",
                                       "gpu_xids")} for r in live.sink.ranks()]
    live.journal.flush()
    crashed = crash_copy(tmp_path / "d", tmp_path)  # what a SIGKILL leaves: the bytes written
    live.journal.close()

    again = Journal(crashed)
    sink = again.load(stale_after=5.0, now=100.0)[RUN]
    after = sink.header()
    assert after["alerts"] == before["alerts"]
    assert after["collectives_last"] == before["collectives_last"]
    assert after["data_stragglers"] == before["data_stragglers"]
    assert [{k: r[k] for k in ranks_before[0]} for r in sink.ranks()] == ranks_before
    # the GPU rules compare with what they had: the same ECC count raises nothing new
    sink.live = True
    sink.gpu_health(0, gpu(0, ecc=3).sample, 101.0)
    assert sink.header()["alerts"] == before["alerts"]
    sink.gpu_health(0, gpu(0, ecc=4).sample, 102.0)  # a new one does
    ecc = [a for a in sink.header()["alerts"] if a["kind"] == "gpu_ecc"]
    assert ecc == [{"kind": "gpu_ecc", "rank": 0, "at": 102.0, "host": "n0",
                    "message": "4 uncorrected ECC errors on GPU 0"}]
    again.close()


def test_a_journal_without_state_entries_loads_as_it_did(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An upgrade loses nothing: a data dir an earlier version wrote (no STATE entries)
    rebuilds what its frames say, the verdict included."""
    monkeypatch.setattr(statenotes.StateNotes, "note", lambda *a, **k: False)
    live = Live(tmp_path / "d")
    a_run_with_every_kind(live)
    before = {(a["kind"], a["rank"]): a for a in live.sink.header()["alerts"]}
    live.journal.close()
    assert b"XID 79" not in (tmp_path / "d" / "runs" / f"{RUN}.journal").read_bytes()
    monkeypatch.undo()
    again = Journal(tmp_path / "d")
    sink = again.load(stale_after=5.0, now=100.0)[RUN]
    after = {(a["kind"], a["rank"]): a for a in sink.header()["alerts"]}
    for key in (("stalled", 0), ("stalled", 1), ("rank_error", 1)):
        assert after[key] == before[key]
    assert sink.header()["collectives_last"]["groups"][0]["behind"][0]["rank"] == 2
    again.close()


# ------------------------------------------------------------------ when STATE is written


def throttled() -> ResourceSample:
    return ResourceSample(gpus=[GpuSample(device_index=0, name="H100", sm_clock_mhz=900.0,
                                          throttle_reasons=["hw_thermal"])])


def test_a_persisting_condition_costs_an_entry_a_minute_not_a_second() -> None:
    """64 GPUs throttling for an hour, raised again every second: the alert list's times go
    to disk once a minute, a new alert within a second, and the bytes stay bounded."""
    clock = [0.0]
    notes = statenotes.StateNotes(clock=lambda: clock[0])
    sink = RunSink(RUN)
    sink.live = True
    for r in range(64):
        sink.apply(Register(run=RUN, rank=r, world_size=64, host=f"n{r}"), 0.0)
    notes.loaded(sink)  # (as after a load: what the sink holds is on disk)
    buf = bytearray()
    entries = []
    for second in range(3600):
        clock[0] = float(second)
        for r in range(64):
            sink.gpu_health(r, throttled(), float(second))
        before = len(buf)
        notes.note(buf, sink)
        if len(buf) != before:
            entries.append(second)
        if second == 1800:  # something new: written at once
            sink._raise("stalled", 3, "stalled 61s in all_reduce (train.py:3)", 1800.0)
    assert entries[:2] == [1, 61]  # (the first throttle alerts at 1 s: two samples running)
    assert 1801 in entries and len(entries) <= 3600 // 60 + 2
    assert len(buf) < 60 * 64 * 120  # ~60 lists of 64 alerts, not 3,600


def test_a_state_part_that_cannot_be_taken_is_one_warning_and_the_frames_still_count(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    live = Live(tmp_path / "d")
    for r in range(2):
        live.feed(Register(run=RUN, rank=r, world_size=2, host=f"n{r}"), 1.0)
    live.feed(Finish(run=RUN, rank=1, status="error"), 2.0)
    live.journal.close()
    path = tmp_path / "d" / "runs" / f"{RUN}.journal"
    with open(path, "ab") as f:  # well formed entries (good CRCs) holding what no sink takes
        f.write(statenotes.state_entry("alerts", {"alerts": [["stale", 1, "m", 2.0]]}))
        f.write(statenotes.state_entry("figures", [[0, "high"]]))
    again = Journal(tmp_path / "d")
    with caplog.at_level("WARNING"):
        sink = again.load(now=100.0)[RUN]
    assert [(a["kind"], a["rank"]) for a in sink.header()["alerts"]] == [("rank_error", 1)]
    lines = [r.getMessage() for r in caplog.records if "cannot be restored" in r.getMessage()]
    assert len(lines) == 2 and all("\n" not in line for line in lines), lines
    assert not any(r.exc_info for r in caplog.records)
    again.close()
