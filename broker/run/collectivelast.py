"""The run header's ``collectives_last`` (PROTOCOL.md 8.5): the answer to a hang, kept.

The collective verdict (7.2) is formed from current frames only, so it empties as soon as the
hung job is killed or its ranks step again, and it was gone the next morning. This keeps the
latest verdict that named a rank (a group with a ``behind``, ``absent`` or ``mismatched``
rank) as ``{at, groups}``, by these rules:

* a **hang** runs from a verdict that names a rank until no ``collectives`` frame is current;
* within one hang the kept verdict is the one with the most ``waiting`` ranks (over its
  groups), the latest among equals, so ranks that step again one by one as a hang ends do
  not replace its answer; the first naming verdict of a later hang replaces it;
* ``at`` is the broker's time when the kept verdict was first formed: the same verdict
  formed again keeps it;
* at most :data:`MAX_GROUPS` groups (most ``waiting`` first), each rank list cut to its
  lowest :data:`MAX_RANKS` entries, each group gaining ``counts`` (the full lengths), so the
  header stays bounded in bytes for any world size.

Pure (the caller passes ``now``); :meth:`LastVerdict.state`/:meth:`LastVerdict.restore`
carry it across a restart through the journal, where replayed frames are not current.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

__all__ = ["LastVerdict", "MAX_GROUPS", "MAX_RANKS", "names_rank", "kept_form"]

#: Groups ``collectives_last`` holds at most.
MAX_GROUPS = 16
#: Entries of each of a group's rank lists it holds at most (the lowest ranks).
MAX_RANKS = 1024
_LISTS = ("waiting", "behind", "absent", "mismatched")


def names_rank(groups: Sequence[Mapping[str, Any]]) -> bool:
    """Does a verdict name a rank (a group with a ``behind``, ``absent`` or ``mismatched``)?"""
    return any(g.get("behind") or g.get("absent") or g.get("mismatched") for g in groups)


def _waiting(groups: Sequence[Mapping[str, Any]]) -> int:
    return sum(len(g.get("waiting") or ()) for g in groups)


def kept_form(groups: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """A verdict's groups as ``collectives_last`` holds them: most ``waiting`` first (ties:
    the verdict's order), at most :data:`MAX_GROUPS`, rank lists cut, ``counts`` added."""
    order = sorted(range(len(groups)), key=lambda i: -len(groups[i].get("waiting") or ()))
    out: List[Dict[str, Any]] = []
    for i in order[:MAX_GROUPS]:
        g = dict(groups[i])
        counts = {}
        for name in _LISTS:
            items = list(g.get(name) or ())
            counts[name] = len(items)
            g[name] = items[:MAX_RANKS]
        g["counts"] = counts
        out.append(g)
    return out


class LastVerdict:
    """One run's ``collectives_last`` and whether a hang is going on."""

    __slots__ = ("value", "_waiting", "in_hang", "version")

    def __init__(self) -> None:
        #: the header's ``collectives_last``: ``{"at", "groups"}`` or None
        self.value: Optional[Dict[str, Any]] = None
        self._waiting = 0  # the kept verdict's waiting ranks (full count)
        #: a verdict named a rank and some collectives frame has been current since
        self.in_hang = False
        #: bumped by every change of :attr:`value` (the header and the journal read it)
        self.version = 0

    def offer(self, groups: Sequence[Mapping[str, Any]], any_current: bool, now: float) -> bool:
        """A verdict was formed at ``now`` over the current frames (``any_current``: some
        rank's frame is current). Returns True when :attr:`value` changed."""
        if not names_rank(groups):
            if not any_current:
                self.in_hang = False  # the hang is over: the next naming verdict replaces
            return False
        waiting = _waiting(groups)
        if self.in_hang and waiting < self._waiting:
            return False
        kept = kept_form(groups)
        self.in_hang = any_current
        self._waiting = waiting
        if self.value is not None and self.value["groups"] == kept:
            return False  # the same verdict formed again keeps its time
        self.value = {"at": now, "groups": kept}
        self.version += 1
        return True

    def end_hang(self) -> None:
        """No ``collectives`` frame is current (e.g. after a restart): a hang is over."""
        self.in_hang = False

    def state(self) -> Optional[Dict[str, Any]]:
        """:attr:`value` plus the kept verdict's waiting count, for the journal."""
        if self.value is None:
            return None
        return {"at": self.value["at"], "groups": self.value["groups"], "waiting": self._waiting}

    def restore(self, state: Optional[Mapping[str, Any]]) -> None:
        """Take back what :meth:`state` wrote; a hang is never going on after a restart
        (replayed frames are not current). Raises ``ValueError`` for data it cannot take."""
        if state is None:
            value, waiting = None, 0
        else:
            at, groups = state["at"], state["groups"]
            if not isinstance(at, (int, float)) or not isinstance(groups, list) or not all(
                    isinstance(g, dict) for g in groups):
                raise ValueError("bad collectives_last")
            value, waiting = {"at": float(at), "groups": groups}, int(state.get("waiting", 0))
        self.value, self._waiting, self.in_hang = value, waiting, False
        self.version += 1
