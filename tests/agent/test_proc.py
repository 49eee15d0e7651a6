"""``register.proc`` (PROTOCOL.md 8.1): the agent's id of its process, in every register (the
implicit one too), the same for the life of a process and different in a forked child, so
the broker tells a restarted job from a process registering again."""
from __future__ import annotations

import os
import re

from rank_agent import RankAgent
from rank_agent.procid import proc_id
from rank_agent.protocol import Register


def _registers(receiver) -> list[Register]:  # type: ignore[no-untyped-def]
    return [f for f in receiver.all_frames if isinstance(f, Register)]


def test_every_register_carries_this_process_id_the_implicit_one_too(receiver, make_agent) -> None:  # type: ignore[no-untyped-def]
    agent = make_agent(broker=receiver.endpoint)
    assert agent.log_epoch(0, 1.0)  # no register() call: the implicit one goes first
    assert agent.register(total_epochs=3)
    receiver.wait_count(2)
    regs = _registers(receiver)
    assert len(regs) == 2 and regs[0].proc == regs[1].proc == proc_id()
    assert re.fullmatch(r"[0-9a-f]{16}", regs[0].proc)
    other = make_agent(broker=receiver.endpoint, rank=1, world_size=2)
    assert other.register()
    receiver.wait_for(lambda _: len(_registers(receiver)) == 3)
    assert _registers(receiver)[2].proc == proc_id()  # one id a process, not an agent


def test_a_forked_child_registers_with_its_own_id(receiver) -> None:  # type: ignore[no-untyped-def]
    from tests.support.forking import fork, wait_child

    agent = RankAgent(receiver.endpoint, "forked-proc", 0, 2, stall_after=0, control=False)
    try:
        assert agent.register()
        receiver.wait_for(lambda _: len(_registers(receiver)) == 1)
        parent = proc_id()
        pid = fork()
        if pid == 0:  # the child: no assertion may raise out of here
            code = 1
            try:
                code = 0 if proc_id() != parent and proc_id() == proc_id() else 2
                child = RankAgent(receiver.endpoint, "forked-proc", 1, 2, stall_after=0,
                                  control=False)
                child.register()
                agent.register()  # the inherited agent: the child's id too
                child.close()
                agent.close()
            finally:
                os._exit(code)
        assert wait_child(pid) == 0
        receiver.wait_for(lambda _: len(_registers(receiver)) == 3, timeout=10)
        regs = _registers(receiver)
        assert regs[0].proc == parent
        assert regs[1].proc == regs[2].proc != parent
        assert proc_id() == parent  # the parent's id is untouched
    finally:
        agent.close()
