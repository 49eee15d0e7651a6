"""An exception as the wire's ``ErrorInfo`` (PROTOCOL.md section 8.2), cut to fit its bounds.

Why a module of its own: the agent builds one from three places (``finish(error=exc)``, a
``with`` block's end, the exit rule of :mod:`rank_agent.lifecycle`) and the integrations
from a fourth (Lightning's ``on_exception``), and every one of them runs while a training
process is going down: the builder must never raise (an exception whose ``__str__`` raises,
a traceback whose source file is gone) and must cut to the wire's bounds rather than lose
the frame to a ``schema`` rejection. Pure: no socket, no clock but the one it is handed.
"""
from __future__ import annotations

import math
import time
import traceback
from typing import Any, List, Optional

from .protocol import (
    MAX_ERROR_FRAMES,
    MAX_ERROR_MESSAGE,
    MAX_ERROR_TYPE,
    MAX_STACK_TEXT,
    ErrorInfo,
    StackFrame,
)

__all__ = ["error_info", "type_name", "exit_is_success"]


def _cut(text: Any, limit: int) -> str:
    """``text`` as a ``str`` of at most ``limit`` characters (never raises)."""
    try:
        text = text if type(text) is str else str(text)
    except Exception:
        return ""
    return text if len(text) <= limit else text[:limit]


def type_name(cls: type) -> str:
    """``<module>.<qualname>`` of an exception class, the module left out for ``builtins``
    (``RuntimeError``, ``torch.OutOfMemoryError``, ``__main__.ShardError``)."""
    try:
        qual = getattr(cls, "__qualname__", None) or getattr(cls, "__name__", "") or "?"
        module = getattr(cls, "__module__", None)
        name = qual if not module or module == "builtins" else f"{module}.{qual}"
    except Exception:
        name = "?"
    return _cut(name, MAX_ERROR_TYPE) or "?"


def _message(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        try:
            text = repr(exc)
        except Exception:
            text = "<unprintable exception>"
    return _cut(text, MAX_ERROR_MESSAGE)


def _frames(exc: BaseException) -> List[StackFrame]:
    """The traceback's innermost :data:`MAX_ERROR_FRAMES` frames, outermost first (as
    ``traceback.extract_tb`` gives them), each string cut to the ``stacks`` frame's 512."""
    tb = getattr(exc, "__traceback__", None)
    if tb is None:
        return []
    out: List[StackFrame] = []
    try:
        for fs in traceback.extract_tb(tb, limit=-MAX_ERROR_FRAMES):
            out.append(StackFrame(file=_cut(fs.filename, MAX_STACK_TEXT),
                                  line=int(fs.lineno or 0),
                                  function=_cut(fs.name, MAX_STACK_TEXT),
                                  code=_cut((fs.line or "").strip(), MAX_STACK_TEXT)))
    except Exception:  # a source file that cannot be read, a broken frame: keep what we have
        pass
    return out


def error_info(exc: BaseException, at: Optional[float] = None) -> ErrorInfo:
    """The ``ErrorInfo`` of ``exc``, caught at ``at`` (unix seconds; default now), within
    every wire bound. Never raises: a part that cannot be read is left empty."""
    if at is None or not math.isfinite(at):
        at = time.time()
    try:
        return ErrorInfo(type=type_name(type(exc)), message=_message(exc), at=float(at),
                         frames=_frames(exc))
    except Exception:  # pragma: no cover - defensive: the parts above never raise
        return ErrorInfo(type="?", message="", at=float(at))


def exit_is_success(exc: BaseException) -> bool:
    """A ``SystemExit`` with code 0 or ``None`` is a success (section 8.2); every other
    exception, ``KeyboardInterrupt`` included, is an error."""
    return isinstance(exc, SystemExit) and getattr(exc, "code", None) in (0, None)
