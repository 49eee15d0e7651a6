"""The receive loop under a flood (issue 33): a batch that took a full receive queue, after a
batch that did too, waits briefly for ZeroMQ's refill instead of ending at the first empty
read; a burst after quiet never waits. Real PUSH/PULL sockets on loopback, the PULL with the
broker's receive HWM."""
from __future__ import annotations

import logging
from typing import Any, Iterator

import pytest
import zmq

from broker.ingest import IngestLoop
from broker.runs import Runs
from broker.server import INGEST_RCVHWM
from rank_agent.protocol import GpuSample, Resources, ResourceSample
from rank_agent.ratelimit import RateLimitedLog
from tests.support.frames import enc, register
from tests.support.polling import wait_for

RUN = "flood"
FLOOD = 4  # a "full queue" for these tests (the broker's is INGEST_RCVHWM)


def sample(rank: int, i: int) -> bytes:
    return enc(Resources(run=RUN, rank=rank, sample=ResourceSample(
        cpu_percent=float(i % 100), gpus=[GpuSample(device_index=0, name="H100")])))


@pytest.fixture
def sockets() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.rcvhwm = INGEST_RCVHWM
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.connect(f"tcp://127.0.0.1:{port}")
    yield pull, push
    push.close(0)
    pull.close(0)
    ctx.term()


def loop() -> tuple[IngestLoop, Runs]:
    runs = Runs(hold_samples=True)
    ingest = IngestLoop(runs, 1000, RateLimitedLog(logging.getLogger(__name__)), flood_after=FLOOD)
    ingest.flood_wait_ms = 1000  # long enough for loopback under load (the batch's last wait
    # times out: the flood is over)
    ingest.flood_batch_s = 30.0
    runs.ingest(enc(register(RUN, 0, 8)), 1.0)
    return ingest, runs


def drain_all(ingest: IngestLoop, pull: zmq.Socket, runs: Runs, n: int) -> None:
    """Drain until ``n`` more frames were accepted (the first batch of a flood ends dry)."""
    want = runs.accepted + n

    def done() -> bool:
        if pull.poll(50):
            ingest.drain(pull, 2.0)
        return runs.accepted >= want
    wait_for(done, 15, "the frames")


class PollSpy:
    """Stands in for ``zmq.zmq_poll`` around a drain: counts the waits and, at the first,
    sends ``late`` (the frame that arrives while the batch waits), then polls for real."""

    def __init__(self, push: zmq.Socket, late: bytes | None) -> None:
        self.push, self.late, self.calls = push, late, 0
        self.real = zmq.zmq_poll

    def __call__(self, items: Any, timeout: int) -> Any:
        self.calls += 1
        if self.late is not None:
            self.push.send(self.late)
            self.late = None
        return self.real(items, timeout)

    def __enter__(self) -> PollSpy:
        zmq.zmq_poll = self  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        zmq.zmq_poll = self.real  # type: ignore[assignment]


def test_a_floods_batch_waits_for_the_refill(sockets: tuple[zmq.Socket, zmq.Socket]) -> None:
    pull, push = sockets
    ingest, runs = loop()
    for i in range(FLOOD):
        push.send(sample(i % 8, i))
    drain_all(ingest, pull, runs, FLOOD)  # a full queue's batch: the next one is a flood's
    for i in range(FLOOD + 1):
        push.send(sample(i % 8, i))
    wait_for(lambda: pull.poll(0), 15, "the second burst")
    base = runs.accepted
    with PollSpy(push, sample(7, 99)) as spy:
        ingest.drain(pull, 3.0)
    # one batch: the burst, then the frame that came while it waited (a burst the I/O
    # thread had not queued yet when the loop ran dry only adds waits)
    assert spy.calls >= 1 and runs.accepted - base == FLOOD + 2
    assert runs.rejected_total == 0


def test_a_burst_after_quiet_never_waits(sockets: tuple[zmq.Socket, zmq.Socket]) -> None:
    pull, push = sockets
    ingest, runs = loop()
    for i in range(2 * FLOOD):
        push.send(sample(i % 8, i))
    wait_for(lambda: pull.poll(0), 15, "the burst")
    with PollSpy(push, None) as spy:
        ingest.drain(pull, 2.0)  # the batch before it was not a flood's: it ends dry
    assert spy.calls == 0 and 1 <= runs.accepted - 1 <= 2 * FLOOD
