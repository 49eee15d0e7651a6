"""Hostile input through the REAL PULL socket of a real ``rankboard broker`` process: random
and malformed frames interleaved with a checkable valid run (tests/support/fuzzgen.py, pushed
and checked by tests/support/fuzzrun.py).
Zero crashes, every valid frame applied, every frame counted by reason, and the counts on the
web's /metrics. The long run is ``python bench/fuzz_ingest.py`` (>= 100 000 frames)."""
from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Callable

import pytest

from broker import feed
from broker.runs import Runs
from broker.snapshots import msgpack_ints
from rank_agent import protocol as P
from tests.support import fuzzgen, fuzzreplay, fuzzrun
from tests.support.brokers import Pusher
from tests.support.http import fetch
from tests.support.polling import wait_for
from tests.support.procs import Proc, no_traceback, start_broker, start_web

FRAMES = 5000
SEED = 20261129


def test_generator_is_deterministic_and_covers_every_kind() -> None:
    a, epochs = fuzzgen.generate(2000, SEED)
    b, _ = fuzzgen.generate(2000, SEED)
    assert a == b and len(a) == 2000 and epochs >= 2
    kinds = {m.kind for m in fuzzgen.generate(20_000, SEED, big=False)[0]}
    assert kinds >= {name for name, _ in fuzzgen.WEIGHTS} - {"oversize"}


@pytest.mark.parametrize("seed", [SEED, 7])
def test_fuzzed_ingest_in_process_counts_within_bounds_and_closes_every_check_step(
        seed: int, caplog: pytest.LogCaptureFixture) -> None:
    """The same traffic straight into ``Runs.ingest`` (no sockets, a fake clock ticking):
    every counter within what the generator expects, no internal error, and the check
    steps run closed exactly as PROTOCOL 2.4 says."""
    caplog.set_level(logging.CRITICAL)  # thousands of rate-limited reject lines
    msgs, _ = fuzzgen.generate(FRAMES, seed, big=False)
    runs = Runs(max_runs=100_000)
    now = 1_800_000_000.0
    for i, m in enumerate(msgs):
        now += 0.001
        runs.ingest(m.data, now)
        if i % 50 == 0:
            runs.tick(now)
    observed = dict(runs.rejected, accept=runs.accepted)
    assert "internal" not in observed
    limits = fuzzrun.bounds(msgs)
    for outcome, count in observed.items():
        lo, hi = limits.get(outcome, (0, 0))
        assert lo <= count <= hi, (outcome, count, lo, hi)
    assert observed["steps_shape"] > 0 and runs.late_steps > 0
    problems: list[str] = []
    (snap,) = runs.snapshot(fuzzgen.CHECK_STEPS_RUN)
    want = fuzzgen.expected_check_steps(fuzzgen.check_steps_blocks(msgs))
    assert len(want) >= 2 * fuzzgen.CHECK_STEP_BLOCK
    assert fuzzrun.check_steps_result(snap, want, problems) == set() and problems == []
    assert snap["header"]["status"] == "complete"
    for run in runs:  # every run still servable as a snapshot (as the server encodes it)
        (one,) = runs.snapshot(run)
        sink = runs.get(run)
        assert sink is not None
        closed = sink.steps.column("step").tolist()  # each step closed once, ascending
        assert closed == sorted(set(closed)) and all(sink.steps.column("n") >= 1)
        try:
            feed.encode_run_snapshot(one)
        except OverflowError:  # summed byte counts past 64 bits: widened, as the server does
            feed.encode_run_snapshot(msgpack_ints(one))


@pytest.mark.parametrize("seed", [SEED, 7])
def test_fuzzed_frames_accepted_live_replay_from_the_journal_to_the_live_state(
        seed: int, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 38: the frames a broker accepted live, journaled as the server journals them,
    replayed as a restart replays them (tests/support/fuzzreplay.py), with issue 38's
    frames among them (the 89-byte data wait, a group id "²"): no exception, nothing set
    aside, and every run's replayed state is its live state."""
    caplog.set_level(logging.CRITICAL)
    msgs, _ = fuzzgen.generate(FRAMES, seed, big=False)
    traffic = fuzzreplay.extremes(random.Random(seed), [m.data for m in msgs])
    live, replayed, journal = fuzzreplay.journal_and_replay(traffic, tmp_path / "data")
    try:
        assert "internal" not in live.rejected
        assert journal.counters()["unreplayable_entries"] == 0
        assert journal.counters()["damaged_entries"] == 0
        assert "run-01" in replayed and "run-02" in replayed
        assert replayed["run-01"].steps.rows == 1
        assert fuzzreplay.differences(live, replayed) == []
    finally:
        journal.close()


def test_fuzzed_ingest_no_crash_no_valid_frame_lost_rejects_counted(
        spawn: Callable[..., Proc], tmp_path: Path) -> None:
    msgs, epochs = fuzzgen.generate(FRAMES, SEED)
    msgs.append(fuzzgen._Hostile(__import__("random").Random(1), True).oversize())
    broker, eps = start_broker(spawn, tmp_path / "data", "--max-runs", "100000")
    web = start_web(spawn, eps)
    report = fuzzrun.run_fuzz(eps.ingest, eps.publish, eps.snapshot, msgs, epochs,
                              alive=lambda: broker.proc.poll() is None)
    print("\n" + "\n".join(report.lines()))
    assert report.broker_alive
    assert report.problems == []
    assert report.valid_lost == 0 and report.check_records == epochs
    assert report.check_steps > 0 and report.check_steps_closed == report.check_steps
    assert report.steps_frames_lost == 0 and report.steps_closed >= report.check_steps
    assert report.rejected.get("internal", 0) == 0

    # the web's /metrics shows the same totals, by reason
    def scraped() -> dict[str, float] | None:
        found: dict[str, float] = {}
        for line in fetch(web.port, "/metrics").text.splitlines():
            if line.startswith("rankboard_frames_rejected_total{reason="):
                reason = line.split('"')[1]
                found[reason] = float(line.rsplit(" ", 1)[1])
        return found if found == {k: float(v) for k, v in report.rejected.items()} else None

    wait_for(scraped, what="/metrics to show the broker's reject counters")
    assert fetch(web.port, "/healthz").status == 200
    assert broker.proc.poll() is None
    no_traceback(broker, web)


def test_byte_counts_summing_past_64_bits_neither_crash_nor_lose_the_record(
        spawn: Callable[..., Proc], tmp_path: Path) -> None:
    """Every wire integer fits MessagePack, but a cluster's summed RAM of four hosts each
    claiming 2**64-1 bytes does not: the record and the run's snapshot must still go out."""
    broker, eps = start_broker(spawn, tmp_path / "data")
    web = start_web(spawn, eps)
    pusher = Pusher(eps.ingest)
    try:
        huge = 2**64 - 1
        for rank in range(4):
            pusher.register("wide", rank, 4, host=f"host-{rank}", local_rank=0)
            pusher.send(P.Resources(run="wide", rank=rank, sample=P.ResourceSample(
                cpu_percent=1.0, ram_used_bytes=huge, ram_total_bytes=huge,
                vram_allocated_bytes=huge, vram_total_bytes=huge)))
        pusher.epoch("wide", 0, 4)
        pusher.register("after", 0, 1)  # the broker still serves after it

        def record() -> dict | None:
            r = fetch(web.port, "/api/runs/wide")
            recs = r.json()["records"] if r.status == 200 else []
            return recs[0] if recs else None

        rec = wait_for(record, what="the wide record on the web")
        assert rec["resources"]["ram_used_bytes"] == float(4 * huge)
        assert rec["resources"]["vram_total_bytes"] == float(4 * huge)
        wait_for(lambda: fetch(web.port, "/api/runs/after").status == 200, what="next run")
        assert broker.proc.poll() is None
        no_traceback(broker, web)
    finally:
        pusher.close()
