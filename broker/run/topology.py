"""Where ranks live and what they run on: the topology (PROTOCOL.md 2.1) and the run's
hardware string (2.2), both pure and incrementally maintained.

Kept apart from the sink because they are the one part of a run's state that is about the
cluster rather than the training: :class:`Topology` orders hosts and ranks as registers
arrive, and :class:`HardwareString` renders ``"<host>: <cpu> | gr=G lr=L: <gpu> ..."`` from
per-rank summaries, at most :data:`MAX_HARDWARE_BYTES` long (v3), from small per-host facts
cached and rebuilt only for the hosts that changed.
"""
from __future__ import annotations

import bisect
from typing import Any, Callable, Dict, Iterator, List, Tuple

__all__ = ["Topology", "HardwareString", "MAX_HARDWARE_BYTES"]

#: Longest hardware string, in UTF-8 bytes (contract v3 section 2.2). 65,536 ranks with
#: 4,096-character summaries would otherwise make a ~268 MB string riding in every header.
MAX_HARDWARE_BYTES = 64 * 1024
_SEP = " | "


class Topology:
    """Host and local rank per registered global rank, ordered as PROTOCOL 2.1 says.

    Hosts are ordered by the lowest global rank registered on them; ranks within a host by
    local rank (then global rank, so equal local ranks still order deterministically).
    Everything derived is cached per host and rebuilt only for the host that changed; the
    host order is re-sorted only when a host appears, disappears or changes its lowest
    rank. So an epoch close costs no sort, and a register costs O(hosts), not O(ranks).
    """

    def __init__(self) -> None:
        #: rank -> (host, local_rank), for every registered rank.
        self.place: Dict[int, Tuple[str, int]] = {}
        self._members: Dict[str, List[Tuple[int, int]]] = {}  # host -> sorted (lr, rank)
        self._lowest: Dict[str, int] = {}  # host -> lowest global rank on it
        self._order: List[str] | None = None  # hosts in topology order
        self._entries: Dict[str, Dict[str, Any]] = {}  # host -> {"host", "ranks"} (cached)
        self._ordered: List[Dict[str, Any]] | None = None

    def set(self, rank: int, host: str, local_rank: int) -> List[str]:
        """Place ``rank``; returns the hosts whose membership changed (empty: no change)."""
        old = self.place.get(rank)
        if old == (host, local_rank):
            return []
        touched = []
        if old is not None:
            self._drop(rank, old)
            touched.append(old[0])
        self.place[rank] = (host, local_rank)
        bisect.insort(self._members.setdefault(host, []), (local_rank, rank))
        low = self._lowest.get(host)
        if low is None or rank < low:
            self._lowest[host] = rank
            self._order = None
        if host not in touched:
            touched.append(host)
        self._changed(host)
        return touched

    def remove(self, rank: int) -> str | None:
        """Forget ``rank``; returns its host (None if it was not placed)."""
        old = self.place.pop(rank, None)
        if old is None:
            return None
        self._drop(rank, old)
        return old[0]

    def _drop(self, rank: int, old: Tuple[str, int]) -> None:
        host, local_rank = old
        members = self._members[host]
        del members[bisect.bisect_left(members, (local_rank, rank))]
        if not members:
            del self._members[host]
            del self._lowest[host]
            self._order = None
        elif self._lowest[host] == rank:
            self._lowest[host] = min(r for _, r in members)
            self._order = None
        self._changed(host)

    def _changed(self, host: str) -> None:
        self._entries.pop(host, None)
        self._ordered = None

    def hosts(self) -> List[str]:
        """Host names in topology order. Cached; do not mutate."""
        if self._order is None:
            lowest = self._lowest
            self._order = sorted(lowest, key=lowest.__getitem__)
        return self._order

    def ordered(self) -> List[Dict[str, Any]]:
        """``[{"host", "ranks": [ranks in local-rank order]}]`` in host order: the header's
        ``hosts``. Cached and shared between headers; do not mutate."""
        if self._ordered is None:
            entries = self._entries
            out = []
            for host in self.hosts():
                entry = entries.get(host)
                if entry is None:
                    entry = entries[host] = {
                        "host": host, "ranks": [r for _, r in self._members[host]],
                    }
                out.append(entry)
            self._ordered = out
        return self._ordered

    def members(self, host: str) -> List[Tuple[int, int]]:
        """The (local_rank, rank) pairs of ``host`` in order (empty for an unknown host)."""
        return self._members.get(host, [])


def _nbytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def rank_ranges(ranks: List[int]) -> str:
    """Ascending ranks as ``"0-3,8,10-11"`` (runs of consecutive ranks as ``a-b``)."""
    out = []
    start = prev = ranks[0]
    for r in ranks[1:]:
        if r != prev + 1:
            out.append(f"{start}-{prev}" if prev > start else str(start))
            start = r
        prev = r
    out.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(out)


class _Host:
    """What the string needs of one host with at least one report, in sizes and ranks
    only (no text is kept: the parts are cut from the summaries when rendered)."""

    __slots__ = ("host", "reporting", "first", "cpu_only", "gpu_ranks", "groups", "head",
                 "exact", "folded")

    def __init__(self, host: str) -> None:
        self.host = host
        self.reporting = 0  # ranks of the host with a report
        self.first = -1  # the first reporting rank (local-rank order): its cpu part is shown
        self.cpu_only = 0  # reporting ranks without a GPU part (shown by the host part)
        self.gpu_ranks: List[Tuple[int, int]] = []  # (rank, local rank) with a GPU part
        # one (ranks, their ranges, a representative rank, GPU part bytes) per distinct GPU
        # part, in order of first appearance
        self.groups: List[Tuple[List[int], str, int, int]] = []
        self.head = 0  # bytes of "<host>: <cpu>"
        self.exact = 0  # bytes of the exact block
        self.folded = 0  # bytes of the folded block


class HardwareString:
    """The hardware string of PROTOCOL 2.2 over a :class:`Topology`, at most ``limit``
    UTF-8 bytes (contract v3).

    Three forms, the first that fits:

    1. **exact**: as section 2.2 says; per host ``"<host>: <cpu>"`` then
       ``" | gr=<G> lr=<L>: <gpu>"`` per rank with a GPU part; blocks joined by ``" | "``.
    2. **folded**: per host, ranks whose GPU parts are identical are one part,
       ``" | gr=<ranges>: <gpu>"``, ``<ranges>`` the global ranks as comma-separated runs
       (``gr=0-7``, ``gr=0-3,8``), in order of each GPU part's first rank on the host; the
       local ranks are left out (the header's ``hosts`` has them). E.g. eight identical
       GPUs: ``"node0: Xeon | gr=0-7: H100 80GB"``.
    3. **folded and cut**: the folded parts in order while they fit, then
       ``" | … and N more ranks"``, N the reporting ranks whose part is not shown. It is cut
       only between parts, never inside one.

    ``summary_of(rank)`` returns a rank's last ``hardware`` summary (None: no report). A
    report or a placement change marks its host; :meth:`render` rebuilds the marked hosts'
    facts (O(ranks on the host)) and then works in sizes, O(hosts), cutting text from the
    summaries only for what it emits, so a 65,536-rank report storm costs O(1) per frame
    and one bounded render per header, never a string of the whole cluster.
    """

    def __init__(self, topology: Topology, summary_of: Callable[[int], str | None],
                 limit: int = MAX_HARDWARE_BYTES) -> None:
        self.topology = topology
        self.summary_of = summary_of
        self.limit = limit
        self._hosts: Dict[str, _Host | None] = {}  # host -> facts (None: no report)
        self._dirty: set[str] = set()
        self._string: str | None = None

    def hosts_changed(self, hosts: List[str]) -> None:
        """Membership of ``hosts`` changed: their facts and the string are stale
        (re-rendered when the string is next asked for)."""
        self._dirty.update(hosts)
        self._string = None

    def report_changed(self, rank: int) -> bool:
        """``rank``'s summary changed; True when the string may have changed with it (the
        rank is placed: an unplaced rank is in no block). O(1): the host is only marked."""
        place = self.topology.place.get(rank)
        if place is None:
            return False
        self._dirty.add(place[0])
        self._string = None
        return True

    def render(self) -> str:
        """The hardware string (cached until something changes)."""
        if self._string is None:
            self._string = self._render()
        return self._string

    # ----------------------------------------------------------------- internals

    def _facts(self) -> List[_Host]:
        hosts = self._hosts
        for host in self._dirty:
            hosts[host] = self._build(host)
        self._dirty.clear()
        out = []
        for host in self.topology.hosts():
            if host in hosts:
                facts = hosts[host]
            else:
                facts = hosts[host] = self._build(host)
            if facts is not None:
                out.append(facts)
        order = self.topology.hosts()
        if len(hosts) > len(order) + 64:  # forget hosts that left the topology
            live = set(order)
            for host in [h for h in hosts if h not in live]:
                del hosts[host]
        return out

    def _build(self, host: str) -> _Host | None:
        facts = _Host(host)
        summary_of = self.summary_of
        groups: Dict[str, Tuple[List[int], int]] = {}  # GPU part -> (ranks, its bytes)
        exact = 0
        for local_rank, rank in self.topology.members(host):
            summary = summary_of(rank)
            if summary is None:
                continue
            facts.reporting += 1
            cpu, sep, gpu = summary.partition(_SEP)
            if facts.first < 0:
                facts.first = rank
                exact = facts.head = len(host) + 2 + _nbytes(cpu)
            if not (sep and gpu):
                facts.cpu_only += 1
                continue
            facts.gpu_ranks.append((rank, local_rank))
            group = groups.get(gpu)
            if group is None:
                group = groups[gpu] = ([], _nbytes(gpu))
            group[0].append(rank)
            exact += 3 + len(f"gr={rank} lr={local_rank}: ") + group[1]
        if not facts.reporting:
            return None
        facts.exact = exact
        folded = exact - sum(3 + len(f"gr={r} lr={lr}: ") for r, lr in facts.gpu_ranks)
        folded -= sum(g[1] * (len(g[0]) - 1) for g in groups.values())
        for ranks, nbytes in groups.values():
            ranks.sort()
            ranges = rank_ranges(ranks)
            facts.groups.append((ranks, ranges, ranks[0], nbytes))
            folded += 3 + len(ranges) + 5  # " | " "gr=" ranges ": "
        facts.folded = folded
        return facts

    def _gpu(self, rank: int) -> str:
        return (self.summary_of(rank) or "").partition(_SEP)[2]

    def _head(self, facts: _Host) -> str:
        return f"{facts.host}: {(self.summary_of(facts.first) or '').partition(_SEP)[0]}"

    def _render(self) -> str:
        hosts = self._facts()
        if not hosts:
            return ""
        seps = 3 * (len(hosts) - 1)
        if sum(h.exact for h in hosts) + seps <= self.limit:
            return _SEP.join(self._exact_block(h) for h in hosts)
        if sum(h.folded for h in hosts) + seps <= self.limit:
            return _SEP.join(_SEP.join(part for part, _, _ in self._folded_parts(h))
                             for h in hosts)
        return self._cut(hosts)

    def _exact_block(self, facts: _Host) -> str:
        parts = [self._head(facts)]
        parts.extend(f"gr={rank} lr={lr}: {self._gpu(rank)}" for rank, lr in facts.gpu_ranks)
        return _SEP.join(parts)

    def _folded_parts(self, facts: _Host) -> Iterator[Tuple[str, int, int]]:
        """(part, its bytes, ranks it shows) of the folded block, in order, made lazily."""
        yield self._head(facts), facts.head, facts.cpu_only
        for ranks, ranges, rep, nbytes in facts.groups:
            yield f"gr={ranges}: {self._gpu(rep)}", 5 + len(ranges) + nbytes, len(ranks)

    def _cut(self, hosts: List[_Host]) -> str:
        total = sum(h.reporting for h in hosts)
        # room for the tail with N as wide as it can be
        room = self.limit - _nbytes(f"{_SEP}… and {total} more ranks")
        out: List[str] = []
        used = shown = 0
        for facts in hosts:
            for part, nbytes, ranks in self._folded_parts(facts):
                need = nbytes + (3 if out else 0)
                if used + need > room:
                    break
                out.append(part)
                used += need
                shown += ranks
            else:
                continue
            break
        more = total - shown
        if more:
            out.append(f"… and {more} more ranks")
        return _SEP.join(out)
