"""The process-wide hooks over every live :class:`~rank_agent.agent.RankAgent`.

An ``os.register_at_fork`` hook resets every live agent in a forked child (its sockets,
threads and pending points are the parent's), and an ``atexit`` hook closes the agents a
script forgot to close (bounded by each one's ``linger_ms``), so their last frames
(``finish``) still go out. Apart from the agent because they are about the process, not
one rank's connection; the agent adds itself to :data:`AGENTS` when built.

**The exit rule** (PROTOCOL.md 8.2): at interpreter exit an agent that has not finished
finishes, ``error`` with the main thread's uncaught exception when one is ending the process,
``ok`` otherwise. Python tells exit hooks nothing of that exception, so the agent wraps
``sys.excepthook`` when built (:func:`watch_uncaught`): the wrapper notes the exception and its
time, then always calls the hook it found, so the traceback still prints and a user's or
another library's hook still runs. A hook installed later that does not chain to ours still
leaves ``sys.last_value``, which the interpreter sets before calling any hook: the exit rule
reads that when the wrapper saw nothing. Only the process that built an agent finishes it: a
forked child (a data-loader worker) that exits closes what it made itself and never ends its
parent's rank.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from typing import Any, Callable, Optional, Tuple

import zmq  # noqa: F401  (imported before the exit hook is registered: see below)

__all__ = ["AGENTS", "watch_uncaught", "uncaught"]

#: every live agent of this process (weak: an agent dropped without close() leaves it)
AGENTS: weakref.WeakSet[Any] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for agent in list(AGENTS):
        agent._reset_after_fork()


#: The main thread's uncaught exception and the unix time the excepthook saw it (None: none).
_uncaught: Optional[Tuple[BaseException, float]] = None

ExceptHook = Callable[[Any, Any, Any], Any]


def _interactive() -> bool:
    """An interactive session (the REPL, ``python -i``, IPython/Jupyter) survives its
    exceptions, and IPython sets ``sys.last_value`` for every failed cell: there, an
    exception seen earlier is not what ends the process."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or "IPython" in sys.modules


def _record(value: Any) -> None:
    global _uncaught
    if isinstance(value, BaseException) and not _interactive():
        _uncaught = (value, time.time())


def _wrap(found: ExceptHook) -> ExceptHook:
    def rankboard_excepthook(tp: Any, value: Any, tb: Any) -> Any:
        try:
            _record(value)
        except Exception:  # pragma: no cover - never in the way of the traceback
            pass
        return found(tp, value, tb)

    rankboard_excepthook.rankboard_wrapper = True  # type: ignore[attr-defined]
    return rankboard_excepthook


def watch_uncaught() -> None:
    """Wrap ``sys.excepthook`` (once: again only if someone replaced our wrapper since), so
    the exit rule knows the exception ending the process. The wrapper always calls the
    hook it found first."""
    try:
        hook = sys.excepthook
        if not getattr(hook, "rankboard_wrapper", False):
            sys.excepthook = _wrap(hook)
    except Exception:  # pragma: no cover - a guest never raises
        pass


def uncaught() -> Optional[Tuple[BaseException, float]]:
    """The exception ending this process and when it was caught, or None: the wrapper's
    note, else the interpreter's ``sys.last_value`` (a later hook bypassed ours: its time is
    now)."""
    if _uncaught is not None:
        return _uncaught
    value = getattr(sys, "last_value", None)
    if isinstance(value, BaseException) and not _interactive():
        return value, time.time()
    return None


def _close_all_at_exit() -> None:
    """The exit rule (module docstring): finish each agent this process built that has not
    finished, then flush and close every agent a script forgot to close (bounded by each
    one's linger)."""
    caught = uncaught()
    for agent in list(AGENTS):
        try:
            agent._users = 1  # users still holding a shared agent at exit: it ends now
            agent._end_at_exit(caught)
        except Exception:  # pragma: no cover - interpreter teardown
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
# registered after ``import zmq``, so it runs before pyzmq's own exit hook (atexit is LIFO)
atexit.register(_close_all_at_exit)
