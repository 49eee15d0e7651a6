"""Fixtures for the agent tests: a real ZeroMQ PULL receiver on loopback, and agents that
are always closed. Only rank_agent, zmq, msgspec, psutil, pytest and the stdlib are used, so
these tests run in the tox ``agent`` env (no broker, web, gevent, Flask or torch)."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator, List

import pytest
import zmq

from rank_agent import RankAgent
from rank_agent.protocol import decode


class Receiver:
    """A stand-in broker ingest: a PULL socket bound to a random loopback port."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.frames: List[Any] = []

    def _pump(self, deadline: float) -> bool:
        left_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if not self.sock.poll(left_ms):
            return False
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            self.frames.append(decode(data))

    def wait_for(self, pred: Callable[[List[Any]], bool], timeout: float = 10.0) -> List[Any]:
        """Receive until ``pred(all frames so far)`` holds; fail the test at the deadline."""
        deadline = time.monotonic() + timeout
        while not pred(self.frames):
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out; got {len(self.frames)} frames: {self.frames[-5:]!r}")
            self._pump(deadline)
        return self.frames

    def wait_count(self, n: int, timeout: float = 10.0) -> List[Any]:
        return self.wait_for(lambda fs: len(fs) >= n, timeout)

    def of_type(self, cls: type) -> List[Any]:
        return [f for f in self.frames if isinstance(f, cls)]

    def close(self) -> None:
        """Idempotent, so a test can kill "the broker" early and the fixture still cleans up."""
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def make_agent() -> Iterator[Callable[..., RankAgent]]:
    """Build agents that are closed at teardown whatever the test did."""
    agents: List[RankAgent] = []

    def make(**kwargs: Any) -> RankAgent:
        kwargs.setdefault("run", "test-run")
        kwargs.setdefault("rank", 0)
        kwargs.setdefault("world_size", 1)
        kwargs.setdefault("linger_ms", 200)
        agent = RankAgent(**kwargs)
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        agent.close()


@pytest.fixture
def dead_endpoint() -> str:
    """An endpoint nothing listens on (TCP port 1 on loopback: privileged, never served in
    test environments), so ZeroMQ keeps reconnecting and queued frames never leave."""
    return "tcp://127.0.0.1:1"
