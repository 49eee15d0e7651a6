"""One byte budget per process for what the broker and the web keep of ranks' answers.

Why (issue 32, finding 2): a per-run cap bounds nothing across runs. Stack dumps are capped
at 64 MiB a run, and ``--max-runs`` is 1,000, so 24 runs of maximal dumps already took each
process to ~1.6 GiB (~65 GiB at the default). A :class:`ByteBudget` is shared by every store
of such answers in one process (:data:`PROCESS_BUDGET`): each store charges what it keeps and
refunds what it lets go, and when the total passes the limit the budget asks the stores to
drop their **oldest** items first (in the order they were kept, across runs), never the one
just kept.

General on purpose: any family of kept answers (stack dumps, ``collectives`` frames) is a
:class:`Holder`: it charges ``(holder, key, bytes)`` when it keeps an item, refunds when it
drops one itself, and implements ``evict(key)`` (drop that item and refund it). A holder going
away (its run evicted or dropped) refunds everything it holds (``RunStacks.close``,
``RunCollectives.close``).

Pure: no I/O, no clock; one thread (the broker's loop, the web's gevent loop).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Hashable, Protocol

from rank_agent.ratelimit import RateLimitedLog

__all__ = ["ByteBudget", "Holder", "PROCESS_BUDGET", "DEFAULT_BUDGET_BYTES"]

log = logging.getLogger(__name__)
_rlog = RateLimitedLog(log)

#: The budget of each process (broker, web): 256 MiB of kept answers over every run, e.g.
#: four runs of maximal (64 MiB) dumps, or 4,096 ranks' distinct 64 KiB dumps.
DEFAULT_BUDGET_BYTES = 256 * 1024 * 1024


class Holder(Protocol):
    """A store of kept items charged to a :class:`ByteBudget`."""

    def evict(self, key: Hashable) -> None:
        """Drop the item ``key`` (the budget is full) and refund its bytes."""


class ByteBudget:
    """Bytes kept by every holder of one process, oldest dropped first past :attr:`limit`."""

    def __init__(self, limit: int = DEFAULT_BUDGET_BYTES) -> None:
        self.limit = limit
        #: bytes charged now
        self.used = 0
        #: items dropped because the budget was full (since it was made)
        self.dropped = 0
        # (id(holder), key) -> holder, oldest first
        self._order: OrderedDict[tuple[int, Hashable], Holder] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def charge(self, holder: Holder, key: Hashable, nbytes: int) -> None:
        """``holder`` kept ``key`` (``nbytes`` more bytes): it is now the newest item; older
        items of any holder are evicted until the total fits (never this one)."""
        slot = (id(holder), key)
        self._order[slot] = holder
        self._order.move_to_end(slot)
        self.used += nbytes
        while self.used > self.limit and len(self._order) > 1:
            oldest, victim = next(iter(self._order.items()))
            if oldest == slot:
                break
            del self._order[oldest]
            self.dropped += 1
            _rlog.warning("budget_full", "byte budget of %d bytes full: the oldest kept "
                          "answers are dropped (%d so far)", self.limit, self.dropped)
            victim.evict(oldest[1])

    def adjust(self, nbytes: int) -> None:
        """A holder's bytes changed by ``nbytes`` without an item coming or going (shared
        data freed or taken), or an item's refund: ``forget`` does the bookkeeping."""
        self.used += nbytes

    def forget(self, holder: Holder, key: Hashable) -> None:
        """``holder`` no longer keeps ``key`` (its bytes: :meth:`adjust`)."""
        self._order.pop((id(holder), key), None)


#: The budget every store of this process shares unless given another (tests make their own).
PROCESS_BUDGET = ByteBudget()
