"""The per-run sink rules of PROTOCOL.md 2, 2.1 and 3, driven with frames and a fake clock: the
header, rejections, the register rules, svg/metadata/hardware, the header's coalescing and
the bounds in bytes. (Epochs: ``test_sink_epochs.py``; a run's end, liveness and replay:
``test_sink_lifecycle.py``; the hardware string: ``test_sink_hardware.py``.)"""
from __future__ import annotations

import json
import logging
import tracemalloc

import msgspec
import pytest

from broker.run.sink import Event, Rejected, RunSink
from rank_agent.protocol import (
    GpuSample,
)
from tests.support.sinkframes import (
    HEADER_KEYS,
    RUN,
    fin,
    hw,
    kinds,
    met,
    meta,
    of_kind,
    reg,
    registered,
    res,
    state,
    svg,
)

# ---------------------------------------------------------------- basics


def test_first_frame_sets_times_and_emits_header() -> None:
    sink = RunSink(RUN)
    events = sink.apply(met(0, 0), 5.0)
    assert kinds(events) == ["run"]
    header = events[0].data
    assert list(header) == HEADER_KEYS
    assert header["status"] == "waiting" and header["world_size"] is None
    assert (sink.started_at, sink.updated_at) == (5.0, 5.0)
    sink.apply(res(0, cpu_percent=1.0), 7.0)
    assert (sink.started_at, sink.updated_at) == (5.0, 7.0)
    assert sink.header()["updated_at"] == 7.0


def test_header_defaults() -> None:
    sink = RunSink(RUN)
    sink.apply(res(0), 1.0)
    assert sink.header() == {
        "run": RUN, "status": "waiting", "world_size": None, "total_epochs": None,
        "label": None, "hash": None, "port": None, "metadata": None, "hardware": "",
        "has_svg": False, "hosts": [], "alerts": [], "started_at": 1.0, "updated_at": 1.0,
        "steps_done": None, "step_metrics": [], "data_share": None, "data_stragglers": [],
        "shard": 0, "collectives_last": None, "total_steps": None, "eta_secs": None, "alert_ranks": {},
        "failure": None,
        "nonfinite": [], "nonfinite_more": 0, "replica_divergence": [],  # v5, 8.3
        "attempt": 0, "attempts": [{  # v5, 8.1
            "attempt": 0, "started_at": 1.0, "ended_at": None, "world_size": None,
            "first_step": None, "last_step": None, "first_epoch": None, "last_epoch": None,
            "superseded_steps": 0, "superseded_epochs": 0, "cause": None}],
        "alert_attempts": {},
    }


def test_frames_that_do_not_change_the_header_emit_nothing() -> None:
    sink = registered(2)
    sink.tick(0.0)  # the registers' (coalesced) header goes out
    assert sink.apply(res(0, cpu_percent=5.0), 1.0) == []
    assert sink.apply(reg(0, 2, "a"), 2.0) == []  # same placement again
    assert sink.apply(met(0, 0), 3.0) == []  # epoch not complete yet
    assert of_kind(sink.tick(3.0), "run") == []  # (a pending header would go out here)
    # A hardware change is a header change, coalesced: the next tick emits it.
    assert sink.apply(hw(0, "cpu | gpu"), 4.0) == []
    assert of_kind(sink.tick(4.0), "run") != []
    assert sink.apply(hw(0, "cpu | gpu"), 5.0) == []  # same summary: string unchanged
    assert of_kind(sink.tick(6.0), "run") == []


def test_seq_strictly_increasing_and_records_match_events() -> None:
    sink = RunSink(RUN, ranks_interval=0.0)
    events: list[Event] = []
    t = 0.0
    for frame in [reg(0), reg(1), svg(0, "<svg/>"), met(0, 0), met(1, 0), met(0, 1), met(1, 1),
                  fin(0), fin(1)]:
        t += 1.0
        events += sink.apply(frame, t)
        events += sink.tick(t)
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(seqs) + 1))
    assert sink.seq == seqs[-1]
    epoch_events = [e for e in events if e.kind == "epoch"]
    assert sink.record_seqs == [e.seq for e in epoch_events]
    assert sink.records == [e.data for e in epoch_events]
    assert [r["epoch"] for r in sink.records] == [0, 1]


def test_server_may_raise_seq() -> None:
    sink = RunSink(RUN)
    sink.seq = 1000
    assert sink.apply(reg(0), 1.0)[0].seq == 1001


# ---------------------------------------------------------------- rejections


def test_world_size_first_arrival_wins_and_mismatch_is_rejected() -> None:
    sink = RunSink(RUN)
    sink.apply(reg(0, ws=4), 1.0)
    with pytest.raises(Rejected) as exc:
        sink.apply(reg(1, ws=8), 2.0)
    assert exc.value.reason == "world_size_mismatch"
    assert sink.world_size == 4 and sink.header()["world_size"] == 4


def test_rank_out_of_range_once_world_size_known() -> None:
    sink = registered(2)
    for frame in [met(2, 0), res(5), hw(2, "x"), fin(2), svg(3, "<svg/>"), meta(2, "{}")]:
        with pytest.raises(Rejected) as exc:
            sink.apply(frame, 1.0)
        assert exc.value.reason == "rank_out_of_range"


def test_register_beyond_its_own_world_size_rejected_before_world_size_known() -> None:
    sink = RunSink(RUN)
    with pytest.raises(Rejected) as exc:
        sink.apply(reg(4, ws=4), 1.0)
    assert exc.value.reason == "rank_out_of_range"
    assert sink.world_size is None and sink.seq == 0 and sink.started_at is None


def test_malformed_metadata_rejected() -> None:
    sink = registered(1)
    sink.apply(meta(0, '{"lr": 0.1}'), 1.0)
    for bad in ["{lr: 0.1}", "", "[" * 100_000]:
        with pytest.raises(Rejected) as exc:
            sink.apply(meta(0, bad), 2.0)
        assert exc.value.reason == "bad_metadata_json"
    assert sink.header()["metadata"] == {"lr": 0.1}


@pytest.mark.parametrize("text", ['"\\udc00"', '{"path": "/data/x\\udcff.bin"}',
                                  '{"\\ud800": 1}', '["ok", ["\\ud83d"]]', '"\\ude00\\ud83d"'])
def test_metadata_with_a_lone_surrogate_is_malformed(text: str) -> None:
    """Contract v3: json.loads accepts a lone surrogate escape, but no encoder can write it
    into an event or a snapshot, so the run's history would be lost to later webs."""
    assert "\udc00" in json.loads('"\\udc00"')  # what makes it slip through json alone
    sink = registered(1)
    sink.apply(meta(0, '{"lr": 0.1}'), 1.0)
    seq = sink.seq
    with pytest.raises(Rejected) as exc:
        sink.apply(meta(0, text), 2.0)
    assert exc.value.reason == "bad_metadata_json"
    assert sink.header()["metadata"] == {"lr": 0.1} and sink.seq == seq
    msgspec.msgpack.encode(sink.snapshot())  # still encodable


def test_metadata_with_escaped_valid_characters_is_accepted() -> None:
    sink = registered(1)
    sink.apply(meta(0, '{"smile": "\\ud83d\\ude00", "e": "\\u00e9", "nl": "a\\nb"}'), 1.0)
    assert sink.header()["metadata"] == {"smile": "\U0001f600", "e": "\u00e9", "nl": "a\nb"}


@pytest.mark.parametrize(
    "frame",
    [reg(1, ws=3), reg(9, ws=16), met(7, 0), meta(0, "{oops"), meta(5, "{}"), fin(4)],
    ids=["ws-mismatch", "ws-mismatch-and-range", "range", "metadata", "range-metadata", "range-finish"],
)
def test_rejected_frame_has_no_effect(frame) -> None:
    sink = registered(2, ranks_interval=0.0)
    sink.apply(met(0, 0), 1.0)
    sink.tick(1.0)
    before = state(sink)
    seq = sink.seq
    with pytest.raises(Rejected):
        sink.apply(frame, 5.0)
    assert sink.seq == seq
    assert state(sink) == before
    assert sink.tick(5.0) == []  # not even the ranks array changed (nothing marked seen)
    assert [r["rank"] for r in sink.ranks()] == [0, 1]


def test_rejected_first_frame_creates_nothing() -> None:
    sink = RunSink(RUN)
    with pytest.raises(Rejected):
        sink.apply(meta(0, "nope"), 1.0)
    assert sink.started_at is None and sink.ranks() == [] and sink.seq == 0


def test_discard_when_world_size_becomes_known() -> None:
    sink = RunSink(RUN)
    sink.apply(met(3, 0, loss=100.0, b=10), 1.0)
    sink.apply(res(3, cpu_percent=99.0, vram_total_bytes=77, gpus=[GpuSample(device_index=0, name="X")]), 1.0)
    sink.apply(hw(3, "big cpu | big gpu"), 1.0)
    sink.apply(fin(3, "error"), 1.0)
    sink.apply(met(0, 0, loss=1.0), 2.0)
    sink.apply(met(1, 0, loss=3.0), 2.0)
    assert sink.records == []  # world size unknown: no epoch closes
    assert [r["rank"] for r in sink.ranks()] == [0, 1, 3]
    events = sink.apply(reg(0, ws=2, host="a"), 3.0)
    assert [r["rank"] for r in sink.ranks()] == [0, 1]
    (record,) = of_kind(events, "epoch")
    assert record["metrics"]["loss"] == 2.0  # rank 3's loss 100 is gone
    assert record["missing_ranks"] == []
    assert record["resources"]["cpu_percent"] is None
    assert record["resources"]["vram_total_bytes"] is None
    assert record["resources"]["gpus"] == []
    header = sink.header()
    assert header["alerts"] == []  # rank 3's rank_error went with it
    assert header["hosts"] == [{"host": "a", "ranks": [0]}]
    assert header["status"] == "training"
    with pytest.raises(Rejected):
        sink.apply(res(3), 4.0)


def test_discarded_rank_hardware_leaves_nothing_behind() -> None:
    # A placed rank is always below the world size (its own register latches it), so what
    # gets discarded is state of ranks that never registered: hardware, samples, reports.
    sink = RunSink(RUN)
    sink.apply(hw(5, "cpu5 | gpu5"), 1.0)
    sink.apply(reg(0, ws=2, host="a"), 2.0)
    sink.apply(hw(0, "cpu0 | gpu0"), 3.0)
    assert sink.header()["hardware"] == "a: cpu0 | gr=0 lr=0: gpu0"
    assert [r["rank"] for r in sink.ranks()] == [0]


# ---------------------------------------------------------------- register rules


def test_host_and_local_rank_last_write() -> None:
    sink = registered(2, hosts=["a", "a"])
    assert sink.apply(reg(1, 2, "b", lr=3), 1.0) == []  # header change coalesced ...
    events = sink.tick(1.0)  # ... until the next tick
    assert of_kind(events, "run")[0]["hosts"] == [{"host": "a", "ranks": [0]}, {"host": "b", "ranks": [1]}]
    entry = sink.ranks()[1]
    assert (entry["host"], entry["local_rank"]) == ("b", 3)


def test_topology_ordering() -> None:
    sink = RunSink(RUN)
    # Arrival order is scrambled on purpose; host "y" holds rank 0, so it comes first.
    for rank, host, lr in [(5, "x", 0), (3, "x", 1), (4, "y", 2), (0, "y", 1), (1, "z", 0), (2, "y", 0)]:
        sink.apply(reg(rank, 6, host, lr=lr), 1.0)
    assert sink.header()["hosts"] == [
        {"host": "y", "ranks": [2, 0, 4]},  # by local rank
        {"host": "z", "ranks": [1]},
        {"host": "x", "ranks": [5, 3]},
    ]
    # Rank 0 moving away from "y" makes y's lowest rank 2: "z" (rank 1) now leads.
    sink.apply(reg(0, 6, "w", lr=0), 2.0)
    assert [h["host"] for h in sink.header()["hosts"]] == ["w", "z", "y", "x"]


def test_earlier_headers_do_not_change_after_the_fact() -> None:
    sink = RunSink(RUN)
    first = sink.apply(reg(1, 4, "a"), 1.0)[0].data
    frozen = msgspec.msgpack.encode(first)
    later = []
    for t, frame in [(2.0, reg(0, 4, "a")),  # same host, new lowest rank
                     (3.0, reg(2, 4, "b")), (4.0, reg(1, 4, "c")),  # (rank 1 moves away)
                     (5.0, hw(0, "cpu | gpu"))]:
        sink.apply(frame, t)
        later += of_kind(sink.tick(t), "run")  # coalesced: each tick builds a header
    assert len(later) == 4
    assert msgspec.msgpack.encode(first) == frozen
    assert sink.header()["hosts"] == [
        {"host": "a", "ranks": [0]}, {"host": "c", "ranks": [1]}, {"host": "b", "ranks": [2]},
    ]


def test_port_first_nonzero_wins(caplog) -> None:
    sink = registered(4)  # placements settled: only the port can change the header now
    sink.apply(reg(0, 4, port=0), 1.0)
    sink.tick(1.0)  # the registers' (coalesced) header goes out
    assert sink.header()["port"] is None
    # Header changes from registers are coalesced: the next tick emits them.
    assert sink.apply(reg(1, 4, port=8585), 2.0) == []
    assert of_kind(sink.tick(2.0), "run")[0]["port"] == 8585
    assert sink.apply(reg(2, 4, port=8585), 3.0) == []  # the same port again: a no-op
    assert of_kind(sink.tick(3.0), "run") == []
    with caplog.at_level(logging.WARNING, logger="broker.run.sink"):
        assert sink.apply(reg(3, 4, port=9000), 4.0) == []  # a different one: ignored
        assert of_kind(sink.tick(4.0), "run") == []
        sink.apply(reg(3, 4, port=9001), 5.0)  # warned once per interval, still counted
        sink.apply(reg(2, 4, port=0), 6.0)  # zero is "no port": not a conflict
    assert sink.port == 8585 and sink.header()["port"] == 8585
    assert sink.port_conflicts == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "9000" in warnings[0].getMessage()
    with caplog.at_level(logging.WARNING, logger="broker.run.sink"):
        sink.apply(reg(3, 4, port=9002), 4.0 + 3600.0)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_total_epochs_first_nonzero_wins() -> None:
    sink = RunSink(RUN)
    sink.apply(reg(0, 3, total_epochs=0), 1.0)
    assert sink.header()["total_epochs"] is None
    sink.apply(reg(1, 3, total_epochs=10), 2.0)
    sink.apply(reg(2, 3, total_epochs=20), 3.0)
    assert sink.header()["total_epochs"] == 10


# ---------------------------------------------------------------- svg, metadata, hardware


def test_svg_first_nonempty_wins_with_label_and_hash() -> None:
    sink = registered(2)
    assert sink.apply(svg(0, "", label="empty", hash="h0"), 1.0) == []  # empty: no latch
    assert sink.svg is None and not sink.header()["has_svg"]
    events = sink.apply(svg(1, "<svg>1</svg>", label="net", hash="abc"), 2.0)
    header = of_kind(events, "run")[0]
    assert (header["has_svg"], header["label"], header["hash"]) == (True, "net", "abc")
    assert "svg" not in header
    assert sink.apply(svg(0, "<svg>2</svg>", label="other", hash="def"), 3.0) == []
    assert sink.svg == "<svg>1</svg>" and sink.label == "net"
    assert sink.snapshot()["svg"] == "<svg>1</svg>"


def test_metadata_last_write_wins_whole_blob() -> None:
    sink = registered(2)
    sink.tick(0.0)
    sink.apply(meta(0, '{"a": 1, "b": 2}'), 1.0)
    assert sink.apply(meta(1, '{"c": [1, 2]}'), 2.0) == []  # coalesced: the tick emits it
    assert of_kind(sink.tick(2.0), "run")[0]["metadata"] == {"c": [1, 2]}  # replaced
    assert sink.apply(meta(0, '{ "c" : [1,2] }'), 3.0) == []  # same value: header unchanged
    assert sink.apply(meta(1, '{ "c" : [1,2] }'), 4.0) == []  # same text again
    assert of_kind(sink.tick(4.0), "run") == []
    sink.apply(meta(1, "null"), 5.0)
    assert of_kind(sink.tick(5.0), "run")[0]["metadata"] is None


# ---------------------------------------------------------------- header coalescing


def test_register_and_hardware_header_changes_are_coalesced_by_tick() -> None:
    sink = RunSink(RUN, ranks_interval=1.0)
    events: list[Event] = []
    # A start-up storm: 64 registers and 64 hardware reports over 2.5 s, ticked every 0.1 s
    # as the server does.
    frames = [reg(r, 64, f"h{r // 8}", lr=r % 8) for r in range(64)]
    frames += [hw(r, f"cpu{r // 8} | gpu{r}") for r in range(64)]
    applied: list[Event] = []
    t, next_tick = 0.0, 0.0
    for frame in frames:
        while next_tick <= t:
            events += sink.tick(next_tick)
            next_tick = round(next_tick + 0.1, 6)
        out = sink.apply(frame, t)
        applied += out
        events += out
        t = round(t + 2.5 / len(frames), 6)
    # Only the run's first frame emits at once (a new run shows up at once).
    assert kinds(applied) == ["run"] and applied[0].data["hosts"] == [{"host": "h0", "ranks": [0]}]
    runs = [e for e in events if e.kind == "run"]
    assert 2 <= len(runs) <= 5  # the first frame, then at most one per ranks_interval
    tick_times = [e.data["updated_at"] for e in runs[1:]]
    assert all(b - a >= 1.0 - 1.0 / len(frames) for a, b in zip(tick_times, tick_times[1:]))
    # Nothing is lost: the next tick once the interval passed emits the final header.
    (last,) = of_kind(sink.tick(t + 1.0), "run")
    assert last == sink.header()
    assert [h["host"] for h in last["hosts"]] == [f"h{i}" for i in range(8)]
    assert last["hardware"].startswith("h0: cpu0 | gr=0 lr=0: gpu0 | gr=1 lr=1: gpu1")
    assert last["world_size"] == 64
    assert of_kind(sink.tick(t + 5.0), "run") == []  # sent: nothing pending any more
    seqs = [e.seq for e in events] + [sink.seq]
    assert seqs == sorted(set(seqs))


def test_pending_header_is_flushed_just_before_an_epoch() -> None:
    sink = registered(2)
    sink.tick(0.0)
    sink.apply(met(0, 0), 1.0)
    assert sink.apply(hw(0, "Xeon | H100"), 1.5) == []  # pending
    events = sink.apply(met(1, 0), 2.0)
    assert kinds(events) == ["run", "epoch", "run"]  # header, record, then status training
    flushed = events[0].data
    assert flushed["hardware"] == "a: Xeon | gr=0 lr=0: H100" and flushed["status"] == "waiting"
    assert events[0].seq + 1 == events[1].seq
    assert of_kind(sink.tick(2.0), "run") == []  # nothing left pending
    # A register that closes epochs itself (its world size discards a rank) flushes too.
    sink = RunSink(RUN)
    sink.apply(met(0, 0), 1.0)
    sink.apply(met(5, 0), 1.0)  # rank 5: out of range once the world size is known
    events = sink.apply(reg(0, 1, "solo"), 2.0)
    assert kinds(events) == ["run", "epoch", "run"]
    assert events[0].data["world_size"] == 1 and events[0].data["hosts"] == [
        {"host": "solo", "ranks": [0]}]
    assert events[1].data["missing_ranks"] == []


def test_changes_users_expect_at_once_emit_from_apply_and_clear_the_pending_header() -> None:
    sink = registered(2)
    sink.tick(0.0)
    assert sink.apply(reg(1, 2, "b"), 1.0) == []  # pending hosts change
    events = sink.apply(svg(0, "<svg/>", label="net"), 1.1)
    (header,) = of_kind(events, "run")  # at once, carrying the pending change too
    assert header["has_svg"] and header["label"] == "net"
    assert [h["host"] for h in header["hosts"]] == ["a", "b"]
    assert of_kind(sink.tick(5.0), "run") == []  # cleared: it went out with the svg
    sink.apply(hw(0, "c | g"), 6.0)  # pending again
    # Metadata and alerts are coalesced too (v3: a burst of replaced ~1 MiB blobs, or of
    # ranks failing, is one header per ranks_interval, not one per frame).
    assert of_kind(sink.apply(meta(0, '{"lr": 0.1}'), 6.1), "run") == []
    (header,) = of_kind(sink.tick(9.0), "run")
    assert header["metadata"] == {"lr": 0.1} and header["hardware"] == "a: c | gr=0 lr=0: g"
    sink.apply(reg(0, 2, "z"), 10.0)  # pending
    assert of_kind(sink.apply(fin(0, "error"), 10.1), "run") == []
    # Completion is immediate, and carries everything pending.
    events = sink.apply(fin(1), 10.2)
    assert [a["kind"] for a in events[0].data["alerts"]] == ["rank_error"]
    assert events[0].data["hosts"][0]["host"] == "z"
    assert kinds(events) == ["run", "ranks", "complete"] and events[0].data["status"] == "failed"


def test_coalesced_header_rate_limited_per_ranks_interval() -> None:
    sink = registered(2, ranks_interval=1.0)
    assert of_kind(sink.tick(0.0), "run") != []  # first pending header: at once
    sink.apply(hw(0, "c | g1"), 0.1)
    assert of_kind(sink.tick(0.5), "run") == []  # within the interval: held
    sink.apply(hw(0, "c | g2"), 0.6)
    (header,) = of_kind(sink.tick(1.0), "run")  # one header for both changes
    assert header["hardware"].endswith("g2")
    assert of_kind(sink.tick(3.0), "run") == []


# ---------------------------------------------------------------- bounded by bytes (v3)


def test_a_burst_of_replaced_metadata_is_one_header_and_old_blobs_are_freed() -> None:
    """Issue 19 finding 2 (the sink's part): every replaced blob was a header of its own,
    ~1 MiB each, encoded and held by the server for the whole batch; and a parsed blob is
    many times its text. Now a burst is one coalesced header, and the run holds its
    metadata as MessagePack."""
    sink = registered(1)
    sink.tick(0.0)
    blob = '{"k": [' + ",".join(["{}"] * 40_000) + '], "n": %d}'
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        emitted = []
        for i in range(60):
            emitted += sink.apply(meta(0, blob % i), 1.0 + i / 100)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert of_kind(emitted, "run") == []
    (header,) = of_kind(sink.tick(2.0), "run")
    assert header["metadata"]["n"] == 59 and len(header["metadata"]["k"]) == 40_000
    # one blob's text (~160 KB) and its MessagePack (~40 KB) stay; parsed it was ~2.5 MB
    assert held < 600_000, held


def test_metadata_big_integers_become_floats_as_the_feed_would() -> None:
    sink = registered(1)
    sink.apply(meta(0, '{"big": 100000000000000000000000000000, "ok": 18446744073709551615}'),
               1.0)
    assert sink.header()["metadata"] == {"big": 1e29, "ok": 2**64 - 1}
    msgspec.msgpack.encode(sink.snapshot())


def test_ranks_failing_one_by_one_are_one_coalesced_header_not_one_each() -> None:
    """4,096 ranks finishing with an error raised 4,096 headers, each listing every alert so
    far: quadratic bytes from linear frames."""
    ws = 4096
    sink = registered(ws)
    sink.tick(0.0)
    events = []
    for r in range(ws - 1):
        events += sink.apply(fin(r, "error"), 1.0)
    assert of_kind(events, "run") == []
    (header,) = of_kind(sink.tick(1.5), "run")
    # the latest 100 listed, and how many there were (issue 32: the list is capped per kind)
    assert len(header["alerts"]) == 100 + 1
    assert header["alerts"][-1]["message"] == "4095 rank_error alerts raised, the latest 100 listed"


def test_a_run_holds_at_most_1024_open_epochs() -> None:
    """A silent rank (or an unknown world size) keeps every epoch another rank reports
    open: a flood of metrics frames for new epochs grew the run by ~1 KB a frame, without
    end. The 1,025th open epoch is rejected (``open_epochs``); reports for open epochs,
    late ones, and new ones once epochs close, are still taken."""
    from broker.run.epochs import MAX_OPEN_EPOCHS

    assert MAX_OPEN_EPOCHS == 1024
    sink = registered(2)
    for e in range(MAX_OPEN_EPOCHS):  # rank 1 is silent: nothing closes
        sink.apply(met(0, e * 1000), 1.0)
    seq = sink.seq
    with pytest.raises(Rejected) as exc:
        sink.apply(met(0, 10**12), 2.0)
    assert exc.value.reason == "open_epochs" and sink.seq == seq
    sink.apply(met(0, 5000, loss=2.0), 2.0)  # an open epoch: last write, fine
    sink.apply(met(1, 1000), 3.0)  # rank 1 completes epoch 1000: 0..1000 close
    assert [r["epoch"] for r in sink.records] == [0, 1000]
    sink.apply(met(0, 10**12), 4.0)  # room again
    sink.apply(met(1, 0), 5.0)  # late: counted, not rejected
    assert sink.late_metrics == 1
    # before the world size is known nothing closes either
    fresh = RunSink(RUN)
    for e in range(MAX_OPEN_EPOCHS):
        fresh.apply(met(0, e), 1.0)
    with pytest.raises(Rejected):
        fresh.apply(met(0, MAX_OPEN_EPOCHS), 1.0)
