"""One gate (issue 44 item 5): the web's 429 (:class:`web.stacksapi.RequestGate`) and the
broker's forwarding rule (:class:`broker.stacks.requests.ForwardGate`) are one rule,
:class:`broker.stacks.gate.RunGate`: its interval and its bounded table, in one place. Pure
logic, no sockets: the clock is passed in."""
from __future__ import annotations

from typing import Any

from broker.stacks.gate import MIN_INTERVAL_S, PRUNE_AT, RunGate
from broker.stacks.requests import ForwardGate
from rank_agent.controlwire import ControlRequest
from web.stacksapi import RequestGate


def req(request_id: str = "a", kind: str = "stacks", **kw: Any) -> ControlRequest:
    return ControlRequest(run="r", request_id=request_id, kind=kind, **kw)  # type: ignore[arg-type]


def test_a_run_is_shut_for_the_interval_and_remembers_what_was_asked() -> None:
    gate = RunGate()
    assert gate.blocking("r", 10.0) is None and gate.wait_left("r", 10.0) == 0.0
    gate.let_through("r", 10.0, ("stacks", None))
    assert gate.blocking("r", 10.5) == ("stacks", None)
    assert gate.wait_left("r", 10.25) == MIN_INTERVAL_S - 0.25
    assert gate.blocking("other", 10.5) is None  # per run
    assert gate.blocking("r", 10.0 + MIN_INTERVAL_S) is None
    gate.let_through("s", 20.0)  # no shape: still shut (never a falsy answer)
    assert gate.blocking("s", 20.5) is True


def test_the_table_is_bounded_by_the_runs_of_one_interval() -> None:
    gate = RunGate(interval=1.0, prune_at=100)
    for n in range(1000):
        gate.let_through(f"r{n}", n * 0.1)
    assert len(gate) <= 101
    assert gate.blocking("r999", 99.95) is not None  # the recent ones are kept


def test_the_web_and_the_broker_apply_the_same_gate() -> None:
    """Both are built on RunGate with the same interval, and one handed in rules both: a
    5 s gate shuts the web's 429 and the broker's forward for 5 s alike."""
    web, broker = RequestGate(), ForwardGate()
    assert isinstance(web.runs, RunGate) and isinstance(broker.runs, RunGate)
    assert web.runs.interval == broker.runs.interval == MIN_INTERVAL_S
    assert web.runs.prune_at == broker.runs.prune_at == PRUNE_AT

    now = [100.0]
    web = RequestGate(clock=lambda: now[0], runs=RunGate(interval=5.0))
    broker = ForwardGate(runs=RunGate(interval=5.0))
    web.accepted("r")
    assert broker.admit(req("a"), None, True, now[0]) is None
    now[0] += 4.9
    assert web.wait_left("r") > 0
    assert broker.admit(req("b"), None, True, now[0]) == "coalesced"
    assert broker.admit(req("c", "profile"), None, True, now[0]) == "rate_limited"
    now[0] += 0.1
    assert web.wait_left("r") == 0.0
    assert broker.admit(req("d"), None, True, now[0]) is None
    # the web's own counters are its own, and still count
    web.count("rate_limited")
    web.count("ended")
    assert web.results["accepted"] == 1
    assert web.results["rate_limited"] == 1 and web.results["ended"] == 1
