"""``GET /api/hosts`` and ``rankboard_host_suspect`` built off the web's event loop, cached
per state of the runs' headers, the suspect series capped (issue 38, item 5).

Why: the hosts answer is a pass over every host of every run the web holds; at 96,000 hosts
it took 3.45 s on the web's one event loop (``/healthz`` waited 2.6 s), and the cluster page
asks it every 5 s; ``/metrics`` made the suspect verdicts on the loop too, one series per
host (96,000 series).

How: the rules stay :class:`web.cluster.ClusterIndex`'s (:meth:`~web.cluster.ClusterIndex.hosts`,
:meth:`~web.cluster.ClusterIndex.suspects`); only where and when they run changes.

* :class:`FrozenRuns` takes, on the loop, what the rules read of each run (its id and header:
  the hub replaces a header on each ``run`` event, never edits it): O(runs), no per-host work.
* The rules then run in gevent's thread pool on a worker copy of the index's per-run cache
  (so the thread never writes what the loop reads); the per-run results it made are merged
  back on the loop.
* :class:`HostsAnswer` keeps the encoded answer until a run's header changes or a run comes
  or goes (compared by identity, O(runs)), and requests arriving during a build share it.
* :func:`suspect_series` caps the per-host series like the per-rank ones
  (:mod:`web.metricsranks`): every host while there are at most :data:`MAX_HOST_SERIES`,
  past that only the suspect ones, up to the cap; each run's count of suspect hosts is
  always exported (``rankboard_run_suspect_hosts{run}``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, cast

from web.cluster import ClusterIndex, HeldRuns

if TYPE_CHECKING:
    from web.runstate import RunState

__all__ = ["MAX_HOST_SERIES", "FrozenRuns", "HostsAnswer", "suspect_series"]

#: Hosts that export a ``rankboard_host_suspect`` series before only suspect ones do.
MAX_HOST_SERIES = 4096

Offload = Callable[..., Any]


def inline(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` here (unit tests; a web passes gevent's thread pool)."""
    return fn(*args)


class _Frozen:
    """What the cluster rules read of one run (``run``, ``header``)."""

    __slots__ = ("run", "header")

    def __init__(self, run: str, header: dict[str, Any]) -> None:
        self.run = run
        self.header = header


class FrozenRuns:
    """The runs a hub holds, newest first, as the rules read them; taken on the loop."""

    def __init__(self, held: HeldRuns) -> None:
        self._order = [_Frozen(s.run, s.header) for s in held.runs_newest_first()]
        self._runs = {f.run: f for f in self._order}
        #: the headers, newest run first: the state the answers are cached against
        self.headers = [f.header for f in self._order]

    @property
    def runs(self) -> Mapping[str, RunState]:
        return cast("Mapping[str, RunState]", self._runs)

    def runs_newest_first(self) -> list[RunState]:
        return cast("list[RunState]", self._order)

    def same(self, headers: list[dict[str, Any]] | None) -> bool:
        """Whether ``headers`` (an earlier :attr:`headers`) are these, object for object."""
        return (headers is not None and len(headers) == len(self.headers)
                and all(a is b for a, b in zip(headers, self.headers)))


def worker(index: ClusterIndex, frozen: FrozenRuns) -> ClusterIndex:
    """A copy of ``index`` whose per-run cache a thread may fill (taken on the loop)."""
    copy = ClusterIndex()
    copy._hosts = {run: index._hosts[run] for run in frozen.runs if run in index._hosts}
    return copy


def merge(index: ClusterIndex, work: ClusterIndex, frozen: FrozenRuns) -> None:
    """Keep what the worker derived, for the runs still held with the same header (on the
    loop, after the build)."""
    for run, derived in work._hosts.items():
        now = frozen.runs.get(run)
        if now is not None and derived.header is now.header:
            index._hosts[run] = derived


class HostsAnswer:
    """The encoded ``/api/hosts`` answer of one hub, cached per state (module docstring)."""

    def __init__(self) -> None:
        self._headers: list[dict[str, Any]] | None = None
        self._data = b""
        self._inflight: Any = None
        #: answers built (tests read it)
        self.builds = 0

    def get(self, held: HeldRuns, index: ClusterIndex, encode: Callable[[Any], bytes],
            offload: Offload = inline) -> bytes:
        """The answer as of now: cached while no header changed, else built by ``offload``
        (one build at a time: a request arriving meanwhile waits for it and shares it)."""
        frozen = FrozenRuns(held)
        if frozen.same(self._headers):
            return self._data
        inflight = self._inflight
        if inflight is not None:
            return inflight.get()  # type: ignore[no-any-return]
        import gevent.event

        result = self._inflight = gevent.event.AsyncResult()
        try:
            index.prune(held.runs)
            work = worker(index, frozen)
            data = offload(lambda: encode(work.hosts(frozen)))
            merge(index, work, frozen)
            self._headers, self._data = frozen.headers, data
            self.builds += 1
            result.set(data)
            return data  # type: ignore[no-any-return]
        except BaseException as exc:
            result.set_exception(exc)
            raise
        finally:
            self._inflight = None


def suspects_by_run(index: ClusterIndex, frozen: FrozenRuns
                    ) -> tuple[dict[str, bool], dict[str, int]]:
    """host -> suspect (:meth:`ClusterIndex.suspects`) and run -> how many of its hosts are
    suspect; ``index``: a :func:`worker` copy (in the scrape's build thread)."""
    suspects = index.suspects(frozen)
    per_run: dict[str, int] = {}
    for state in frozen.runs_newest_first():
        hosts = {host for host, _ in index._of(state).hosts}
        per_run[state.run] = sum(1 for host in hosts if suspects.get(host))
    return suspects, per_run


def suspect_series(suspects: dict[str, bool]) -> tuple[Iterator[tuple[str, bool]], int]:
    """The ``rankboard_host_suspect`` series to export (by host name) and how many hosts
    were left out: all while at most :data:`MAX_HOST_SERIES`, else the suspect ones up to
    it."""
    if len(suspects) <= MAX_HOST_SERIES:
        return iter(sorted(suspects.items())), 0
    chosen = sorted(host for host, bad in suspects.items() if bad)[:MAX_HOST_SERIES]
    return iter((host, True) for host in chosen), len(suspects) - len(chosen)
