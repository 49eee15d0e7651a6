"""The receive loop under a flood (issue 33): a batch that took a full receive queue, after a
batch that did too, gives way to ZeroMQ's I/O thread for the refill instead of ending at the
first empty read, and ends when none came; a burst after quiet never waits. Real PUSH/PULL
sockets on loopback, the PULL with the broker's receive HWM."""
from __future__ import annotations

import logging
import os
from typing import Any, Iterator

import pytest
import zmq

from broker.ingest import FLOOD_SPINS, IngestLoop
from broker.runs import Runs
from broker.server import INGEST_RCVHWM
from rank_agent.protocol import GpuSample, Resources, ResourceSample
from rank_agent.ratelimit import RateLimitedLog
from tests.support.frames import enc, register
from tests.support.polling import wait_for

RUN = "flood"
FLOOD = 1  # a "full queue" for these tests (the broker's is INGEST_RCVHWM): with one, what
# is queued when a drain starts is known exactly (a poll says one message is there)


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
    ingest.flood_batch_s = 30.0
    runs.ingest(enc(register(RUN, 0, 8)), 1.0)
    return ingest, runs


class NapSpy:
    """The loop's yield around a drain: counts the yields and, at the first, sends ``late``
    (the frame that arrives while the batch waits for a refill), then yields for real."""

    def __init__(self, ingest: IngestLoop, pull: zmq.Socket, push: zmq.Socket,
                 late: bytes | None) -> None:
        self.ingest, self.ingest_socket, self.push = ingest, pull, push
        self.late, self.calls = late, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.late is not None:
            self.push.send(self.late)
            self.late = None
            # (the frame crosses loopback and the I/O thread: give it time, by the clock,
            # not by a count of yields the loop happens to make)
            wait_for(lambda: self.ingest_socket.get(zmq.EVENTS) & zmq.POLLIN, 15, "the frame")
        os.sched_yield()

    def __enter__(self) -> NapSpy:
        self.ingest.nap = self
        return self

    def __exit__(self, *exc: Any) -> None:
        self.ingest.nap = os.sched_yield


def test_a_floods_batch_waits_for_the_refill(sockets: tuple[zmq.Socket, zmq.Socket]) -> None:
    pull, push = sockets
    ingest, runs = loop()
    push.send(sample(0, 0))
    wait_for(lambda: pull.poll(0), 15, "the first frame")
    with NapSpy(ingest, pull, push, None) as spy:
        ingest.drain(pull, 2.0)  # a full queue's batch after quiet: it ends dry, and the
    assert spy.calls == 0        # next batch is a flood's
    base = runs.accepted
    push.send(sample(1, 1))
    wait_for(lambda: pull.poll(0), 15, "the second frame")
    with NapSpy(ingest, pull, push, sample(7, 99)) as spy:
        ingest.drain(pull, 3.0)
    # one batch: the frame, then the one that came while it waited for a refill; then
    # FLOOD_SPINS yields brought nothing and ended it
    assert spy.calls == 1 + FLOOD_SPINS
    assert runs.accepted - base == 2 and runs.rejected_total == 0


def test_a_burst_after_quiet_never_waits(sockets: tuple[zmq.Socket, zmq.Socket]) -> None:
    pull, push = sockets
    ingest, runs = loop()
    for i in range(8):
        push.send(sample(i % 8, i))
    wait_for(lambda: pull.poll(0), 15, "the burst")
    with NapSpy(ingest, pull, push, None) as spy:
        ingest.drain(pull, 2.0)  # the batch before it was not a flood's: it ends dry
    assert spy.calls == 0 and 1 <= runs.accepted - 1 <= 8
