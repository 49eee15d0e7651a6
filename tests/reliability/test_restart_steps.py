"""Closed steps survive a SIGKILLed broker (PROTOCOL 2.4: "Closed steps ... survive a broker
restart exactly as epoch records do"; section 6 "Persistence").

A real ``rankboard broker`` process, real ``steps`` frames on a plain PUSH socket (no
RankAgent: the frames are encoded here), a feed client watching the published ``steps``
events, SIGKILL, a restart on the same data dir and ports, and the snapshot ROUTER asked for
the run: every step published before the kill is there, byte for byte, and the run keeps
closing steps after it. Every wait polls against a deadline.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import zmq

from broker import feed
from broker.run.steps.store import SAMPLES_PER_S, STEP_MS, StepStore, wire_records
from rank_agent.protocol import Register, Steps
from tests.support.brokers import FeedClient, Pusher
from tests.support.procs import Proc, no_traceback, start_broker

RUN = "steps-crash"
WORLD = 2


def steps_frame(rank: int, steps: range, *, nan_at: int = -1) -> Steps:
    s = list(steps)
    return Steps(
        run=RUN, rank=rank, steps=s, times=[time.time()] * len(s),
        step_ms=[100.0 + rank * 10 + (k % 7) for k in s],
        samples=[32] * len(s), tokens=[4096] * len(s),
        metrics={"loss": [math.nan if k == nan_at else 1.0 / (k + 1) + 0.1 * rank for k in s],
                 "lr": [1e-3 if k % 2 else None for k in s]})


def snapshot_store(client: FeedClient) -> tuple[StepStore, dict[str, Any]]:
    snaps, _ = client.snapshot(RUN)
    assert len(snaps) == 1
    store = StepStore()
    store.extend_wire(snaps[0]["steps"])
    return store, snaps[0]


def wire_bytes(store: StepStore) -> bytes:
    """Every array of the store, as the wire carries them (exact, NaN-safe)."""
    return msgspec.msgpack.encode(store.to_wire())


def answers(store: StepStore) -> bytes:
    out: list[Any] = [store.metric_names(), "".join(store.csv_rows())]
    for m in store.metric_names() + [STEP_MS, SAMPLES_PER_S]:
        out.append(store.series(m, None, None, 10_000))
        out.append(store.series(m, None, None, 5))
    return msgspec.msgpack.encode(out)


class Watcher:
    """Collects the run's ``steps`` events (and every id) and the latest heartbeat."""

    def __init__(self, client: FeedClient) -> None:
        self.client = client
        self.records: list[dict[str, Any]] = []
        self.seqs: list[int] = []
        self.heartbeat: feed.Heartbeat | None = None

    def pump_until(self, predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {what}; steps so far: " \
                             f"{[r['step'] for r in self.records][-5:]}"
            if not self.client.sub.poll(int(min(left, 0.5) * 1000)):
                continue
            update = feed.decode_update(self.client.sub.recv_multipart())
            if isinstance(update, feed.Heartbeat):
                self.heartbeat = update
            elif isinstance(update, feed.EventUpdate) and update.run == RUN:
                self.seqs.append(update.seq)
                if update.kind == "steps":
                    self.records += wire_records(update.data)

    def steps(self) -> list[int]:
        return [r["step"] for r in self.records]


def test_broker_sigkill_keeps_every_published_step_and_closes_after_it(
        spawn: Callable[..., Proc], tmp_path: Path, ctx: zmq.Context) -> None:
    data = tmp_path / "data"
    broker, eps = start_broker(spawn, data)
    client = FeedClient(ctx, eps.publish, eps.snapshot)
    pusher = Pusher(eps.ingest)
    watch = Watcher(client)
    try:
        # the SUB is connected once heartbeats arrive (no event may be missed)
        watch.pump_until(lambda: watch.heartbeat is not None, "a heartbeat")
        for r in range(WORLD):
            pusher.send(Register(run=RUN, rank=r, world_size=WORLD, host=f"n{r}"))
        for k in range(0, 200, 20):
            for r in range(WORLD):
                pusher.send(steps_frame(r, range(k, k + 20), nan_at=77))
        # rank 0 runs ahead: 200..209 are accepted but open at the kill (and lost with it:
        # steps frames are not journaled, only closed steps are)
        pusher.send(steps_frame(0, range(200, 210)))
        watch.pump_until(lambda: watch.steps()[-1:] == [199], "steps 0..199 published")
        assert watch.steps() == list(range(200))
        assert all(r["n"] == WORLD for r in watch.records)
        before, snap = snapshot_store(client)
        assert [int(s) for s in before.column("step")] == list(range(200))
        head = snap["header"]
        assert head["steps_done"] == 199 and head["status"] == "training"
        assert head["step_metrics"] == ["loss", "lr"]
        assert [a["message"] for a in head["alerts"]] == [  # (v5, 8.3: the first NaN too)
            "step 77: loss is nan", "loss is nan at step 77: first non-finite loss (2 ranks)"]
        # the published records and the snapshot agree
        published = StepStore()
        published.append(watch.records)
        assert answers(published) == answers(before)
        issued = max(watch.seqs)
        seen_before = len(watch.seqs)

        broker.proc.kill()  # SIGKILL: no close(), no final flush
        assert broker.proc.wait(10) == -9
        broker2, _ = start_broker(spawn, data, endpoints=eps)

        # the SUB has reconnected once the new broker's heartbeats arrive (what the new
        # broker publishes before that is lost to this subscriber, as to any)
        first = watch.heartbeat
        assert first is not None
        watch.pump_until(lambda: watch.heartbeat is not None
                         and watch.heartbeat.instance != first.instance,
                         "a heartbeat of the restarted broker")

        after, snap2 = snapshot_store(client)
        assert wire_bytes(after) == wire_bytes(before)  # every step, identical
        assert answers(after) == answers(before)
        assert snap2["header"]["steps_done"] == 199
        assert snap2["header"]["step_metrics"] == ["loss", "lr"]
        assert [a["message"] for a in snap2["header"]["alerts"]] == [
            "step 77: loss is nan", "loss is nan at step 77: first non-finite loss (2 ranks)"]
        assert snap2["seq"] > issued

        # the run goes on: rank 0's pre-kill points for 200..209 are gone, rank 1's close
        # them; a point at or below 199 is late (dropped and counted)
        pusher.send(steps_frame(0, range(195, 220)))
        pusher.send(steps_frame(1, range(200, 220)))
        watch.pump_until(lambda: watch.steps()[-1:] == [219], "steps 200..219 published")
        assert watch.steps() == list(range(220))
        new = watch.records[200:]
        assert [r["n"] for r in new] == [WORLD] * 20  # rank 0 re-sent 200..209 after restart
        later = watch.seqs[seen_before:]
        assert later and min(later) > issued and later == sorted(set(later))
        watch.pump_until(lambda: watch.heartbeat is not None and watch.heartbeat.late_steps == 5,
                         "late_steps 5 on the heartbeat")
        final, _ = snapshot_store(client)
        assert [int(s) for s in final.column("step")] == list(range(220))
        assert final.to_wire(0, 200) == before.to_wire(0, 200)
        no_traceback(broker2)
    finally:
        pusher.close()
        client.close()
