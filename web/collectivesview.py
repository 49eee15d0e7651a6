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
from typing import Any, Dict, List, Tuple

__all__ = ["RunCollectiveView"]

log = logging.getLogger(__name__)


def _key(item: Any) -> Tuple[int, str] | None:
    """(rank, reason) of a frame in wire form, or None when it is not one."""
    if (isinstance(item, dict) and type(item.get("rank")) is int
            and item.get("reason") in ("stall", "request")
            and isinstance(item.get("groups"), list) and isinstance(item.get("entries"), list)):
        return (item["rank"], item["reason"])
    return None


class RunCollectiveView:
    """One run's ``collectives`` frames (latest per rank and reason) and verdict."""

    def __init__(self) -> None:
        self._frames: Dict[Tuple[int, str], Dict[str, Any]] = {}
        self.groups: List[Dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self._frames)

    @classmethod
    def from_snapshot(cls, body: Any) -> RunCollectiveView:
        """The ``collectives`` of a run snapshot (malformed parts skipped)."""
        view = cls()
        if isinstance(body, dict):
            view._put(body.get("ranks"))
            groups = body.get("groups")
            view.groups = groups if isinstance(groups, list) else []
        return view

    def _put(self, items: Any) -> List[Dict[str, Any]]:
        out = []
        for item in items if isinstance(items, list) else ():
            key = _key(item)
            if key is None:
                log.warning("malformed collectives frame skipped")
                continue
            self._frames[key] = item
            out.append({"rank": key[0], "reason": key[1], "request_id": item.get("request_id", ""),
                        "taken_at": item.get("taken_at")})
        return out

    def apply_event(self, data: Any) -> List[Dict[str, Any]]:
        """A ``stacks`` feed event; returns the SSE event's ``collectives`` entries
        (``{rank, reason, request_id, taken_at}`` of the frames it brought)."""
        if not isinstance(data, dict):
            return []
        for key in data.get("collectives_gone") or ():
            try:
                rank, reason = key
                self._frames.pop((int(rank), str(reason)), None)
            except (TypeError, ValueError):
                continue
        out = self._put(data.get("collectives"))
        verdict = data.get("verdict")
        if isinstance(verdict, list):
            self.groups = verdict
        return out

    def view(self) -> Dict[str, Any]:
        """The ``GET /collectives`` JSON: ``{"groups": [...], "ranks": [...]}`` (frames by
        rank then reason; read-only, shared)."""
        return {"groups": self.groups, "ranks": [self._frames[k] for k in sorted(self._frames)]}
