"""One snapshot (issue 44 item 6): a rank's ``stalled`` status and the ``stalled`` alert it
raised reach ``/api/runs/<run>`` together. A reader of one answer must never see a rank
``stalled`` whose alert the header does not list.

Why this needs a test of its own: the broker coalesces the header (``run`` event) and the
``ranks`` array to about once a second each, on timers of their own. A rank sampling its
resources keeps the ranks array dirty, so the two timers drift apart; a stall dump arriving
between them then showed the rank ``stalled`` in the ranks array up to a second before the
header listed its alert (4 of 7 tries of a 3-rank hang, read over HTTP). The hang here is the
wire's: three ranks sampling as an agent does, each sending its ``stall`` dump a few tenths
of a second after the one before (so the dumps land on either side of a ``ranks`` event),
while the test reads ``/api/runs/<run>`` as fast as the web answers.

Real parts: a broker in a thread on loopback ZeroMQ sockets, a real ``rankboard web``
subprocess, real wire frames. Nothing sleeps to synchronise: the frames are paced by the
clock and the reads poll against a deadline.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from rank_agent import protocol as wire
from tests.support.brokers import Broker, Pusher
from tests.support.http import SSEClient, fetch, get_json
from tests.support.polling import wait_for
from tests.support.procs import Proc, start_web

WORLD = 3
#: Seconds from the registers to the first sample: past the broker's one-second interval,
#: so the first sample's ``ranks`` event goes out at once and sets the ranks timer's phase.
QUIET = 1.3
#: Seconds from the first sample to the first stall dump: half-way through the ranks
#: timer's second, so the header with its alert goes out then, half a second out of phase,
#: and cannot go again for a second.
FIRST_DUMP = 0.45
#: Seconds between one rank's stall dump and the next, one value a try: the later dumps
#: arrive before the next ``ranks`` event, which shows them ``stalled`` half a second
#: before the header may list their alerts.
DUMP_GAPS = (0.2, 0.15, 0.25)
#: Seconds between resource samples (each rank), as a sampler keeps the ranks array dirty.
SAMPLE_GAP = 0.1


def sample(run: str, rank: int) -> wire.Resources:
    return wire.Resources(run=run, rank=rank, sample=wire.ResourceSample(cpu_percent=50.0))


def stall_dump(run: str, rank: int) -> wire.Stacks:
    thread = wire.ThreadStack(name="MainThread", main=True, frames=[
        wire.StackFrame(file="/job/train.py", line=7, function="all_reduce", code="wait()")])
    return wire.Stacks(run=run, rank=rank, reason="stall", taken_at=time.time(), idle_s=2.0,
                       threads=[thread])


def torn(answer: dict[str, Any]) -> list[int]:
    """The ranks ``answer`` shows ``stalled`` without a ``stalled`` alert of theirs listed."""
    alerted = {a.get("rank") for a in answer.get("alerts") or [] if a.get("kind") == "stalled"}
    return [r["rank"] for r in answer.get("ranks") or []
            if r.get("status") == "stalled" and r["rank"] not in alerted]


def hang_and_read(port: int, pusher: Pusher, run: str, gap: float
                  ) -> tuple[int, list[tuple[int, list[int]]]]:
    """Hang ``run``'s three ranks one dump at a time while sampling, reading the run after
    every send; returns (answers read, the torn ones as (answer index, ranks))."""
    for rank in range(WORLD):
        pusher.register(run, rank, WORLD)

    def get_ok() -> Any:
        return get_json(port, f"/api/runs/{run}")

    wait_for(lambda: fetch(port, f"/api/runs/{run}").status == 200
             and len(get_ok()["ranks"]) == WORLD, timeout=30.0, what=f"{run} at the web")
    start = time.monotonic() + QUIET  # (read while waiting, as after)
    next_sample, dumped, reads, bad = start, 0, 0, []
    all_seen_at: float | None = None
    while True:
        now = time.monotonic()
        assert now - start < 60.0, f"the hang of {run} never showed whole at the web"
        if next_sample <= now:
            pusher.send(*(sample(run, r) for r in range(WORLD)))
            next_sample = now + SAMPLE_GAP
        if dumped < WORLD and now >= start + FIRST_DUMP + dumped * gap:
            pusher.send(stall_dump(run, dumped))
            dumped += 1
        answer = get_ok()
        reads += 1
        if gone := torn(answer):
            bad.append((reads, gone))
        stalled = [r for r in answer["ranks"] if r.get("status") == "stalled"]
        if len(stalled) == WORLD and all_seen_at is None:
            all_seen_at = now
        if all_seen_at is not None and now - all_seen_at > 1.5:
            return reads, bad  # every rank stalled, and read for a while after


def stream_tears(events: list[dict[str, Any]]) -> list[tuple[str, list[int]]]:
    """In stream order: each ``ranks`` event (by id) showing ranks ``stalled`` whose alert no
    ``run`` event before it listed."""
    alerted: set[int] = set()
    bad = []
    for ev in events:
        if ev["event"] == "run":
            alerted = {a.get("rank") for a in ev["data"].get("alerts") or []
                       if a.get("kind") == "stalled"}
        elif ev["event"] == "ranks":
            gone = [r["rank"] for r in ev["data"]
                    if r.get("status") == "stalled" and r["rank"] not in alerted]
            if gone:
                bad.append((ev["id"], gone))
    return bad


def test_the_stream_never_sends_a_status_before_its_alert(
        spawn: Callable[..., Proc], broker: Broker, pusher: Pusher) -> None:
    """The same hang on the SSE stream: every ``ranks`` event that shows a rank ``stalled``
    comes after a ``run`` event that lists its alert."""
    port = start_web(spawn, broker).wait_dashboard()
    run = "hang-sse"
    pusher.register(run, 0, WORLD)  # the run exists, so its stream opens at once
    wait_for(lambda: fetch(port, f"/api/runs/{run}").status == 200, timeout=30.0,
             what=f"{run} at the web")
    events: list[dict[str, Any]] = []
    with SSEClient(port, f"/api/runs/{run}/events") as client:
        def read() -> None:
            try:
                while (ev := client.next_event()) is not None:
                    events.append(ev)
            except OSError:
                pass  # closed under us at the end

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        hang_and_read(port, pusher, run, DUMP_GAPS[0])
        wait_for(lambda: any(e["event"] == "ranks" and sum(
            r.get("status") == "stalled" for r in e["data"]) == WORLD for e in events),
            timeout=15.0, what="the whole hang on the stream")
    reader.join(10)
    assert stream_tears(events) == [], stream_tears(events)[:3]


def test_a_status_never_reaches_the_api_without_its_alert(
        spawn: Callable[..., Proc], broker: Broker, pusher: Pusher) -> None:
    port = start_web(spawn, broker).wait_dashboard()
    results = [hang_and_read(port, pusher, f"hang-{i}", gap) for i, gap in enumerate(DUMP_GAPS)]
    assert all(reads > 30 for reads, _ in results), results  # read often enough to see it
    torn_tries = [(i, bad[:3]) for i, (_, bad) in enumerate(results) if bad]
    assert not torn_tries, f"stalled without its alert (try, [(read, ranks)]): {torn_tries}"
