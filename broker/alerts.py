"""A run's alert list (PROTOCOL.md section 3): each (kind, rank) listed once, the newest
message and time kept, handed to the webhooks while the run is live.

Kept apart from :class:`broker.sink.RunSink` because every diagnosis feeds it (stalls, stale
ranks, GPU health, non-finite losses, and in v4 the data wait and the collectives): one
place decides what an alert is, how the header lists it and who is told, so a new kind is
one ``raise_`` call and a bound on the list is written once.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["RunAlerts", "OnAlert"]

#: ``on_alert(run, kind, rank, message, host, now)``: an alert raised live (webhooks, 3.1).
OnAlert = Callable[[str, str, Optional[int], str, Optional[str], float], None]
#: ``place(rank) -> (host, local_rank) | None``: where a rank runs (the run's topology).
Place = Callable[[int], Optional[Tuple[str, int]]]


class RunAlerts:
    """The alerts of one run, in first-raised order (a re-raise updates in place)."""

    __slots__ = ("_alerts", "on_alert")

    def __init__(self) -> None:
        self._alerts: Dict[Tuple[str, Optional[int]], Dict[str, Any]] = {}
        #: Hook for alerts raised while live (the broker's webhooks); None: nobody.
        self.on_alert: OnAlert | None = None

    def raise_(self, run: str, kind: str, rank: Optional[int], message: str, now: float,
               place: Place, notify: bool) -> None:
        """Raise (or re-raise) an alert; ``notify`` (the run is live and the alert is news)
        hands it to :attr:`on_alert` too: grouping and repeat suppression are the
        webhooks'."""
        alert = self._alerts.get((kind, rank))
        if alert is None:
            self._alerts[(kind, rank)] = {"kind": kind, "rank": rank, "message": message, "at": now}
        else:
            alert["message"] = message
            alert["at"] = now
        if notify and self.on_alert is not None:
            p = place(rank) if rank is not None else None
            self.on_alert(run, kind, rank, message, p[0] if p else None, now)

    def listed(self) -> List[Dict[str, Any]]:
        """The header's ``alerts``: copies, since event data leaves the sink."""
        return [dict(a) for a in self._alerts.values()]

    def forget_ranks_from(self, world_size: int) -> None:
        """Drop the alerts of ranks that turned out to be past the world size."""
        for key in [k for k in self._alerts if k[1] is not None and k[1] >= world_size]:
            del self._alerts[key]

    def __len__(self) -> int:
        return len(self._alerts)
