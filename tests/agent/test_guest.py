"""The guest rules: the agent never blocks or raises into the training loop, its memory and
shutdown are bounded, and it survives fork()."""
from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from rank_agent import RankAgent
from rank_agent.protocol import Finish, Metrics, Register, decode
from tests.support.forking import fork as _fork
from tests.support.forking import wait_child as _wait_child


def test_no_broker_50k_epochs_return_promptly_and_count_drops(make_agent, dead_endpoint):
    agent = make_agent(broker=dead_endpoint, sndhwm=1000)
    n = 50_000
    t0 = time.monotonic()
    for i in range(n):
        agent.log_epoch(i, 0.5, batches=10, scalars={"acc": 0.9})
    elapsed = time.monotonic() - t0
    assert elapsed < 20.0
    assert agent.dropped > 0
    assert agent.sent + agent.dropped == n + 1  # + the implicit register ahead of epoch 0
    assert agent.sent <= 2 * 1000  # bounded by the high-water mark, not by n
    assert agent.errors == 0
    t0 = time.monotonic()
    agent.close()
    assert time.monotonic() - t0 < 2.0


def test_close_is_bounded_when_the_broker_is_gone(receiver, dead_endpoint):
    agent = RankAgent(broker=dead_endpoint, run="r", rank=0, world_size=1, linger_ms=500)
    for i in range(100):
        agent.log_epoch(i, 1.0)
    assert agent.sent == 101  # + the implicit register ahead of epoch 0
    t0 = time.monotonic()
    agent.close()
    assert time.monotonic() - t0 < 2.0


def test_close_is_bounded_after_the_broker_went_away(receiver):
    agent = RankAgent(broker=receiver.endpoint, run="r", rank=0, world_size=1, linger_ms=500)
    agent.register(total_epochs=1)
    receiver.wait_count(1)
    receiver.close()  # the broker dies
    for i in range(2000):
        agent.log_epoch(i, 1.0)
    t0 = time.monotonic()
    agent.close()
    assert time.monotonic() - t0 < 2.0


def test_linger_zero_closes_at_once(dead_endpoint):
    agent = RankAgent(broker=dead_endpoint, run="r", rank=0, world_size=1, linger_ms=0)
    agent.log_epoch(0, 1.0)
    t0 = time.monotonic()
    agent.close()
    assert time.monotonic() - t0 < 0.5


def test_frames_queued_before_the_broker_starts_are_delivered(make_agent, tmp_path):
    """A rank that starts before the broker: frames wait in the bounded queue, then go out."""
    endpoint = f"ipc://{tmp_path}/ingest"
    agent = make_agent(broker=endpoint)
    assert agent.register() and agent.log_epoch(0, 1.0)
    ctx = zmq.Context()
    late = ctx.socket(zmq.PULL)
    late.setsockopt(zmq.LINGER, 0)
    try:
        late.bind(endpoint)
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            if late.poll(100):
                got.append(decode(late.recv()))
        assert [type(f) for f in got] == [Register, Metrics]
    finally:
        late.close(linger=0)
        ctx.term()


def test_sampler_and_training_thread_send_concurrently(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint, sndhwm=100_000)
    agent.start_sampling(interval=0.1)
    errors = []

    def train(base):
        try:
            for i in range(2000):
                agent.log_epoch(base + i, 0.1)
        except Exception as exc:  # pragma: no cover - the agent never raises
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(k * 10_000,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    frames = receiver.wait_for(lambda fs: sum(isinstance(f, Metrics) for f in fs) >= 6000)
    assert len({f.epoch for f in frames if isinstance(f, Metrics)}) == 6000
    assert agent.errors == 0 and agent.dropped == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.parametrize("child_sends", [True, False])
def test_fork_child_uses_and_closes_the_agent_parent_unaffected(receiver, make_agent, child_sends):
    agent = make_agent(broker=receiver.endpoint)
    agent.start_sampling(interval=0.1)
    agent.register(total_epochs=1)
    receiver.wait_for(lambda fs: any(isinstance(f, Register) for f in fs))
    parent_ctx = agent._pusher._ctx
    pid = _fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            ok = agent._pusher._ctx is None and agent._pusher._sock is None  # inherited objects let go
            if child_sends:
                ok = agent.log_epoch(1000, 2.0) and ok
                ok = agent._pusher._ctx is not None and agent._pusher._ctx is not parent_ctx and ok
            agent.close()
            code = 0 if ok else 3
        except BaseException:
            code = 2
        finally:
            os._exit(code)
    assert _wait_child(pid) == 0
    # the parent's context and socket still work
    assert agent._pusher._ctx is parent_ctx
    for epoch in range(5):
        assert agent.log_epoch(epoch, 1.0)
    agent.finish()
    frames = receiver.wait_for(lambda fs: any(isinstance(f, Finish) for f in fs))
    parent_epochs = {f.epoch for f in frames if isinstance(f, Metrics) and f.epoch < 1000}
    assert parent_epochs == set(range(5))
    if child_sends:
        receiver.wait_for(lambda fs: any(isinstance(f, Metrics) and f.epoch == 1000 for f in fs))
    t0 = time.monotonic()
    agent.close()
    assert time.monotonic() - t0 < 2.0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_before_first_send(receiver, make_agent):
    """Fork an agent that has no context yet: both processes create their own lazily."""
    agent = make_agent(broker=receiver.endpoint)
    pid = _fork()
    if pid == 0:
        code = 1
        try:
            agent.log_epoch(7, 1.0)
            agent.close()
            code = 0
        finally:
            os._exit(code)
    agent.log_epoch(8, 1.0)
    assert _wait_child(pid) == 0
    frames = receiver.wait_for(lambda fs: {7, 8} <= {f.epoch for f in fs if isinstance(f, Metrics)})
    assert len([f for f in frames if isinstance(f, Metrics)]) == 2
    # each process introduced itself: it had sent nothing before the fork
    assert len([f for f in receiver.all_frames if isinstance(f, Register)]) == 2


def test_unusable_endpoint_is_tried_once_then_frames_are_dropped(make_agent, caplog):
    caplog.set_level("ERROR", logger="rank_agent")
    agent = make_agent(broker="not-an-endpoint")
    for i in range(100):
        assert agent.log_epoch(i, 1.0) is False
    assert agent.dropped == agent.errors == 100 and agent.sent == 0
    assert agent._pusher._ctx is None  # no context left behind by the failed attempt
    errors = [r for r in caplog.records if r.name == "rank_agent.pusher"]
    assert len(errors) == 1 and "not-an-endpoint" in errors[0].getMessage()


def test_an_agent_left_open_is_flushed_at_interpreter_exit(receiver):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "from rank_agent import RankAgent\n"
        f"a = RankAgent(broker={receiver.endpoint!r}, run='exit', rank=0, world_size=1)\n"
        "a.register(total_epochs=1); a.log_epoch(0, 1.0); a.finish()\n"  # no close(): the exit hook flushes
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    frames = receiver.wait_count(3)
    assert [type(f) for f in frames] == [Register, Metrics, Finish]
