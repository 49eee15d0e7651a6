"""``replicated=`` (PROTOCOL.md 8.3) through every integration's keyword arguments, to a real
broker: the Lightning and Hugging Face callbacks build their agent with
``integrations._common.make_agent`` from their ``**agent_kwargs``; the Accelerate tracker
(in its ``log_with=[RankboardTracker(...)]`` form, which runs on every process) builds its
own. Each one's ``register`` arrives carrying the names, and the run's set is theirs."""
from __future__ import annotations

import uuid
from typing import Any

import pytest

from rank_agent.integrations import _common
from rank_agent.integrations.accelerate import RankboardTracker
from rank_agent.integrations.lightning import RankboardCallback as LightningCallback
from rank_agent.integrations.transformers import RankboardCallback as HFCallback
from tests.support import polling


def registered(broker: Any, run: str) -> list[list[str]]:
    return [f.replicated for f in broker.frames(run, "register")]


@pytest.mark.parametrize("callback", [LightningCallback, HFCallback], ids=["lightning", "hf"])
def test_the_callbacks_agent_sends_the_names(broker: Any, monkeypatch: Any,
                                             callback: Any) -> None:
    monkeypatch.setenv("RANKBOARD_BROKER", broker.ingest)
    cb = callback(replicated=["grad_norm"], control=False)
    run = f"rep-{uuid.uuid4().hex[:8]}"
    agent = _common.make_agent(run=run, rank=0, world_size=1, local_rank=0,
                               agent_kwargs=cb.agent_kwargs)
    try:
        assert agent.register()
        polling.wait_for(lambda: registered(broker, run), 20.0, "the register")
        assert registered(broker, run) == [["grad_norm"]]
    finally:
        agent.close()


def test_the_accelerate_tracker_sends_the_names(broker: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("RANKBOARD_BROKER", broker.ingest)
    run = f"rep-{uuid.uuid4().hex[:8]}"
    tracker = RankboardTracker(run=run, replicated=["grad_norm", "param_sum"], control=False)
    try:
        tracker.log({"grad_norm": 1.0}, step=0)
        polling.wait_for(lambda: registered(broker, run), 20.0, "the register")
        assert registered(broker, run)[0] == ["grad_norm", "param_sum"]
    finally:
        tracker.finish()
