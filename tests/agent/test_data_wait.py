"""The agent's data wait (PROTOCOL.md 7.1): ``batch_ready()`` and ``log_step(..., data_ms=)``.

``data_ms`` = (time of the latest ``batch_ready`` - time of the previous ``log_step``) in
ms, or nothing when ``batch_ready`` was not called since that previous call (or there was
none); an explicit ``data_ms`` wins. Real agents and a real PULL socket (the ``receiver``
fixture); the clock is ``time.time`` patched (``fake_time``).
"""
from __future__ import annotations

import pytest

from rank_agent.stepframes import step_frames
from tests.agent.test_log_step import ASLEEP, fake_time, wait_points  # noqa: F401

__all__ = ["fake_time"]


def test_data_ms_from_batch_ready_to_the_previous_log_step(receiver, make_agent, fake_time):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP)
    script = [  # (time, call)
        (100.0, "ready"),   # before any log_step: no previous call, nothing to measure
        (100.2, 0),         # -> None
        (100.5, "ready"),   # waited 0.3 s since step 0's call
        (101.0, 1),         # -> 300
        (101.1, 2),         # no batch_ready since step 1's call -> None
        (101.2, "ready"),
        (101.6, "ready"),   # the latest batch_ready counts: 0.5 s since step 2's call
        (102.0, 3),         # -> 500
        (102.0, "ready"),   # at once: no wait
        (102.5, 4),         # -> 0
    ]
    for t, call in script:
        fake_time(t)
        if call == "ready":
            assert agent.batch_ready() is None
        else:
            assert agent.log_step(call, {"loss": 1.0})
    agent.close()
    (frame,) = wait_points(receiver, 5)
    assert frame.steps == [0, 1, 2, 3, 4]
    assert frame.data_ms == [None, pytest.approx(300.0), None, pytest.approx(500.0), 0.0]


def test_a_negative_or_nan_explicit_wait_is_not_sent_the_point_is(receiver, make_agent,
                                                                    fake_time):
    """Issue 38: the broker rejects a ``steps`` frame holding a wait < 0 or NaN (a negative
    ``data_share`` otherwise), so the agent sends such a point without its ``data_ms``
    rather than lose the frame's other points; 0 and an infinite wait are sent."""
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP)
    fake_time(10.0)
    for step, wait in enumerate((-1.0, float("nan"), -0.5, 0.0, float("inf"), -(10**400))):
        assert agent.log_step(step, data_ms=wait)
    agent.close()
    (frame,) = wait_points(receiver, 6)
    assert frame.data_ms == [None, None, None, 0.0, float("inf"), None]
    assert agent.dropped == 0


def test_explicit_data_ms_wins_and_bad_values_are_not_sent(receiver, make_agent, fake_time):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP)
    fake_time(10.0)
    agent.log_step(0)
    fake_time(11.0)
    agent.batch_ready()
    fake_time(12.0)
    agent.log_step(1, data_ms=42.0)  # explicit: not 1000 from batch_ready
    agent.log_step(2, data_ms=7)  # an int is a number
    agent.log_step(3, data_ms="slow")  # not a number: the point goes, without data_ms
    agent.log_step(4, data_ms=True)  # nor is a bool
    agent.close()
    (frame,) = wait_points(receiver, 5)
    assert frame.data_ms == [None, 42.0, 7.0, None, None]
    assert agent.dropped == 0


def test_no_batch_ready_means_no_data_ms_list(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP)
    for step in range(3):
        agent.log_step(step)
    agent.close()
    (frame,) = wait_points(receiver, 3)
    assert frame.data_ms == []


def test_repeated_step_keeps_the_first_calls_data_ms() -> None:
    pts = [(1, 1.0, None, None, 0, 0, 5.0), (1, 1.1, None, {"a": 1.0}, 0, 0, None),
           (2, 2.0, 10.0, None, 0, 0, None), (2, 2.1, None, None, 0, 0, 8.0)]
    (frame,), last = step_frames("r", 0, pts)
    assert frame.steps == [1, 2] and frame.data_ms == [5.0, 8.0]
    # a repeat of the previous flush's last point is sent again, merged
    (again,), _ = step_frames("r", 0, [(2, 3.0, None, {"b": 1.0}, 0, 0, 9.0)], last)
    assert again.steps == [2] and again.data_ms == [8.0]


class _Agent:
    """What the integrations' Reporter needs of an agent, recording its log_step calls."""

    rank, run = 0, "r"

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict]] = []

    def log_step(self, step, metrics=None, samples=0, tokens=0, **kw):  # noqa: ANN001
        self.calls.append((step, kw))

    def finish(self, status: str, error: BaseException | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def test_the_integrations_send_the_wait_explicitly(fake_time) -> None:
    """The Reporter (what Lightning's and the Trainer's callbacks call) measures from the
    previous step's end to the latest batch_ready and passes data_ms to log_step, also for
    a held step (the Trainer's) sent at the next step's end."""
    from rank_agent.integrations._common import Reporter

    agent = _Agent()
    rep = Reporter(agent)  # type: ignore[arg-type]
    try:
        for t, call in [(1.0, "ready"), (1.1, 1), (1.3, "ready"), (1.5, 2), (1.6, 3),
                        (2.0, "ready"), (2.05, "hold4"), (2.2, "ready"), (2.3, "hold5")]:
            fake_time(t)
            if call == "ready":
                rep.batch_ready()
            elif isinstance(call, str):
                rep.hold_step(int(call[4:]))
            else:
                rep.step(call, {"loss": 1.0})
        rep.release_step()
    finally:
        rep.end("ok")
    got = {step: kw.get("data_ms") for step, kw in agent.calls}
    assert got[1] is None  # no previous step
    assert got[2] == pytest.approx(200.0)  # 1.3 - 1.1
    assert got[3] is None  # no batch_ready since step 2
    assert got[4] == pytest.approx(400.0)  # 2.0 - 1.6
    assert got[5] == pytest.approx(150.0)  # 2.2 - 2.05
