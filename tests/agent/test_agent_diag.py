"""RankAgent owns the stall watch and the control channel (PROTOCOL.md sections 2.5 and 5):
a silent loop is dumped with ``main`` on the thread that called ``log_step``, ``stall_after=0``
and ``control=False`` open nothing, and ``close()`` leaves no thread, socket or context."""
from __future__ import annotations

import threading
import time
from typing import Iterator

import psutil
import pytest
import zmq

from rank_agent import RankAgent
from rank_agent.controlwire import ControlRequest, encode_request
from rank_agent.protocol import Stacks
from tests.support.agent import Receiver, control_connected
from tests.support.polling import wait_for


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rx = Receiver()
    yield rx
    rx.close()


def _diag_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith(("rankboard-stallwatch", "rankboard-control")))


def stalled_in_named_function(agent: RankAgent, rx: Receiver) -> Stacks:
    """Call log_step from this thread, then stop calling it (the loop hangs here)."""
    for step in range(3):
        agent.log_step(step)
    frames = rx.wait_for(lambda fs: any(isinstance(f, Stacks) for f in fs), timeout=10)
    return next(f for f in frames if isinstance(f, Stacks))


def test_a_silent_loop_is_dumped_with_main_on_the_training_thread(receiver: Receiver) -> None:
    with RankAgent(receiver.endpoint, "diag", 0, 1, stall_after=0.5, control=False) as agent:
        box: dict[str, Stacks] = {}
        trainer = threading.Thread(target=lambda: box.update(d=stalled_in_named_function(
            agent, receiver)), name="trainer")
        trainer.start()
        trainer.join(15)
        dump = box["d"]
        assert dump.reason == "stall" and dump.idle_s >= 0.5
        main = [t for t in dump.threads if t.main]
        assert [t.name for t in main] == ["trainer"]
        assert main[0].frames[-1].function in ("wait_for", "_pump", "poll")
        assert any(f.function == "stalled_in_named_function" for f in main[0].frames)


def test_stall_after_zero_and_control_false_start_nothing(receiver: Receiver) -> None:
    before = _diag_threads()
    agent = RankAgent(receiver.endpoint, "off", 0, 1, stall_after=0, control=False)
    agent.log_step(0)
    agent.log_epoch(0, 1.0)
    assert _diag_threads() == before
    assert agent._steps.watch is None  # log_step pays nothing at all
    agent.close()
    with pytest.raises(ValueError):
        RankAgent(receiver.endpoint, "bad", 0, 1, stall_after=-1)


def test_from_env_takes_the_diagnosis_keywords(receiver: Receiver) -> None:
    env = {"RANKBOARD_BROKER": receiver.endpoint, "RANKBOARD_RUN": "envdiag"}
    agent = RankAgent.from_env(env, stall_after=7, control="tcp://127.0.0.1:1")
    try:
        assert agent._watch.stall_after == 7
        assert agent._control is not None and agent._control.endpoint == "tcp://127.0.0.1:1"
    finally:
        agent.close()


def test_close_leaves_no_thread_or_socket(receiver: Receiver) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    proc = psutil.Process()
    before_threads = {t.ident for t in threading.enumerate()}
    before_fds = proc.num_fds()
    try:
        agent = RankAgent(receiver.endpoint, "closing", 0, 1, stall_after=0.3,
                          control=f"tcp://127.0.0.1:{port}")
        agent.log_step(0)
        wait_for(lambda: len(_diag_threads()) == 2, timeout=5)
        assert agent._control is not None and control_connected(agent._control, 5)
        # the channel works through the agent: a request is answered with the agent's run
        deadline = time.monotonic() + 10
        while not receiver.of_type(Stacks) or all(s.reason != "request"
                                                  for s in receiver.of_type(Stacks)):
            pub.send_multipart(encode_request(ControlRequest(run="closing", request_id="r1",
                                                             kind="stacks", ranks=[0])))
            receiver._pump(min(deadline, time.monotonic() + 0.2))
            assert time.monotonic() < deadline, "no answer"
        agent.close()
        assert _diag_threads() == []
        assert {t.ident for t in threading.enumerate()} <= before_threads
        assert agent._control._ctx is None
        wait_for(lambda: proc.num_fds() <= before_fds, timeout=5)
    finally:
        pub.close(linger=0)
        ctx.term()


def test_a_forked_child_gets_its_own_stall_watch(receiver: Receiver) -> None:
    """The parent's watch runs; a forked child's first log_step starts a fresh one whose
    stall dump carries the child's rank, and the parent's watch keeps running."""
    import os

    from tests.support.forking import fork, wait_child

    agent = RankAgent(receiver.endpoint, "forked", 0, 2, stall_after=0.3, control=False)
    try:
        agent.log_step(0)
        wait_for(lambda: _diag_threads() == ["rankboard-stallwatch-0"], timeout=5)
        pid = fork()
        if pid == 0:  # the child: no assertion may raise out of here
            code = 1
            try:
                child = RankAgent(receiver.endpoint, "forked", 1, 2, stall_after=0.3,
                                  control=False)
                agent.log_step(1)  # the inherited agent: its watch comes back here
                child.log_step(0)
                names = _diag_threads()
                code = 0 if names == ["rankboard-stallwatch-0", "rankboard-stallwatch-1"] else 3
                deadline = time.monotonic() + 5
                while child._watch.dumps_sent == 0 and time.monotonic() < deadline:
                    time.sleep(0.02)  # the child's loop is silent: its watch dumps
                if child._watch.dumps_sent == 0:
                    code = 4
                child.close()
                agent.close()
            finally:
                os._exit(code)
        assert wait_child(pid) == 0
        frames = receiver.wait_for(lambda fs: any(isinstance(f, Stacks) and f.rank == 1
                                                  for f in fs), timeout=10)
        assert any(isinstance(f, Stacks) and f.rank == 1 and f.reason == "stall" for f in frames)
        assert _diag_threads() == ["rankboard-stallwatch-0"]  # the parent's, untouched
    finally:
        agent.close()
