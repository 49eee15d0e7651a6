"""The agent's broker list (PROTOCOL 7.3): real PULL sockets stand in for N brokers; each
agent reaches only its run's shard, and its control channel follows the same position."""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterator, List

import pytest

from rank_agent import RankAgent
from rank_agent.shards import shard_of
from tests.support.agent import Receiver

RUNS = [f"job-{i}" for i in range(12)]


@pytest.fixture
def receivers() -> Iterator[List[Receiver]]:
    made = [Receiver() for _ in range(3)]
    try:
        yield made
    finally:
        for r in made:
            r.close()


def test_each_agent_reaches_only_its_runs_shard(
        receivers: List[Receiver], make_agent: Callable[..., RankAgent]) -> None:
    brokers = ",".join(r.endpoint for r in receivers)
    owners = {run: shard_of(run, 3) for run in RUNS}
    assert set(owners.values()) == {0, 1, 2}  # the runs cover every shard
    for run in RUNS:
        agent = make_agent(broker=brokers, run=run, control=False)
        assert agent.broker == receivers[owners[run]].endpoint
        assert agent.shard == owners[run]
        assert agent.register(total_epochs=3)
    for k, receiver in enumerate(receivers):
        mine = {run for run, owner in owners.items() if owner == k}
        receiver.wait_for(lambda fs, mine=mine: {f.run for f in fs} >= mine)
    # drain what else may still be in flight, for a bounded while: nothing is misrouted
    deadline = time.monotonic() + 0.3
    for receiver in receivers:
        receiver._pump(deadline)
    for k, receiver in enumerate(receivers):
        assert {f.run for f in receiver.all_frames} == \
            {run for run, owner in owners.items() if owner == k}


def test_one_endpoint_is_a_list_of_one(receiver: Receiver,
                                       make_agent: Callable[..., RankAgent]) -> None:
    agent = make_agent(broker=receiver.endpoint, run="job-3", control=False)
    assert (agent.broker, agent.shard) == (receiver.endpoint, 0)


def test_control_channel_follows_the_shard(make_agent: Callable[..., RankAgent],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    brokers = "tcp://127.0.0.1:1,tcp://127.0.0.1:4,tcp://127.0.0.1:7"
    monkeypatch.delenv("RANKBOARD_CONTROL", raising=False)
    for run in RUNS[:6]:
        agent = make_agent(broker=brokers, run=run)
        assert agent._control is not None
        assert agent._control.endpoint == f"tcp://127.0.0.1:{3 * shard_of(run, 3) + 2}"
    monkeypatch.setenv("RANKBOARD_CONTROL", "tcp://c0:9, tcp://c1:9, tcp://c2:9")
    for run in RUNS[:6]:
        agent = make_agent(broker=brokers, run=run)
        assert agent._control is not None
        assert agent._control.endpoint == f"tcp://c{shard_of(run, 3)}:9"


def test_a_control_list_of_another_length_is_no_channel_and_one_warning(
        make_agent: Callable[..., RankAgent], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("RANKBOARD_CONTROL", "tcp://c0:9,tcp://c1:9")
    with caplog.at_level(logging.WARNING, logger="rank_agent"):
        agent = make_agent(broker="tcp://127.0.0.1:1,tcp://127.0.0.1:4,tcp://127.0.0.1:7",
                           run="job-1")
    assert agent._control is None
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "RANKBOARD_CONTROL" in warnings[0].getMessage()


def test_from_env_reads_the_list(launcher_env: Callable[..., None], receivers: List[Receiver]) -> None:
    launcher_env(RANKBOARD_BROKER=",".join(r.endpoint for r in receivers),
                 RANKBOARD_RUN="job-5")
    agent = RankAgent.from_env(control=False)
    try:
        assert agent.broker == receivers[shard_of("job-5", 3)].endpoint
    finally:
        agent.close()


def test_a_list_with_a_hole_is_a_clear_error(make_agent: Callable[..., RankAgent]) -> None:
    with pytest.raises(ValueError, match="empty endpoint"):
        make_agent(broker="tcp://127.0.0.1:1,,tcp://127.0.0.1:7", run="job-1")
