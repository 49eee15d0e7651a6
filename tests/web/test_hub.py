"""web/hub.py without sockets: the Clone-pattern snapshot, gaps, restarts, replay and resume,
bounded client queues; plus the pure parts of app.py (CSV) and metrics.py."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import gevent.queue
import pytest
from prometheus_client import generate_latest

from broker import feed
from tests.support.spying import spy
from web import sse
from web.app import RANKS_SEQ_HEADER, create_app, history_csv
from web.hub import Hub, parse_position
from web.metrics import make_registry
from web.parking import PARK_S, ParkedStreams
from web.runstate import RunState, Subscriber
from web.stream import COALESCE_BYTES, replay

RUN = "r1"


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def ev(seq: int, kind: str, data: Any, run: str = RUN) -> list[bytes]:
    return feed.encode_event(run, SimpleNamespace(seq=seq, kind=kind, data=data))


def header(status: str = "training", **extra: Any) -> dict[str, Any]:
    h = {"run": RUN, "status": status, "world_size": 2, "total_epochs": 5, "label": None,
         "hash": None, "port": None, "metadata": None, "hardware": "", "has_svg": False,
         "hosts": [], "alerts": [], "started_at": 1.0, "updated_at": 2.0}
    h.update(extra)
    return h


def record(epoch: int, loss: float = 1.0) -> dict[str, Any]:
    return {"epoch": epoch, "total_epochs": 5, "duration_secs": 1.0, "elapsed_secs": 1.0,
            "eta_secs": None, "metrics": {"loss": loss}, "resources": {}, "gpu_metrics": [],
            "missing_ranks": []}


def run_snap(seq: int, records: list[tuple[int, dict[str, Any]]], *, run: str = RUN,
             hdr: dict[str, Any] | None = None, complete: tuple[int, str] | None = None,
             ranks: list[dict[str, Any]] | None = None, svg: str | None = None) -> list[bytes]:
    return feed.encode_run_snapshot({
        "run": run, "seq": seq, "header": hdr or header(), "ranks": ranks or [],
        "records": [[s, r] for s, r in records], "complete": list(complete) if complete else None,
        "svg": svg,
    })


def hb(instance: str = "i1") -> list[bytes]:
    return feed.encode_heartbeat(instance, 0.0, 10, {"schema": 2, "decode": 1}, 1, late_metrics=3)


def ready_hub(records: int = 0, *, queue_size: int = 256, clock: Clock | None = None) -> Hub:
    """A hub that took a full snapshot of one run with ``records`` records (seq 2, 3, ...)."""
    hub = Hub(queue_size=queue_size, clock=clock or Clock())
    assert hub.next_request() == [b"SNAP"]
    recs = [(i + 2, record(i)) for i in range(records)]
    hub.handle_snapshot(run_snap(1 + records, recs))
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 1))
    hub.handle_pub(hb("i1"))
    return hub


def drain(sub: Subscriber) -> list[Any]:
    items = []
    while True:
        try:
            items.append(sub.queue.get_nowait())
        except gevent.queue.Empty:
            return items


def parse(chunks: list[bytes]) -> list[dict[str, str]]:
    """SSE bytes -> [{field: value}] (data lines joined)."""
    out = []
    for block in b"".join(chunks).decode().split("\n\n"):
        if not block:
            continue
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            name, _, value = line.partition(": ")
            fields[name] = fields[name] + "\n" + value if name in fields else value
        out.append(fields)
    return out


# ------------------------------------------------------------------ snapshot / Clone
def test_updates_during_the_first_snapshot_are_buffered_then_applied_above_its_seq() -> None:
    hub = Hub(clock=Clock())
    assert not hub.connected
    assert hub.next_request() == [b"SNAP"]
    assert hub.next_request() is None  # one outstanding at a time
    hub.handle_pub(ev(2, "epoch", record(0)))  # already in the snapshot
    hub.handle_pub(ev(3, "epoch", record(1)))  # after it
    hub.handle_snapshot(run_snap(2, [(2, record(0))]))
    assert RUN not in hub.runs  # nothing applied before END
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 1))
    state = hub.runs[RUN]
    assert state.seq == 3
    assert [s for s, _ in state.records] == [2, 3]
    assert not hub.connected  # no heartbeat yet
    hub.handle_pub(hb("i1"))
    assert hub.connected


def test_an_evicted_event_drops_the_run_and_parks_its_streams_until_it_comes_back() -> None:
    """Issue 19 finding 5: the broker's ``evicted`` event (``--max-runs``) makes every web
    drop the run (its records and steps freed); a later frame of the run brings it back
    through a snapshot. Its open streams are parked meanwhile, not ended: a live run evicted
    by a flood of new runs resumes on the same connection with exactly what it missed."""
    hub = ready_hub(records=2)  # seq 2, 3
    got = hub.subscribe(RUN, 0)
    assert got is not None
    sub = got[0]
    hub.handle_pub(ev(4, "epoch", record(2)))
    assert [i for i, _ in drain(sub)] == [4]
    hub.handle_pub(ev(5, "evicted", {"run": RUN}))
    assert RUN not in hub.runs
    assert not sub.closed and drain(sub) == []  # parked: open, nothing sent
    assert hub.client_count == 0
    hub.handle_pub(ev(7, "run", header()))  # the run is back: a gap, healed by its snapshot
    assert RUN not in hub.runs
    assert hub.next_request() == [b"SNAP", RUN.encode()]
    recs = [(2, record(0)), (3, record(1)), (4, record(2)), (6, record(3))]
    hub.handle_snapshot(run_snap(7, recs, hdr=header(hardware="new")))
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 1))
    assert hub.runs[RUN].subscribers == {sub} and hub.client_count == 1
    events = parse([data for _, data in drain(sub)])
    assert [(e["event"], e["id"]) for e in events] == [("epoch", "6"), ("run", "7")]
    hub.handle_pub(ev(8, "epoch", record(4)))
    assert [i for i, _ in drain(sub)] == [8]  # and live again


def test_parked_streams_are_bounded_in_number_oldest_ending_first() -> None:
    """Past ``max_runs`` parked runs the oldest one's streams end at once, whatever its age;
    the rest stay open until their time is up."""
    parked = ParkedStreams(park_s=30.0, max_runs=2)
    subs = {}
    for i, run in enumerate(["a", "b", "c"]):
        state = RunState(run)
        subs[run] = Subscriber(run, 8)
        state.subscribers.add(subs[run])
        parked.park(state, 100.0 + i)
    assert len(parked) == 2 and subs["a"].closed
    assert not subs["b"].closed and not subs["c"].closed
    assert parked.take("a") is None
    parked.expire(131.5)  # b parked at 101: past 30 s; c at 102: not yet
    assert subs["b"].closed and not subs["c"].closed
    back = parked.take("c")
    assert back is not None and back.subscribers == {subs["c"]} and not parked


def test_parked_streams_end_when_the_run_does_not_come_back() -> None:
    clock = Clock()
    hub = ready_hub(records=1, clock=clock)
    gone = hub.subscribe(RUN, 0)[0]  # type: ignore[index]
    stays = hub.subscribe(RUN, 0)[0]  # type: ignore[index]
    hub.handle_pub(ev(3, "evicted", {"run": RUN}))
    hub.unsubscribe(gone)  # a client that goes away while parked is forgotten
    clock.now += PARK_S - 1
    hub.take_socket_reset()
    assert not stays.closed
    clock.now += 2
    hub.take_socket_reset()
    assert stays.closed and drain(stays) == [None]  # the close sentinel: its stream ends
    hub.handle_pub(ev(5, "run", header()))
    hub.next_request()
    hub.handle_snapshot(run_snap(5, [(2, record(0))]))
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 1))
    assert hub.runs[RUN].subscribers == set()


def test_connected_needs_fresh_heartbeats_of_the_snapshot_instance() -> None:
    clock = Clock()
    hub = ready_hub(clock=clock)
    assert hub.connected
    clock.now += 3.5
    assert not hub.connected
    hub.handle_pub(hb("i1"))
    assert hub.connected


def test_a_gap_buffers_the_run_and_asks_its_snapshot() -> None:
    hub = ready_hub(1)  # seq 2 = epoch 0
    got = hub.subscribe(RUN, 0)
    assert got is not None
    sub = got[0]
    hub.handle_pub(ev(3, "epoch", record(1)))
    hub.handle_pub(ev(5, "epoch", record(3)))  # seq 4 lost
    assert hub.gaps == 1
    assert hub.next_request() == [b"SNAP", RUN.encode()]
    hub.handle_pub(ev(6, "ranks", [{"rank": 0, "loss": 0.5}]))
    assert hub.runs[RUN].seq == 3  # buffered
    hub.handle_snapshot(run_snap(5, [(2, record(0)), (3, record(1)), (4, record(2)),
                                     (5, record(3))]))
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 1))
    state = hub.runs[RUN]
    assert state.seq == 6
    assert [s for s, _ in state.records] == [2, 3, 4, 5]
    assert state.ranks == [{"rank": 0}]
    ids = [seq for seq, _ in drain(sub)]
    assert ids == [3, 4, 5, 6]  # the client got exactly what it missed, in order


def test_the_snapshot_answer_says_which_ranks_it_holds() -> None:
    """``GET /api/runs/<run>`` names the sequence number its ranks are as of: the ranks
    event's, or the broker snapshot's; the page orders it against its stream's events."""
    hub = ready_hub(1)  # run snapshot at seq 2
    client = create_app(hub).test_client()
    first = client.get(f"/api/runs/{RUN}", headers={"Host": "localhost"})
    assert first.headers[RANKS_SEQ_HEADER] == "2"
    hub.handle_pub(ev(3, "ranks", [{"rank": 0, "status": "ok"}]))
    hub.handle_pub(ev(4, "epoch", record(1)))
    answer = client.get(f"/api/runs/{RUN}", headers={"Host": "localhost"})
    assert answer.headers[RANKS_SEQ_HEADER] == "3"  # the ranks' own, not the run's 4
    assert answer.get_json()["ranks"] == [{"rank": 0, "status": "ok"}]


def test_a_run_unknown_to_the_broker_is_not_asked_forever() -> None:
    hub = ready_hub()
    hub.handle_pub(ev(7, "run", header(), run="new"))  # first event seen mid-way
    assert hub.next_request() == [b"SNAP", b"new"]
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 0))
    assert hub.runs["new"].seq == 7
    assert hub.next_request() is None


def test_broker_restart_takes_a_fresh_snapshot_and_forgets_gone_runs() -> None:
    hub = ready_hub(2)
    hub.handle_pub(ev(1, "run", header(), run="other"))
    sub = hub.subscribe("other", 0)[0]  # type: ignore[index]
    hub.handle_pub(hb("i2"))
    assert hub.take_socket_reset()
    assert hub.next_request() == [b"SNAP"]
    assert not hub.connected
    hub.handle_snapshot(run_snap(1000, [(2, record(0)), (3, record(1))]))
    hub.handle_snapshot(feed.encode_snapshot_end("i2", 1))
    assert hub.instance == "i2" and hub.connected
    assert "other" not in hub.runs
    assert drain(sub) == [None]  # its stream is ended


def test_an_unanswered_snapshot_is_asked_again_on_a_new_socket() -> None:
    clock = Clock()
    hub = Hub(clock=clock)
    assert hub.next_request() == [b"SNAP"]
    assert not hub.take_socket_reset()
    clock.now += 6
    assert hub.take_socket_reset()
    assert hub.next_request() == [b"SNAP"]


def test_malformed_feed_messages_are_skipped() -> None:
    hub = ready_hub(1)
    hub.handle_pub([b"r:" + RUN.encode(), b"\xc1"])
    hub.handle_pub([b"only one part"])
    hub.handle_pub([b"!future", b"x"])
    hub.handle_snapshot([b"WHAT", b"x"])
    assert hub.runs[RUN].seq == 2


def test_port_topic_reaches_listeners() -> None:
    hub = ready_hub()
    seen: list[tuple[str, int, int]] = []
    hub.port_listeners.append(lambda *a: seen.append(a))
    hub.handle_pub(feed.encode_port(RUN, 3, 8686))
    assert seen == [(RUN, 3, 8686)]


def test_svg_is_fetched_with_a_run_snapshot() -> None:
    hub = ready_hub()
    hub.handle_pub(ev(2, "run", header(has_svg=True)))
    assert hub.runs[RUN].svg is None
    assert hub.next_request() == [b"SNAP", RUN.encode()]
    hub.handle_snapshot(run_snap(2, [], hdr=header(has_svg=True), svg="<svg/>"))
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 1))
    assert hub.runs[RUN].svg == "<svg/>"


# ------------------------------------------------------------------ replay / resume
def test_subscribe_replays_records_after_the_position_then_complete() -> None:
    hub = ready_hub(3)  # records at seq 2, 3, 4
    hub.handle_pub(ev(5, "run", header("complete")))
    hub.handle_pub(ev(6, "complete", {"status": "complete"}))
    sub, chunks, last = hub.subscribe(RUN, 0)  # type: ignore[misc]
    assert chunks[0] == b"retry: 2000\n\n"
    events = parse(chunks[1:])
    assert [(e["id"], e["event"]) for e in events] == [
        ("0", "run"), ("2", "epoch"), ("3", "epoch"), ("4", "epoch"), ("6", "complete")]
    assert json.loads(events[0]["data"])["status"] == "complete"
    assert json.loads(events[-1]["data"]) == {"status": "complete"}
    assert last == 6

    _, chunks, last = hub.subscribe(RUN, 3)  # type: ignore[misc]
    assert [(e["id"], e["event"]) for e in parse(chunks[1:])] == [
        ("3", "run"), ("4", "epoch"), ("6", "complete")]
    _, chunks, last = hub.subscribe(RUN, 6)  # type: ignore[misc]
    assert [(e["id"], e["event"]) for e in parse(chunks[1:])] == [("6", "run")]
    assert last == 6


def test_a_position_ahead_of_the_run_counts_as_zero() -> None:
    hub = ready_hub(2)
    _, chunks, _ = hub.subscribe(RUN, 99)  # type: ignore[misc]
    assert [(e["id"], e["event"]) for e in parse(chunks[1:])] == [
        ("0", "run"), ("2", "epoch"), ("3", "epoch")]


def test_replays_share_the_encoded_bytes_and_the_header_follows_changes() -> None:
    hub = ready_hub(2)
    _, a, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
    _, b, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
    assert len(a) == len(b) == 4 and all(x is y for x, y in zip(a, b))
    _, c, _ = hub.subscribe(RUN, 3)  # type: ignore[misc]
    assert [(e["id"], e["event"]) for e in parse(c[1:2])] == [("3", "run")]
    hub.handle_pub(ev(4, "run", header("complete", label="changed")))
    _, d, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
    (run_event,) = parse(d[1:2])
    assert run_event["id"] == "0" and json.loads(run_event["data"])["label"] == "changed"
    assert json.loads(run_event["data"])["status"] == "complete"


def test_replay_writes_big_chunks_uncopied_and_joins_small_ones() -> None:
    big1, big2 = b"A" * COALESCE_BYTES, b"B" * (3 * COALESCE_BYTES)
    small = [b"retry: 2000\n\n", b"x" * 100, b"y" * 200]
    chunks = [small[0], small[1], big1, small[2], big2, b"z" * 10]
    expected = b"".join(chunks)
    writes = list(replay(list(chunks)))
    assert b"".join(writes) == expected
    assert writes[1] is big1 and writes[3] is big2  # shared bytes, not per-client copies
    assert len(writes) == 5  # the two leading small chunks went out as one write
    many = [b"s" * 100] * 100  # 10 KB of small chunks: a few writes, each bounded
    writes = list(replay(list(many)))
    assert b"".join(writes) == b"".join(many)
    assert 2 <= len(writes) <= 4 and all(len(w) < 2 * COALESCE_BYTES for w in writes)
    source = list(chunks)
    list(replay(source))
    assert source == []  # the stream keeps nothing of the replay once written


def test_unknown_run_cannot_be_subscribed() -> None:
    assert ready_hub().subscribe("nope", 0) is None


def test_parse_position() -> None:
    assert parse_position(["12"]) == 12
    assert parse_position([" 7 "]) == 7
    for bad in ("abc", "-1", "1e3", "", "١٢", "9" * 40):
        assert parse_position([bad]) == 0, bad
    assert parse_position([None]) == 0
    assert parse_position([None, "5"]) == 5


def test_live_events_are_encoded_once_and_shared() -> None:
    hub = ready_hub(1)
    a = hub.subscribe(RUN, 0)[0]  # type: ignore[index]
    b = hub.subscribe(RUN, 0)[0]  # type: ignore[index]
    hub.handle_pub(ev(3, "epoch", record(1, float("nan"))))
    (sa, da), = drain(a)
    (sb, db), = drain(b)
    assert sa == sb == 3 and da is db
    assert da == sse.json_event("epoch", 3, record(1, float("nan")))
    assert b'"loss":null' in da


def test_ranks_loss_is_stripped_from_public_output_but_kept_for_metrics() -> None:
    hub = ready_hub()
    sub = hub.subscribe(RUN, 0)[0]  # type: ignore[index]
    ranks = [{"rank": 0, "host": "h", "local_rank": 0, "status": "ok", "last_seen": 999.0,
              "epoch": 1, "hardware": None, "resources": {"cpu_percent": 12.5}, "loss": 0.25}]
    hub.handle_pub(ev(2, "ranks", ranks))
    state = hub.runs[RUN]
    assert "loss" not in state.ranks[0] and state.ranks_full[0]["loss"] == 0.25
    (_, data), = drain(sub)
    assert b"loss" not in data
    text = generate_latest(make_registry(hub)).decode()
    assert 'rankboard_rank_loss{host="h",rank="0",run="r1"} 0.25' in text
    assert 'rankboard_rank_cpu_percent{host="h",rank="0",run="r1"} 12.5' in text
    assert 'rankboard_frames_rejected_total{reason="schema"} 2.0' in text
    assert "rankboard_frames_accepted_total 10.0" in text
    assert "rankboard_web_connected 1.0" in text
    assert "rankboard_sse_clients 1.0" in text


def test_a_full_queue_drops_that_client_only() -> None:
    hub = ready_hub(queue_size=2)
    slow = hub.subscribe(RUN, 0)[0]  # type: ignore[index]
    fast = hub.subscribe(RUN, 0)[0]  # type: ignore[index]
    got = []
    for seq in range(2, 8):
        hub.handle_pub(ev(seq, "epoch", record(seq)))
        got.extend(s for s, _ in drain(fast))
    assert got == [2, 3, 4, 5, 6, 7]
    assert slow.dropped and not fast.dropped
    assert drain(slow) == [None]
    assert hub.clients_dropped == 1
    assert hub.runs[RUN].subscribers == {fast}


def test_reopened_run_forgets_its_completion() -> None:
    hub = ready_hub(1)
    hub.handle_pub(ev(3, "complete", {"status": "failed"}))
    assert hub.runs[RUN].complete == (3, "failed")
    hub.handle_pub(ev(4, "run", header("training")))
    assert hub.runs[RUN].complete is None


# ------------------------------------------------------------------------------ CSV
def test_history_csv_columns_and_empty_cells() -> None:
    records = [
        {"epoch": 0, "duration_secs": 1.5, "metrics": {"loss": 2.0, "b": 1.0},
         "resources": {"cpu_percent": 50.0, "ram_used_bytes": 10, "gpu_util_percent": None}},
        {"epoch": 1, "duration_secs": float("inf"), "metrics": {"loss": float("nan"), "a": 3}},
    ]
    assert history_csv(records) == (
        "epoch,duration_secs,loss,a,b,cpu_percent,ram_used_bytes,ram_total_bytes,"
        "gpu_util_percent,vram_allocated_bytes,vram_total_bytes\r\n"
        "0,1.5,2.0,,1.0,50.0,10,,,,\r\n"
        "1,,,3,,,,,,,\r\n"
    )
    assert history_csv([]).startswith("epoch,duration_secs,cpu_percent,")


def test_events_of_a_run_without_subscribers_are_not_encoded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19 soak: the web JSON-encoded every event for SSE even with nobody to send it
    to (a flood of 1 MiB metadata headers: milliseconds each on the web's one thread). Now
    nothing is encoded until a client subscribes; a replay then encodes what it needs."""
    hub = ready_hub(records=1)
    calls = spy(monkeypatch, sse, "json_event")
    hub.handle_pub(ev(3, "run", header(metadata={"v": list(range(1000))})))
    hub.handle_pub(ev(4, "ranks", [{"rank": 0, "status": "ok"}]))
    hub.handle_pub(ev(5, "epoch", record(1)))
    hub.handle_pub(ev(6, "complete", {"status": "complete"}))
    assert [kind for kind, _, _ in calls] == []
    got = hub.subscribe(RUN, 0)
    assert got is not None
    assert [e["event"] for e in parse(got[1][1:])] == ["run", "epoch", "epoch", "complete"]
    hub.handle_pub(ev(7, "run", header(status="training")))
    assert [e["id"] for e in parse([d for _, d in drain(got[0])])] == ["7"]
