"""``total_steps`` (PROTOCOL 8.5) as the agent sends it: ``RankAgent(total_steps=)`` and
``from_env`` put it in every register, the implicit one included; the integrations' figure
(Lightning's ``estimated_stepping_batches``, the Trainer's ``max_steps``) goes in unless the
user gave one; what is not a finite whole number of steps is "unknown" (0), never an error."""
from __future__ import annotations

import math

from rank_agent import RankAgent
from rank_agent.agent import checked_total_steps
from rank_agent.integrations._common import Reporter
from rank_agent.protocol import Register


def _registers(receiver) -> list[Register]:
    return [f for f in receiver.all_frames if isinstance(f, Register)]


def test_every_register_carries_total_steps_the_implicit_one_too(receiver, make_agent) -> None:
    agent = make_agent(broker=receiver.endpoint, total_steps=10_000)
    assert agent.log_epoch(0, 1.0)  # no register() call: the implicit one goes first
    assert agent.register(total_epochs=3)
    receiver.wait_for(lambda _: len(_registers(receiver)) >= 2)
    assert [r.total_steps for r in _registers(receiver)] == [10_000, 10_000]


def test_register_may_set_it_later_and_keeps_it(receiver, make_agent) -> None:
    agent = make_agent(broker=receiver.endpoint)
    assert agent.register()
    assert agent.register(total_steps=1234)
    assert agent.register(port=0)
    receiver.wait_for(lambda _: len(_registers(receiver)) >= 3)
    assert [r.total_steps for r in _registers(receiver)] == [0, 1234, 1234]


def test_from_env_takes_total_steps(receiver, launcher_env) -> None:
    launcher_env(RANKBOARD_BROKER=receiver.endpoint, RANKBOARD_RUN="fromenv-steps")
    with RankAgent.from_env(total_steps=77, control=False) as agent:
        assert agent.total_steps == 77
        agent.register()
    receiver.wait_for(lambda _: bool(_registers(receiver)))
    assert _registers(receiver)[0].total_steps == 77


def test_what_is_not_a_number_of_steps_is_unknown() -> None:
    assert checked_total_steps(500) == 500
    assert checked_total_steps(500.0) == 500  # Lightning gives floats
    for unknown in (0, -3, math.inf, -math.inf, math.nan, None, "many", True, 2**64):
        assert checked_total_steps(unknown) == 0


def test_the_frameworks_figure_goes_in_unless_the_user_gave_one(receiver, make_agent) -> None:
    reporters = []
    for run, given, framework in (("mine", 50, 900.0), ("theirs", 0, 900.0),
                                  ("endless", 0, math.inf)):
        reporter = Reporter(make_agent(broker=receiver.endpoint, run=run, total_steps=given))
        reporter.start(total_steps=framework, sample_interval=None)
        reporters.append(reporter)
    receiver.wait_for(lambda _: {r.run for r in _registers(receiver)} >= {"mine", "theirs",
                                                                         "endless"})
    for reporter in reporters:
        reporter.end("ok")
    sent = {r.run: r.total_steps for r in _registers(receiver)}
    assert sent == {"mine": 50, "theirs": 900, "endless": 0}

