"""One agent per process and run (PROTOCOL.md section 5, the Accelerate bullet).

A training process may reach for an agent from several places: the per-rank recipe's
``RankAgent.from_env()``, a framework tracker or callback, twice ``from_env`` in one script.
Two agents for one (run, rank) would register twice, send two finishes and split one rank's
step points between two flushers; so :meth:`rank_agent.RankAgent.from_env` asks this registry
first and the framework integrations adopt what it holds. The agent counts its users and
finishes and closes when the last of them does (``RankAgent.close``); a closed agent leaves
the registry, so a later ``from_env`` makes a fresh one.

Fork-safe: entries belong to the process that made them (a forked child starts with an
empty registry and a fresh lock: the parent's agents are the parent's). Bounded: one entry
per live agent.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Dict, Protocol, Tuple, TypeVar, cast


class SharedAgent(Protocol):
    """What this registry needs of an agent (``RankAgent`` is one). A protocol, not an
    import of ``agent.py``, which imports this module: the layering has no cycle."""

    run: str
    rank: int

    @property
    def closed(self) -> bool: ...

    def _add_user(self) -> bool: ...


A = TypeVar("A", bound=SharedAgent)
Key = Tuple[str, int]

_lock = threading.Lock()
_agents: Dict[Key, SharedAgent] = {}
_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _lock, _pid
    _lock = threading.Lock()  # the parent's may have been held at the fork
    _agents.clear()
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _live(agent: SharedAgent) -> bool:
    return not agent.closed


def find(run: str | None, rank: int) -> SharedAgent | None:
    """This process's live agent for (``run``, ``rank``); ``run=None``: the most recently
    made one of that rank (for a caller whose run id would be generated, hence unknown)."""
    if _pid != os.getpid():  # a fork the at-fork hook did not see
        _after_fork_in_child()
    with _lock:
        return _find(run, rank)


def _find(run: str | None, rank: int) -> SharedAgent | None:
    if run is not None:
        agent = _agents.get((run, rank))
        return agent if agent is not None and _live(agent) else None
    for (_, r), agent in reversed(list(_agents.items())):
        if r == rank and _live(agent):
            return agent
    return None


def latest() -> SharedAgent | None:
    """This process's most recently made live agent, whatever its run and rank."""
    if _pid != os.getpid():
        _after_fork_in_child()
    with _lock:
        for agent in reversed(list(_agents.values())):
            if _live(agent):
                return agent
    return None


def acquire(run: str | None, rank: int, make: Callable[[], A]) -> A:
    """The live agent for (``run``, ``rank``) with one more user, or ``make()``'s (one user),
    remembered under its own (run, rank). Atomic: two threads asking at once get one agent."""
    if _pid != os.getpid():
        _after_fork_in_child()
    with _lock:
        found = _find(run, rank)
        if found is not None and found._add_user():
            return cast(A, found)  # the registry holds only what make() gave
        agent = make()
        _agents[(agent.run, agent.rank)] = agent
        return agent


def adopt(agent: SharedAgent) -> bool:
    """One more user for ``agent`` (an integration taking over the process's agent);
    ``False`` if it closed meanwhile."""
    return agent._add_user()


def forget(agent: SharedAgent) -> None:
    """``agent`` closed: drop its entry (if it is still the one under its key)."""
    with _lock:
        key = (agent.run, agent.rank)
        if _agents.get(key) is agent:
            del _agents[key]
