"""Fixtures for the agent tests: a real ZeroMQ PULL receiver on loopback, and agents that
are always closed. Only rank_agent, zmq, msgspec, psutil, pytest and the stdlib are used, so
these tests run in the tox ``agent`` env (no broker, web, gevent, Flask or torch)."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator, List

import pytest
import zmq

from rank_agent import RankAgent
from rank_agent.protocol import Register, decode


class Receiver:
    """A stand-in broker ingest: a PULL socket bound to a random loopback port."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.frames: List[Any] = []
        #: every frame, the agents' implicit registers included (``frames`` leaves those out)
        self.all_frames: List[Any] = []
        self._heard: set[tuple[str, int]] = set()

    def _pump(self, deadline: float) -> bool:
        left_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if not self.sock.poll(left_ms):
            return False
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            self._keep(decode(data))

    def _keep(self, frame: Any) -> None:
        """An agent's first frame is a ``register`` (its own, or the implicit one it sends
        ahead of any other first frame, PROTOCOL.md section 5): it is kept in ``all_frames``
        and ``registers``, and left out of ``frames``, so that each test sees the frames its
        own calls produced. ``test_implicit_register`` checks the implicit one itself."""
        self.all_frames.append(frame)
        who = (frame.run, frame.rank)
        first = who not in self._heard
        self._heard.add(who)
        if first and isinstance(frame, Register) and frame.port == 0 and frame.total_epochs == 0:
            return
        self.frames.append(frame)

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


_LAUNCHER_VARS = (
    "RANKBOARD_BROKER", "RANKBOARD_RUN", "RANKBOARD_HOST", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
    "SLURM_NPROCS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_ID",
)


@pytest.fixture
def launcher_env(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """A process environment with no launcher variables; call it to set some."""
    for name in _LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)

    def set_(**values: str) -> None:
        for k, v in values.items():
            monkeypatch.setenv(k, v)

    return set_
