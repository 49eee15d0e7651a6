"""One agent per process and run (rank_agent.shared) and the agent's implicit register
(PROTOCOL.md section 5), against a real PULL socket and real processes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, List

import pytest

from rank_agent import RankAgent, shared
from rank_agent.protocol import Finish, Metrics, Register, Steps
from tests.support.forking import fork as _fork
from tests.support.forking import wait_child as _wait_child

REPO = Path(__file__).resolve().parents[2]


def _by(frames: List[Any], run: str, rank: int = 0) -> List[Any]:
    return [f for f in frames if f.run == run and f.rank == rank]


# -- the implicit register ---------------------------------------------------------------------


def test_an_agent_that_never_registers_registers_itself_first(receiver, launcher_env):
    launcher_env(RANKBOARD_BROKER=receiver.endpoint, RANKBOARD_RUN="implicit", RANK="1",
        WORLD_SIZE="4", LOCAL_RANK="1", RANKBOARD_HOST="node7")
    with RankAgent.from_env(step_flush=0.05) as agent:
        agent.log_step(0)
        agent.log_step(1)
    frames = receiver.wait_for(lambda fs: any(isinstance(f, Finish) for f in receiver.all_frames))
    sent = receiver.all_frames
    first = sent[0]
    assert isinstance(first, Register)
    assert (first.run, first.rank, first.world_size, first.local_rank, first.host) == (
        "implicit", 1, 4, 1, "node7")
    assert (first.port, first.total_epochs, first.pid) == (0, 0, os.getpid())
    assert [type(f) for f in sent[1:]] == [Steps, Finish]
    assert [type(f) for f in frames] == [Steps, Finish]  # what the calls themselves sent
    assert agent.sent == 3


def test_an_explicit_first_register_is_not_doubled_and_a_later_one_still_goes(receiver, make_agent):
    agent = make_agent(broker=receiver.endpoint)
    assert agent.register(port=8600, total_epochs=3)
    agent.log_epoch(0, 1.0)
    receiver.wait_for(lambda fs: any(isinstance(f, Metrics) for f in fs))
    assert [type(f) for f in receiver.all_frames] == [Register, Metrics]

    late = make_agent(broker=receiver.endpoint, run="late")
    late.log_epoch(0, 1.0)  # implicit register first
    assert late.register(port=8601, total_epochs=5)  # later: sent as usual, first arrival rules
    regs = receiver.wait_for(lambda fs: len(_by(receiver.all_frames, "late")) >= 3)
    assert regs  # (the filtered view)
    late_frames = _by(receiver.all_frames, "late")
    assert [type(f) for f in late_frames] == [Register, Metrics, Register]
    assert (late_frames[0].port, late_frames[0].total_epochs) == (0, 0)
    assert (late_frames[2].port, late_frames[2].total_epochs) == (8601, 5)


RECIPE = """
import sys
from rank_agent import RankAgent
with RankAgent.from_env(step_flush=0.05) as agent:   # the README's per-rank recipe
    for step in range(1, 6):
        agent.log_step(step, samples=8)
"""


def test_a_process_pair_that_never_calls_register_tells_the_world_size_and_finishes(receiver):
    """Without the implicit register no frame of this run would carry its world size, and
    the broker could never complete it."""
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "SLURM_"))}
        env.update(RANKBOARD_BROKER=receiver.endpoint, RANKBOARD_RUN="pair", RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, "-c", RECIPE], cwd=REPO, env=env))
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    receiver.wait_for(lambda fs: sum(isinstance(f, Finish) for f in fs) == 2)
    for rank in (0, 1):
        mine = _by(receiver.all_frames, "pair", rank)
        assert isinstance(mine[0], Register) and mine[0].world_size == 2
        assert isinstance(mine[-1], Finish) and mine[-1].status == "ok"
        assert sorted(s for f in mine if isinstance(f, Steps) for s in f.steps) == [1, 2, 3, 4, 5]


# -- one agent per process and run ------------------------------------------------------------


def test_a_second_from_env_for_the_same_run_returns_the_same_agent(receiver, launcher_env):
    launcher_env(RANKBOARD_BROKER=receiver.endpoint, RANKBOARD_RUN="same", RANK="0", WORLD_SIZE="1")
    first = RankAgent.from_env()
    second = RankAgent.from_env(step_flush=9.0)  # the other kwargs do not apply then
    other = RankAgent.from_env(run="other")
    try:
        assert second is first and other is not first
        assert shared.find("same", 0) is first and shared.latest() is other
        first.log_epoch(0, 1.0)
        second.close()  # one user left: still open
        assert not first.closed and first.log_epoch(1, 1.0)
        first.close()
        assert first.closed and shared.find("same", 0) is None
        third = RankAgent.from_env()
        assert third is not first  # a closed agent is not handed out
        third.close()
    finally:
        other.close()
        first.close()
    frames = _by(receiver.wait_for(lambda fs: len(_by(fs, "same")) >= 2), "same")
    regs = [f for f in _by(receiver.all_frames, "same") if isinstance(f, Register)]
    assert len(regs) == 1 and [f.epoch for f in frames if isinstance(f, Metrics)] == [0, 1]


@pytest.mark.parametrize("fail_first", [True, False])
def test_a_shared_agent_finishes_once_when_its_last_user_ends_and_an_error_sticks(
        receiver, launcher_env, fail_first):
    launcher_env(RANKBOARD_BROKER=receiver.endpoint, RANKBOARD_RUN="ends", RANK="0", WORLD_SIZE="1")
    tracker_side = RankAgent.from_env()  # e.g. the Accelerate tracker, made first
    with pytest.raises(RuntimeError) if fail_first else _nothing():
        with RankAgent.from_env() as agent:  # the per-rank recipe
            assert agent is tracker_side
            agent.log_step(1)
            if fail_first:
                raise RuntimeError("training blew up")
    assert not tracker_side.closed  # the tracker still holds it
    assert not any(isinstance(f, Finish) for f in receiver.all_frames)
    tracker_side.finish("ok")  # e.g. the tracker at the end (or process exit)
    tracker_side.close()
    assert tracker_side.closed
    receiver.wait_for(lambda fs: any(isinstance(f, Finish) for f in fs))
    finishes = [f for f in receiver.all_frames if isinstance(f, Finish)]
    assert [f.status for f in finishes] == ["error" if fail_first else "ok"]
    assert [s for f in receiver.all_frames if isinstance(f, Steps) for s in f.steps] == [1]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_does_not_get_its_parents_agent(receiver, launcher_env):
    launcher_env(RANKBOARD_BROKER=receiver.endpoint, RANKBOARD_RUN="forked", RANK="0", WORLD_SIZE="1")
    parent = RankAgent.from_env()
    try:
        pid = _fork()
        if pid == 0:  # the child: never return into pytest
            code = 1
            try:
                child = RankAgent.from_env()
                ok = child is not parent and shared.find("forked", 0) is child
                child.close()
                code = 0 if ok else 3
            finally:
                os._exit(code)
        assert _wait_child(pid) == 0
        assert shared.find("forked", 0) is parent and RankAgent.from_env() is parent
        parent.close()  # the second user
    finally:
        parent.close()
    assert parent.closed
