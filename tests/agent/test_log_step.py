"""RankAgent.log_step (PROTOCOL.md section 5): per-step points are buffered by the calling
thread and sent as ``steps`` frames (section 2) by the agent's flusher thread.

Every test reads real frames from a loopback PULL socket and decodes them with
``protocol.decode`` (which also checks equal lengths and strictly increasing steps). A long
``step_flush`` keeps the flusher asleep where a test needs to know what is pending; waiting
is always poll-with-a-deadline.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Iterator, List

import pytest

from rank_agent.protocol import Finish, Steps
from rank_agent.stepbuffer import MAX_PENDING_STEPS
from rank_agent.stepframes import flush_interval, step_frames
from tests.support.forking import fork as _fork
from tests.support.forking import wait_child as _wait_child
from tests.support.polling import wait_for

ASLEEP = 3600.0  # a step_flush that never fires during a test: only finish()/close() flush


def steps_frames(receiver: Any) -> List[Steps]:
    return receiver.of_type(Steps)


def points(frames: List[Steps]) -> List[int]:
    return [s for f in frames for s in f.steps]


def wait_points(receiver: Any, n: int, timeout: float = 10.0) -> List[Steps]:
    receiver.wait_for(lambda fs: len(points([f for f in fs if isinstance(f, Steps)])) >= n, timeout)
    return steps_frames(receiver)


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[float], None]]:
    """Control what ``time.time()`` returns to log_step (the flusher uses monotonic waits)."""
    now = [1_000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])

    def set_to(t: float) -> None:
        now[0] = t

    yield set_to


# -- what a frame carries -----------------------------------------------------------------------


def test_points_arrive_as_one_decoded_steps_frame(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP, rank=2, world_size=4)
    t0 = time.time()
    for step in range(5):
        assert agent.log_step(step, {"loss": 1.0 / (step + 1), "lr": 3e-4}, samples=32, tokens=4096)
    assert agent.pending_steps == 5
    agent.close()
    (frame,) = wait_points(receiver, 5)
    assert (frame.run, frame.rank) == ("test-run", 2)
    assert frame.steps == [0, 1, 2, 3, 4]
    assert all(t0 - 1 <= t <= time.time() + 1 for t in frame.times)
    assert frame.times == sorted(frame.times)
    assert frame.samples == [32] * 5 and frame.tokens == [4096] * 5
    assert frame.metrics == {"loss": [1.0, 0.5, 1 / 3, 0.25, 0.2], "lr": [3e-4] * 5}
    assert frame.step_ms[0] is None and all(ms is not None and ms >= 0 for ms in frame.step_ms[1:])
    assert agent.dropped == 0 and agent.errors == 0


def test_step_ms_from_the_previous_call(receiver, make_agent, fake_time):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP)
    calls = [  # (time, step)
        (100.0, 0),   # first call: None
        (100.5, 1),   # 0.5 s for 1 step: 500
        (101.5, 3),   # 1 s for 2 steps: 500 per step
        (101.9, 3),   # repeated step: merged into step 3, no step_ms of its own
        (103.5, 4),   # from the first call of step 3 (101.5): 2000
        (104.0, 2),   # counting restarted: None, a new frame, the new anchor
        (104.3, 5),   # 0.3 s for 3 steps from the restart: 100
    ]
    for t, step in calls:
        fake_time(t)
        agent.log_step(step)
    agent.close()
    frames = wait_points(receiver, 6)
    assert [f.steps for f in frames] == [[0, 1, 3, 4], [2, 5]]
    assert frames[0].step_ms == [None, pytest.approx(500.0), pytest.approx(500.0),
                                 pytest.approx(2000.0)]
    assert frames[0].times == [100.0, 100.5, 101.5, 103.5]  # a repeat keeps the step's first time
    assert frames[1].step_ms == [None, pytest.approx(100.0)]
    assert frames[0].samples == [] and frames[0].tokens == [] and frames[0].metrics == {}


def test_metric_values_that_are_not_int_or_float_are_skipped(receiver, make_agent):
    class Sub(float):  # what numpy.float64 is: a float subclass
        pass

    class Tensorish:
        def item(self) -> float:  # pragma: no cover - must never be called
            raise AssertionError("log_step converted a tensor")

        __float__ = item

    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP)
    metrics = {"loss": 0.5, "count": 3, "sub": Sub(1.5), "flag": True, "off": False, "text": "x",
               "none": None, "tensor": Tensorish(), "big": 10 ** 400, "nan": float("nan")}
    assert agent.log_step(0, metrics)
    assert agent.log_step(1, {"flag": True, "tensor": Tensorish()})  # a point with no metric left
    agent.close()
    (frame,) = wait_points(receiver, 2)
    assert set(frame.metrics) == {"loss", "count", "sub", "nan"}
    assert frame.metrics["loss"] == [0.5, None]
    assert frame.metrics["count"] == [3.0, None] and type(frame.metrics["count"][0]) is float
    assert frame.metrics["sub"] == [1.5, None]
    assert frame.metrics["nan"][0] != frame.metrics["nan"][0]  # NaN is news, sent as is
    assert agent.dropped == 0  # a skipped value is not a lost point


def test_metric_names_clamped_and_capped_frames_split_on_the_name_limit(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP)
    long_name = "m" * 200
    agent.log_step(0, {long_name: 1.0})
    agent.log_step(1, {f"a{i:03d}": float(i) for i in range(100)})  # 100 names: the first 64 go
    agent.log_step(2, {f"b{i:03d}": float(i) for i in range(10)})  # would make 74: next frame
    agent.close()
    frames = wait_points(receiver, 3)
    assert [f.steps for f in frames] == [[0], [1], [2]]  # 1 + 64 names > 64: split
    assert list(frames[0].metrics) == ["m" * 128]
    assert list(frames[1].metrics) == [f"a{i:03d}" for i in range(64)]
    assert list(frames[2].metrics) == [f"b{i:03d}" for i in range(10)]


def test_bad_calls_are_counted_never_raised(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP)
    for bad in (-1, "3", 2.0, True, None):
        assert agent.log_step(bad, {"loss": 1.0}) is False  # type: ignore[arg-type]
    assert agent.log_step(7, ["not", "a", "mapping"]) is False  # type: ignore[arg-type]
    assert agent.dropped == 6 and agent.errors == 6
    assert agent.log_step(8, samples=-5, tokens=1.5)  # type: ignore[arg-type]  # counts as 0
    agent.close()
    (frame,) = wait_points(receiver, 1)
    assert frame.steps == [8] and frame.samples == [] and frame.tokens == []


def test_the_callers_dict_is_copied(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP)
    metrics = {"loss": 1.0}
    for step in range(3):
        metrics["loss"] = float(step)
        agent.log_step(step, metrics)
    metrics.clear()
    agent.close()
    (frame,) = wait_points(receiver, 3)
    assert frame.metrics == {"loss": [0.0, 1.0, 2.0]}


def test_samples_and_tokens_only_sent_when_some_point_has_them(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP)
    agent.log_step(0, samples=16)
    agent.log_step(1)
    agent.close()
    (frame,) = wait_points(receiver, 2)
    assert frame.samples == [16, 0] and frame.tokens == []


def test_a_repeated_step_is_merged_even_across_flushes(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, step_flush=0.05)
    agent.log_step(0)
    agent.log_step(1, {"loss": 2.0}, samples=8)
    agent.log_step(1, {"acc": 0.5}, samples=8)  # same step: one point, samples add up
    first = wait_points(receiver, 2)[0]
    assert first.steps == [0, 1]
    assert first.metrics == {"loss": [None, 2.0], "acc": [None, 0.5]} and first.samples == [0, 16]
    agent.log_step(1, {"lr": 0.1})  # after the point left: the merged point is sent again
    frames = wait_points(receiver, 3)
    again = frames[1]
    assert again.steps == [1] and again.step_ms == [first.step_ms[1]]
    assert again.times == [first.times[1]]
    assert again.metrics == {"loss": [2.0], "acc": [0.5], "lr": [0.1]} and again.samples == [16]


# -- when frames leave -------------------------------------------------------------------------


def test_flusher_sends_without_further_calls_within_two_flush_periods(receiver, make_agent):
    flush = 0.2
    agent = make_agent(broker=receiver.endpoint, step_flush=flush)
    agent.register(total_epochs=1)
    receiver.wait_count(1)
    assert agent._steps.thread is None
    t0 = time.monotonic()
    agent.log_step(0, {"loss": 1.0})  # the one call; nothing else touches the agent
    wait_points(receiver, 1, timeout=10.0)
    elapsed = time.monotonic() - t0
    assert elapsed < 2 * flush + 1.0, elapsed  # slack for a loaded CI machine
    assert agent.pending_steps == 0


@pytest.mark.parametrize("step_flush, world_size, want", [
    (0.25, 1, 0.25), (0.25, 1024, 0.25), (0.25, 4096, 0.25), (0.25, 16384, 1.0),
    (0.25, 65536, 4.0), (2.0, 16384, 2.0), (0.01, 8192, 0.5),
])
def test_flush_interval_in_force_is_step_flush_or_world_size_over_16384(
        step_flush, world_size, want):
    assert flush_interval(step_flush, world_size) == want


def test_a_big_run_flushes_at_most_every_world_size_over_16384_seconds(receiver, make_agent):
    """Contract v3 section 5: with 65,536 ranks the interval in force is 4 s, whatever
    ``step_flush`` says; the same agent in a 1-rank run sends within its step_flush."""
    small = make_agent(broker=receiver.endpoint, step_flush=0.05, rank=0, world_size=1,
                       run="small-run")
    big = make_agent(broker=receiver.endpoint, step_flush=0.05, rank=0, world_size=65536)
    assert (big._steps.interval, small._steps.interval) == (4.0, 0.05)
    big.log_step(0, {"loss": 1.0})
    small.log_step(0, {"loss": 1.0})
    # the small run's point arrives within a few of its flush periods ...
    receiver.wait_for(lambda fs: any(isinstance(f, Steps) and f.run == "small-run"
                                     for f in fs), 10.0)
    t0 = time.monotonic()
    # ... the big run's does not before its 4 s interval (polled, not slept: any frame of
    # it ends the wait and fails the test)
    with pytest.raises(AssertionError):
        receiver.wait_for(lambda fs: any(isinstance(f, Steps) and f.run == "test-run"
                                         for f in fs), 1.5)
    assert time.monotonic() - t0 < 4.0  # (the 1.5 s window was inside the interval)
    assert big.pending_steps == 1
    big.close()  # close() sends what is pending at once
    wait_points(receiver, 2)


def test_points_are_batched_not_sent_one_frame_per_call(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, step_flush=0.25)
    for step in range(300):
        agent.log_step(step, {"loss": 1.0})
    frames = wait_points(receiver, 300)
    assert points(frames) == list(range(300))
    assert len(frames) <= 4  # the calls take well under a flush period
    assert agent.sent == len(frames) + 1  # + the implicit register


def test_flusher_is_started_lazily_by_the_first_log_step(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP, rank=0)
    agent.register()
    assert agent._steps.thread is None
    agent.log_step(0)
    thread = agent._steps.thread
    assert thread is not None and thread.daemon and thread.is_alive()
    agent.close()
    assert not thread.is_alive()  # close() stops it


@pytest.mark.parametrize("how", ["finish", "close", "with"])
def test_finish_and_close_send_pending_points_first(receiver, make_agent, how):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP)
    for step in range(3):
        agent.log_step(step, {"loss": 1.0})
    if how == "finish":
        agent.finish()
    elif how == "close":
        agent.close()
    else:
        with agent:
            pass
    # close() finishes an unfinished agent ok too (sections 5, 8.2), after the points
    frames = receiver.wait_for(lambda fs: any(isinstance(f, Finish) for f in fs))
    assert [type(f) for f in frames] == [Steps, Finish]
    assert frames[0].steps == [0, 1, 2] and frames[1].status == "ok"


def test_split_at_1024_points(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP)
    for step in range(2500):
        agent.log_step(step, {"loss": 0.5})
    agent.close()
    frames = wait_points(receiver, 2500)
    assert [len(f.steps) for f in frames] == [1024, 1024, 452]
    assert points(frames) == list(range(2500))
    assert all(len(f.metrics["loss"]) == len(f.steps) == len(f.times) == len(f.step_ms)
               for f in frames)


def test_at_most_8192_points_wait_older_ones_dropped_and_counted(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP, sndhwm=100)
    extra = 777
    for step in range(MAX_PENDING_STEPS + extra):
        assert agent.log_step(step, {"loss": 1.0})
    assert MAX_PENDING_STEPS == 8192
    assert agent.pending_steps == 8192
    assert agent.dropped == extra  # exactly the points pushed out
    agent.close()
    frames = wait_points(receiver, 8192)
    assert points(frames) == list(range(extra, 8192 + extra))  # the oldest went
    assert [len(f.steps) for f in frames] == [1024] * 8
    # + the implicit register, + the finish close() sends (8.2)
    assert agent.dropped == extra and agent.sent == 8 + 1 + 1


def test_log_step_after_close_is_counted_as_dropped(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint)
    agent.close()
    assert agent.log_step(0) is False
    assert agent.dropped == 1 and agent._steps.thread is None


# -- the guest rules ---------------------------------------------------------------------------


def test_no_broker_no_raise_and_bounded_time(make_agent, dead_endpoint):
    agent = make_agent(broker=dead_endpoint, step_flush=0.01, sndhwm=10, linger_ms=200)
    t0 = time.monotonic()
    for step in range(30_000):
        assert agent.log_step(step, {"loss": 1.0}, samples=1)
    assert time.monotonic() - t0 < 20.0
    wait_for(lambda: agent.dropped > 0, what="frames dropped at the high-water mark")
    t0 = time.monotonic()
    agent.finish()
    agent.close()
    assert time.monotonic() - t0 < 3.0  # join of the flusher + linger, not a hang
    assert agent.errors == 0


def test_flusher_survives_a_broken_endpoint(make_agent):
    agent = make_agent(broker="not-an-endpoint://x", step_flush=0.01)
    assert agent.log_step(0)
    wait_for(lambda: agent.errors >= 1, what="the bad endpoint to be noticed")
    assert agent._steps.thread is not None and agent._steps.thread.is_alive()
    assert agent.log_step(1)
    agent.close()


def test_a_dead_flusher_is_replaced_once_the_buffer_fills(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, step_flush=0.05)
    agent.log_step(0)
    wait_points(receiver, 1)
    old = agent._steps.thread
    agent._steps.stop.set()  # the flusher dies (as if something outside the agent ended it)
    old.join(5)
    agent._steps.stop = threading.Event()
    for step in range(1, MAX_PENDING_STEPS + 2):  # nothing drains: the buffer fills up
        assert agent.log_step(step)
    assert agent.dropped == 1  # step 1 was pushed out
    new = agent._steps.thread
    assert new is not None and new is not old and new.is_alive()
    frames = wait_points(receiver, 1 + MAX_PENDING_STEPS)  # sent by the new flusher
    assert points(frames) == [0] + list(range(2, MAX_PENDING_STEPS + 2))


def test_a_fork_the_hook_missed_is_noticed_when_the_buffer_fills(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP)
    agent.log_step(0)
    inherited_stop, inherited_thread = agent._steps.stop, agent._steps.thread
    agent._steps._pid = -1  # as a child forked by a raw syscall sees it: no socket was made yet
    try:
        for step in range(1, MAX_PENDING_STEPS + 1):  # the last one finds the buffer full
            assert agent.log_step(step)
        # the "parent's" buffer is let go, this process gets its own flusher
        assert agent._steps._pid == os.getpid() and agent.pending_steps == 1 and agent.dropped == 1
        assert agent._steps.thread is not inherited_thread and agent._steps.thread.is_alive()
        agent.close()
        assert points(wait_points(receiver, 1)) == [MAX_PENDING_STEPS]
    finally:
        inherited_stop.set()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_child_logs_its_own_steps_parent_unaffected(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, step_flush=ASLEEP)
    for step in range(5):  # pending in the parent at the fork: the child must not send them
        agent.log_step(step, {"who": 0.0})
    parent_thread = agent._steps.thread
    pid = _fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            ok = agent.pending_steps == 0 and agent._steps.thread is None
            agent.step_flush = 0.05
            for step in range(1000, 1005):
                ok = agent.log_step(step, {"who": 1.0}) and ok
            child_thread = agent._steps.thread
            ok = child_thread is not None and child_thread is not parent_thread and ok
            deadline = time.monotonic() + 10
            while agent.sent < 1 and time.monotonic() < deadline:  # the child's own flusher
                time.sleep(0.01)
            ok = agent.sent >= 1 and ok
            agent.close()
            code = 0 if ok else 3
        except BaseException:
            code = 2
        finally:
            os._exit(code)
    assert _wait_child(pid) == 0
    frames = wait_points(receiver, 5)
    assert points(frames) == [1000, 1001, 1002, 1003, 1004]
    assert all(v == 1.0 for f in frames for v in f.metrics["who"])
    assert agent.pending_steps == 5 and parent_thread is not None and parent_thread.is_alive()
    agent.log_step(5, {"who": 0.0})
    agent.close()
    frames = wait_points(receiver, 11)
    assert sorted(points(frames)) == [0, 1, 2, 3, 4, 5, 1000, 1001, 1002, 1003, 1004]


# -- the pure frame builder --------------------------------------------------------------------


def test_step_frames_restart_starts_a_new_frame_and_last_merges():
    pts = [(5, 1.0, None, {"a": 1.0}, 0, 0, None), (6, 2.0, 10.0, None, 2, 0, None),
           (3, 3.0, None, None, 0, 0, None)]
    frames, last = step_frames("r", 0, pts)
    assert [f.steps for f in frames] == [[5, 6], [3]]
    assert frames[0].metrics == {"a": [1.0, None]}
    assert frames[0].samples == [0, 2] and frames[1].samples == []
    assert last == (3, 3.0, None, None, 0, 0, None)
    frames, last = step_frames("r", 0, [(3, 9.0, None, {"b": 2.0}, 1, 1, None)], last)
    assert [f.steps for f in frames] == [[3]] and frames[0].times == [3.0]
    assert frames[0].metrics == {"b": [2.0]} and frames[0].tokens == [1]
    assert step_frames("r", 0, [], last) == ([], last)


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, float("nan"), float("inf"), "x"])
def test_step_flush_is_checked_the_same_way_by_the_constructor_and_the_setter(
        make_agent: Callable[..., Any], bad: Any) -> None:
    """Issue 27: ``agent.step_flush = 0`` skipped the constructor's check, and the flusher
    then woke every 61 us. One check serves both."""
    with pytest.raises(ValueError, match="step_flush"):
        make_agent(broker="tcp://127.0.0.1:1", step_flush=bad)
    agent = make_agent(broker="tcp://127.0.0.1:1", step_flush=ASLEEP)
    with pytest.raises(ValueError, match="step_flush"):
        agent.step_flush = bad
    assert agent.step_flush == ASLEEP
    agent.step_flush = 0.5
    assert agent.step_flush == 0.5
