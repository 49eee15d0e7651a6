"""The broker loop's side of PROTOCOL 8.4 (the data dir bounded in bytes and days).

:mod:`broker.retention.plan` decides, in a thread, which ended runs to delete; this applies it on
the loop that owns the runs and the journal: at start (before anything is served, in the
caller's thread), then every pass interval, at most :data:`DELETES_PER_TURN` runs per loop
turn, each checked again first (a frame that arrived since the pass keeps its run: a run
whose ``updated_at`` moved, or that came back into memory, is not deleted). A run deleted
while in memory leaves it as a ``--max-runs`` eviction does (:meth:`broker.runs.Runs.drop`:
its ``evicted`` event, so every web drops it), then its files go.

Its figures ride in the heartbeat's ``journal`` map (``data_dir_bytes``,
``runs_deleted_bytes``, ``runs_deleted_days``): the web's ``/metrics`` shows them as
``rankboard_data_dir_bytes`` and ``rankboard_runs_deleted_total{reason}``.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from broker.retention.plan import (
    LIVE_OVER_LOG_S,
    MemRun,
    Plan,
    RetentionWorker,
    interval_from_env,
)
from broker.run.events import Event
from broker.run.sink import RunSink
from rank_agent.ratelimit import RateLimitedLog

__all__ = ["DataDirBound", "DELETES_PER_TURN", "held_runs"]

log = logging.getLogger("broker.retention")

#: Runs deleted per loop turn at most (each an unlink or two and, when held, an eviction):
#: a pass that frees thousands of runs does not hold the ingest for their sum.
DELETES_PER_TURN = 32


def held_runs(sinks: Any, now: float | None = None, stale_after: float = 0.0
              ) -> dict[str, MemRun]:
    """The loop's view of the runs it holds (``(run, sink)`` pairs): a run is ended by its
    state when its status is ``complete``/``failed``, or no rank is ``ok``. Ranks are looked
    at (``quiet()``, which stops at the first ``ok`` one) only for a run silent for
    ``stale_after`` before ``now``: a run with a recent frame has a rank that sent it, and
    walking every rank of a thousand live runs each pass would cost the loop for nothing
    (``now`` None: every run's, as at start, where nothing is stale yet and it is cheap)."""
    horizon = None if now is None else now - stale_after
    out = {}
    for run, sink in sinks:
        updated = sink.updated_at
        ended = sink.finished or (
            (horizon is None or updated is None or updated < horizon) and sink.quiet())
        out[run] = MemRun(updated, ended)
    return out


class DataDirBound:
    """PROTOCOL 8.4 for one :class:`~broker.server.BrokerServer` (module docstring): off
    (no work at all) without a data dir. Without ``--retain-bytes`` and
    ``--retention-days`` its passes delete nothing but still measure the data dir for
    ``rankboard_data_dir_bytes``."""

    def __init__(self, server: Any) -> None:
        #: the BrokerServer (not imported: it imports this); read: runs, _journal, clock,
        #: stale_after, retain_bytes, retention_days, retention_interval
        self.server = server
        self._worker: RetentionWorker | None = None
        self._queue: deque[tuple[str, str, float | None, tuple[str, ...], int]] = deque()
        self._next_pass = 0.0
        self.interval = 0.0
        #: since start (the start pass included): runs deleted, by reason
        self.deleted = {"bytes": 0, "days": 0}
        #: the runs' bytes as of the latest pass, less what it deleted since
        self.data_dir_bytes = 0
        self._live_logged_at = -LIVE_OVER_LOG_S
        self._rlog = RateLimitedLog(log, 60.0)

    @property
    def active(self) -> bool:
        return self._worker is not None

    def start_pass(self, journal: Any, sinks: dict[str, RunSink]) -> None:
        """The start pass over the journal's rebuilt ``sinks`` (deleted ones are removed
        from it), then the worker thread for the passes to come. A failure is logged, and
        the broker starts without the bound rather than not at all."""
        try:
            self._start_pass(journal, sinks)
        except Exception:
            log.exception("retention: the start pass failed; the data dir is not bounded")

    def _start_pass(self, journal: Any, sinks: dict[str, RunSink]) -> None:
        server = self.server
        self.deleted["days"] += journal.deleted_at_load
        self.interval = (server.retention_interval if server.retention_interval is not None
                         else interval_from_env())
        worker = RetentionWorker(journal.runs_dir, retain_bytes=server.retain_bytes,
                                 retention_days=server.retention_days,
                                 stale_after=server.stale_after, clock=server.clock)
        plan = worker.run_now(held_runs(sinks.items()))
        for run, reason, _, paths, nbytes in plan.victims:
            sinks.pop(run, None)
            journal.delete_run(run, paths)
            self._count(run, reason, nbytes)
        self._took(plan, worker.last_pass_s)
        self._worker = worker
        worker.start()
        self._next_pass = time.monotonic() + self.interval

    def turn(self, mono: float) -> list[tuple[str, Event]]:
        """The loop's per-tick call: start a pass when due, take a finished one, and apply
        up to :data:`DELETES_PER_TURN` of its deletions. Returns the ``evicted`` events of
        the held runs it deleted (the server publishes them). Never raises: a bug here must
        not stop the receive loop (logged, rate-limited)."""
        try:
            return self._turn(mono)
        except Exception:
            self._rlog.error("turn", "retention: a turn failed", exc_info=True)
            return []

    def _turn(self, mono: float) -> list[tuple[str, Event]]:
        worker = self._worker
        if worker is None:
            return []
        if mono >= self._next_pass and not self._queue:
            view = held_runs(((s.run, s) for s in self.server.runs.sinks()),
                             self.server.clock(), self.server.stale_after)
            if worker.submit(view):
                self._next_pass = mono + self.interval
        plan = worker.take()
        if plan is not None:
            self._took(plan, worker.last_pass_s)
            self._queue.extend(plan.victims)
        if not self._queue:
            return []
        return self._apply(DELETES_PER_TURN)

    def _apply(self, budget: int) -> list[tuple[str, Event]]:
        server = self.server
        journal = server._journal
        runs = server.runs
        out: list[tuple[str, Event]] = []
        now = server.clock()
        while self._queue and budget > 0:
            run, reason, judged, paths, nbytes = self._queue.popleft()
            sink = runs.get(run)
            if sink is not None:
                if judged is None or sink.updated_at != judged:
                    continue  # it came back, or a frame arrived since the pass: kept
                out.extend(runs.drop(run, now))
            if journal is not None:
                journal.delete_run(run, paths)
            self._count(run, reason, nbytes)
            budget -= 1
        return out

    def _count(self, run: str, reason: str, nbytes: int) -> None:
        self.deleted[reason] += 1
        self.data_dir_bytes = max(0, self.data_dir_bytes - nbytes)
        if reason == "days":
            log.info("retention: deleted ended run %r (%d bytes): older than --retention-days "
                     "%g", run, nbytes, self.server.retention_days)
        else:
            log.info("retention: deleted ended run %r (%d bytes): the runs' files exceeded "
                     "--retain-bytes %d", run, nbytes, self.server.retain_bytes)

    def _took(self, plan: Plan, seconds: float) -> None:
        self.data_dir_bytes = plan.total
        log.debug("retention: pass over %d runs (%d bytes) in %.3f s: %d to delete",
                  plan.scanned, plan.total, seconds, len(plan.victims))
        if plan.live_over > 0:
            mono = time.monotonic()
            if mono - self._live_logged_at >= LIVE_OVER_LOG_S:
                self._live_logged_at = mono
                log.warning("retention: live runs alone exceed --retain-bytes %d by %d bytes; "
                            "no live run is deleted (a bigger bound, or fewer live runs)",
                            self.server.retain_bytes, plan.live_over)

    def counters(self) -> dict[str, int]:
        """The heartbeat's share (PROTOCOL 8.4's /metrics figures; empty while off)."""
        out = {"data_dir_bytes": self.data_dir_bytes,
               "runs_deleted_bytes": self.deleted["bytes"],
               "runs_deleted_days": self.deleted["days"]}
        if self.server.retain_bytes is not None:  # the bound, for "near its bound" rules
            out["retain_bytes"] = self.server.retain_bytes
        return out

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
