"""Replicated step metrics (PROTOCOL.md 8.3) on the agent's side: ``RankAgent(...,
replicated=...)`` (and ``from_env``, and every integration's keyword arguments) sends the
names in every register, the implicit one too, within the wire's bounds."""
from __future__ import annotations

import logging

import pytest

from rank_agent import RankAgent
from rank_agent.integrations._common import AGENT_KWARGS, check_agent_kwargs
from rank_agent.protocol import Register, decode, encoder
from rank_agent.replicated import replicated_names


def test_every_register_carries_the_replicated_names_the_implicit_one_too(
        receiver, make_agent) -> None:
    agent = make_agent(broker=receiver.endpoint, replicated=["grad_norm", "param_checksum"])
    assert agent.log_epoch(0, 1.0)  # no register() call: the implicit one goes first
    assert agent.register(total_epochs=3)
    receiver.wait_count(2)  # the metrics frame and the explicit register
    regs = [f for f in receiver.all_frames if isinstance(f, Register)]
    assert [(r.total_epochs, r.replicated) for r in regs] == [
        (0, ["grad_norm", "param_checksum"]), (3, ["grad_norm", "param_checksum"])]


def test_from_env_takes_replicated(receiver) -> None:
    env = {"RANKBOARD_BROKER": receiver.endpoint, "RANKBOARD_RUN": "rep-env", "RANK": "1",
           "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    with RankAgent.from_env(env, replicated=("grad_norm",), linger_ms=200) as agent:
        assert agent.replicated == ["grad_norm"]
        assert agent.register(total_epochs=1)  # (a first plain register is the receiver's to hide)
        frames = receiver.wait_for(lambda fs: any(isinstance(f, Register) for f in fs))
    reg = next(f for f in frames if isinstance(f, Register))
    assert (reg.run, reg.rank, reg.replicated) == ("rep-env", 1, ["grad_norm"])


def test_names_past_the_wire_bounds_are_left_out_so_the_register_is_accepted(
        caplog: pytest.LogCaptureFixture) -> None:
    names = [f"m{i}" for i in range(70)] + ["x" * 129, "m3", ""]
    with caplog.at_level(logging.WARNING, logger="rank_agent.replicated"):
        kept = replicated_names(names)
    assert kept == [f"m{i}" for i in range(64)]
    assert len([r for r in caplog.records if "replicated names left out" in r.getMessage()]) == 1
    assert replicated_names("grad_norm") == ["grad_norm"]  # one name, not its letters
    assert replicated_names(None) == []
    frame = Register(run="r", rank=0, world_size=1, host="h", replicated=kept)
    assert decode(encoder.encode(frame)).replicated == kept  # within the schema's bounds


def test_every_integration_takes_replicated_as_an_agent_keyword() -> None:
    # the integrations' **agent_kwargs are checked against RankAgent's signature
    assert "replicated" in AGENT_KWARGS
    for where in ("lightning.RankboardCallback", "transformers.RankboardCallback",
                  "accelerate.RankboardTracker"):
        check_agent_kwargs({"replicated": ["grad_norm"]}, where)  # does not raise
