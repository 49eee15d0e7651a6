"""Step runs have an end (PROTOCOL 8.5): ``register.total_steps`` latched on its first non-zero
arrival, the header's ``total_steps`` and the step-run ``eta_secs`` = max(0, total - 1 -
steps_done) x the median of the finite ``step_ms`` means of the latest <= 100 closed steps /
1000, in the broker's header and the web's (pure: a sink with a fake clock)."""
from __future__ import annotations

import math

import pytest

from broker.run.steps.eta import recent_step_ms, step_eta
from broker.run.steps.store import StepStore
from rank_agent.protocol import Register
from tests.support.stepdrive import RUN, Drive, stp, wire
from web.runstate import RunState


def _reg(rank: int, ws: int, total_steps: int = 0) -> Register:
    return wire(Register(run=RUN, rank=rank, world_size=ws, host="h", local_rank=rank,
                         total_steps=total_steps))


def test_total_steps_first_non_zero_arrival_wins() -> None:
    d = Drive()
    d.send(_reg(0, 2), 0.0)
    assert d.sink.header()["total_steps"] is None
    d.send(_reg(1, 2, total_steps=500), 0.1)
    d.send(_reg(0, 2, total_steps=900), 0.2)  # a later, different one: ignored
    assert d.sink.header()["total_steps"] == 500


def test_eta_is_remaining_steps_times_the_median_step_ms() -> None:
    d = Drive()
    d.send(_reg(0, 1, total_steps=1000), 0.0)
    # 150 closed steps: the first 50 slow (outside the latest 100), then 100 ms with one
    # 5 s outlier and one non-finite mean; the median of the latest 100 finite is 100 ms
    ms = [900.0] * 50 + [100.0] * 98 + [5000.0, math.inf]
    d.send(stp(0, range(150), ms=ms), 2.0)
    d.tick(3.0)
    h = d.sink.header()
    assert h["steps_done"] == 149
    assert h["eta_secs"] == pytest.approx((1000 - 1 - 149) * 100.0 / 1000)


def test_eta_is_null_without_total_steps_or_closed_steps_and_never_negative() -> None:
    d = Drive()
    d.send(_reg(0, 1), 0.0)
    d.send(stp(0, range(3)), 2.0)
    d.tick(3.0)
    assert d.sink.header()["eta_secs"] is None  # total_steps unknown
    e = Drive()
    e.send(_reg(0, 1, total_steps=10), 0.0)
    assert e.sink.header()["eta_secs"] is None  # no step closed
    e.send(stp(0, range(20), ms=50.0), 2.0)  # past the total (a resumed count)
    e.tick(3.0)
    assert e.sink.header()["eta_secs"] == 0.0
    f = Drive()
    f.send(_reg(0, 1, total_steps=10), 0.0)
    f.send(stp(0, range(2), ms=None), 2.0)  # no step_ms at all
    f.tick(3.0)
    assert f.sink.header()["eta_secs"] is None


def test_median_of_an_even_count_is_the_mean_of_the_two_middle_values() -> None:
    store = StepStore()
    assert recent_step_ms(store) is None and step_eta(10, store) is None
    d = Drive()
    d.send(_reg(0, 1, total_steps=10), 0.0)
    d.send(stp(0, range(4), ms=[10.0, 20.0, 40.0, 1000.0]), 2.0)
    d.tick(3.0)
    assert recent_step_ms(d.sink.steps) == 30.0
    assert step_eta(10, d.sink.steps) == pytest.approx((10 - 1 - 3) * 0.030)


def test_the_webs_header_follows_its_own_steps() -> None:
    """The web recomputes ``eta_secs`` against the steps its stream brought, as it does
    ``steps_done``: the broker's header is only as fresh as its last ``run`` event."""
    d = Drive()
    d.send(_reg(0, 1, total_steps=100), 0.0)
    d.send(stp(0, range(10), ms=200.0), 2.0)
    d.tick(3.0)
    state = RunState(RUN)
    state.set_header(d.sink.header())
    assert state.public_header()["total_steps"] == 100
    assert state.public_header()["eta_secs"] is None  # this web holds no closed step yet
    state.steps.extend_wire(d.sink.steps.to_wire())
    h = state.public_header()
    assert h["steps_done"] == 9 and h["eta_secs"] == pytest.approx(90 * 0.2)
