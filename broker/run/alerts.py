"""A run's alert list (PROTOCOL.md section 3): each (kind, rank) listed once, the newest
message and time kept, handed to the webhooks while the run is live.

Kept apart from :class:`broker.run.sink.RunSink` because every diagnosis feeds it (stalls, stale
ranks, GPU health, non-finite losses, and in v4 the data wait and the collectives): one
place decides what an alert is, how the header lists it and who is told, so a new kind is
one ``raise_`` call and a bound on the list is written once.

The bound (issue 32, finding 5): 65,536 stalled ranks with long paths made 76 MiB of alerts
and 65-80 MiB ``run`` events, past what an SSE client may queue, so every viewer was dropped
on every reconnect. Per kind the list keeps the :data:`MAX_ALERTS_PER_KIND` most recently
raised (older ones of that kind leave the list) and a count of the kind's alerts, listed as
one run-wide entry (``rank`` null: "N stalled alerts raised, the latest 100 listed") once
some were left out; each message is at most :data:`MAX_ALERT_MESSAGE` characters. Webhooks
are told of every alert as before: the bound is on what the header carries.

Across a restart (PROTOCOL 8.5) the list is not rebuilt by replaying frames: alerts that
depend on the clock (``stale``), on samples the journal coalesced away (the GPU kinds) or on
currency (the collectives) would be lost. :meth:`RunAlerts.state` is the whole list as
plain data (in listed order, with each kind's cap order and count) and :meth:`RunAlerts.
restore` puts it back exactly; :attr:`RunAlerts.version` says when it changed and
:attr:`RunAlerts.shape` when more than an alert's time did (a new alert, a new message, one
leaving the list), so the journal writes it only then, and a condition that persists (a GPU
throttling, raised again with every sample) costs little (``broker/journal/statenotes.py``).
Any kind raised here survives.

(v5, 8.5 "Hosts, fairly") Each entry keeps ``host``: the host its rank had when the alert was
last raised (None for a run-wide alert or a rank on no known host), a plain value on the
entry so it travels (and is journaled) with it: a job requeued onto other nodes blames none
of them for the old ones' alerts. And per kind the list counts the **distinct ranks** that
raised it, past the cap (:meth:`RunAlerts.ranks_raised`, the header's ``alert_ranks``): a
kind raised by more than half of the world is the run's, not a host's (``web/cluster.py``
judges that). The ranks are a bitmap per kind, at most ``MAX_WORLD_SIZE`` bits (8 KiB): a
65,536-rank stall costs bytes, not a set of 65,536 ints.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from rank_agent.protocol import MAX_WORLD_SIZE

__all__ = ["RunAlerts", "OnAlert", "MAX_ALERTS_PER_KIND", "MAX_ALERT_MESSAGE"]

#: Alerts of one kind listed in a run's header: the most recently raised.
MAX_ALERTS_PER_KIND = 100
#: Characters of one alert message (longer ones end with "…").
MAX_ALERT_MESSAGE = 512
#: (8.1) attempts whose per-kind rank counts are kept (the header lists as many attempts)
MAX_COUNTED_ATTEMPTS = 1000

#: ``on_alert(run, kind, rank, message, host, now)``: an alert raised live (webhooks, 3.1).
OnAlert = Callable[[str, str, Optional[int], str, Optional[str], float], None]
#: ``place(rank) -> (host, local_rank) | None``: where a rank runs (the run's topology).
Place = Callable[[int], Optional[Tuple[str, int]]]


def _mark(bitmaps: Dict[str, bytearray], kind: str, rank: int) -> bool:
    """Set ``rank``'s bit in ``kind``'s bitmap (grown as needed); True when it was not set
    yet. Ranks past any world size a run may have are left out (False)."""
    if not 0 <= rank < MAX_WORLD_SIZE:
        return False
    bits = bitmaps.get(kind)
    if bits is None:
        bits = bitmaps[kind] = bytearray()
    byte, bit = rank >> 3, 1 << (rank & 7)
    if byte >= len(bits):
        bits.extend(bytes(byte + 1 - len(bits)))
    if bits[byte] & bit:
        return False
    bits[byte] |= bit
    return True


class RunAlerts:
    """The alerts of one run, in first-raised order (a re-raise updates in place)."""

    __slots__ = ("_alerts", "on_alert", "_recent", "_raised", "version", "shape", "_ranks",
                 "_n_ranks", "attempt", "_att_bits", "_att_counts")

    def __init__(self) -> None:
        self._alerts: Dict[Tuple[str, Optional[int]], Dict[str, Any]] = {}
        #: Hook for alerts raised while live (the broker's webhooks); None: nobody.
        self.on_alert: OnAlert | None = None
        #: kind -> its listed keys, least recently raised first (the cap's order)
        self._recent: Dict[str, OrderedDict[Tuple[str, Optional[int]], None]] = {}
        #: kind -> alerts of that kind added to the list (a count, kept past the cap)
        self._raised: Dict[str, int] = {}
        #: bumped by every change to the list (the journal writes :meth:`state` when it moved)
        self.version = 0
        #: bumped by every change but an alert's time alone
        self.shape = 0
        #: kind -> a bitmap of the ranks that raised it (bit r of byte r >> 3), past the cap
        self._ranks: Dict[str, bytearray] = {}
        #: kind -> how many bits of its bitmap are set
        self._n_ranks: Dict[str, int] = {}
        #: (8.1, 8.5) the run's current attempt; per kind the ranks that raised it in this
        #: attempt (a bitmap, anew each attempt) and the distinct ranks of each attempt in
        #: which it was raised (attempt -> count; the header's ``alert_attempts``)
        self.attempt = 0
        self._att_bits: Dict[str, bytearray] = {}
        self._att_counts: Dict[str, Dict[int, int]] = {}

    def raise_(self, run: str, kind: str, rank: Optional[int], message: str, now: float,
               place: Place, notify: bool) -> None:
        """Raise (or re-raise) an alert; ``notify`` (the run is live and the alert is news)
        hands it to :attr:`on_alert` too: grouping and repeat suppression are the
        webhooks'."""
        if len(message) > MAX_ALERT_MESSAGE:
            message = message[:MAX_ALERT_MESSAGE - 1] + "…"
        self.version += 1
        key = (kind, rank)
        alert = self._alerts.get(key)
        recent = self._recent.get(kind)
        if recent is None:
            recent = self._recent[kind] = OrderedDict()
        p = place(rank) if rank is not None else None
        host = p[0] if p else None
        if rank is not None:
            self._count_rank(kind, rank)
            self._count_attempt(kind, rank)
        if alert is None:
            self.shape += 1
            self._alerts[key] = {"kind": kind, "rank": rank, "message": message, "at": now,
                                 "host": host}
            self._raised[kind] = self._raised.get(kind, 0) + 1
            recent[key] = None
            if len(recent) > MAX_ALERTS_PER_KIND:
                oldest, _ = recent.popitem(last=False)
                del self._alerts[oldest]
        else:
            if alert["message"] != message:
                self.shape += 1
                alert["message"] = message
            alert["at"] = now
            if alert.get("host") != host:
                self.shape += 1
                alert["host"] = host
            recent.move_to_end(key)
        if notify and self.on_alert is not None:
            self.on_alert(run, kind, rank, message, host, now)

    def _count_rank(self, kind: str, rank: int) -> None:
        """Note that ``rank`` raised ``kind`` (once per rank; ranks past any world size a
        run may have are left out: they are discarded when the world size is known)."""
        if _mark(self._ranks, kind, rank):
            self._n_ranks[kind] = self._n_ranks.get(kind, 0) + 1

    def _count_attempt(self, kind: str, rank: int) -> None:
        """Note that ``rank`` raised ``kind`` in the current attempt (8.5: a kind is judged
        in the attempt in which an alert was last raised)."""
        if _mark(self._att_bits, kind, rank):
            counts = self._att_counts.setdefault(kind, {})
            counts[self.attempt] = counts.get(self.attempt, 0) + 1
            if len(counts) > MAX_COUNTED_ATTEMPTS:  # (the oldest attempt's count goes)
                del counts[min(counts)]

    def new_attempt(self, attempt: int) -> None:
        """A new attempt (8.1): its ranks raise each kind afresh."""
        self.attempt = attempt
        self._att_bits = {}
        self.version += 1

    def raised_by_attempt(self) -> Dict[str, List[List[int]]]:
        """The header's ``alert_attempts`` (8.5 with 8.1): kind -> ``[[attempt, distinct
        ranks that raised it in that attempt], ...]``, attempts ascending."""
        return {kind: [[a, n] for a, n in sorted(counts.items())]
                for kind, counts in self._att_counts.items()}

    def ranks_raised(self) -> Dict[str, int]:
        """The header's ``alert_ranks`` (8.5): kind -> the distinct ranks that raised it,
        counted past the list's cap (kinds raised only run-wide are absent)."""
        return dict(self._n_ranks)

    def ranks_state(self) -> Dict[str, bytes]:
        """kind -> its ranks bitmap, for a journal that keeps the alert list across a
        restart: the count past the cap is not in the listed entries (8.5)."""
        return {kind: bytes(bits) for kind, bits in self._ranks.items()}

    def restore_ranks(self, state: Dict[str, bytes]) -> None:
        """Merge bitmaps from :meth:`ranks_state` (a restart): each rank counts once, whether
        it comes back from the journal, from a replayed frame, or both; a bitmap past
        ``MAX_WORLD_SIZE`` bits is cut there."""
        for kind, saved in state.items():
            saved = bytes(saved[:MAX_WORLD_SIZE >> 3])
            bits = self._ranks.get(kind)
            if bits is None:
                bits = self._ranks[kind] = bytearray()
            if len(bits) < len(saved):
                bits.extend(bytes(len(saved) - len(bits)))
            for i, byte in enumerate(saved):
                bits[i] |= byte
            self._n_ranks[kind] = sum(bin(b).count("1") for b in bits)

    def listed(self) -> List[Dict[str, Any]]:
        """The header's ``alerts``: copies, since event data leaves the sink."""
        out = [dict(a) for a in self._alerts.values()]
        for kind, recent in self._recent.items():
            raised = self._raised.get(kind, 0)
            if raised > len(recent):  # some left the list: say how many there were
                last = self._alerts[next(reversed(recent))]["at"] if recent else None
                out.append({"kind": kind, "rank": None, "at": last, "message":
                            f"{raised} {kind} alerts raised, the latest {len(recent)} listed",
                            "host": None})
        return out

    def forget_ranks_from(self, world_size: int) -> None:
        """Drop the alerts of ranks that turned out to be past the world size."""
        for key in [k for k in self._alerts if k[1] is not None and k[1] >= world_size]:
            del self._alerts[key]
            self._recent[key[0]].pop(key, None)
            self._raised[key[0]] -= 1
            self.version += 1
            self.shape += 1

        for kind, bits in self._ranks.items():
            keep = (world_size + 7) >> 3
            if world_size & 7 and keep <= len(bits):
                bits[keep - 1] &= (1 << (world_size & 7)) - 1
            del bits[keep:]
            self._n_ranks[kind] = sum(bin(b).count("1") for b in bits)

    def state(self) -> Dict[str, Any]:
        """The list as plain data (MessagePack-ready) for the journal: ``alerts`` as the
        listed dicts in listed (first-raised) order (every key, so a field added to alerts
        later is kept too), ``recent`` each kind's ranks least recently raised first (which
        one the cap drops next), ``raised`` each kind's count. :meth:`restore` takes it back."""
        return {
            "alerts": list(self._alerts.values()),
            "recent": {kind: [key[1] for key in recent] for kind, recent in self._recent.items()},
            "raised": dict(self._raised),
            "ranks": self.ranks_state(),  # the distinct ranks of each kind, past the cap
            # 8.1/8.5: the current attempt's ranks per kind, and each attempt's count
            "attempt": self.attempt,
            "att_bits": {kind: bytes(bits) for kind, bits in self._att_bits.items()},
            "att_counts": {kind: [[a, n] for a, n in counts.items()]
                           for kind, counts in self._att_counts.items()},
        }

    def restore(self, state: Dict[str, Any]) -> None:
        """Replace the list with one :meth:`state` wrote (after a restart: the same alerts,
        order, messages and times as before it). Raises ``ValueError``/``TypeError``/
        ``KeyError`` for data it cannot take, leaving the list as it was."""
        alerts: Dict[Tuple[str, Optional[int]], Dict[str, Any]] = {}
        for item in state["alerts"]:
            kind, rank, message, at = item["kind"], item["rank"], item["message"], item["at"]
            if not isinstance(kind, str) or not isinstance(message, str) or not (
                    rank is None or type(rank) is int) or not isinstance(at, (int, float)):
                raise ValueError("bad alert entry")
            alerts[(kind, rank)] = {**item, "at": float(at)}
        recent: Dict[str, OrderedDict[Tuple[str, Optional[int]], None]] = {}
        for kind, ranks in state["recent"].items():
            order: OrderedDict[Tuple[str, Optional[int]], None] = OrderedDict()
            for rank in ranks:
                if (kind, rank) in alerts:
                    order[(kind, rank)] = None
            recent[kind] = order
        for key in alerts:  # every listed alert is in its kind's cap order
            order = recent.setdefault(key[0], OrderedDict())
            if key not in order:
                order[key] = None
        raised = {str(k): int(v) for k, v in state["raised"].items()}
        for kind, order in recent.items():
            raised[kind] = max(raised.get(kind, 0), len(order))
        self._alerts, self._recent, self._raised = alerts, recent, raised
        if isinstance(state.get("ranks"), dict):  # absent in entries written before it
            self.restore_ranks({str(k): bytes(v) for k, v in state["ranks"].items()})
        if isinstance(state.get("att_counts"), dict) and state.get("attempt") == self.attempt:
            # (8.1: absent in entries written before it; a replay rebuilt the attempt first)
            self._att_counts = {str(k): {int(a): int(n) for a, n in v}
                                for k, v in state["att_counts"].items()}
            self._att_bits = {str(k): bytearray(bytes(v)[:MAX_WORLD_SIZE >> 3])
                              for k, v in (state.get("att_bits") or {}).items()}
        self.version += 1
        self.shape += 1

    def __len__(self) -> int:
        return len(self._alerts)
