"""The process-wide hooks over every live :class:`~rank_agent.agent.RankAgent`.

An ``os.register_at_fork`` hook resets every live agent in a forked child (its sockets,
threads and pending points are the parent's), and an ``atexit`` hook closes the agents a
script forgot to close (bounded by each one's ``linger_ms``), so their last frames
(``finish``) still go out. Apart from the agent because they are about the process, not
one rank's connection; the agent adds itself to :data:`AGENTS` when built.
"""
from __future__ import annotations

import atexit
import os
import weakref
from typing import Any

import zmq  # noqa: F401  (imported before the exit hook is registered: see below)

__all__ = ["AGENTS"]

#: every live agent of this process (weak: an agent dropped without close() leaves it)
AGENTS: weakref.WeakSet[Any] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for agent in list(AGENTS):
        agent._reset_after_fork()


def _close_all_at_exit() -> None:
    """Flush and close the agents a script forgot to close (bounded by each one's linger)."""
    for agent in list(AGENTS):
        try:
            agent._users = 1  # users still holding a shared agent at exit: it ends now
            agent.close()
        except Exception:  # pragma: no cover - interpreter teardown
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
# registered after ``import zmq``, so it runs before pyzmq's own exit hook (atexit is LIFO)
atexit.register(_close_all_at_exit)
