"""``/metrics`` built off the web's event loop, from a frozen view of the hub (issue 32, finding 4).

The web serves every page, SSE stream and probe from one gevent loop; a scrape of a 65,536-rank
run used to build ~720,000 series on that loop (17.7 s during which ``/healthz`` stalled).
Now:

* :meth:`ScrapeRegistry.latest` takes a :class:`HubView` on the loop: references to each run's
  ranks array and header (the hub replaces those wholesale, never mutates them in place) and
  copies of the counters, O(runs), no per-rank work;
* the exposition is then built in gevent's thread pool (a native thread: the loop keeps
  serving while it runs, the GIL switching every few milliseconds) from that view only, so
  the build never reads the hub while the loop mutates it;
* scrapes that arrive while a build is in flight share it (one build at a time, whatever
  the number of scrapers);
* the per-rank and per-GPU series are bounded (:mod:`web.metricsranks`), so a build is
  bounded too.

To add a family: put what it needs into :meth:`HubView.freeze` (read on the loop: keep it
O(runs), copy what the hub mutates in place) and yield it from a collector over the view
(:class:`web.metrics.HubCollector`, or a new collector passed to ``register``).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import gevent
import gevent.event
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from web.hostsanswer import FrozenRuns, suspects_by_run, worker
from web.shards import shard_states

log = logging.getLogger(__name__)


class FrozenRun:
    """What a scrape reads of one run, taken on the loop. ``ranks_all`` is the feed's ranks
    array (the hub replaces it on each ``ranks`` event, never edits it); ``ranks_full`` is set
    in the build to the ranks exported per rank (:func:`web.metricsranks.select`): every
    collector of per-rank series reads that one, so they all bound alike."""

    __slots__ = ("run", "header", "last_step", "steps_rows", "ranks_all", "ranks_full",
                 "gpu_cap")

    def __init__(self, run: str, header: dict[str, Any], last_step: int | None,
                 steps_rows: int, ranks: list[Any]) -> None:
        self.run = run
        self.header = header
        self.last_step = last_step
        self.steps_rows = steps_rows
        self.ranks_all = ranks
        self.ranks_full: list[Any] = ranks
        #: set by the selection: only unhealthy GPUs of this run's ranks export series
        self.gpu_cap = False


class HubView:
    """The hub as one scrape sees it (see the module docstring)."""

    def __init__(self) -> None:
        self.runs: dict[str, FrozenRun] = {}
        self.heartbeat: Any = None
        self.connected = False
        self.client_count = 0
        self.clients_dropped = 0
        self.gaps = 0
        self.limited: dict[str, int] = {}
        #: ``[{"shard", "connected"}]`` (PROTOCOL 7.3) and host -> suspect (7.4)
        self.shards: list[dict[str, Any]] = []
        self.suspects: dict[str, bool] = {}
        #: run -> how many of its hosts are suspect (always exported: the host series are
        #: capped, :func:`web.hostsanswer.suspect_series`)
        self.run_suspect_hosts: dict[str, int] = {}
        self._hosts: tuple[Any, Any] | None = None  # (frozen runs, worker index): freeze

    def freeze(self, hub: Any) -> None:
        """Take the hub's state now (on the loop)."""
        self.runs = {run: FrozenRun(run, state.header, state.steps.last_step,
                                    state.steps.rows, state.ranks_full)
                     for run, state in hub.runs.items()}
        self.heartbeat = hub.heartbeat  # a decoded struct, replaced on each heartbeat
        self.connected = hub.connected
        self.client_count = hub.client_count
        self.clients_dropped = hub.clients_dropped
        self.gaps = hub.gaps
        self.limited = dict(hub.limited)
        self.shards = shard_states(hub)
        # what the host verdicts read, O(runs) on the loop; the verdicts themselves are made
        # in the build (derive_hosts, issue 38 item 5: 96,000 hosts held the loop)
        frozen = FrozenRuns(hub)
        self._hosts = (frozen, worker(hub.cluster, frozen))

    def derive_hosts(self) -> None:
        """The host verdicts and per-run suspect counts of the frozen runs (in the build)."""
        if self._hosts is not None:
            frozen, work = self._hosts
            self.suspects, self.run_suspect_hosts = suspects_by_run(work, frozen)


class ScrapeRegistry(CollectorRegistry):
    """A per-app registry whose collectors read :attr:`view`; :meth:`latest` is the exposition."""

    def __init__(self, hub: Any, prepare: Callable[[HubView], None] | None = None) -> None:
        super().__init__(auto_describe=False)
        self.hub = hub
        self.view = HubView()
        #: run in the build, before the collectors (the cardinality selection)
        self.prepare = prepare
        self._inflight: gevent.event.AsyncResult | None = None
        #: builds done (tests and the bench read it)
        self.builds = 0
        self._building = False

    def collect(self) -> Iterable[Metric]:  # type: ignore[override]
        """Every family; called outside :meth:`latest` (``generate_latest(registry)``, as
        tests do, on the loop) it freezes the view first."""
        if not self._building:
            self._freeze()
            if self.prepare is not None:
                self.prepare(self.view)
        return super().collect()

    def _freeze(self) -> None:
        view = HubView()
        view.freeze(self.hub)
        self.view.__dict__.update(view.__dict__)  # the collectors hold self.view

    def _build(self, view: HubView) -> bytes:
        if self.prepare is not None:
            self.prepare(view)
        for _ in range(3):
            try:
                return generate_latest(self)
            except RuntimeError:  # a small dict a collector reads changed size: read again
                log.debug("metrics build retried", exc_info=True)
        return generate_latest(self)

    def latest(self) -> bytes:
        """The exposition text, built in the thread pool from a view frozen now; a scrape
        arriving during a build waits for that build and shares its text."""
        inflight = self._inflight
        if inflight is not None:
            return inflight.get()  # type: ignore[no-any-return]
        result = self._inflight = gevent.event.AsyncResult()
        self._building = True
        try:
            self._freeze()
            text = gevent.get_hub().threadpool.apply(self._build, (self.view,))
            self.builds += 1
            result.set(text)
            return text  # type: ignore[no-any-return]
        except BaseException as exc:
            result.set_exception(exc)
            raise
        finally:
            self._building = False
            self._inflight = None
