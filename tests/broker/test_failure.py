"""The first failure (PROTOCOL 8.2) in the broker's sink: ranks ``error``, the header's
``failure`` (first by ``at`` not by arrival, a silent rank that stopped earlier becoming
first once stale, groups by type, bounds), the ``rank_error`` message, and the pure
:mod:`broker.run.failure` helpers (the attempts' ``cause``, the error byte budget). Frames go
through the real schema (encoded and decoded), the sink gets explicit times."""
from __future__ import annotations

import json
from typing import Any

from broker.run.failure import (
    MAX_GROUPS,
    MAX_LISTED_RANKS,
    ErrorStore,
    cause,
    failure,
)
from broker.run.rankstate import RankState
from broker.run.sink import RunSink
from rank_agent import protocol
from rank_agent.protocol import ErrorInfo, StackFrame
from tests.support.sinkframes import RUN, fin, reg, wire


def err(rank: int, tp: str = "RuntimeError", message: str = "boom", at: float = 1.0,
        frames: int = 0) -> protocol.Finish:
    info = ErrorInfo(type=tp, message=message, at=at,
                     frames=[StackFrame(file="train.py", line=i + 1, function=f"f{i}",
                                        code=f"line {i}") for i in range(frames)])
    return wire(protocol.Finish(run=RUN, rank=rank, status="error", error=info))


def sink_of(n: int, hosts: str = "ab") -> RunSink:
    sink = RunSink(RUN, stale_after=30.0)
    for r in range(n):
        sink.apply(reg(r, n, host=f"node-{hosts[r % len(hosts)]}"), 0.0)
    return sink


def test_first_is_the_earliest_error_by_at_not_by_arrival() -> None:
    sink = sink_of(4)
    sink.apply(err(2, "DistBackendError", "peer gone", at=105.0), 110.0)  # arrives first
    sink.apply(err(1, "torch.OutOfMemoryError", "CUDA out of memory\nTried 2 GiB", at=100.0,
                   frames=3), 120.0)
    f = sink.header()["failure"]
    assert f["first"] == {
        "rank": 1, "host": "node-b", "kind": "error", "at": 100.0,
        "type": "torch.OutOfMemoryError", "message": "CUDA out of memory\nTried 2 GiB",
        "frames": [{"file": "train.py", "line": i + 1, "function": f"f{i}", "code": f"line {i}"}
                   for i in range(3)],
    }
    assert f["groups"] == [
        {"type": "torch.OutOfMemoryError", "message": "CUDA out of memory\nTried 2 GiB",
         "ranks": [1], "count": 1, "first_at": 100.0},
        {"type": "DistBackendError", "message": "peer gone", "ranks": [2], "count": 1,
         "first_at": 105.0},
    ]
    assert f["groups_more"] == 0 and f["silent"] == {"ranks": [], "count": 0}


def test_no_failure_while_ranks_train_or_all_finish_ok() -> None:
    sink = sink_of(2)
    assert sink.header()["failure"] is None
    sink.apply(fin(0), 1.0)
    assert sink.header()["failure"] is None
    sink.apply(fin(1), 2.0)
    assert sink.header()["failure"] is None and sink.status == "complete"


def test_an_at_in_the_future_or_not_finite_counts_as_the_arrival() -> None:
    sink = sink_of(3)
    sink.apply(err(0, at=500.0), 50.0)  # a clock ahead: failed no later than it said so
    sink.apply(err(1, at=float("nan")), 60.0)
    sink.apply(err(2, at=float("-inf")), 70.0)
    f = sink.header()["failure"]
    assert [(g["ranks"], g["first_at"]) for g in f["groups"]] == [([0, 1, 2], 50.0)]
    assert f["first"]["rank"] == 0 and f["first"]["at"] == 50.0
    assert [r["error"] for r in sink.ranks()] == [
        {"type": "RuntimeError", "at": 50.0}, {"type": "RuntimeError", "at": 60.0},
        {"type": "RuntimeError", "at": 70.0}]
    json.dumps(sink.header(), allow_nan=False)  # nothing non-finite reaches the JSON


def test_an_error_on_an_ok_finish_is_ignored() -> None:
    sink = sink_of(1)
    frame = wire(protocol.Finish(run=RUN, rank=0, status="ok",
                                 error=ErrorInfo(type="X", message="m", at=1.0)))
    sink.apply(frame, 2.0)
    assert sink.status == "complete" and sink.header()["failure"] is None
    assert sink.ranks()[0]["error"] is None
    assert [a["kind"] for a in sink.header()["alerts"]] == []


def test_a_finish_error_without_errorinfo_is_a_group_of_empty_type_at_its_arrival() -> None:
    sink = sink_of(2)
    sink.apply(fin(1, "error"), 7.0)
    f = sink.header()["failure"]
    assert f["first"] == {"rank": 1, "host": "node-b", "kind": "error", "at": 7.0, "type": "",
                          "message": "", "frames": []}
    assert f["groups"] == [{"type": "", "message": "", "ranks": [1], "count": 1, "first_at": 7.0}]
    assert sink.ranks()[1]["error"] is None  # no ErrorInfo sent
    (alert,) = sink.header()["alerts"]
    assert alert["message"] == "rank 1 finished with error"  # as before


def test_a_silent_rank_that_stopped_earlier_becomes_first_once_stale() -> None:
    sink = sink_of(3)
    sink.apply(wire(protocol.Resources(run=RUN, rank=0, sample=protocol.ResourceSample())), 10.0)
    sink.apply(wire(protocol.Resources(run=RUN, rank=2, sample=protocol.ResourceSample())), 10.0)
    # rank 1 was last heard at 0.0: killed by the kernel; the others fail in the collective
    sink.apply(err(0, "DistBackendError", "recv from rank 1 failed", at=20.0), 21.0)
    sink.tick(25.0)
    f = sink.header()["failure"]
    assert f["first"]["rank"] == 0 and f["first"]["kind"] == "error"  # 1 not stale yet
    events = sink.tick(31.0)  # rank 1 stale (silent since 0.0); rank 2 still alive
    assert any(e.kind == "run" for e in events)  # the header went out with the new truth
    f = sink.header()["failure"]
    assert f["first"] == {"rank": 1, "host": "node-b", "kind": "silent", "at": 0.0, "type": "",
                          "message": "", "frames": []}
    assert f["silent"] == {"ranks": [1], "count": 1}
    assert [g["ranks"] for g in f["groups"]] == [[0]]


def test_a_job_gone_silent_fails_once_every_rank_is_finished_or_stale() -> None:
    sink = sink_of(3)
    sink.apply(fin(0), 5.0)
    sink.tick(31.0)  # ranks 1 and 2 stale, 0 finished ok: the job is gone
    f = sink.header()["failure"]
    assert f["first"]["rank"] == 1 and f["first"]["kind"] == "silent"
    assert f["groups"] == [] and f["silent"] == {"ranks": [1, 2], "count": 2}
    sink.apply(wire(protocol.Resources(run=RUN, rank=1, sample=protocol.ResourceSample())), 32.0)
    assert sink.header()["failure"] is None  # rank 1 is back: not gone after all


def test_ties_go_to_the_lowest_rank_and_groups_order_by_first_at_then_type() -> None:
    sink = sink_of(6)
    sink.apply(err(5, "B", at=3.0), 9.0)
    sink.apply(err(4, "A", at=3.0), 9.0)
    sink.apply(err(3, "C", "c3", at=1.0), 9.0)
    sink.apply(err(2, "C", "c2", at=1.0), 9.0)
    f = sink.header()["failure"]
    assert f["first"]["rank"] == 2 and f["first"]["message"] == "c2"
    assert [(g["type"], g["ranks"], g["message"]) for g in f["groups"]] == [
        ("C", [2, 3], "c2"), ("A", [4], "boom"), ("B", [5], "boom")]


def test_the_rank_error_alert_names_the_type_and_first_line() -> None:
    sink = sink_of(3)
    sink.apply(err(0, "torch.OutOfMemoryError", "CUDA out of memory. Tried 20 GiB\nmore"), 1.0)
    sink.apply(err(1, "__main__.E", "\n second line only"), 1.0)
    sink.apply(err(2, "X", "y" * 300), 1.0)
    msgs = [a["message"] for a in sink.header()["alerts"]]
    assert msgs == ["failed: torch.OutOfMemoryError: CUDA out of memory. Tried 20 GiB",
                    "failed: __main__.E", "failed: X: " + "y" * 200]


def test_the_webhook_of_a_rank_error_says_the_type_and_first_line() -> None:
    sink = sink_of(1)
    sink.live = True
    told: list[Any] = []
    sink.on_alert = lambda *a: told.append(a)
    sink.apply(err(0, "ValueError", "bad batch 3\ntraceback..."), 2.0)
    assert told == [(RUN, "rank_error", 0, "failed: ValueError: bad batch 3", "node-a", 2.0)]


def test_the_webhook_post_of_a_rank_error_carries_that_message() -> None:
    from broker.webhooks.notifier import AlertGrouper

    sink = sink_of(2)
    sink.live = True
    grouper = AlertGrouper(window=5.0)
    sink.on_alert = lambda run, kind, rank, message, host, now: grouper.alert(
        run, kind, rank, message, now, host=host)
    sink.apply(err(1, "torch.OutOfMemoryError", "CUDA out of memory\nTried 2 GiB"), 10.0)
    (post,) = grouper.due(16.0)
    assert post["message"] == "failed: torch.OutOfMemoryError: CUDA out of memory"
    assert post["text"] == ("[rankboard] run-1: rank_error on rank 1 (node-b): "
                            "failed: torch.OutOfMemoryError: CUDA out of memory")


def test_a_reactivated_rank_leaves_the_failure_and_its_next_finish_decides() -> None:
    sink = sink_of(2)
    sink.apply(err(0, at=1.0), 2.0)
    assert sink.header()["failure"] is not None
    sink.apply(reg(0, 2, host="node-a"), 3.0)  # rank 0 trains again
    assert sink.header()["failure"] is None
    sink.apply(fin(0), 4.0)
    assert sink.ranks()[0]["error"] is None  # its latest finish carried none


def test_groups_and_rank_lists_are_bounded_and_counted() -> None:
    n = 2000
    sink = sink_of(n)
    for r in range(n):
        # 100 types; every rank of type k fails at time k, so order is by type number
        sink.apply(err(r, f"T{r % 100:03d}", at=float(r % 100)), 200.0)
    f = sink.header()["failure"]
    assert len(f["groups"]) == MAX_GROUPS and f["groups_more"] == 100 - MAX_GROUPS
    assert [g["type"] for g in f["groups"]] == [f"T{k:03d}" for k in range(MAX_GROUPS)]
    assert all(g["count"] == 20 for g in f["groups"])
    one = sink_of(n)
    for r in range(n):
        one.apply(err(r, at=5.0), 9.0)
    g = one.header()["failure"]["groups"][0]
    assert g["count"] == n and g["ranks"] == list(range(MAX_LISTED_RANKS))
    silent = sink_of(n)
    silent.tick(31.0)
    s = silent.header()["failure"]["silent"]
    assert s["count"] == n and s["ranks"] == list(range(MAX_LISTED_RANKS))


def test_the_header_of_the_worst_failure_stays_small() -> None:
    """65,536 ranks, 100 types of the longest messages and 64 frames of 512-character
    strings each: the header (the ``failure`` of it) stays within 2 MiB of JSON."""
    n = 65536
    ranks = {}
    long = "m" * protocol.MAX_ERROR_MESSAGE
    store = ErrorStore()
    text = "x" * protocol.MAX_STACK_TEXT
    frames = [StackFrame(file=text, line=1, function=text, code=text)] * 64
    for r in range(n):
        st = RankState(r, 0.0)
        st.status = "error"
        st.error = store.admit(ErrorInfo(type=f"pkg.T{r % 100}" + "t" * 240, message=long,
                                         at=float(r), frames=frames))
        st.error_at = float(r)
        ranks[r] = st
    f = failure(ranks, lambda r: "node")
    assert f is not None and len(f["first"]["frames"]) == 64
    assert len(json.dumps(f)) < 2 * 1024 * 1024
    assert store.bytes <= store.budget + 65536 * 1024 and store.cut > 0  # bounded in bytes


def test_the_error_budget_cuts_late_errors_to_their_first_line() -> None:
    store = ErrorStore(budget=10_000)
    big = ErrorInfo(type="T", message="a" * 4000 + "\nrest", at=1.0,
                    frames=[StackFrame(file="f", line=1, function="g")] * 10)
    kept = [store.admit(big) for _ in range(4)]
    assert kept[0] is big and kept[1] is big
    assert kept[2].message == "a" * 200 and kept[2].frames == [] and kept[2].type == "T"
    assert store.cut == 2
    store.release(kept[0])
    store.release(kept[1])
    assert store.admit(big) is big  # bytes given back are usable again


def test_cause_is_first_without_frames_and_the_first_line() -> None:
    sink = sink_of(2)
    sink.apply(err(1, "E", "line one " + "z" * 300 + "\nline two", at=3.0, frames=2), 4.0)
    c = cause(sink.header()["failure"])
    assert c == {"rank": 1, "host": "node-b", "kind": "error", "at": 3.0, "type": "E",
                 "message": ("line one " + "z" * 300)[:200]}
    assert cause(None) is None


# -- kept by the journal -----------------------------------------------------------------

def test_the_failure_survives_a_restart_and_the_journal_keeps_known_fields_only(
        tmp_path: Any) -> None:
    import msgspec

    from tests.support.journalrun import Server, crash_copy, frame_entries, journal_path, reload

    srv = Server(tmp_path / "d")
    for r in range(3):
        assert srv.send(protocol.Register(run="fr", rank=r, world_size=3, host=f"h{r}"))
    info = {"type": "torch.OutOfMemoryError", "message": "CUDA out of memory\nmore",
            "at": srv.now + 0.25, "frames": [{"file": "t.py", "line": 9, "function": "step",
                                              "code": "loss.backward()", "secret": "s" * 64}],
            "unknown_key": "u" * 64}
    raw = msgspec.msgpack.encode({"type": "finish", "run": "fr", "rank": 1, "status": "error",
                                  "error": info, "also_unknown": 1})
    assert srv.send(protocol.decode(raw))
    assert srv.send(protocol.Finish(run="fr", rank=2, status="error",
                                    error=ErrorInfo(type="DistBackendError", message="gone",
                                                    at=srv.now + 5.0)))
    before = srv.sinks["fr"].snapshot()
    assert before["header"]["failure"]["first"]["rank"] == 1
    data = crash_copy(tmp_path / "d", tmp_path)
    srv.close()
    stored = journal_path(data, "fr").read_bytes()
    assert b"unknown_key" not in stored and b"secret" not in stored
    assert b"also_unknown" not in stored
    finishes = [f for f in frame_entries(journal_path(data, "fr"))
                if isinstance(f, protocol.Finish)]
    assert [f.error.type for f in finishes if f.error] == ["torch.OutOfMemoryError",
                                                           "DistBackendError"]
    j, sinks = reload(data)
    try:
        after = sinks["fr"].snapshot()
        assert after["header"]["failure"] == before["header"]["failure"]
        assert [r["error"] for r in after["ranks"]] == [r["error"] for r in before["ranks"]]
        assert [a["message"] for a in after["header"]["alerts"]] == [
            "failed: torch.OutOfMemoryError: CUDA out of memory", "failed: DistBackendError: gone"]
    finally:
        j.close()


def test_the_sinks_index_agrees_with_the_rule_over_random_histories() -> None:
    """The sink keeps a :class:`~broker.run.failure.FailureIndex` for speed; at every point of
    random histories (finishes with and without errors, ties, reactivations, ranks going
    stale and coming back) it gives what the plain rule :func:`failure` gives."""
    import random

    rng = random.Random(40)
    for trial in range(40):
        n = rng.randint(1, 12)
        sink = sink_of(n)
        now = 1.0
        for _ in range(60):
            now += rng.choice([0.0, 0.5, 3.0, 31.0])
            r = rng.randrange(n)
            op = rng.random()
            if op < 0.35:
                sink.apply(err(r, rng.choice("ABC"), f"m{r}", at=rng.choice([now - 1, 2.0, now + 9])),
                           now)
            elif op < 0.45:
                sink.apply(fin(r, rng.choice(["ok", "error"])), now)
            elif op < 0.55:
                sink.apply(reg(r, n, host="node-a"), now)
            elif op < 0.8:
                sink.apply(wire(protocol.Resources(run=RUN, rank=r,
                                                   sample=protocol.ResourceSample())), now)
            sink.tick(now)
            want = failure(sink._ranks, lambda x, place=sink.topology.place:
                           (place.get(x) or (None,))[0])
            assert sink.failure == want, (trial, now)


def test_an_error_past_its_bounds_is_rejected_counted_logged_and_the_rest_arrives(
        caplog: Any) -> None:
    import logging

    import msgspec

    from broker.runs import Runs

    runs = Runs()
    runs.ingest(protocol.encoder.encode(protocol.Register(run="b", rank=0, world_size=2,
                                                          host="h")), 1.0)
    bad = msgspec.msgpack.encode({"type": "finish", "run": "b", "rank": 0, "status": "error",
                                  "error": {"type": "E", "message": "m" * 5000, "at": 1.0}})
    with caplog.at_level(logging.WARNING, logger="broker.runs"):
        for _ in range(50):
            assert runs.ingest(bad, 2.0) == []
    assert runs.rejected["schema"] == 50
    warned = [r for r in caplog.records if "rejected frame (schema)" in r.getMessage()]
    assert 1 <= len(warned) <= 2 and "\n" not in warned[0].getMessage()  # one line, limited
    assert not any(r.exc_info for r in warned)  # no traceback
    runs.ingest(protocol.encoder.encode(protocol.Finish(
        run="b", rank=1, status="error", error=ErrorInfo(type="E", message="fine", at=1.5))), 3.0)
    sink = runs.get("b")
    assert sink is not None and sink.failure is not None
    assert sink.failure["first"]["rank"] == 1  # the valid one arrived; rank 0 is untouched
    assert [r["status"] for r in sink.ranks()] == ["ok", "error"]


def test_an_attempts_cause_counts_its_unfinished_ranks_as_silent() -> None:
    """8.1: an attempt's ``cause`` is its ``failure.first`` at the moment it ended, its
    unfinished ranks counted as stale (a rank killed by the kernel is silent before the
    launcher restarts the job)."""
    sink = sink_of(3)
    sink.apply(wire(protocol.Resources(run=RUN, rank=2, sample=protocol.ResourceSample())), 8.0)
    sink.apply(err(0, "E", "after the kill", at=9.0), 9.5)
    place = sink.topology.place

    def host(r: int) -> str | None:
        return (place.get(r) or (None,))[0]

    assert cause(failure(sink._ranks, host))["rank"] == 0  # as the header has it now
    ended = failure(sink._ranks, host, unfinished_silent=True)
    assert ended is not None and ended["silent"] == {"ranks": [1, 2], "count": 2}
    assert cause(ended) == {"rank": 1, "host": "node-b", "kind": "silent", "at": 0.0,
                            "type": "", "message": ""}
