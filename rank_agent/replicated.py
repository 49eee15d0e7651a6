"""The agent's side of replicated step metrics (PROTOCOL.md 8.3): the names a rank declares
in its ``register`` as computed to the same value on every rank by construction.

Apart from :mod:`rank_agent.agent` because the check is the wire's bound (at most 64 names
of at most 128 characters, :data:`~rank_agent.protocol.MAX_REPLICATED`): a register over it
would be rejected whole (``schema``), losing the rank's world size and host with it, so the
agent keeps what fits and says what it left out, once, at construction (never in the loop).
"""
from __future__ import annotations

import logging
from typing import Iterable, List

from .protocol import MAX_REPLICATED, MAX_STEP_METRIC_NAME

__all__ = ["replicated_names"]

log = logging.getLogger(__name__)


def replicated_names(names: Iterable[str] | str | None) -> List[str]:
    """The names to send: strings, each once, in the order given, at most 64 of at most 128
    characters (a longer name could never match a step metric: left out, logged). ``None``
    is none; a single string is one name (not its letters)."""
    if names is None:
        return []
    if isinstance(names, str):
        names = [names]
    out: List[str] = []
    skipped: List[str] = []
    try:
        for name in names:
            if not isinstance(name, str) or not name or len(name) > MAX_STEP_METRIC_NAME:
                skipped.append(repr(name)[:40])
            elif name not in out:
                out.append(name)
    except TypeError:
        log.warning("rankboard: replicated must be a list of metric names, got %r; ignored",
                    type(names).__name__)
        return []
    if len(out) > MAX_REPLICATED:
        skipped.extend(out[MAX_REPLICATED:])
        out = out[:MAX_REPLICATED]
    if skipped:
        log.warning("rankboard: %d replicated names left out (at most %d names of at most %d "
                    "characters): %s", len(skipped), MAX_REPLICATED, MAX_STEP_METRIC_NAME,
                    ", ".join(skipped[:5]))
    return out
