"""Rate-limited logging: at most one line per key per interval (the one definition: the
agent, the broker and its webhook thread use it; it lives in ``rank_agent`` because that is
the lowest layer, and it imports only the standard library).

A broker fed garbage by a misconfigured client (or an attacker) receives thousands of bad
frames a second; one warning each would flood the log and cost more than the decode. So
each *key* (e.g. a reject reason) logs at most once per ``interval`` seconds, and the next
line it does log says how many were suppressed in between, so no count is silently lost.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Callable, Hashable

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """Per-key rate limiter in front of a :class:`logging.Logger`.

    ``clock`` is injectable (monotonic seconds) so tests need no sleeps; a caller that
    reads no clock of its own (the pure sink) passes ``now`` per call instead. The number of keys
    is bounded (``max_keys``, least recently logged forgotten first) because keys may be
    derived from untrusted input such as run names.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 10.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 1024,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._max_keys = max_keys
        # key -> [time of the last emitted line, lines suppressed since]
        self._keys: OrderedDict[Hashable, list[Any]] = OrderedDict()

    def log(
        self, key: Hashable, level: int, msg: str, *args: Any, exc_info: bool = False,
        stacklevel: int = 1, now: float | None = None,
    ) -> bool:
        """Log ``msg % args`` unless ``key`` logged within ``interval``; True if emitted.
        ``now``: the time to judge by (default: the clock)."""
        if now is None:
            now = self._clock()
        state = self._keys.get(key)
        if state is not None and now - state[0] < self.interval:
            state[1] += 1
            return False
        suppressed = state[1] if state is not None else 0
        self._keys[key] = [now, 0]
        self._keys.move_to_end(key)
        while len(self._keys) > self._max_keys:
            self._keys.popitem(last=False)
        if suppressed:
            msg = msg + " (%d similar suppressed)"
            args = (*args, suppressed)
        # stacklevel: the record names the caller's line, not this helper's.
        self.logger.log(level, msg, *args, exc_info=exc_info, stacklevel=stacklevel + 1)
        return True

    def warning(self, key: Hashable, msg: str, *args: Any, now: float | None = None) -> bool:
        """Shorthand for :meth:`log` at WARNING."""
        return self.log(key, logging.WARNING, msg, *args, stacklevel=2, now=now)

    def error(self, key: Hashable, msg: str, *args: Any, exc_info: bool = False) -> bool:
        """Shorthand for :meth:`log` at ERROR."""
        return self.log(key, logging.ERROR, msg, *args, exc_info=exc_info, stacklevel=2)

    def __call__(self, key: Hashable, msg: str, *args: Any, level: int = logging.WARNING) -> bool:
        """``warn(kind, msg, *args)``: :meth:`log` at ``level`` (WARNING), as the agent calls it."""
        return self.log(key, level, msg, *args, stacklevel=2)

    def suppressed(self, key: Hashable) -> int:
        """Lines of ``key`` suppressed since its last emitted line (for tests and stats)."""
        state = self._keys.get(key)
        return state[1] if state is not None else 0
