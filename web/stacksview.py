"""The web's copy of a run's stack dumps, and the ``GET /api/runs/<run>/stacks`` answer
(PROTOCOL.md sections 2.5 and 4).

The broker publishes dumps as ``stacks`` feed events (``{"dumps": [wire items], "gone":
[[rank, reason]]}``, at most 4 a second per run) and carries them in run snapshots
(``"stacks": [wire items]``); the wire form is :mod:`broker.stacks.store`'s, and so is the
store: thread blobs interned across ranks, the broker's byte cap, so the web holds what the
broker holds in about the same bytes. :class:`RunDumps` adds what ``GET /stacks`` needs:

* **which ranks are stalled now**: the latest ``ranks`` array says so, and a rank whose
  ``stall`` dump came in an event numbered after that array is stalled too (the broker's
  ``ranks`` events are rate-limited to one a second, so without this a page reading
  ``/stacks`` on the SSE ``stacks`` event could find its group missing);
* **the run's latest request**: the newest request this web sent for the run
  (:meth:`RunDumps.note_request`), or else the request id of the newest answer received, so
  another web's request is grouped too;
* the answer itself, :meth:`RunDumps.view`, grouped by :func:`broker.stacks.groups.stack_groups`.
  Blobs are decoded once per answer and let go with it (what is held is the store's bytes).
  The answer is built off the loop (gevent's thread pool) from the dumps' wire tuples, and
  its JSON is cached
  (:meth:`RunDumps.view_json`) until the dumps, the ranks array or the latest request change:
  six tabs reading ``/stacks`` once a second took the web to 86 % CPU (issue 32); the cached
  bytes are charged to the process's byte budget (:mod:`broker.budget`) like the dumps.

Pure: no sockets, no clock.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Hashable, Iterable, List, Optional

import msgspec

from broker.stacks.groups import stack_groups
from broker.stacks.store import RunStacks, Wire
from web.collectivesview import RunCollectiveView

__all__ = ["RunDumps", "summary"]

log = logging.getLogger(__name__)

_decode = msgspec.msgpack.Decoder().decode


def summary(item: Wire) -> Dict[str, Any]:
    """A dump's entry in an SSE ``stacks`` event (section 4)."""
    return {"rank": item[0], "reason": item[1], "request_id": item[2], "taken_at": item[3]}


class RunDumps:
    """One run's dumps as the web keeps them (module docstring)."""

    def __init__(self) -> None:
        self.store = RunStacks()
        # rank -> seq of the event that brought its latest stall dump
        self._stall_seq: Dict[int, int] = {}
        self._requested: Optional[str] = None  # the latest request this web sent
        self._answered: Optional[tuple[float, str]] = None  # (taken_at, id) newest answer
        #: the run's ``collectives`` frames and verdict (section 7.2), from the same events
        self.collectives = RunCollectiveView(self.store.budget)
        #: (key, JSON) of the last ``GET /stacks`` answer (:meth:`view_json`)
        self._json: Optional[tuple[Any, bytes]] = None

    def view_json(self, ranks: List[Dict[str, Any]], ranks_seq: int,
                  encode: Callable[[Any], bytes],
                  offload: Callable[..., Any] = lambda fn, *a: fn(*a)) -> bytes:
        """:meth:`view` encoded by ``encode``, built once per state of the dumps, the ranks
        array and the latest request (then served from the cache, charged to the budget).
        The build runs in ``offload`` (the web: gevent's thread pool, issue 38 item 2) over
        what is taken here: the kept dumps' wire tuples and the ranks array, neither ever
        changed in place, so the loop may change the store meanwhile."""
        key = (self.store.version, ranks_seq, self.latest_request)
        cached = self._json
        if cached is not None and cached[0] == key:
            return cached[1]
        self._drop_json()
        items = list(self.store.wire())
        data = offload(_view_json, items, ranks, self.stalled(ranks, ranks_seq), key[2], encode)
        if self._json is not None:  # another reader's build finished first: keep the newest
            self._drop_json()
        self._json = (key, data)
        before = self.store.version
        self.store.budget.charge(self, "view", len(data))
        if before == key[0] and self.store.version != before and self._json is not None:
            # the charge dropped some of this run's oldest dumps to fit: the answer keeps
            # them until the next change, rather than being rebuilt (and charged) each read.
            # Only then: a dump that arrived while the build ran (``before`` is already
            # newer than ``key``) is not in ``data``, which must not pass for the newer state
            self._json = ((self.store.version, *key[1:]), data)
        return data

    def _drop_json(self) -> None:
        if self._json is not None:
            size = len(self._json[1])
            self._json = None
            self.store.budget.forget(self, "view")
            self.store.budget.adjust(-size)

    def evict(self, key: Hashable) -> None:
        """The process's byte budget is full and the cached answer is its oldest item."""
        self._drop_json()

    def close(self) -> None:
        """The run left this web: every byte goes back to the budget."""
        self._drop_json()
        self.store.close()
        self.collectives.close()

    @classmethod
    def from_snapshot(cls, items: Any, collectives: Any = None,
                      prepared: Any = None) -> RunDumps:
        """The dumps of a run snapshot (``items``: its ``stacks``; malformed ones skipped),
        and its ``collectives`` (or what :meth:`RunCollectiveView.prepare_snapshot` made of
        them, off the loop: ``prepared``)."""
        dumps = cls()
        dumps._apply(items if isinstance(items, list) else [], 0)
        dumps.collectives = (
            RunCollectiveView.from_snapshot(collectives, dumps.store.budget) if prepared is None
            else RunCollectiveView.from_prepared(prepared, dumps.store.budget))
        return dumps

    def apply_event(self, seq: int, data: Any) -> List[Dict[str, Any]]:
        """A ``stacks`` feed event; returns the SSE event's ``dumps`` entries."""
        if not isinstance(data, dict):
            return []
        items = data.get("dumps") or []
        # every key the event replaces goes first, so the store never passes the cap on the
        # way to the broker's state (which fits it)
        for item in items if isinstance(items, list) else ():
            if isinstance(item, (list, tuple)) and len(item) > 2:
                try:
                    self.store.remove((int(item[0]), str(item[1])))
                except (TypeError, ValueError):
                    continue
        for key in data.get("gone") or ():
            try:
                rank, reason = key
                self.store.remove((int(rank), str(reason)))
                if reason == "stall":
                    self._stall_seq.pop(int(rank), None)
            except (TypeError, ValueError):
                continue
        return self._apply(items if isinstance(items, list) else [], seq)

    def _apply(self, items: Iterable[Any], seq: int) -> List[Dict[str, Any]]:
        out = []
        for item in items:
            try:
                kept = self.store.put_wire(item)
            except ValueError:
                log.warning("malformed stacks dump skipped")
                continue
            if not kept:
                continue
            if item[1] == "stall":
                self._stall_seq[item[0]] = seq
            else:
                answered = self._answered
                if answered is None or item[3] >= answered[0]:
                    self._answered = (item[3], item[2])
            out.append(summary(item))
        return out

    def note_request(self, request_id: str) -> None:
        """This web sent ``request_id``: it is the run's latest request from now on."""
        self._requested = request_id
        self._answered = None

    @property
    def latest_request(self) -> Optional[str]:
        if self._answered is not None:
            return self._answered[1]
        return self._requested

    def stalled(self, ranks: List[Dict[str, Any]], ranks_seq: int) -> set[int]:
        """The ranks stalled now (module docstring); ``ranks_seq``: the sequence number the
        ranks array is as of (:attr:`web.runstate.RunState.ranks_seq`)."""
        now = {r.get("rank") for r in ranks if r.get("status") == "stalled"}
        now.update(rank for rank, seq in self._stall_seq.items() if seq > ranks_seq)
        return {r for r in now if isinstance(r, int)}

    def view(self, ranks: List[Dict[str, Any]], ranks_seq: int) -> Dict[str, Any]:
        """The ``GET /stacks`` JSON: every kept dump by rank then reason, with its host
        (from ``ranks``, the run's ranks array as of ``ranks_seq``), and the groups of
        section 2.5."""
        return _view(list(self.store.wire()), ranks, self.stalled(ranks, ranks_seq),
                     self.latest_request)


def _dict(item: Wire, host: Any, decoded: Dict[bytes, Any]) -> Dict[str, Any]:
    threads = []
    for blob in item[7]:
        thread = decoded.get(blob)
        if thread is None:
            thread = decoded[blob] = _decode(blob)
        threads.append(thread)
    return {"rank": item[0], "host": host, "reason": item[1], "request_id": item[2],
            "taken_at": item[3], "idle_s": item[4], "threads": threads,
            "profile": _decode(item[8]) if item[8] else [], "samples": item[5],
            "seconds": item[6]}


def _view(items: List[Wire], ranks: List[Dict[str, Any]], stalled: set[int],
          latest: Optional[str]) -> Dict[str, Any]:
    """:meth:`RunDumps.view` of the dumps ``items``. Each distinct thread blob is decoded
    once for this answer and let go with it (issue 38, item 3: a cache of decoded blobs
    kept beside the store held several times the bytes the budget was charged for them)."""
    hosts = {r.get("rank"): r.get("host") for r in ranks}
    decoded: Dict[bytes, Any] = {}
    dumps = [_dict(item, hosts.get(item[0]), decoded) for item in items]
    stall = {d["rank"]: d for d in dumps if d["reason"] == "stall"}
    answers = {d["rank"]: d for d in dumps if d["reason"] == "request"}
    return {"dumps": dumps, "groups": stack_groups(stall, stalled, answers, latest)}


def _view_json(items: List[Wire], ranks: List[Dict[str, Any]], stalled: set[int],
               latest: Optional[str], encode: Callable[[Any], bytes]) -> bytes:
    return encode(_view(items, ranks, stalled, latest))
