"""The one-request-a-run-a-second rule for requests for dumps (PROTOCOL.md sections 2.5, 4).

Two places apply it: the web's ``POST /api/runs/<run>/stacks`` answers 429
(:class:`web.stacksapi.RequestGate`), and the broker refuses to forward
(:class:`broker.stacks.requests.ForwardGate`), because the broker's socket is reachable by
more than the web. They were written twice, each with its own interval and its own prune
(issue 44 item 5); :class:`RunGate` is the rule once: when each run was last let through,
how long until it may be again, and a table bounded by the runs let through in the last
interval. What each side counts (the web's results, the broker's refusals) stays its own.

Pure: the caller passes ``now`` (monotonic seconds); no sockets, no clock, no logging.
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional, Tuple

__all__ = ["MIN_INTERVAL_S", "PRUNE_AT", "RunGate"]

#: Seconds between two requests let through for one run (the web's 429, the broker's
#: ``rate_limited``/``coalesced``).
MIN_INTERVAL_S = 1.0
#: Runs remembered before the table is pruned to those let through in the last interval:
#: bounded by how many runs can be asked in one interval, whatever the run names.
PRUNE_AT = 4096


class RunGate:
    """Per run, when a request was last let through and what it asked (its ``shape``, any
    hashable: the broker tells an identical request from a different one by it)."""

    __slots__ = ("interval", "prune_at", "_last")

    def __init__(self, interval: float = MIN_INTERVAL_S, prune_at: int = PRUNE_AT) -> None:
        self.interval = interval
        self.prune_at = prune_at
        self._last: Dict[str, Tuple[float, Hashable]] = {}

    def __len__(self) -> int:
        """Runs remembered now (at most ``prune_at`` + 1)."""
        return len(self._last)

    def blocking(self, run: str, now: float) -> Optional[Hashable]:
        """The shape of the request that keeps ``run`` shut at ``now`` (one let through less
        than ``interval`` before), or None when the run may be asked. A request let through
        without a shape blocks with ``True``, so the answer is never falsy while shut."""
        last = self._last.get(run)
        if last is None or now - last[0] >= self.interval:
            return None
        return last[1]

    def wait_left(self, run: str, now: float) -> float:
        """Seconds until ``run`` may be asked again (0.0: now)."""
        last = self._last.get(run)
        if last is None:
            return 0.0
        return max(0.0, self.interval - (now - last[0]))

    def let_through(self, run: str, now: float, shape: Hashable = True) -> None:
        """``run`` was asked at ``now``: shut for ``interval``. Past ``prune_at`` runs, the
        table keeps only the runs let through in the last interval (they are all that
        :meth:`blocking` can still answer for)."""
        self._last[run] = (now, shape)
        if len(self._last) > self.prune_at:
            self._last = {r: seen for r, seen in self._last.items()
                          if now - seen[0] < self.interval}
