"""Fixtures for the agent tests: a real ZeroMQ PULL receiver on loopback, and agents that
are always closed. Only rank_agent, zmq, msgspec, psutil, pytest and the stdlib are used, so
these tests run in the tox ``agent`` env (no broker, web, gevent, Flask or torch)."""
from __future__ import annotations

from typing import Any, Callable, Iterator, List

import pytest

from rank_agent import RankAgent
from tests.support.agent import Publisher, Receiver


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


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    """A stand-in for the broker's publish socket (requests for dumps, to the agents)."""
    p = Publisher()
    try:
        yield p
    finally:
        p.close()
