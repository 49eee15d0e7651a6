"""The run's hardware string (PROTOCOL.md 3: ``hardware`` in the header), driven through the
sink with frames: grouped by host, exact while it fits, then folded, then cut between parts
with a count, and small at 65,536 ranks with 4,096-character summaries."""
from __future__ import annotations

import re
import time
import tracemalloc

from broker.run.sink import RunSink
from broker.run.topology import MAX_HARDWARE_BYTES, HardwareString, Topology
from rank_agent.protocol import (
    Hardware,
    Register,
    decode,
    encoder,
)
from tests.support.sinkframes import (
    RUN,
    hw,
    of_kind,
    reg,
)


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
