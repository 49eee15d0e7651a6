"""The hub's ``steps`` events (issue 17): the broker sends the store's wire block of the
closed steps; the web appends it and encodes the contract's ``{"steps": [records]}`` SSE
event from its own store, only for a run that has a subscriber. Without sockets: real
:class:`RunSink` events through the real feed codec into a :class:`Hub`."""
from __future__ import annotations

import logging
import math
from typing import Any

import msgspec
import numpy as np
import pytest

from broker import feed
from broker.run.sink import Event, RunSink
from broker.run.steps.store import StepStore, wire_records
from rank_agent.protocol import Finish, Register, Steps
from tests.support.spying import spy
from tests.support.steprecords import close_frames
from tests.web.test_hub import RUN, drain, ev, parse, ready_hub
from web import hub as hub_mod
from web import sse

NAN, INF = math.nan, math.inf


def steps_data(records: list[dict[str, Any]], base: int = 0) -> dict[str, Any]:
    """A ``steps`` event's data (a wire block) holding ``records``, numbered from row
    ``base``."""
    store = StepStore()
    store.append(records)
    block = store.to_wire()
    if base:
        block["base"] = base
        for parts in [block["step_ms"], *block["metrics"].values()]:
            parts[0] = (np.frombuffer(parts[0], np.uint32) + base).astype("<u4").tobytes()
    return block


def frames() -> list[Steps]:
    """Two ranks, awkward values: NaN and infinite metrics, None step times and metric
    values, a metric only some steps have, a rank without samples/tokens."""
    f0 = Steps(run=RUN, rank=0, steps=[0, 1, 2, 3, 4], times=[1.0, 2.0, 3.0, 4.0, 5.5],
               step_ms=[10.0, None, 12.5, INF, 1e-320], samples=[32, 32, 0, 32, 32],
               tokens=[4096, 0, 0, 1, 2**40],
               metrics={"loss": [1.0, NAN, 0.5, 0.25, 1 / 3],
                        "lr": [1e-3, None, None, 2e-3, None],
                        "gn": [INF, -INF, 1.0, 2.0, 3.0]})
    f1 = Steps(run=RUN, rank=1, steps=[0, 1, 2, 3, 4], times=[1.5, 2.5, 3.5, 4.5, 5.0],
               step_ms=[11.0, None, 12.5, 9.0, None],
               metrics={"loss": [2.0, 0.1, 0.7, 0.2, 0.1], "acc": [0.5, None, 0.6, 0.7, 0.8],
                        "gn": [-INF, 1.0, 2.0, 3.0, 4.0]})
    return [f0, f1]


def sink_events(*, finish: bool = True, seq: int = 1) -> tuple[RunSink, list[Event]]:
    """A real sink fed :func:`frames` (world size 2); every event it emitted (numbered
    after ``seq``: the hub of :func:`ready_hub` holds the run at seq 1)."""
    sink = RunSink(RUN)
    sink.seq = seq
    out: list[Event] = []
    for r in range(2):
        out += sink.apply(Register(run=RUN, rank=r, world_size=2, host="h"), 0.5)
    for f in frames():
        out += sink.apply(f, 0.6)
    if finish:
        for r in range(2):
            out += sink.apply(Finish(run=RUN, rank=r), 0.7)
    return sink, out


def on_the_wire(events: list[Event]) -> list[list[bytes]]:
    return [feed.encode_event(RUN, e) for e in events]


def old_records() -> list[dict[str, Any]]:
    """The records the broker used to put in the event (``ClosedSteps.records``), as the
    web received them (through MessagePack)."""
    batch = close_frames(frames())
    assert batch is not None
    return msgspec.msgpack.decode(msgspec.msgpack.encode(batch.records()))


def subscribed_hub() -> tuple[hub_mod.Hub, Any]:
    hub = ready_hub(0)
    got = hub.subscribe(RUN, 0)
    assert got is not None
    return hub, got[0]


def steps_items(sub: Any) -> list[tuple[int, bytes]]:
    return [item for item in drain(sub) if item is not None and b"event: steps" in item[1]]


def live_steps(items: list[tuple[int, bytes]]) -> list[list[dict[str, Any]]]:
    """The records of each ``steps`` event in ``items``."""
    return [msgspec.json.decode(e["data"])["steps"] for e in parse([d for _, d in items])
            if e.get("event") == "steps"]


# ------------------------------------------------------------------- SSE equals the records


def test_the_sse_steps_event_is_byte_identical_to_one_of_the_old_records() -> None:
    _, events = sink_events()
    steps = [e for e in events if e.kind == "steps"]
    assert len(steps) == 1 and "steps" not in steps[0].data  # a block, not records
    hub, sub = subscribed_hub()
    for parts in on_the_wire(events):
        hub.handle_pub(parts)
    (item,) = steps_items(sub)
    # (v5, 8.1: each record carries the attempt that closed it)
    assert item == (steps[0].seq, sse.json_event(
        "steps", steps[0].seq, {"steps": [dict(r, attempt=0) for r in old_records()]}))


def test_wire_records_are_the_old_records() -> None:
    _, events = sink_events()
    (block,) = [e.data for e in events if e.kind == "steps"]
    got = wire_records(msgspec.msgpack.decode(msgspec.msgpack.encode(block)))
    assert msgspec.json.encode(got) == msgspec.json.encode(old_records())


def test_several_steps_events_each_carry_only_their_rows() -> None:
    """Events at STEPS_INTERVAL: each block holds the rows since the previous one, with
    absolute row numbers; the web's store ends up equal to the broker's."""
    sink = RunSink(RUN)
    sink.seq = 1  # after ready_hub's snapshot
    hub, sub = subscribed_hub()
    for parts in on_the_wire(sink.apply(Register(run=RUN, rank=0, world_size=1, host="h"), 0.0)):
        hub.handle_pub(parts)
    now, steps_seen = 1.0, []
    for k in range(6):
        events = sink.apply(Steps(run=RUN, rank=0, steps=[2 * k, 2 * k + 1],
                                  times=[now, now], step_ms=[1.0, 2.0],
                                  metrics={"loss": [k, k]} if k % 2 else {"m": [1.0, 2.0]}),
                            now)
        events += sink.tick(now + 0.3)
        for e in events:
            if e.kind == "steps":
                steps_seen.append(e.data["rows"])
                assert wire_records(e.data)[0]["step"] == e.data["base"]  # one step a row
        for parts in on_the_wire(events):
            hub.handle_pub(parts)
        now += 1.0
    assert steps_seen == [2] * 6
    live = [r["step"] for recs in live_steps(steps_items(sub)) for r in recs]
    assert live == list(range(12))
    web = hub.runs[RUN].steps
    assert msgspec.msgpack.encode(web.to_wire()) == msgspec.msgpack.encode(sink.steps.to_wire())


# ------------------------------------------------------------------- no subscriber: no JSON


class Counting:
    """Counts :func:`sse.json_event` calls by kind (the hub's only JSON for events)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._events = spy(monkeypatch, hub_mod.sse, "json_event")
        self._records = spy(monkeypatch, StepStore, "records")

    @property
    def kinds(self) -> list[str]:
        return [args[0] for args in self._events]

    @property
    def records(self) -> int:
        return len(self._records)


def test_a_run_without_subscribers_encodes_no_steps_json(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, events = sink_events()
    hub = ready_hub(0)
    count = Counting(monkeypatch)
    for parts in on_the_wire(events):
        hub.handle_pub(parts)
    assert "steps" not in count.kinds and count.records == 0
    store = hub.runs[RUN].steps
    assert store.rows == 5 and store.last_step == 4  # stored all the same (/steps serves them)
    assert [b[0] for b in store.series("loss", None, None, 10)] == [0, 1, 2, 3, 4]


def test_a_subscriber_gets_the_steps_event_encoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _, events = sink_events()
    hub, sub = subscribed_hub()
    other = hub.subscribe(RUN, 0)
    assert other is not None
    count = Counting(monkeypatch)
    for parts in on_the_wire(events):
        hub.handle_pub(parts)
    assert count.kinds.count("steps") == 1 and count.records == 1
    assert steps_items(sub) == steps_items(other[0])


# ------------------------------------------------------------------- malformed: skipped


def good_block(first: int = 0, n: int = 3) -> dict[str, Any]:
    return steps_data([{"step": first + i, "time": 1.0, "n": 1, "metrics": {"loss": [1.0, 1.0, 1.0]},
                        "step_ms": [5.0, 5.0, 5.0], "slowest_rank": 0, "samples": 1,
                        "tokens": 1, "samples_per_s": 200.0, "tokens_per_s": 200.0}
                       for i in range(n)])


def broken(what: str) -> Any:
    block = good_block(10)
    if what == "not a dict":
        return [1, 2]
    if what == "no metrics":
        del block["metrics"]
    elif what == "short column":
        block["time"] = block["time"][:8]
    elif what == "odd bytes":
        block["n"] = b"\x00" * 5
    elif what == "rows past the block":
        block["rows"] = 2
        for name in ("step", "time", "n", "slowest", "samples", "tokens"):
            block[name] = block[name][: len(block[name]) * 2 // 3]
    elif what == "overlap":
        return good_block(2)  # steps 2..4, the store has 0..2
    elif what == "descending":
        store = StepStore()
        store.append([{"step": s, "time": 1.0, "n": 1, "metrics": {}, "step_ms": None,
                       "slowest_rank": None, "samples": 0, "tokens": 0} for s in (20, 30)])
        block = store.to_wire()
        block["step"] = block["step"][8:] + block["step"][:8]
    elif what == "string rows":
        block["rows"] = "x"
    return block


@pytest.mark.parametrize("what", ["not a dict", "no metrics", "short column", "odd bytes",
                                  "rows past the block", "overlap", "descending",
                                  "string rows"])
def test_a_malformed_steps_event_is_logged_and_skipped(
        what: str, caplog: pytest.LogCaptureFixture) -> None:
    hub, sub = subscribed_hub()  # the run at seq 1
    hub.handle_pub(ev(2, "steps", good_block(0)))
    before = msgspec.msgpack.encode(hub.runs[RUN].steps.to_wire())
    with caplog.at_level(logging.WARNING, logger="web.hub"):
        hub.handle_pub(ev(3, "steps", broken(what)))
    assert "steps event of run" in caplog.text
    assert msgspec.msgpack.encode(hub.runs[RUN].steps.to_wire()) == before
    assert [seq for seq, _ in steps_items(sub)] == [2]  # nothing broadcast for seq 3
    hub.handle_pub(ev(4, "steps", good_block(3)))  # the feed goes on
    assert hub.runs[RUN].steps.last_step == 5


def test_a_block_whose_rows_do_not_follow_is_renumbered_when_its_steps_ascend() -> None:
    hub, sub = subscribed_hub()
    hub.handle_pub(ev(2, "steps", good_block(0)))
    hub.handle_pub(ev(3, "steps", steps_data(good_block_records(7, 2), base=40)))
    store = hub.runs[RUN].steps
    assert store.rows == 5 and store.column("step").tolist() == [0, 1, 2, 7, 8]
    assert [b[0] for b in store.series("loss", None, None, 10)] == [0, 1, 2, 7, 8]
    assert len(steps_items(sub)) == 2


def good_block_records(first: int, n: int) -> list[dict[str, Any]]:
    return wire_records(good_block(first, n))


def test_the_catch_up_after_a_resnapshot_still_sends_the_missed_steps() -> None:
    """A gap: the run's snapshot brings steps 0..4; the subscriber gets them as one
    ``steps`` event (records from the new store), then live blocks continue."""
    sink, _ = sink_events(finish=False, seq=10)
    hub, sub = subscribed_hub()
    hub.handle_pub(ev(5, "ranks", []))  # a gap (the hub holds seq 1): the snapshot is asked
    assert hub.next_request() == feed.encode_snapshot_request(RUN)
    hub.handle_snapshot(feed.encode_run_snapshot(sink.snapshot()))
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 1))
    (recs,) = live_steps(steps_items(sub))
    assert recs == msgspec.json.decode(msgspec.json.encode(  # (8.1: with their attempt)
        [dict(r, attempt=0) for r in old_records()]))
    events = sink.apply(Steps(run=RUN, rank=0, steps=[5], times=[9.0], step_ms=[1.0]), 1.0)
    events += sink.apply(Steps(run=RUN, rank=1, steps=[5], times=[9.0], step_ms=[2.0]), 1.0)
    for parts in on_the_wire(events):
        hub.handle_pub(parts)
    assert [[r["step"] for r in recs] for recs in live_steps(steps_items(sub))] == [[5]]
    assert hub.runs[RUN].steps.column("step").tolist() == [0, 1, 2, 3, 4, 5]
