"""The web's copy of a run's ``collectives`` frames and collective verdict, and the
``GET /api/runs/<run>/collectives`` answer (PROTOCOL.md section 7.2).

The broker computes the verdict and carries it in its ``stacks`` feed events and run
snapshots; the web does not compute its own. Why: a frame counts only while it is
**current** (received after its rank's latest ``steps``/``metrics`` frame), and only the
broker sees those frames in their order; the web sees closed steps, later and merged. So
the feed carries the frames kept since the previous event (``"collectives"``, in the wire
form of :mod:`broker.stacks.collectives`), the ones the broker could not keep
(``"collectives_gone"``: ``[[rank, reason]]``) and the verdict whenever it changed
(``"verdict"``: the listed groups); a snapshot carries ``{"groups", "ranks"}``, the same as
the GET. What the web holds is what the broker kept (its byte cap bounds both).

Pure: no sockets, no clock.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Hashable, List, Optional, Protocol, Tuple

import msgspec

from broker.stacks.store import RunStacks

__all__ = ["RunCollectiveView"]

log = logging.getLogger(__name__)

_json = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def _key(item: Any) -> Tuple[int, str] | None:
    """(rank, reason) of a frame in wire form, or None when it is not one."""
    if (isinstance(item, dict) and type(item.get("rank")) is int
            and item.get("reason") in ("stall", "request")
            and isinstance(item.get("groups"), list) and isinstance(item.get("entries"), list)):
        return (item["rank"], item["reason"])
    return None


class ByteBudget(Protocol):
    """What the view uses of :class:`broker.budget.ByteBudget` (the web reaches the budget
    through the stacks store: ``broker.stacks.store`` is the broker module it may import)."""

    def charge(self, holder: Any, key: Hashable, nbytes: int) -> None: ...

    def adjust(self, nbytes: int) -> None: ...

    def forget(self, holder: Any, key: Hashable) -> None: ...


#: What one held frame costs beyond its JSON bytes (the bytes object, its key tuple and the
#: dict slot), in the charge to the process's byte budget.
FRAME_OVERHEAD = 160

#: One event's frames made ready off the loop (:meth:`RunCollectiveView.prepare`): the keys
#: it drops, each kept frame as ``(key, JSON, SSE summary)``, and the verdict's JSON (None:
#: unchanged).
Prepared = Tuple[List[Tuple[int, str]], List[Tuple[Tuple[int, str], bytes, Dict[str, Any]]],
                 Optional[bytes]]


def _summary(key: Tuple[int, str], item: Dict[str, Any]) -> Dict[str, Any]:
    return {"rank": key[0], "reason": key[1], "request_id": item.get("request_id", ""),
            "taken_at": item.get("taken_at")}


def _frames(items: Any) -> List[Tuple[Tuple[int, str], bytes, Dict[str, Any]]]:
    out = []
    for item in items if isinstance(items, list) else ():
        key = _key(item)
        if key is None:
            log.warning("malformed collectives frame skipped")
            continue
        out.append((key, _json(item), _summary(key, item)))
    return out


class RunCollectiveView:
    """One run's ``collectives`` frames (latest per rank and reason) and verdict.

    Held **encoded** (issue 38, item 3): each frame as its JSON bytes, the verdict too, and
    each charged to the process's byte budget (:mod:`broker.budget`, shared with the dumps)
    at what it holds: as decoded dicts a 65,536-rank run's frames were ~7 times the bytes
    charged for them, and nothing charged them in the web at all. The ``GET /collectives``
    answer is those bytes joined (:meth:`view_json`), built once per state of the frames and
    verdict (issue 38, item 7: it was rebuilt per request, 115 MiB each) and charged too.
    """

    def __init__(self, budget: ByteBudget | None = None) -> None:
        #: the process's byte budget, shared with the run's dumps (``RunDumps`` passes its
        #: store's; by default the one a store gets: the web reaches the budget through the
        #: stacks store, the broker module it may import)
        self.budget = budget if budget is not None else RunStacks().budget
        self._frames: Dict[Tuple[int, str], bytes] = {}
        self._groups = b"[]"
        self._groups_charged = 0
        #: bumped by every change (the key of :meth:`view_json`'s cache)
        self.version = 0
        #: frames dropped because the process's budget was full
        self.over_budget = 0
        self._json: Optional[Tuple[int, bytes]] = None

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def groups(self) -> List[Dict[str, Any]]:
        """The verdict's listed groups (decoded anew: read rarely, by the report)."""
        groups = _decode(self._groups)
        return groups if isinstance(groups, list) else []

    @property
    def held_bytes(self) -> int:
        """The bytes of the encoded frames, verdict and cached answer held now."""
        cached = len(self._json[1]) if self._json is not None else 0
        return sum(map(len, self._frames.values())) + len(self._groups) + cached

    @classmethod
    def from_snapshot(cls, body: Any, budget: ByteBudget | None = None) -> RunCollectiveView:
        """The ``collectives`` of a run snapshot (malformed parts skipped)."""
        return cls.from_prepared(cls.prepare_snapshot(body), budget)

    @staticmethod
    def prepare_snapshot(body: Any) -> Prepared:
        """A run snapshot's ``collectives`` checked and encoded: pure (:meth:`prepare`)."""
        if not isinstance(body, dict):
            return [], [], None
        groups = body.get("groups")
        return [], _frames(body.get("ranks")), _json(groups) if isinstance(groups, list) else None

    @classmethod
    def from_prepared(cls, prepared: Prepared, budget: ByteBudget | None = None
                      ) -> RunCollectiveView:
        """A view holding what :meth:`prepare_snapshot` made."""
        view = cls(budget)
        view.apply_prepared(prepared)
        return view

    @staticmethod
    def prepare(data: Any) -> Prepared:
        """A ``stacks`` feed event's frames, each checked and encoded: pure, so the hub runs
        it off the loop for a big event (:attr:`web.hub.Hub.offload`)."""
        if not isinstance(data, dict):
            return [], [], None
        gone = []
        for key in data.get("collectives_gone") or ():
            try:
                rank, reason = key
                gone.append((int(rank), str(reason)))
            except (TypeError, ValueError):
                continue
        verdict = data.get("verdict")
        return gone, _frames(data.get("collectives")), (
            _json(verdict) if isinstance(verdict, list) else None)

    def apply_prepared(self, prepared: Prepared) -> List[Dict[str, Any]]:
        """Keep what :meth:`prepare` made; returns the SSE event's ``collectives`` entries
        (``{rank, reason, request_id, taken_at}`` of the frames it brought)."""
        gone, frames, verdict = prepared
        if not (gone or frames or verdict is not None):
            return []
        self._drop_json()
        self.version += 1
        for key in gone:
            self._remove(key)
        for key, data, _ in frames:
            self._remove(key)
            self._frames[key] = data
            self.budget.charge(self, key, len(data) + FRAME_OVERHEAD)  # may drop older ones
        if verdict is not None:
            self.budget.adjust(len(verdict) - self._groups_charged)
            self._groups, self._groups_charged = verdict, len(verdict)
        return [summary for _, _, summary in frames]

    def apply_event(self, data: Any) -> List[Dict[str, Any]]:
        """A ``stacks`` feed event (:meth:`prepare` then :meth:`apply_prepared`)."""
        return self.apply_prepared(self.prepare(data))

    def _remove(self, key: Tuple[int, str]) -> None:
        data = self._frames.pop(key, None)
        if data is not None:
            self.budget.forget(self, key)
            self.budget.adjust(-(len(data) + FRAME_OVERHEAD))

    def evict(self, key: Hashable) -> None:
        """The process's byte budget is full and ``key`` is its oldest item: a frame (the
        run's view loses it, as the broker's budget drops frames) or the cached answer."""
        if key == "view":
            self._drop_json()
            return
        if key in self._frames:
            data = self._frames.pop(key)  # type: ignore[call-overload]
            self.budget.adjust(-(len(data) + FRAME_OVERHEAD))
            self.over_budget += 1
            self.version += 1
            self._drop_json()

    def _drop_json(self) -> None:
        if self._json is not None:
            size = len(self._json[1])
            self._json = None
            self.budget.forget(self, "view")
            self.budget.adjust(-size)

    def close(self) -> None:
        """The run left this web: every byte goes back to the budget."""
        self._drop_json()
        for key in list(self._frames):
            self._remove(key)
        self.budget.adjust(-self._groups_charged)
        self._groups, self._groups_charged = b"[]", 0

    def view(self) -> Dict[str, Any]:
        """The ``GET /collectives`` answer decoded: ``{"groups": [...], "ranks": [...]}``
        (frames by rank then reason; made anew on each call, for the report and tests)."""
        return _decode(self.view_json())  # type: ignore[no-any-return]

    def view_json(self) -> bytes:
        """The ``GET /collectives`` JSON, the held bytes joined, cached per :attr:`version`
        and charged to the budget (the class docstring)."""
        cached = self._json
        if cached is not None and cached[0] == self.version:
            return cached[1]
        self._drop_json()
        frames = self._frames
        data = b"".join((b'{"groups":', self._groups, b',"ranks":[',
                         b",".join([frames[k] for k in sorted(frames)]), b"]}"))
        version = self.version
        self._json = (version, data)
        self.budget.charge(self, "view", len(data))
        if self.version != version and self._json is not None:
            # the charge dropped some of the oldest frames: the answer keeps them until the
            # next change rather than being rebuilt (and charged) on each read
            self._json = (self.version, data)
        return data
