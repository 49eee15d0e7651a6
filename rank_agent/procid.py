"""This process's id for ``register.proc`` (PROTOCOL.md 8.1).

The broker tells a restarted job from the same process re-registering by this id: a rank
whose ``proc`` changes starts a new attempt of the run. So it must differ in every process,
a forked child included (a data-loader worker that uses an agent is a new process), and stay
the same for the life of one. Random rather than derived from the pid: pids repeat across
hosts and across container restarts, where a restarted rank 0 often gets the same pid.
"""
from __future__ import annotations

import os
import secrets
from typing import Optional, Tuple

__all__ = ["proc_id"]

#: (pid that made it, the id); remade when the pid differs (a forked child)
_current: Optional[Tuple[int, str]] = None


def proc_id() -> str:
    """This process's id: 16 hex digits, made once per process (a forked child makes its
    own: the pid check costs one system call's worth, ``os.getpid`` is cached by libc)."""
    global _current
    pid = os.getpid()
    cur = _current
    if cur is None or cur[0] != pid:
        cur = _current = (pid, secrets.token_hex(8))
    return cur[1]


def _forget_after_fork() -> None:
    global _current
    _current = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
