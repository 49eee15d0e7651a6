"""The ``stacks`` frame in the broker (PROTOCOL.md sections 2, 2.5, 3): per (rank, reason)
last write, kept compact under a byte cap that is counted when it bites; the ``stalled``
status and alert; ``stacks`` events at most 4 a second; a replay keeps the dumps but not the
status; the journal's bytes for dumps are bounded; the STACKS verb of the snapshot socket."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq

from broker import feed
from broker.journal import journal
from broker.journal.journal import Journal
from broker.run.sink import RunSink
from broker.server import BrokerServer
from broker.stacks.feed import STACKS_INTERVAL
from broker.stacks.store import DUMP_OVERHEAD, RunStacks
from rank_agent.controlwire import ControlRequest, decode_request
from rank_agent.protocol import (
    Metrics,
    Register,
    StackFrame,
    Stacks,
    Steps,
    ThreadStack,
)
from tests.support.brokers import Pusher, RunningBroker
from tests.support.polling import wait_for

RUN = "s1"


def frames(*functions: str, file: str = "train.py") -> list[StackFrame]:
    return [StackFrame(file=file, line=10 + i, function=f, code=f"{f}()")
            for i, f in enumerate(functions)]


def dump(rank: int, *functions: str, reason: str = "stall", idle: float = 61.4,
         request_id: str = "", extra_threads: int = 0, pad: int = 0) -> Stacks:
    threads = [ThreadStack(name="MainThread", main=True, frames=frames(*functions))]
    # each extra thread: ``pad`` frames of about 70 bytes (within every wire limit)
    threads += [ThreadStack(name=f"worker-{rank}-{i}",
                            frames=frames(*[f"wait_{j}_{'y' * 40}" for j in range(pad)]))
                for i in range(extra_threads)]
    return Stacks(run=RUN, rank=rank, reason=reason, request_id=request_id,  # type: ignore[arg-type]
                  taken_at=1000.0 + rank, idle_s=idle, threads=threads)


def registered(ws: int = 4) -> RunSink:
    sink = RunSink(RUN)
    for r in range(ws):
        sink.apply(Register(run=RUN, rank=r, world_size=ws, host=f"n{r // 2}"), 1.0)
    return sink


def statuses(sink: RunSink) -> dict[int, str]:
    return {r["rank"]: r["status"] for r in sink.ranks()}


def test_a_stall_dump_makes_the_rank_stalled_and_raises_the_alert() -> None:
    sink = registered()
    sink.apply(Steps(run=RUN, rank=0, steps=[1], times=[1.0], step_ms=[None]), 2.0)
    sink.apply(dump(0, "main", "train_step", "all_reduce"), 3.0)
    assert statuses(sink)[0] == "stalled" and statuses(sink)[1] == "ok"
    alert = next(a for a in sink.header()["alerts"] if a["kind"] == "stalled")
    assert alert == {"kind": "stalled", "rank": 0, "at": 3.0, "host": "n0",
                     "message": "stalled 61s in all_reduce (train.py:12)"}
    # a request answer does not stall; the next steps or metrics frame ends the stall
    sink.apply(dump(1, "main", reason="request", request_id="q"), 3.0)
    assert statuses(sink)[1] == "ok"
    sink.apply(Steps(run=RUN, rank=0, steps=[2], times=[4.0], step_ms=[None]), 4.0)
    assert statuses(sink)[0] == "ok"
    sink.apply(dump(2, "main", "f"), 5.0)
    sink.apply(Metrics(run=RUN, rank=2, epoch=0, avg_loss=1.0), 6.0)
    assert statuses(sink)[2] == "ok"
    # stale and finished win over stalled
    sink.apply(dump(3, "main", "f"), 7.0)
    sink.tick(7.0 + sink.stale_after + 1)
    assert statuses(sink)[3] == "stale"


def test_dumps_are_last_write_per_rank_and_reason_and_published_4_a_second() -> None:
    sink = registered()
    events = sink.apply(dump(0, "main", "a"), 10.0)
    assert [e.kind for e in events] == ["stacks"]
    assert [d[:3] for d in events[0].data["dumps"]] == [[0, "stall", ""]]
    # within STACKS_INTERVAL: coalesced, the later dump of the same key wins
    assert sink.apply(dump(1, "main", "b"), 10.1) == []
    assert sink.apply(dump(1, "main", "c"), 10.1) == []
    assert sink.apply(dump(1, "main", reason="request", request_id="q"), 10.1) == []
    out = [e for e in sink.tick(10.0 + STACKS_INTERVAL) if e.kind == "stacks"]
    assert len(out) == 1
    got = [(d[0], d[1]) for d in out[0].data["dumps"]]
    assert got == [(1, "request"), (1, "stall")]
    snap = sink.snapshot()["stacks"]
    assert [(d[0], d[1]) for d in snap] == [(0, "stall"), (1, "request"), (1, "stall")]
    kept = sink.stacks.dumps()
    assert kept[2]["threads"][0]["frames"][-1]["function"] == "c"


def test_the_run_cap_bites_counted_and_never_keeps_an_older_dump_as_latest() -> None:
    store = RunStacks(cap=20_000)
    assert store.put(dump(0, "main", "a", extra_threads=2, pad=15))
    used = store.bytes
    # the ranks of a hang share their training thread's blob: cheap
    assert store.put(dump(1, "main", "a"))
    assert store.bytes - used == DUMP_OVERHEAD
    for r in range(2, 40):
        store.put(dump(r, "main", "a", extra_threads=2, pad=15))
    assert store.over_cap > 0 and store.bytes <= store.cap
    # the rank whose new dump did not fit has none (its older one is not shown as latest)
    assert store.put(dump(1, "main", "b", extra_threads=8, pad=45)) is False
    assert (1, "stall") not in store
    # releasing frees the shared blobs exactly
    for r in range(40):
        store.discard(r)
    assert store.bytes == 0 and len(store) == 0


def test_a_stall_dump_over_the_cap_still_stalls_the_rank_and_the_web_hears_it_gone() -> None:
    sink = registered()
    sink.stacks.cap = 1  # nothing fits
    events = sink.apply(dump(0, "main", "a"), 1.0)
    assert statuses(sink)[0] == "stalled"
    assert events[0].data == {"dumps": [], "gone": [[0, "stall"]]}
    assert sink.stacks.over_cap == 1


def test_a_replay_keeps_the_dumps_but_not_the_stalled_status(tmp_path: Path) -> None:
    j = Journal(tmp_path / "d")
    j.load()
    sink = registered()
    for r in range(4):
        j.accept(sink, b"", Register(run=RUN, rank=r, world_size=4, host=f"n{r // 2}"), 1.0)
    frame = dump(2, "main", "all_reduce")
    sink.apply(frame, 2.0)
    j.accept(sink, b"", frame, 2.0)
    j.flush()
    j.close()
    j = Journal(tmp_path / "d")
    try:
        rebuilt = j.load()[RUN]
        assert statuses(rebuilt)[2] == "ok"
        assert [(d["rank"], d["reason"]) for d in rebuilt.stacks.dumps()] == [(2, "stall")]
        # a dump received since the restart makes it stalled again
        rebuilt.apply(dump(2, "main", "all_reduce"), 10.0)
        assert statuses(rebuilt)[2] == "stalled"
    finally:
        j.close()


def test_the_journal_keeps_a_bounded_number_of_dump_bytes(tmp_path: Path,
                                                           monkeypatch: Any) -> None:
    monkeypatch.setattr(journal, "MAX_STACKS_BYTES", 50_000)
    j = Journal(tmp_path / "d")
    j.load()
    sink = registered()
    j.accept(sink, b"", Register(run=RUN, rank=0, world_size=4, host="n0"), 1.0)
    for i in range(200):  # a rank stalling again and again, each dump ~3 KB
        frame = dump(i % 4, "main", "all_reduce", extra_threads=1, pad=45)
        sink.apply(frame, 2.0 + i)
        j.accept(sink, b"", frame, 2.0 + i)
        j.flush()
    size = (tmp_path / "d" / "runs" / f"{RUN}.journal").stat().st_size
    assert size < 50_000 + 10_000
    assert j.counters()["stacks_unjournaled"] > 150
    j.close()
    # the budget survives a restart: what the file holds counts
    j = Journal(tmp_path / "d")
    try:
        rebuilt = j.load()[RUN]
        frame = dump(0, "main", "x", extra_threads=1, pad=45)
        rebuilt.apply(frame, 500.0)
        j.accept(rebuilt, b"", frame, 500.0)
        j.flush()
        assert j.counters()["stacks_unjournaled"] == 1
    finally:
        j.close()


def test_the_snapshot_socket_forwards_a_web_request_to_the_runs_ranks() -> None:
    broker = RunningBroker(BrokerServer("tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                                        "tcp://127.0.0.1:*"))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        for s in (sub, dealer):
            s.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"!ctl:" + RUN.encode() + b"!")
        sub.connect(broker.endpoints["publish"])
        dealer.connect(broker.endpoints["snapshot"])
        pusher = Pusher(broker.endpoints["ingest"])  # the broker forwards only to runs it holds
        pusher.register(RUN, 0, 4)
        wait_for(lambda: broker.server.runs.get(RUN), timeout=10)
        pusher.close()
        # a malformed request is refused (counted), never forwarded
        dealer.send_multipart(feed.encode_stacks_request(
            ControlRequest(run=RUN, request_id="bad", kind="nope")))  # type: ignore[arg-type]

        def forwarded() -> Any:
            dealer.send_multipart(feed.encode_stacks_request(ControlRequest(
                run=RUN, request_id="q1", kind="profile", ranks=[2, 3], hz=50, seconds=1.0)))
            if sub.poll(200):
                return decode_request(sub.recv_multipart())
            return None

        req = wait_for(forwarded, timeout=10)
        assert (req.run, req.request_id, req.kind, req.ranks, req.hz, req.seconds) == (
            RUN, "q1", "profile", [2, 3], 50, 1.0)
        assert broker.server.stacks_gate.refused["malformed"] == 1
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
        broker.stop()
