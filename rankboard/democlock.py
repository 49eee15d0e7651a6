"""The demo step job's lockstep: every simulated rank's step ends when the slowest rank's does,
as in synchronous data-parallel training (each step's gradient all-reduce waits for every
rank). Without it the demo's ranks stepped at their own pace, and its slow rank drifted tens
of steps away from ranks the page showed "waiting in all_reduce" (issue 34, item 6).

A :class:`StepClock` is a small file of one 8-byte counter per rank (the steps each rank has
finished), mapped into every rank process of one run: a rank writes its own counter after
its step and then waits until every counter has reached it. Reading the map costs about a
microsecond, so the waiting ranks poll it every :data:`POLL_S` without a socket, a server or
a lock (each slot has one writer; an 8-byte aligned store is not torn on the platforms the
demo runs on). The ranks are separate processes started by :class:`rankboard.demo.Cluster`,
which creates the file (:func:`create`) in the run's temporary directory.
"""
from __future__ import annotations

import mmap
import os
import struct
import time

#: How often a rank waiting for its peers looks at the counters (seconds): short against
#: the demo's ~0.1 s steps, so the ranks leave the barrier within a few ms of each other.
POLL_S = 0.002


def create(path: str, world_size: int) -> None:
    """The clock file of a run of ``world_size`` ranks: every counter at 0."""
    with open(path, "wb") as f:
        f.write(bytes(8 * max(1, world_size)))


class StepClock:
    """One rank's view of the shared counters at ``path`` (made by :func:`create`)."""

    def __init__(self, path: str, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._fmt = f"<{world_size}q"
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, 8 * world_size)
        finally:
            os.close(fd)

    def counts(self) -> tuple[int, ...]:
        """Each rank's finished steps."""
        return struct.unpack_from(self._fmt, self._map, 0)

    def arrive(self, done: int, timeout: float) -> bool:
        """This rank has finished ``done`` steps: wait until every rank has (at most
        ``timeout`` seconds, so a demo rank never hangs on a peer that died). True when
        they all did."""
        struct.pack_into("<q", self._map, 8 * self.rank, done)
        deadline = time.monotonic() + timeout
        while min(self.counts()) < done:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def close(self) -> None:
        self._map.close()
