"""The cluster view's rules (PROTOCOL 7.4): the ``/api/runs`` filters and counts, and the
hosts of ``/api/hosts`` with their incidents and the ``suspect`` verdict.

Pure: it reads :class:`~web.runstate.RunState` objects and touches no socket, so every rule
is a fast unit test (``tests/web/test_cluster.py``). It runs on the web's one event-loop
thread, over every run the web holds (thousands, up to ``--max-runs`` per shard), on every
request and scrape, so what can be kept is kept: a :class:`ClusterIndex` remembers, per run,
what it derived from that run's header and ranks and reuses it while they are the same
objects (the hub replaces a run's header dict on each ``run`` event and its ranks list on
each ``ranks`` event, never mutates them in place). A request then costs a pass over the
runs plus the work for the runs that changed, not a pass over every rank of every run.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, TypeGuard

from web.runstate import RunState, finite

#: Run statuses (PROTOCOL 3) a ``status`` filter may name.
RUN_STATUSES = ("waiting", "training", "complete", "failed")
#: The alert kinds that are a host's incidents (PROTOCOL 7.4): trouble that may be the
#: machine's, not the job's (``nonfinite_loss`` and ``collective_mismatch`` are the job's).
INCIDENT_KINDS = frozenset((
    "gpu_xid", "gpu_ecc", "gpu_row_remap", "gpu_pcie", "gpu_nvlink", "gpu_throttle", "stalled",
    "stale", "rank_error", "data_straggler", "collective_behind",
    "nonfinite", "replica_divergence"))  # (8.3: a rank's own numbers gone wrong)
#: Incidents that make a host suspect on their own: the GPU itself says it is failing.
HARDWARE_KINDS = frozenset(("gpu_xid", "gpu_ecc", "gpu_row_remap"))
#: (8.5 "Hosts, fairly") Kinds that are the run's, not a host's, once more than half of the
#: run's world raised them: a job-wide stall, a whole job gone stale, every rank failing.
RUN_WIDE_KINDS = frozenset(("stalled", "stale", "rank_error", "data_straggler", "nonfinite"))
#: (8.3) ... and a replica that disagrees with the others (silent data corruption): its
#: reason is listed with the GPU ones.
SUSPECT_KINDS = HARDWARE_KINDS | {"replica_divergence"}
#: ``limit``'s range.
MAX_LIMIT = 10_000


class HeldRuns(Protocol):
    """What the index reads of a :class:`web.hub.Hub`: the runs it holds and their order."""

    @property
    def runs(self) -> Mapping[str, RunState]: ...

    def runs_newest_first(self) -> list[RunState]: ...


class BadFilter(ValueError):
    """A ``/api/runs`` query value answered with 400; ``str()`` is the one-line reason."""


@dataclass(frozen=True)
class RunsFilter:
    """A parsed ``/api/runs`` query: None / 0 where the caller gave nothing."""

    #: the statuses to keep (None: every run)
    statuses: frozenset[str] | None = None
    #: a case-folded substring of the run id or label (None: every run)
    q: str | None = None
    limit: int | None = None
    offset: int = 0

    def keeps(self, state: RunState) -> bool:
        """Whether the run passes the status and search filters."""
        header = state.header
        if self.statuses is not None and header.get("status", "waiting") not in self.statuses:
            return False
        if self.q is None:
            return True
        if self.q in state.run.casefold():
            return True
        label = header.get("label")
        return isinstance(label, str) and self.q in label.casefold()


def _count(args: Mapping[str, str], name: str, low: int, high: int | None) -> int | None:
    raw = args.get(name)
    if raw is None or raw == "":
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 19):
        raise BadFilter(f"{name} must be an integer from {low} to {high}" if high is not None
                        else f"{name} must be an integer >= {low}")
    value = int(text)
    if value < low or (high is not None and value > high):
        raise BadFilter(f"{name} must be an integer from {low} to {high}" if high is not None
                        else f"{name} must be an integer >= {low}")
    return value


def parse_runs_filter(args: Mapping[str, str]) -> RunsFilter:
    """The ``/api/runs`` query (``status``, ``q``, ``limit``, ``offset``) or
    :class:`BadFilter`. An empty value is as if absent; other parameters (``token``) are not
    this function's. ``status`` is comma-separated; blanks around and between the names are
    ignored, names are matched exactly (lower case, as the header has them)."""
    statuses: frozenset[str] | None = None
    raw = args.get("status")
    if raw:
        names = [part.strip() for part in raw.split(",") if part.strip()]
        unknown = [n for n in names if n not in RUN_STATUSES]
        if unknown:
            raise BadFilter(f"unknown run status {unknown[0][:64]!r} (one of "
                            f"{', '.join(RUN_STATUSES)})")
        statuses = frozenset(names) if names else None
    q = args.get("q")
    limit = _count(args, "limit", 1, MAX_LIMIT)
    offset = _count(args, "offset", 0, None)
    return RunsFilter(statuses=statuses, q=q.casefold() if q else None, limit=limit,
                      offset=offset or 0)


def shard_of(header: Mapping[str, Any]) -> int:
    """The run's shard (PROTOCOL 7.3): the broker's ``shard`` in the header, else 0."""
    shard = header.get("shard")
    return shard if isinstance(shard, int) and not isinstance(shard, bool) else 0


# ------------------------------------------------------------------------ the hosts
@dataclass(frozen=True)
class _RunHosts:
    """What one run's header says about hosts: ``(host, {"run", "ranks"})`` per known host
    and ``host -> [(at, run, rank, kind)]`` of its incidents (``at`` None-safe for sorting
    as -inf). The ``{"run", "ranks"}`` dicts are shared by every answer: read-only."""

    header: dict[str, Any]
    hosts: tuple[tuple[str, dict[str, Any]], ...]
    incidents: dict[str, list[tuple[float, str, int, str, Any]]]


def _is_rank(value: Any) -> TypeGuard[int]:
    """An int that is not a bool (JSON's true is no rank and no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def runs_own_kinds(header: Mapping[str, Any]) -> frozenset[str]:
    """The alert kinds of :data:`RUN_WIDE_KINDS` that are this run's, not any host's (8.5):
    raised by more than half of its world size (exactly half still blames hosts).

    The distinct ranks are the broker's count (the header's ``alert_ranks``, kept past the
    alert list's cap), or the listed alerts' ranks when those are more (a header from a
    broker before 8.5 has no count; an unknown world size judges nothing run-wide)."""
    world = header.get("world_size")
    if not _is_rank(world) or world <= 0:
        return frozenset()
    counted = header.get("alert_ranks")
    counts = counted if isinstance(counted, dict) else {}
    listed: dict[str, set[int]] = {}
    raw = header.get("alerts")
    for alert in raw if isinstance(raw, list) else ():
        if isinstance(alert, dict) and alert.get("kind") in RUN_WIDE_KINDS and _is_rank(
                alert.get("rank")):
            listed.setdefault(alert["kind"], set()).add(alert["rank"])
    own = []
    for kind in RUN_WIDE_KINDS:
        raw_n = counts.get(kind)
        n: int = raw_n if _is_rank(raw_n) else 0
        if 2 * max(n, len(listed.get(kind, ()))) > world:
            own.append(kind)
    return frozenset(own)


def runs_own_alert(header: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], bool]:
    """Whether an alert of :data:`RUN_WIDE_KINDS` is the run's, not its host's (8.5), judged
    in the attempt in which it was last raised (8.1), against that attempt's world size:
    the attempt is the latest of the header's ``attempts`` that began at or before the
    alert's ``at``; its count of distinct ranks for the kind is the header's
    ``alert_attempts``. A header without them (a broker before 8.1) is judged as before,
    over the whole run (:func:`runs_own_kinds`)."""
    counts = header.get("alert_attempts")
    attempts = header.get("attempts")
    if not isinstance(counts, dict) or not isinstance(attempts, list) or not attempts:
        whole = runs_own_kinds(header)
        return lambda alert: alert.get("kind") in whole
    starts: list[float] = []
    worlds: list[Any] = []
    numbers: list[int] = []
    for a in attempts:
        if not isinstance(a, dict) or not _is_rank(a.get("attempt")):
            continue
        at = a.get("started_at")
        starts.append(float(at) if isinstance(at, (int, float)) and a["attempt"] else -math.inf)
        worlds.append(a.get("world_size"))
        numbers.append(a["attempt"])
    by_kind: dict[str, dict[int, int]] = {}
    for kind, pairs in counts.items():
        if isinstance(pairs, list):
            by_kind[str(kind)] = {p[0]: p[1] for p in pairs if isinstance(p, list) and len(p) == 2
                                  and _is_rank(p[0]) and _is_rank(p[1])}
    current = header.get("world_size")

    def judge(alert: Mapping[str, Any]) -> bool:
        kind = alert.get("kind")
        if kind not in RUN_WIDE_KINDS:
            return False
        at = alert.get("at")
        i = bisect.bisect_right(starts, float(at) if isinstance(at, (int, float)) else math.inf) - 1
        i = max(0, min(i, len(numbers) - 1))
        world = worlds[i] if _is_rank(worlds[i]) else current
        if not _is_rank(world) or world <= 0:
            return False
        return 2 * by_kind.get(str(kind), {}).get(numbers[i], 0) > world

    return judge


def alert_host(alert: Mapping[str, Any], owner: Mapping[int, str]) -> str | None:
    """The host an alert blames (8.5): the host its rank had when it was last raised (the
    broker keeps it on the alert), else, for an alert without one (an older broker's, or a
    rank not yet placed then), the host the run's topology gives the rank now."""
    host = alert.get("host")
    if isinstance(host, str) and host:
        return host
    return owner.get(alert["rank"])


def _run_hosts(run: str, header: dict[str, Any]) -> _RunHosts:
    owner: dict[int, str] = {}
    hosts: list[tuple[str, dict[str, Any]]] = []
    raw_hosts = header.get("hosts")
    for item in raw_hosts if isinstance(raw_hosts, list) else ():
        if not isinstance(item, dict):
            continue
        host = item.get("host")
        ranks = item.get("ranks")
        if not isinstance(host, str) or not host or not isinstance(ranks, list):
            continue  # a rank without a host is nobody's
        mine = sorted(r for r in ranks if isinstance(r, int) and not isinstance(r, bool))
        for r in mine:
            owner[r] = host
        hosts.append((host, {"run": run, "ranks": mine}))
    incidents: dict[str, list[tuple[float, str, int, str, Any]]] = {}
    raw_alerts = header.get("alerts")
    runs_own = runs_own_alert(header)
    for alert in raw_alerts if isinstance(raw_alerts, list) else ():
        if not isinstance(alert, dict) or alert.get("kind") not in INCIDENT_KINDS:
            continue
        if runs_own(alert):
            continue  # raised by most of the run: the job's trouble, no host's (8.5)
        if not _blames_host(alert):
            continue
        rank = alert.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool):
            continue  # run-wide: nobody's
        host = alert_host(alert, owner)
        if host is None:  # a rank on no known host
            continue
        at = finite(alert.get("at"))
        key = at if at is not None else float("-inf")
        incidents.setdefault(host, []).append((key, run, rank, str(alert["kind"]), at))
    return _RunHosts(header, tuple(hosts), incidents)


def _blames_host(alert: dict[str, Any]) -> bool:
    """(8.3, 8.5) A ``replica_divergence`` from a step that had no majority blames no host:
    every rank disagreed (a metric that is not replicated after all, or a job-wide fault);
    its message says so (``..., no majority among <n> ranks``)."""
    return not (alert.get("kind") == "replica_divergence"
                and ", no majority among " in str(alert.get("message", "")))


def host_verdict(incidents: list[tuple[float, str, int, str, Any]]
                 ) -> tuple[bool, list[str]]:
    """``(suspect, reasons)`` of a host from its incidents sorted newest first: suspect on
    any GPU hardware incident or replica divergence (8.3), or incidents in >= 2 runs
    (PROTOCOL 7.4)."""
    reasons: list[str] = []
    seen: set[tuple[str, str]] = set()
    runs: set[str] = set()
    for _, run, _, kind, _ in incidents:
        runs.add(run)
        if kind in SUSPECT_KINDS and (kind, run) not in seen:
            seen.add((kind, run))
            reasons.append(f"{kind} in {run}")
    if len(runs) >= 2:
        reasons.append(f"incidents in {len(runs)} runs")
    return bool(reasons), reasons


class ClusterIndex:
    """Per-run derived figures of the cluster view, cached against the objects they came
    from (see the module docstring). One per hub; only the event-loop thread uses it."""

    def __init__(self) -> None:
        self._hosts: dict[str, _RunHosts] = {}
        #: run -> (its ranks list, ranks_stalled, ranks_stale)
        self._counts: dict[str, tuple[list[Any], int, int]] = {}

    # ------------------------------------------------------------------ runs
    def rank_counts(self, state: RunState) -> tuple[int, int]:
        """``(ranks_stalled, ranks_stale)`` of the run's latest ranks."""
        cached = self._counts.get(state.run)
        if cached is not None and cached[0] is state.ranks:
            return cached[1], cached[2]
        stalled = stale = 0
        for entry in state.ranks:
            if isinstance(entry, dict):
                status = entry.get("status")
                if status == "stalled":
                    stalled += 1
                elif status == "stale":
                    stale += 1
        self._counts[state.run] = (state.ranks, stalled, stale)
        return stalled, stale

    def run_entry(self, state: RunState) -> dict[str, Any]:
        """One ``/api/runs`` entry (PROTOCOL 4 with the 7.4 counts), read from the header
        with :meth:`RunState.public_header`'s defaults without copying the header."""
        header = state.header
        stalled, stale = self.rank_counts(state)
        alerts = header.get("alerts")
        return {
            "run": state.run, "status": header.get("status", "waiting"),
            "world_size": header.get("world_size"), "total_epochs": header.get("total_epochs"),
            "epochs_done": len(state.records), "label": header.get("label"),
            "started_at": header.get("started_at"), "updated_at": header.get("updated_at"),
            "shard": shard_of(header), "ranks_stalled": stalled, "ranks_stale": stale,
            "alerts": len(alerts) if isinstance(alerts, list) else 0,
            "steps_done": state.steps.last_step,
            "attempt": header.get("attempt", 0),  # 8.1
        }

    def runs(self, held: HeldRuns, filt: RunsFilter) -> list[dict[str, Any]]:
        """The ``/api/runs`` answer: the runs passing ``filt``, newest first, paged by its
        ``offset``/``limit``; entries are built for the page only."""
        self.prune(held.runs)
        kept = [s for s in held.runs_newest_first() if filt.keeps(s)]
        end = None if filt.limit is None else filt.offset + filt.limit
        return [self.run_entry(s) for s in kept[filt.offset:end]]

    # ----------------------------------------------------------------- hosts
    def _of(self, state: RunState) -> _RunHosts:
        cached = self._hosts.get(state.run)
        if cached is None or cached.header is not state.header:
            cached = self._hosts[state.run] = _run_hosts(state.run, state.header)
        return cached

    def prune(self, runs: Mapping[str, RunState]) -> None:
        """Forget runs the web no longer holds (evicted at ``--max-runs``, gone from a
        snapshot): the caches stay as large as the hub."""
        for cache in (self._hosts, self._counts):
            if len(cache) > len(runs) or any(run not in runs for run in cache):
                for run in [r for r in cache if r not in runs]:
                    del cache[run]

    def hosts(self, held: HeldRuns) -> list[dict[str, Any]]:
        """The ``/api/hosts`` answer (PROTOCOL 7.4) over the runs held; each host's ``runs``
        newest run first, as ``/api/runs`` lists them."""
        self.prune(held.runs)
        table: dict[str, dict[str, Any]] = {}
        found: dict[str, list[tuple[float, str, int, str, Any]]] = {}
        for state in held.runs_newest_first():
            derived = self._of(state)
            for host, entry in derived.hosts:
                row = table.get(host)
                if row is None:
                    row = table[host] = {"host": host, "runs": [], "ranks": 0}
                row["runs"].append(entry)
                row["ranks"] += len(entry["ranks"])
            for host, items in derived.incidents.items():
                found.setdefault(host, []).extend(items)
        for host in found:  # blamed where its rank ran then, a host no run holds now (8.5)
            if host not in table:
                table[host] = {"host": host, "runs": [], "ranks": 0}
        out = []
        for host, row in table.items():
            items = found.get(host, [])
            items.sort(key=lambda i: (-i[0], i[1], i[2], i[3]))
            row["incidents"] = [{"run": run, "rank": rank, "kind": kind, "at": at}
                                for _, run, rank, kind, at in items]
            row["suspect"], row["reasons"] = host_verdict(items)
            out.append(row)
        out.sort(key=lambda r: (not r["suspect"], -len(r["incidents"]), r["host"]))
        return out

    def suspects(self, held: HeldRuns) -> dict[str, bool]:
        """host -> suspect, for ``rankboard_host_suspect`` (the same rules as
        :meth:`hosts`, without building its rows or sorting)."""
        self.prune(held.runs)
        known: set[str] = set()
        found: dict[str, list[tuple[float, str, int, str, Any]]] = {}
        for state in held.runs.values():
            derived = self._of(state)
            known.update(host for host, _ in derived.hosts)
            for host, items in derived.incidents.items():
                found.setdefault(host, []).extend(items)
        known.update(found)
        return {host: host_verdict(found.get(host, []))[0] for host in known}
