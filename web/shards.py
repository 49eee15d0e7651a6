"""A web over N brokers (PROTOCOL 7.3): one :class:`~web.hub.Hub` and one feed pump per shard,
and :class:`ShardedHub`, which reads them as one.

Why one hub per shard rather than one hub for all: each broker is a separate feed with its own
instance, sequence numbers, heartbeats and snapshots, and the hub's rules (the Clone pattern,
re-snapshot on a restart or a gap, liveness from heartbeats) are per feed. Keeping them per
shard reuses those rules unchanged, and gives a shard's loss exactly the contract's cost:
its hub stops hearing heartbeats (that shard is not ``connected``) but keeps its runs, listed
and readable as last seen; when the broker returns, its new instance's heartbeat asks a fresh
snapshot and the runs continue. The other shards' hubs never notice.

:class:`ShardedHub` has the reading side of a hub that the app, the metrics and the server
use (``runs``, ``subscribe``, ``stacks_view``, ``heartbeat``, ...). A run is served from the
shard that holds it; one id held by two shards (N changed, and an old broker's journal still
holds the run) is served from the shard the id hashes to now, unless that copy is a stub
(still ``waiting``, no record, no step: a lone ``register``) and another holds more: then
the other is the run. A web of one broker keeps its
plain :class:`Hub` (nothing here is on its path).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

from broker import feed
from rank_agent.controlwire import ControlRequest
from rank_agent.shards import shard_of
from web.cluster import ClusterIndex
from web.config import FeedError, feed_pairs
from web.hub import Hub
from web.runstate import RunState, Subscriber, finite

__all__ = ["ShardedHub", "MergedRuns", "feed_pairs", "shard_states", "FeedError",
           "lone_register"]

log = logging.getLogger(__name__)


def lone_register(state: RunState) -> bool:
    """Whether a shard's copy of a run is a stub: still ``waiting`` (no epoch, step or
    finish), with no record and no step. Such a copy is what a lone ``register`` sent to
    the run's new shard makes after N changed; the copy on the old shard, which the run's
    ranks still feed, is the run."""
    return (state.header.get("status", "waiting") == "waiting" and not state.records
            and state.steps.last_step is None)


class MergedRuns(Mapping[str, RunState]):
    """Every shard's runs as one read-only mapping (run id -> state)."""

    def __init__(self, hubs: Sequence[Hub]) -> None:
        self.hubs = hubs

    def locate(self, run: str) -> tuple[int, RunState] | None:
        """(shard, state) of ``run``: the shard the id hashes to first, then the others;
        but a copy that is only a stub (:func:`lone_register`) never hides a copy that
        holds more (issue 38: after N changed, one ``register`` sent to a live run's new
        shard hid the run, its records and steps, behind an empty page)."""
        hubs = self.hubs
        home = shard_of(run, len(hubs))
        state = hubs[home].runs.get(run)
        if state is not None and not lone_register(state):
            return home, state
        found = None if state is None else (home, state)
        for index, hub in enumerate(hubs):
            if index != home:
                other = hub.runs.get(run)
                if other is not None:
                    if not lone_register(other):
                        return index, other
                    if found is None:
                        found = (index, other)
        return found

    def __getitem__(self, run: str) -> RunState:
        found = self.locate(run)
        if found is None:
            raise KeyError(run)
        return found[1]

    def get(self, run: str, default: Any = None) -> Any:
        found = self.locate(run)
        return default if found is None else found[1]

    def __contains__(self, run: object) -> bool:
        return isinstance(run, str) and self.locate(run) is not None

    def items_by_shard(self) -> Iterator[tuple[int, RunState]]:
        """(shard, state) of every run once: a run id two shards hold is the copy
        :meth:`locate` serves."""
        hubs = self.hubs
        for index, hub in enumerate(hubs):
            for run, state in hub.runs.items():
                # a dict lookup per other shard first: the hash only for an id held twice
                if any(other is not hub and run in other.runs for other in hubs):
                    found = self.locate(run)
                    if found is not None and found[0] != index:
                        continue  # shadowed by the copy :meth:`locate` serves
                yield index, state

    def __iter__(self) -> Iterator[str]:
        return (state.run for _, state in self.items_by_shard())

    def __len__(self) -> int:
        return sum(1 for _ in self.items_by_shard())

    def values(self) -> Any:
        return [state for _, state in self.items_by_shard()]


class ShardHub(Hub):
    """One shard's hub: a :class:`Hub` that also keeps, in :attr:`retired`, the counters its
    broker's earlier instances had reached when a restart began a new instance at zero (the
    sum over shards then never goes back, PROTOCOL 7.3)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.retired: dict[str, Any] = {}

    def _on_heartbeat(self, hb: feed.Heartbeat) -> None:
        previous = self.heartbeat
        if previous is not None and previous.instance != hb.instance:
            _merge(self.retired, previous._asdict())
        super()._on_heartbeat(hb)


class ShardedHub:
    """The hubs of N shards (index = shard), read as one hub (module docstring). The pumps
    feed each its own hub; this object only reads them and routes by run."""

    def __init__(self, hubs: Sequence[Hub]) -> None:
        if len(hubs) < 2:
            raise ValueError("a sharded hub has two or more shards")
        self.hubs = list(hubs)
        self.runs = MergedRuns(self.hubs)
        self.queue_size = self.hubs[0].queue_size
        #: listeners shared by every shard's hub (each calls them with itself)
        self.port_listeners: list[Callable[[str, int, int], None]] = []
        self.snapshot_listeners: list[Callable[[Any], None]] = []
        for hub in self.hubs:
            hub.port_listeners = self.port_listeners
            hub.snapshot_listeners = self.snapshot_listeners
        #: the limits counted by the server and the app (the hubs count their SSE queues)
        self._limited: dict[str, int] = {}
        #: the cluster view's per-run figures over every shard's runs (:mod:`web.cluster`)
        self.cluster = ClusterIndex()

    # ------------------------------------------------------------------ status
    @property
    def connected(self) -> bool:
        """At least one shard is connected (``/healthz`` 200)."""
        return any(hub.connected for hub in self.hubs)

    def shard_connected(self) -> list[bool]:
        return [hub.connected for hub in self.hubs]

    def live(self, run: str) -> bool:
        """Whether ``run``'s shard is connected now (False for a run no shard holds)."""
        found = self.runs.locate(run)
        return found is not None and self.hubs[found[0]].connected

    def shard_of_run(self, run: str) -> int | None:
        found = self.runs.locate(run)
        return None if found is None else found[0]

    @property
    def heartbeat(self) -> feed.Heartbeat | None:
        """The broker counters summed over the shards' last heartbeats (a lost shard's
        last figures stay in the sum) and, for a :class:`ShardHub`, what its earlier broker
        instances had counted before a restart began a new one at zero: a counter never
        goes back."""
        beats = [hub.heartbeat for hub in self.hubs if hub.heartbeat is not None]
        if not beats:
            return None
        totals: dict[str, Any] = {}
        for hub in self.hubs:
            _merge(totals, getattr(hub, "retired", {}))
        for hb in beats:
            _merge(totals, hb._asdict())
        return feed.Heartbeat(
            instance=",".join(hb.instance for hb in beats), time=max(hb.time for hb in beats),
            **{name: totals.get(name, {} if name in _MAPS else 0) for name in _COUNTERS})

    @property
    def client_count(self) -> int:
        return sum(hub.client_count for hub in self.hubs)

    @property
    def clients_dropped(self) -> int:
        return sum(hub.clients_dropped for hub in self.hubs)

    @property
    def gaps(self) -> int:
        return sum(hub.gaps for hub in self.hubs)

    @property
    def limited(self) -> dict[str, int]:
        out = dict(self._limited)
        for hub in self.hubs:
            for reason, n in hub.limited.items():
                out[reason] = out.get(reason, 0) + n
        return out

    def count_limit(self, reason: str) -> None:
        self._limited[reason] = self._limited.get(reason, 0) + 1

    # ------------------------------------------------------------------ reads
    def _hub_of(self, run: str) -> Hub | None:
        found = self.runs.locate(run)
        return None if found is None else self.hubs[found[0]]

    def runs_newest_first(self) -> list[RunState]:
        def order(state: RunState) -> tuple[float, str]:
            started = finite(state.header.get("started_at"))
            return (started if started is not None else 0.0, state.run)

        return sorted(self.runs.values(), key=order, reverse=True)

    def stacks_view(self, run: str) -> dict[str, Any] | None:
        hub = self._hub_of(run)
        return None if hub is None else hub.stacks_view(run)

    def stacks_view_json(self, run: str, encode: Callable[[Any], bytes],
                         offload: Callable[..., Any] | None = None) -> bytes | None:
        hub = self._hub_of(run)
        if hub is None:
            return None
        return (hub.stacks_view_json(run, encode) if offload is None
                else hub.stacks_view_json(run, encode, offload))

    def collectives_view(self, run: str) -> dict[str, Any] | None:
        hub = self._hub_of(run)
        return None if hub is None else hub.collectives_view(run)

    def collectives_view_json(self, run: str) -> bytes | None:
        hub = self._hub_of(run)
        return None if hub is None else hub.collectives_view_json(run)

    def subscribe(self, run: str, position: int) -> tuple[Subscriber, list[bytes], int] | None:
        hub = self._hub_of(run)
        return None if hub is None else hub.subscribe(run, position)

    def unsubscribe(self, sub: Subscriber) -> None:
        for hub in self.hubs:
            hub.unsubscribe(sub)

    def close_all(self) -> None:
        for hub in self.hubs:
            hub.close_all()

    def stacks_router(self, pumps: Sequence[Any]) -> Callable[[ControlRequest], str]:
        """``request_stacks(req)`` that reaches the pump of the request's run's own shard."""
        from web.pump import StacksRequestError

        def request_stacks(req: ControlRequest) -> str:
            index = self.shard_of_run(req.run)
            if index is None:
                raise StacksRequestError(f"no shard holds run {req.run}")
            result: str = pumps[index].request_stacks(req)
            return result

        return request_stacks


#: the heartbeat's counters (every field but ``instance`` and ``time``) and which are maps
_COUNTERS = tuple(f for f in feed.Heartbeat._fields if f not in ("instance", "time"))
_MAPS = ("rejected", "journal")


def _merge(totals: dict[str, Any], other: Mapping[str, Any]) -> None:
    """Add the counters of ``other`` (a heartbeat's fields) into ``totals``, maps key by key."""
    for name, value in other.items():
        if name not in _COUNTERS:
            continue
        if name in _MAPS:
            bucket = totals.setdefault(name, {})
            for key, n in value.items():
                bucket[key] = bucket.get(key, 0) + n
        else:
            totals[name] = totals.get(name, 0) + value


AnyHub = Union[Hub, ShardedHub]


def shard_states(hub: AnyHub) -> list[dict[str, Any]]:
    """``[{"shard", "connected"}]`` by shard (one entry for a web of one broker)."""
    if isinstance(hub, ShardedHub):
        return [{"shard": k, "connected": c} for k, c in enumerate(hub.shard_connected())]
    return [{"shard": 0, "connected": hub.connected}]


def journal_states(hub: AnyHub) -> list[str]:
    """PROTOCOL 8.4: each shard's journal, ``"ok"`` or ``"failing"`` (by shard; from its
    broker's latest heartbeat, which carries ``failing`` while a journal write fails; a
    broker that has not said, or an older one, is ``"ok"``)."""
    hubs = hub.hubs if isinstance(hub, ShardedHub) else [hub]
    out = []
    for one in hubs:
        hb = one.heartbeat
        out.append("failing" if hb is not None and hb.journal.get("failing") else "ok")
    return out


def run_live(hub: AnyHub) -> Optional[Callable[[str], bool]]:
    """The "is this run's shard connected" test of ``POST …/stacks`` (None: one broker,
    where the request itself finds out)."""
    return hub.live if isinstance(hub, ShardedHub) else None
