"""Why a run died: the rank that failed first (PROTOCOL.md 8.2), pure.

When a distributed job dies one rank fails first and the others follow (collective errors,
watchdog timeouts, the launcher's kill), so the first failure is the cause and the rest is
noise. This module turns the ranks' states into the header's ``failure``:

* ``first``: the earliest of the ranks that finished with ``error`` (at their error's
  ``at``, or the ``finish``'s arrival without one) and the ``stale`` ranks (at their
  ``last_seen``: a rank killed by the kernel goes silent before the ranks that waited for
  it); ties: the lowest rank;
* ``groups``: the error ranks by exception type, ordered by their first ``at`` then type;
* ``silent``: the stale ranks.

It is ``None`` unless some rank finished with ``error``, or every rank is finished or stale
with at least one stale (the job is gone). The truth as known: a rank that turns stale
later may become ``first``. :func:`failure` is also what an attempt's end keeps as its
``cause`` (8.1): :func:`cause` is that form (no frames, the message's first line).

Bounds: every rank list is the lowest :data:`MAX_LISTED_RANKS` (all counted), at most
:data:`MAX_GROUPS` groups (more counted), so the header stays small for 65,536 ranks; the
errors the broker keeps are bounded in bytes by :class:`ErrorStore`.

Cost: :func:`failure` is one pass over the ranks in rank order (about a microsecond a rank
in CPython: 65,536 ranks took ~80 ms, over the 50 ms the issue allows). The sink therefore
keeps a :class:`FailureIndex`, updated at each status change (a finish, a rank turning stale
or back): per exception type the failed ranks and their times, and the stale ranks with
theirs, so ``failure`` is a C-level ``min`` per group plus the lowest 1,024 ranks of the 64
groups listed (``failure_65536_ms`` in BENCHMARKS.md); it recomputes only after a change.
:func:`failure` stays as the plain statement of the rule: the tests hold the index to it,
and it computes an attempt's ``cause`` over any set of ranks.
"""
from __future__ import annotations

import heapq
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from rank_agent.protocol import ErrorInfo

__all__ = ["failure", "cause", "first_line", "alert_message", "ErrorStore", "error_at",
           "FailureIndex",
           "MAX_LISTED_RANKS", "MAX_GROUPS", "ERROR_BYTES", "FIRST_LINE"]

#: Ranks listed in a group or in ``silent`` (the lowest; ``count`` says how many in all).
MAX_LISTED_RANKS = 1024
#: Groups listed (``groups_more`` counts the rest).
MAX_GROUPS = 64
#: Characters of a message's first line in an alert, a cause and a cut error.
FIRST_LINE = 200
#: Bytes of errors a run keeps whole (messages and tracebacks); an error arriving past them
#: is kept as its type, time and first line. 65,536 ranks x (4 KiB message + 64 frames of
#: three 512-character strings) would be ~6 GiB; the first failure and the groups' messages
#: are nearly always among the first errors to arrive.
ERROR_BYTES = 16 * 1024 * 1024

#: ``host_of(rank)``: the rank's host, or None.
HostOf = Callable[[int], Optional[str]]


def first_line(message: str) -> str:
    """The message's text before its first newline, cut to :data:`FIRST_LINE` characters."""
    line = message.split("\n", 1)[0]
    return line[:FIRST_LINE]


def alert_message(info: ErrorInfo) -> str:
    """The ``rank_error`` alert of a finish with an ``ErrorInfo``: ``failed: <type>: <first
    line>`` (``failed: <type>`` when that line is empty). The webhooks carry it as it is."""
    line = first_line(info.message)
    return f"failed: {info.type}: {line}" if line else f"failed: {info.type}"


def error_at(info: Optional[ErrorInfo], arrival: float) -> float:
    """When a rank failed: its error's ``at``, or the ``finish``'s arrival when there is no
    error, or its ``at`` is not finite or later than that arrival (clocks are assumed in
    step; a rank cannot have failed after it said so)."""
    if info is None:
        return arrival
    at = info.at
    return at if math.isfinite(at) and at <= arrival else arrival


def _size(info: ErrorInfo) -> int:
    """About the bytes an error holds: its strings plus a fixed cost per object."""
    n = 64 + len(info.type) + len(info.message)
    for f in info.frames:
        n += 64 + len(f.file) + len(f.function) + len(f.code)
    return n


class ErrorStore:
    """The bytes of the errors one run keeps (:data:`ERROR_BYTES`): :meth:`admit` returns
    the error to keep for a rank, whole while the budget allows, else cut to its type, time
    and first line (no frames). :meth:`release` gives a replaced or forgotten error's bytes
    back."""

    __slots__ = ("bytes", "budget", "cut")

    def __init__(self, budget: int = ERROR_BYTES) -> None:
        self.bytes = 0
        self.budget = budget
        #: errors kept cut because the budget was spent (a count for the log and tests)
        self.cut = 0

    def admit(self, info: ErrorInfo) -> ErrorInfo:
        size = _size(info)
        if self.bytes + size > self.budget:
            self.cut += 1
            info = ErrorInfo(type=info.type, message=first_line(info.message), at=info.at)
            size = _size(info)
        self.bytes += size
        return info

    def release(self, info: Optional[ErrorInfo]) -> None:
        if info is not None:
            self.bytes -= _size(info)


def _frames(info: Optional[ErrorInfo]) -> List[Dict[str, Any]]:
    if info is None:
        return []
    return [{"file": f.file, "line": f.line, "function": f.function, "code": f.code}
            for f in info.frames]


def failure(ranks: Mapping[int, Any], host_of: HostOf, *,
            unfinished_silent: bool = False) -> Optional[Dict[str, Any]]:
    """The header's ``failure`` over ``ranks`` (rank -> a state with ``status``,
    ``last_seen``, ``error`` and ``error_at``: :class:`broker.run.rankstate.RankState`), or
    ``None`` (module docstring). JSON-ready and new on every call. ``unfinished_silent``:
    count every rank that has not finished as ``stale`` (an attempt's end, 8.1: a rank
    killed by the kernel is silent before the launcher restarts the job)."""
    first_at = math.inf
    first_rank = -1
    first_kind = ""
    # type -> [first_at, its rank, its error, ranks listed, count]
    groups: Dict[str, List[Any]] = {}
    silent: List[int] = []
    n_silent = 0
    unfinished = False
    for rank in sorted(ranks):
        st = ranks[rank]
        status = st.status
        if status == "error":
            at = st.error_at
            info = st.error
            tp = info.type if info is not None else ""
            g = groups.get(tp)
            if g is None:
                groups[tp] = [at, rank, info, [rank], 1]
            else:
                g[4] += 1
                if len(g[3]) < MAX_LISTED_RANKS:
                    g[3].append(rank)
                if at < g[0]:  # (rank order: a tie keeps the lower rank)
                    g[0], g[1], g[2] = at, rank, info
            if at < first_at:
                first_at, first_rank, first_kind = at, rank, "error"
        elif status == "stale" or (unfinished_silent and status != "finished"):
            n_silent += 1
            if n_silent <= MAX_LISTED_RANKS:
                silent.append(rank)
            at = st.last_seen
            if at < first_at:
                first_at, first_rank, first_kind = at, rank, "silent"
        elif status != "finished":
            unfinished = True
    if not groups and (unfinished or not n_silent):
        return None
    st = ranks[first_rank]
    info = st.error if first_kind == "error" else None
    first = {"rank": first_rank, "host": host_of(first_rank), "kind": first_kind,
             "at": first_at, "type": info.type if info is not None else "",
             "message": info.message if info is not None else "", "frames": _frames(info)}
    ordered = sorted(groups.items(), key=_group_order)
    return {
        "first": first,
        "groups": [{"type": tp, "message": g[2].message if g[2] is not None else "",
                    "ranks": g[3], "count": g[4], "first_at": g[0]}
                   for tp, g in ordered[:MAX_GROUPS]],
        "groups_more": max(0, len(ordered) - MAX_GROUPS),
        "silent": {"ranks": silent, "count": n_silent},
    }


def _group_order(item: Tuple[str, List[Any]]) -> Tuple[float, str]:
    return item[1][0], item[0]


def cause(value: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """An attempt's ``cause`` (8.1) from a :func:`failure`: its ``first`` without ``frames``,
    the message cut to its first line of at most 200 characters (``None`` when nothing
    failed). The attempts' rules (another part) call it when an attempt ends, with the
    attempt's unfinished ranks counted as stale."""
    if value is None:
        return None
    first = {k: v for k, v in value["first"].items() if k != "frames"}
    first["message"] = first_line(first["message"])
    return first


class FailureIndex:
    """What ``failure`` is computed from, kept up to date at each status change (module
    docstring, "Cost"): per type the ranks that finished with ``error`` (rank -> when they
    failed), and the ``stale`` ranks (rank -> ``last_seen``). The sink calls
    :meth:`failed`/:meth:`unfailed` at a finish and a reactivation, :meth:`stale`/
    :meth:`unstale` when a rank turns stale or is heard again, :meth:`forget` when a rank
    leaves the run."""

    __slots__ = ("groups", "type_of", "silent")

    def __init__(self) -> None:
        #: type -> {rank: at} of the ranks that finished with error ("" : no ErrorInfo)
        self.groups: Dict[str, Dict[int, float]] = {}
        self.type_of: Dict[int, str] = {}
        #: rank -> last_seen of the stale ranks
        self.silent: Dict[int, float] = {}

    def failed(self, rank: int, tp: str, at: float) -> None:
        self.unfailed(rank)
        group = self.groups.get(tp)
        if group is None:
            group = self.groups[tp] = {}
        group[rank] = at
        self.type_of[rank] = tp

    def unfailed(self, rank: int) -> None:
        tp = self.type_of.pop(rank, None)
        if tp is not None:
            group = self.groups[tp]
            del group[rank]
            if not group:
                del self.groups[tp]

    def stale(self, rank: int, last_seen: float) -> None:
        self.silent[rank] = last_seen

    def unstale(self, rank: int) -> None:
        self.silent.pop(rank, None)

    def forget(self, rank: int) -> None:
        self.unfailed(rank)
        self.unstale(rank)

    def failure(self, info_of: Callable[[int], Optional[ErrorInfo]], host_of: HostOf,
                gone: bool) -> Optional[Dict[str, Any]]:
        """:func:`failure` from the index; ``gone``: every rank is finished or stale."""
        silent = self.silent
        if not self.groups and not (gone and silent):
            return None
        first: Tuple[float, int] | None = None
        first_kind = "error"
        entries: List[Tuple[float, str, int, Dict[int, float]]] = []
        for tp, group in self.groups.items():
            at, rank = min(zip(group.values(), group.keys()))  # (ties: the lowest rank)
            entries.append((at, tp, rank, group))
            if first is None or (at, rank) < first:
                first = (at, rank)
        if silent:
            earliest = min(zip(silent.values(), silent.keys()))
            if first is None or earliest < first:
                first, first_kind = earliest, "silent"
        assert first is not None
        entries.sort(key=_entry_order)
        info = info_of(first[1]) if first_kind == "error" else None
        return {
            "first": {"rank": first[1], "host": host_of(first[1]), "kind": first_kind,
                      "at": first[0], "type": info.type if info is not None else "",
                      "message": info.message if info is not None else "",
                      "frames": _frames(info)},
            "groups": [{"type": tp, "message": _message(info_of(rank)), "ranks": _lowest(group),
                        "count": len(group), "first_at": at}
                       for at, tp, rank, group in entries[:MAX_GROUPS]],
            "groups_more": max(0, len(entries) - MAX_GROUPS),
            "silent": {"ranks": _lowest(silent), "count": len(silent)},
        }


def _entry_order(entry: Tuple[float, str, int, Dict[int, float]]) -> Tuple[float, str]:
    return entry[0], entry[1]


def _message(info: Optional[ErrorInfo]) -> str:
    return info.message if info is not None else ""


def _lowest(ranks: Dict[int, float]) -> List[int]:
    """The lowest :data:`MAX_LISTED_RANKS` ranks, sorted."""
    if len(ranks) <= MAX_LISTED_RANKS:
        return sorted(ranks)
    return heapq.nsmallest(MAX_LISTED_RANKS, ranks)
