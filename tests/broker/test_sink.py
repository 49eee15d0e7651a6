"""The per-run sink rules of PROTOCOL.md 2, 2.1-2.3 and 3, driven with frames and a fake clock."""
from __future__ import annotations

import json
import logging
import math
import random
import re
import time
import tracemalloc

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.sink import Event, Rejected, RunSink
from broker.topology import MAX_HARDWARE_BYTES, HardwareString, Topology
from rank_agent.protocol import (
    Finish,
    GpuSample,
    Hardware,
    Metadata,
    Metrics,
    Register,
    Resources,
    ResourceSample,
    Svg,
    decode,
    encoder,
)

RUN = "run-1"
HEADER_KEYS = [
    "run", "status", "world_size", "total_epochs", "label", "hash", "port", "metadata",
    "hardware", "has_svg", "hosts", "alerts", "started_at", "updated_at", "steps_done",
    "step_metrics",
]


def wire(frame):
    """The frame as the broker sees it: encoded and decoded through the real schema."""
    return decode(encoder.encode(frame))


def reg(rank: int, ws: int = 2, host: str = "a", lr: int | None = None, **kw) -> Register:
    return wire(Register(run=RUN, rank=rank, world_size=ws, host=host,
                         local_rank=rank if lr is None else lr, **kw))


def met(rank: int, epoch: int, loss: float = 1.0, b: int = 1, **kw) -> Metrics:
    return wire(Metrics(run=RUN, rank=rank, epoch=epoch, avg_loss=loss, batches=b, **kw))


def fin(rank: int, status: str = "ok") -> Finish:
    return wire(Finish(run=RUN, rank=rank, status=status))


def res(rank: int, **kw) -> Resources:
    return wire(Resources(run=RUN, rank=rank, sample=ResourceSample(**kw)))


def hw(rank: int, summary: str) -> Hardware:
    return wire(Hardware(run=RUN, rank=rank, summary=summary))


def svg(rank: int, text: str, label=None, hash=None) -> Svg:
    return wire(Svg(run=RUN, rank=rank, svg=text, label=label, hash=hash))


def meta(rank: int, text: str) -> Metadata:
    return wire(Metadata(run=RUN, rank=rank, json=text))


def kinds(events: list[Event]) -> list[str]:
    return [e.kind for e in events]


def of_kind(events: list[Event], kind: str) -> list:
    return [e.data for e in events if e.kind == kind]


def registered(ws: int = 2, hosts=None, **kw) -> RunSink:
    """A sink whose ranks 0..ws-1 registered at t=0 (host of rank r: hosts[r], default "a")."""
    sink = RunSink(RUN, **kw)
    for r in range(ws):
        sink.apply(reg(r, ws, hosts[r] if hosts else "a"), 0.0)
    return sink


def state(sink: RunSink) -> bytes:
    """Everything observable about a sink, as bytes (NaN-safe equality)."""
    extra = (sink.late_metrics, sink.port_conflicts, sink.status, sink.started_at, sink.updated_at)
    return msgspec.msgpack.encode([sink.snapshot(), extra])


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
        "steps_done": None, "step_metrics": [],
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
    with caplog.at_level(logging.WARNING, logger="broker.sink"):
        assert sink.apply(reg(3, 4, port=9000), 4.0) == []  # a different one: ignored
        assert of_kind(sink.tick(4.0), "run") == []
        sink.apply(reg(3, 4, port=9001), 5.0)  # warned once per interval, still counted
        sink.apply(reg(2, 4, port=0), 6.0)  # zero is "no port": not a conflict
    assert sink.port == 8585 and sink.header()["port"] == 8585
    assert sink.port_conflicts == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "9000" in warnings[0].getMessage()
    with caplog.at_level(logging.WARNING, logger="broker.sink"):
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


def test_hardware_string_grouped_by_host() -> None:
    sink = RunSink(RUN)
    for rank, host, lr in [(0, "a", 0), (1, "a", 1), (2, "b", 0), (3, "b", 1), (4, "c", 0)]:
        sink.apply(reg(rank, 6, host, lr=lr), 0.0)
    sink.apply(hw(1, "Xeon 64c | H100 80GB | extra"), 1.0)  # gpu part: everything after the first " | "
    sink.apply(hw(0, "Xeon 64c (rank0) | H100 #0"), 2.0)  # local rank 0: its cpu is the host's
    sink.apply(hw(3, "EPYC | A100"), 3.0)
    sink.apply(hw(2, "EPYC (no gpu)"), 4.0)  # no gpu part: cpu only
    sink.apply(hw(5, "unplaced | GPU"), 5.0)  # rank 5 never registered: no host, not listed
    # host "c" has no report: skipped
    assert sink.header()["hardware"] == (
        "a: Xeon 64c (rank0) | gr=0 lr=0: H100 #0 | gr=1 lr=1: H100 80GB | extra"
        " | b: EPYC (no gpu) | gr=3 lr=1: A100"
    )
    assert sink.ranks()[1]["hardware"] == "Xeon 64c | H100 80GB | extra"
    # Per-rank last write re-renders.
    assert sink.apply(hw(3, "EPYC | B200"), 6.0) == []  # coalesced: the next tick emits it
    events = sink.tick(6.0)
    assert of_kind(events, "run")[0]["hardware"].endswith("gr=3 lr=1: B200")
    # Once rank 5 registers, its report shows up under its host.
    sink.apply(reg(5, 6, "c", lr=0), 7.0)
    assert sink.header()["hardware"].endswith(" | c: unplaced | gr=5 lr=0: GPU")


def _hw_string(reports: dict[int, str], hosts: dict[int, tuple[str, int]], limit: int) -> str:
    topo = Topology()
    for rank, (host, lr) in hosts.items():
        topo.set(rank, host, lr)
    return HardwareString(topo, reports.get, limit).render()


def test_hardware_string_exact_while_it_fits_then_folded_then_cut_between_parts() -> None:
    """Contract v3 2.2: exact while it fits; identical GPU parts folded (``gr=<ranges>``);
    then ``… and N more ranks``, cut only between parts."""
    hosts = {r: (f"n{r // 4}", r % 4) for r in range(8)}
    reports = {r: f"Xeon | {'H100' if r != 6 else 'A100'}" for r in range(8)}
    exact = _hw_string(reports, hosts, 1 << 16)
    assert exact == ("n0: Xeon | gr=0 lr=0: H100 | gr=1 lr=1: H100 | gr=2 lr=2: H100"
                     " | gr=3 lr=3: H100 | n1: Xeon | gr=4 lr=0: H100 | gr=5 lr=1: H100"
                     " | gr=6 lr=2: A100 | gr=7 lr=3: H100")
    assert _hw_string(reports, hosts, len(exact)) == exact  # the limit is inclusive
    folded = "n0: Xeon | gr=0-3: H100 | n1: Xeon | gr=4-5,7: H100 | gr=6: A100"
    assert _hw_string(reports, hosts, len(exact) - 1) == folded
    assert _hw_string(reports, hosts, len(folded)) == folded
    cut = _hw_string(reports, hosts, len(folded) - 1)
    # (room is kept for the widest tail, "… and 8 more ranks": gr=4-5,7 no longer fits)
    assert cut == "n0: Xeon | gr=0-3: H100 | n1: Xeon | … and 4 more ranks"
    assert len(cut.encode()) <= len(folded) - 1
    tiny = _hw_string(reports, hosts, 40)
    assert tiny == "n0: Xeon | … and 8 more ranks" and len(tiny.encode()) <= 40
    # Bytes, not characters: a multi-byte summary is measured in UTF-8.
    wide = {0: "\u00e9" * 30 + " | g"}
    assert _hw_string(wide, {0: ("h", 0)}, 50) == "… and 1 more ranks"


def test_hardware_string_of_65536_ranks_with_4096_char_summaries_stays_small() -> None:
    """Issue 19 finding 1: 65,536 ranks x 4,096-character summaries made a ~268 MB string
    riding in every header. Through the pure sink: the header's string is <= 64 KiB, it is
    re-rendered coalesced (each hardware frame is O(1)), and memory stays small."""
    ws = 65536
    sink = RunSink(RUN)
    for r in range(ws):
        sink.apply(Register(run=RUN, rank=r, world_size=ws, host=f"node{r // 8:05d}",
                            local_rank=r % 8), 0.0)
    sink.tick(0.0)
    summary = "C" * 2040 + " | " + "G" * 2053
    assert len(summary) == 4096
    raw = [encoder.encode(Hardware(run=RUN, rank=r, summary=summary)) for r in range(0, ws, 512)]
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        for r in range(ws):  # each frame decoded on its own, as from the wire
            frame = decode(raw[r // 512]) if r % 512 == 0 else decode(
                encoder.encode(Hardware(run=RUN, rank=r, summary=summary)))
            sink.apply(frame, 1.0)
        applied = time.perf_counter() - t0
        header = of_kind(sink.tick(2.0), "run")[-1]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    text = header["hardware"]
    assert len(text.encode()) <= MAX_HARDWARE_BYTES
    assert text.startswith("node00000: " + "C" * 2040 + " | gr=0-7: " + "G" * 2053 + " | node00001")
    assert re.search(r" \| … and \d+ more ranks\Z", text)
    shown = sum(p.count("gr=") for p in [text])
    assert text.endswith(f"… and {ws - 8 * shown} more ranks")
    assert peak < 64 * 2**20, peak  # the summaries alone would be 268 MB
    assert applied < 30.0
    # One more report: O(1) in apply, one bounded render in the coalesced header.
    t0 = time.perf_counter()
    sink.apply(hw(5, "C" * 2040 + " | X"), 3.0)
    assert of_kind(sink.tick(3.0), "run")[-1]["hardware"].count("gr=") > 1
    assert time.perf_counter() - t0 < 1.0


def test_hardware_string_of_distinct_gpu_parts_is_cut_with_a_count() -> None:
    ws = 4096
    sink = RunSink(RUN)
    for r in range(ws):
        sink.apply(reg(r, ws, f"h{r // 8}", lr=r % 8), 0.0)
        sink.apply(hw(r, f"cpu{r // 8} | " + f"gpu{r:05d}".ljust(4000, "x")), 0.0)
    text = sink.header()["hardware"]
    assert len(text.encode()) <= MAX_HARDWARE_BYTES
    shown = text.count(" | gr=")
    assert 10 < shown < 20 and text.endswith(f" | … and {ws - shown} more ranks")


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
    assert kinds(events) == ["run", "complete"] and events[0].data["status"] == "failed"


def test_coalesced_header_rate_limited_per_ranks_interval() -> None:
    sink = registered(2, ranks_interval=1.0)
    assert of_kind(sink.tick(0.0), "run") != []  # first pending header: at once
    sink.apply(hw(0, "c | g1"), 0.1)
    assert of_kind(sink.tick(0.5), "run") == []  # within the interval: held
    sink.apply(hw(0, "c | g2"), 0.6)
    (header,) = of_kind(sink.tick(1.0), "run")  # one header for both changes
    assert header["hardware"].endswith("g2")
    assert of_kind(sink.tick(3.0), "run") == []


# ---------------------------------------------------------------- epochs


def test_epoch_closes_when_every_rank_reported() -> None:
    sink = registered(2, hosts=["a", "b"])
    sink.apply(reg(0, 2, "a", total_epochs=4), 0.0)
    assert sink.apply(met(0, 0, loss=1.0, b=1, samples=10, epoch_ms=500.0), 10.0) == []
    events = sink.apply(met(1, 0, loss=4.0, b=3, samples=30, epoch_ms=1000.0), 11.0)
    # The registers' coalesced header first (no tick ran), then the record, then the
    # header again for status waiting -> training.
    assert kinds(events) == ["run", "epoch", "run"]
    assert events[0].data["total_epochs"] == 4 and events[0].data["status"] == "waiting"
    record = events[1].data
    assert record["epoch"] == 0 and record["total_epochs"] == 4
    assert record["metrics"] == {"loss": pytest.approx(3.25)}
    assert record["duration_secs"] == 1.0
    assert record["elapsed_secs"] == 11.0
    assert record["eta_secs"] == pytest.approx(1.0 * 3)
    assert record["missing_ranks"] == []
    assert [g["throughput"] for g in record["gpu_metrics"]] == [0.02, 0.03]
    assert events[2].data["status"] == "training" and sink.status == "training"


def test_duplicate_metrics_before_close_last_write_wins() -> None:
    sink = registered(2)
    sink.apply(met(0, 0, loss=100.0, b=5, samples=9, epoch_ms=9000.0,
                   scalars={"acc": (9.0, 1), "gone": (1.0, 1)}), 1.0)
    sink.apply(met(0, 0, loss=2.0, scalars={"acc": (1.0, 1)}), 2.0)
    (record,) = of_kind(sink.apply(met(1, 0, loss=4.0, scalars={"acc": (3.0, 1)}), 3.0), "epoch")
    assert record["metrics"] == {"loss": 3.0, "acc": 2.0}  # nothing of the first report left
    assert record["duration_secs"] == 0.0
    assert [g["chunk_ratio"] for g in record["gpu_metrics"]] == [0.5, 0.5]
    assert sink.late_metrics == 0


def test_duplicate_metrics_after_close_is_late_but_resources_apply() -> None:
    sink = registered(2)
    sink.apply(met(0, 0), 1.0)
    sink.apply(met(1, 0), 1.0)
    events = sink.apply(met(0, 0, loss=50.0, resources=ResourceSample(cpu_percent=42.0)), 2.0)
    assert events == [] and sink.late_metrics == 1
    assert len(sink.records) == 1 and sink.records[0]["metrics"]["loss"] == 1.0
    assert sink.ranks()[0]["resources"]["cpu_percent"] == 42.0
    assert sink.ranks()[0]["loss"] == 1.0  # the dropped frame is not the rank's loss either
    # An epoch at or below the last closed one is late too, even one nobody sent before.
    sink.apply(met(0, 2), 3.0)
    sink.apply(met(1, 2), 3.0)
    sink.apply(met(1, 1), 4.0)
    assert sink.late_metrics == 2


def test_incomplete_epochs_force_closed_by_a_later_complete_one_in_order() -> None:
    sink = registered(3)
    sink.apply(met(0, 0, loss=1.0), 1.0)  # epoch 0: rank 0 only
    sink.apply(met(1, 1, loss=2.0), 1.0)  # epoch 1: rank 1 only
    sink.apply(met(0, 2), 2.0)
    sink.apply(met(1, 2), 2.0)
    events = sink.apply(met(2, 2), 3.0)  # epoch 2 complete: 0 and 1 close first
    records = of_kind(events, "epoch")
    assert [r["epoch"] for r in records] == [0, 1, 2]
    assert [r["missing_ranks"] for r in records] == [[1, 2], [0, 2], []]
    assert records[0]["metrics"]["loss"] == 1.0 and records[1]["metrics"]["loss"] == 2.0
    assert [e.seq for e in events if e.kind == "epoch"] == sink.record_seqs


def test_epoch_after_a_later_one_closed_is_late() -> None:
    sink = registered(2)
    sink.apply(met(0, 0), 1.0)
    sink.apply(met(0, 1), 1.0)
    sink.apply(met(1, 1), 1.0)  # closes 0 (missing rank 1) and 1
    sink.apply(met(1, 0), 2.0)
    assert sink.late_metrics == 1 and len(sink.records) == 2


def test_finishing_rank_lets_pending_epoch_close() -> None:
    sink = registered(3)
    sink.apply(met(0, 0), 1.0)
    sink.apply(met(1, 0), 1.0)
    events = sink.apply(fin(2), 2.0)
    (record,) = of_kind(events, "epoch")
    assert record["missing_ranks"] == [2]  # finished, but sent nothing for epoch 0
    # A finished rank is not waited for any more...
    assert of_kind(sink.apply(met(0, 1), 3.0), "epoch") == []
    assert of_kind(sink.apply(met(1, 1), 3.0), "epoch")[0]["missing_ranks"] == [2]


def test_finished_rank_report_counts_but_is_not_waited_for() -> None:
    sink = registered(2)
    sink.apply(met(0, 0, loss=2.0), 1.0)
    sink.apply(fin(0), 1.0)  # rank 0 is done; its epoch-0 report still counts
    (record,) = of_kind(sink.apply(met(1, 0, loss=4.0), 2.0), "epoch")
    assert record["metrics"]["loss"] == 3.0 and record["missing_ranks"] == []


def test_no_close_before_world_size_known() -> None:
    sink = RunSink(RUN)
    sink.apply(met(0, 0), 1.0)
    sink.apply(met(0, 1), 1.0)
    assert sink.records == []
    events = sink.apply(reg(0, 1), 2.0)
    assert [r["epoch"] for r in of_kind(events, "epoch")] == [0, 1]


def test_nan_loss_stays_nan_and_raises_alert() -> None:
    sink = registered(2)
    sink.tick(0.0)  # the registers' (coalesced) header goes out
    sink.apply(met(0, 3, loss=math.nan), 1.0)
    events = sink.apply(met(1, 3, loss=1.0), 2.0)
    (record,) = of_kind(events, "epoch")
    assert math.isnan(record["metrics"]["loss"])
    (alert,) = of_kind(events, "run")[0]["alerts"]
    assert alert["kind"] == "nonfinite_loss" and alert["rank"] is None and alert["at"] == 2.0
    assert "3" in alert["message"]
    assert math.isnan(sink.ranks()[0]["loss"])


def test_finite_loss_raises_no_alert() -> None:
    sink = registered(1)
    sink.apply(met(0, 0, loss=1e300), 1.0)
    assert sink.header()["alerts"] == []


def test_zero_batches() -> None:
    sink = registered(2)
    sink.apply(met(0, 0, loss=5.0, b=0, samples=8, epoch_ms=4.0, scalars={"acc": (1.0, 1)}), 1.0)
    (record,) = of_kind(sink.apply(met(1, 0, loss=7.0, b=0, scalars={"acc": (3.0, 1)}), 1.0), "epoch")
    assert record["metrics"] == {"loss": 0.0, "acc": 2.0}
    assert [g["chunk_ratio"] for g in record["gpu_metrics"]] == [0.5, 0.5]
    assert [g["throughput"] for g in record["gpu_metrics"]] == [2.0, 0.0]


def test_eta_and_elapsed_over_epochs() -> None:
    sink = RunSink(RUN)
    sink.apply(reg(0, 1, total_epochs=3), 100.0)
    sink.apply(met(0, 0, epoch_ms=2000.0), 110.0)
    rec1 = of_kind(sink.apply(met(0, 1, epoch_ms=4000.0), 120.0), "epoch")[0]
    assert rec1["elapsed_secs"] == 20.0 and rec1["eta_secs"] == pytest.approx(3.0)
    rec2 = of_kind(sink.apply(met(0, 2, epoch_ms=4000.0), 130.0), "epoch")[0]
    assert rec2["eta_secs"] is None  # nothing remains


# ---------------------------------------------------------------- resources in records


def test_record_resources_use_every_ranks_latest_sample() -> None:
    sink = registered(3, hosts=["a", "a", "b"])
    sink.apply(res(0, gpu_util_percent=10.0), 1.0)  # host a's first rank: no CPU reading
    sink.apply(res(1, cpu_percent=30.0, gpu_util_percent=20.0), 1.0)
    sink.apply(res(1, cpu_percent=50.0, gpu_util_percent=40.0), 2.0)  # latest wins
    sink.apply(res(2, cpu_percent=10.0), 2.0)  # rank 2 will not report the epoch
    sink.apply(met(0, 0), 3.0)
    sink.apply(met(1, 0), 3.0)
    (record,) = of_kind(sink.apply(fin(2), 4.0), "epoch")
    assert record["missing_ranks"] == [2]
    assert record["resources"]["cpu_percent"] == 30.0  # (a: 50 from rank 1, b: 10) / 2
    assert record["resources"]["gpu_util_percent"] == 25.0
    assert [g["device_index"] for g in record["gpu_metrics"]] == [0, 1]


def test_ranks_without_samples_and_without_any_sample() -> None:
    sink = registered(2)
    sink.apply(met(0, 0), 1.0)
    (record,) = of_kind(sink.apply(met(1, 0), 1.0), "epoch")
    assert record["resources"] == {
        "cpu_percent": None, "ram_used_bytes": None, "ram_total_bytes": None,
        "gpu_util_percent": None, "vram_allocated_bytes": None, "vram_total_bytes": None, "gpus": [],
    }
    assert sink.ranks()[0]["resources"] is None


def test_gpus_relabelled_including_unknown_host_and_later_register() -> None:
    sink = RunSink(RUN)
    sink.apply(reg(1, 3, "node-b", lr=2), 0.0)
    gpu = [GpuSample(device_index=0, name="H100", util_percent=5.0)]
    sink.apply(res(0, gpus=gpu), 1.0)  # rank 0 has not registered: no host
    sink.apply(res(1, gpus=gpu + [GpuSample(device_index=1, name="second")]), 1.0)
    sink.apply(res(2, cpu_percent=1.0), 1.0)  # no GPU: no entry
    sink.apply(met(0, 0), 2.0)
    sink.apply(met(1, 0), 2.0)
    (record,) = of_kind(sink.apply(met(2, 0), 2.0), "epoch")
    gpus = record["resources"]["gpus"]
    assert [(g["device_index"], g["name"]) for g in gpus] == [(0, "gr=0 H100"), (1, "node-b:lr=2 gr=1 H100")]
    assert all(list(g) == ["device_index", "name", "util_percent", "vram_allocated_bytes",
                           "vram_total_bytes", "temperature_c", "power_w"] for g in gpus)
    assert sink.ranks()[1]["resources"]["gpus"][0]["name"] == "H100"  # ranks keep the raw sample
    # Registering relabels the rank's GPU for the next record.
    sink.apply(reg(0, 3, "node-a", lr=0), 3.0)
    sink.apply(met(0, 1), 4.0)
    sink.apply(met(1, 1), 4.0)
    (record,) = of_kind(sink.apply(met(2, 1), 4.0), "epoch")
    assert record["resources"]["gpus"][0]["name"] == "node-a:lr=0 gr=0 H100"


def test_records_do_not_change_after_the_fact() -> None:
    sink = registered(1)
    sink.apply(res(0, cpu_percent=1.0, gpus=[GpuSample(device_index=0, name="g")]), 1.0)
    (record,) = of_kind(sink.apply(met(0, 0), 1.0), "epoch")
    frozen = msgspec.msgpack.encode(record)
    sink.apply(res(0, cpu_percent=2.0, gpus=[GpuSample(device_index=0, name="h")]), 2.0)
    sink.apply(reg(0, 1, "elsewhere"), 2.0)
    sink.apply(met(0, 1), 3.0)
    assert msgspec.msgpack.encode(sink.records[0]) == frozen


# ---------------------------------------------------------------- finish and completion


def test_all_finished_completes_once() -> None:
    sink = registered(2)
    assert sink.apply(fin(0), 1.0) == []
    events = sink.apply(fin(1), 2.0)
    assert kinds(events) == ["run", "complete"]
    assert events[0].data["status"] == "complete" and events[1].data == {"status": "complete"}
    assert sink.complete == (events[1].seq, "complete") and sink.finished
    assert sink.apply(fin(1), 3.0) == []  # idempotent
    assert sink.status == "complete"
    assert [r["status"] for r in sink.ranks()] == ["finished", "finished"]
    assert sink.snapshot()["complete"] == [events[1].seq, "complete"]


def test_any_error_fails_the_run_and_raises_alert() -> None:
    sink = registered(2)
    sink.apply(fin(1, "error"), 1.0)
    (alert,) = of_kind(sink.tick(1.0), "run")[0]["alerts"]
    assert (alert["kind"], alert["rank"], alert["at"]) == ("rank_error", 1, 1.0)
    events = sink.apply(fin(0), 2.0)
    assert of_kind(events, "complete") == [{"status": "failed"}]
    assert sink.status == "failed"
    assert [r["status"] for r in sink.ranks()] == ["finished", "error"]


def test_completion_needs_every_rank_of_the_world() -> None:
    sink = RunSink(RUN)
    sink.apply(reg(0, 3), 1.0)
    sink.apply(fin(0), 1.0)
    sink.apply(fin(2), 1.0)  # rank 1 never said anything
    assert not sink.finished and sink.complete is None


def test_other_frames_from_finished_rank_leave_it_finished() -> None:
    sink = registered(2)
    sink.apply(fin(0), 1.0)
    for frame in [res(0, cpu_percent=1.0), hw(0, "c | g"), met(0, 0), svg(0, "<svg/>"), meta(0, "1")]:
        sink.apply(frame, 2.0)
    entry = sink.ranks()[0]
    assert entry["status"] == "finished" and entry["last_seen"] == 2.0


def test_register_from_finished_rank_reopens_the_run() -> None:
    sink = registered(2)
    sink.apply(fin(0), 1.0)
    sink.apply(fin(1), 1.0)
    assert sink.status == "complete"
    assert sink.apply(reg(1, 2), 2.0) == []  # the reopened header is coalesced
    events = sink.tick(2.0)
    assert kinds(events) == ["run", "ranks"] and events[0].data["status"] == "waiting"
    assert sink.complete is None and not sink.finished
    assert sink.ranks()[1]["status"] == "ok"
    assert sink.snapshot()["complete"] is None
    # The reactivated rank is waited for again; the run can complete again.
    sink.apply(met(1, 0), 3.0)
    assert sink.status == "training"
    events = sink.apply(fin(1, "error"), 4.0)
    assert of_kind(events, "complete") == [{"status": "failed"}]


def test_reopen_after_records_is_training() -> None:
    sink = registered(1)
    sink.apply(met(0, 0), 1.0)
    sink.apply(fin(0), 2.0)
    sink.apply(reg(0, 1), 3.0)
    assert of_kind(sink.tick(3.0), "run")[0]["status"] == "training"


def test_reactivated_rank_is_waited_for_its_pending_epoch() -> None:
    sink = registered(3)
    sink.apply(met(0, 0), 1.0)
    sink.apply(fin(0), 1.0)
    sink.apply(reg(0, 3), 2.0)  # active again, its epoch-0 report counts again
    sink.apply(met(1, 0), 3.0)
    (record,) = of_kind(sink.apply(met(2, 0), 3.0), "epoch")
    assert record["missing_ranks"] == []


# ---------------------------------------------------------------- liveness


def test_stale_then_ok_via_tick_and_alert_stays() -> None:
    sink = registered(2, stale_after=30.0)  # registered at t=0
    sink.tick(0.0)  # the registers' (coalesced) header goes out
    sink.apply(res(1), 20.0)
    assert of_kind(sink.tick(29.9), "run") == []
    events = sink.tick(30.0)
    (header,) = of_kind(events, "run")
    assert header["alerts"] == [{"kind": "stale", "rank": 0, "message": header["alerts"][0]["message"], "at": 30.0}]
    assert [r["status"] for r in sink.ranks()] == ["stale", "ok"]
    assert of_kind(sink.tick(31.0), "run") == []  # not raised twice while stale
    sink.apply(res(0), 40.0)
    assert sink.ranks()[0]["status"] == "ok"
    assert [a["kind"] for a in sink.header()["alerts"]] == ["stale"]  # still listed
    # Rank 1 goes stale too (a second entry), then rank 0 again: its entry is updated in place.
    sink.tick(50.0)
    events = sink.tick(70.0)
    alerts = of_kind(events, "run")[0]["alerts"]
    assert [(a["rank"], a["at"]) for a in alerts] == [(0, 70.0), (1, 50.0)]


def test_finished_rank_never_goes_stale() -> None:
    sink = registered(2)
    sink.apply(fin(0), 1.0)
    sink.tick(1000.0)
    assert [r["status"] for r in sink.ranks()] == ["finished", "stale"]


def test_ranks_event_only_from_tick_and_rate_limited() -> None:
    sink = registered(2, ranks_interval=1.0)
    assert "ranks" not in kinds(sink.apply(res(0, cpu_percent=1.0), 0.5))
    (ranks,) = of_kind(sink.tick(0.5), "ranks")
    assert [r["rank"] for r in ranks] == [0, 1]
    assert sink.tick(0.6) == []  # nothing changed
    sink.apply(res(0, cpu_percent=2.0), 0.7)
    assert of_kind(sink.tick(0.9), "ranks") == []  # changed, but within the interval
    (ranks,) = of_kind(sink.tick(1.5), "ranks")
    assert ranks[0]["resources"]["cpu_percent"] == 2.0
    assert sink.tick(5.0) == []


def test_rank_entries() -> None:
    sink = RunSink(RUN)
    sink.apply(met(1, 4, loss=0.5), 1.0)  # before register: no host yet
    sink.apply(reg(0, 2, "h", lr=0), 2.0)
    sink.apply(hw(0, "cpu | gpu"), 3.0)
    sink.apply(res(0, cpu_percent=3.0), 4.0)
    r0, r1 = sink.ranks()
    assert r0 == {
        "rank": 0, "host": "h", "local_rank": 0, "status": "ok", "last_seen": 4.0, "epoch": None,
        "hardware": "cpu | gpu",
        "resources": {"cpu_percent": 3.0, "ram_used_bytes": None, "ram_total_bytes": None,
                      "gpu_util_percent": None, "vram_allocated_bytes": None, "vram_total_bytes": None,
                      "gpus": []},
        "step": None, "step_ms": None, "slowest_share": 0.0,
        "loss": None, "gpu_xids": None,
    }
    assert (r1["host"], r1["local_rank"], r1["epoch"], r1["loss"], r1["last_seen"]) == (None, None, 4, 0.5, 1.0)


def test_snapshot_shape() -> None:
    sink = registered(1)
    sink.apply(svg(0, "<svg/>"), 1.0)
    sink.apply(met(0, 0), 2.0)
    snap = sink.snapshot()
    assert list(snap) == ["run", "seq", "header", "ranks", "records", "complete", "svg",
                          "steps", "stacks"]
    assert snap["seq"] == sink.seq and snap["complete"] is None and snap["svg"] == "<svg/>"
    assert snap["records"] == [[sink.record_seqs[0], sink.records[0]]]
    msgspec.msgpack.encode(snap)  # plain values only


# ---------------------------------------------------------------- determinism


def _random_frames(seed: int, ws: int = 4, n: int = 400):
    rng = random.Random(seed)
    out = []
    t = 0.0
    for _ in range(n):
        t += rng.random() * 5
        rank = rng.randrange(ws + 1)
        kind = rng.randrange(8)
        if kind == 0:
            f = reg(rank, ws if rng.random() < 0.9 else ws + 1, rng.choice("ab"), lr=rng.randrange(3),
                    port=rng.choice([0, 1, 2]), total_epochs=rng.choice([0, 9]))
        elif kind == 1:
            f = res(rank, cpu_percent=rng.random(), gpus=[GpuSample(device_index=0, name="g")] * rng.randrange(2))
        elif kind == 2:
            f = hw(rank, rng.choice(["c", "c | g", "c | g | h"]))
        elif kind == 3:
            f = fin(rank, rng.choice(["ok", "error"]))
        elif kind == 4:
            f = meta(rank, rng.choice(["{}", "[1]", "{bad"]))
        elif kind == 5:
            f = svg(rank, rng.choice(["", "<svg/>"]), label="l")
        else:
            f = met(rank, rng.randrange(6), loss=rng.choice([1.0, 2.0, math.nan]), b=rng.randrange(3),
                    scalars={"acc": (rng.random(), rng.randrange(2))},
                    resources=ResourceSample(gpu_util_percent=1.0) if rng.random() < 0.3 else None)
        out.append((f, t))
    return out


def _replay(frames, sink: RunSink):
    events = []
    for frame, t in frames:
        try:
            events += sink.apply(frame, t)
        except Rejected as exc:
            events.append(("rejected", exc.reason))
        events += sink.tick(t)
    return msgspec.msgpack.encode(events), state(sink)


@pytest.mark.parametrize("seed", range(5))
def test_replay_is_deterministic(seed: int) -> None:
    frames = _random_frames(seed)
    assert _replay(frames, RunSink(RUN, stale_after=7.0)) == _replay(frames, RunSink(RUN, stale_after=7.0))


frame_strategy = st.builds(
    lambda kind, rank, epoch, ws, loss, port: [
        reg(rank, ws, "ab"[rank % 2], port=port),
        met(rank, epoch, loss=loss),
        fin(rank, "error" if epoch % 3 == 0 else "ok"),
        res(rank, cpu_percent=float(epoch)),
        meta(rank, "{bad" if epoch % 2 else "{}"),
    ][kind],
    st.integers(0, 4), st.integers(0, 5), st.integers(0, 4), st.integers(1, 5),
    st.sampled_from([0.5, math.nan]), st.sampled_from([0, 80, 81]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(frame_strategy, st.floats(0, 100)), max_size=40))
def test_invariants_under_any_frame_sequence(steps) -> None:
    sink = RunSink(RUN, stale_after=10.0, ranks_interval=0.0)
    last_seq = 0
    t = 0.0
    for frame, dt in steps:
        t += dt
        before = state(sink)
        try:
            events = sink.apply(frame, t)
        except Rejected:
            assert state(sink) == before  # no effect at all
            continue
        events += sink.tick(t)
        for e in events:
            assert e.seq == last_seq + 1
            last_seq = e.seq
    epochs = [r["epoch"] for r in sink.records]
    assert epochs == sorted(set(epochs))
    assert sink.record_seqs == sorted(sink.record_seqs)
    if sink.world_size is not None:
        assert all(r["rank"] < sink.world_size for r in sink.ranks())
        for record in sink.records:
            reported = [g["device_index"] for g in record["gpu_metrics"]]
            assert sorted(reported + record["missing_ranks"]) == list(range(sink.world_size))


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
    from broker.epochs import MAX_OPEN_EPOCHS

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
