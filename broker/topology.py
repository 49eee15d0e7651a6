"""Where ranks live and what they run on: the topology (PROTOCOL.md 2.1) and the run's
hardware string (2.2), both pure and incrementally maintained.

Kept apart from the sink because they are the one part of a run's state that is about the
cluster rather than the training: :class:`Topology` orders hosts and ranks as registers
arrive, and :class:`HardwareString` renders ``"<host>: <cpu> | gr=G lr=L: <gpu> ..."`` from
per-rank summaries with one cached block per host, so a report from one rank re-renders one
host, not the cluster.
"""
from __future__ import annotations

import bisect
from typing import Any, Callable, Dict, List, Tuple

__all__ = ["Topology", "HardwareString"]

_NO_REPORT = object()  # sentinel for a cached hardware block of a host with no report


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


class HardwareString:
    """The hardware string of PROTOCOL 2.2 over a :class:`Topology`.

    ``summary_of(rank)`` returns a rank's last ``hardware`` summary (None: no report). The
    string is rebuilt from cached per-host blocks only when something changed.
    """

    def __init__(self, topology: Topology, summary_of: Callable[[int], str | None]) -> None:
        self.topology = topology
        self.summary_of = summary_of
        self._blocks: Dict[str, Any] = {}
        self._string: str | None = ""

    def hosts_changed(self, hosts: List[str]) -> None:
        """Membership of ``hosts`` changed: their blocks and the string are stale
        (re-rendered when the string is next asked for)."""
        for host in hosts:
            self._blocks.pop(host, None)
        self._string = None

    def report_changed(self, rank: int) -> bool:
        """``rank``'s summary changed; True when the string changed with it. Only the rank's
        host block is re-rendered and compared (O(ranks on the host)); an unplaced rank is in
        no block."""
        place = self.topology.place.get(rank)
        if place is None:
            return False
        host = place[0]
        before = self._blocks.get(host)
        block = self._blocks[host] = self._render_host(host)
        if block != before:
            self._string = None
            return True
        return False

    def render(self) -> str:
        """The hardware string (cached until something changes)."""
        if self._string is None:
            blocks = []
            for host in self.topology.hosts():
                block = self._blocks.get(host)
                if block is None:
                    block = self._blocks[host] = self._render_host(host)
                if block is not _NO_REPORT:
                    blocks.append(block)
            self._string = " | ".join(blocks)
        return self._string

    def _render_host(self, host: str) -> Any:
        """``"<host>: <cpu>"`` plus one ``" | gr=G lr=L: <gpu>"`` per rank with a GPU part."""
        parts: List[str] = []
        summary_of = self.summary_of
        for local_rank, rank in self.topology.members(host):
            summary = summary_of(rank)
            if summary is None:
                continue
            cpu, sep, gpu = summary.partition(" | ")
            if not parts:
                parts.append(f"{host}: {cpu}")
            if sep and gpu:
                parts.append(f"gr={rank} lr={local_rank}: {gpu}")
        return " | ".join(parts) if parts else _NO_REPORT
