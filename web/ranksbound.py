"""A run's SSE ``ranks`` event, bounded in bytes (issue 32, finding 5).

A ``ranks`` event carries every rank's entry, and each entry its latest resource sample: at
65,536 ranks with one GPU each the samples alone were ~47 MiB an event, with 8 GPUs ~260 MiB,
past the 64 MiB a client may queue (``web.runstate.MAX_QUEUED_BYTES``), so every viewer of
the run was dropped on each event. Hardware strings are bounded by
:func:`web.runstate.ranks_payload`; this module bounds the samples
(:meth:`SampleRotation.event`, one per run: ``RunState.samples_sent``).

While the event (hardware already bounded) encodes to at most :data:`RANKS_EVENT_BYTES` it
goes out as it always did, byte for byte. Past that the run's stream carries an entry's
``resources`` only when the sample differs from what the stream last carried for that rank,
and carries changed samples in rotation (the least recently carried first) up to a room of
samples bytes per event: what is left of :data:`RANKS_EVENT_BYTES` beside the entries
without samples (as the previous bounded event measured them), and never less than
:data:`RESOURCES_EVENT_BYTES`. An entry without the key keeps the sample the page has
(``web/static/store.js``); ``GET /api/runs/<run>`` always carries every sample.

Each sample is encoded once (its bytes give its size, a fingerprint to compare against the
one last carried, and, as :class:`msgspec.Raw`, the event's text), so the memory kept per
rank is two integers, not a second copy of its sample.
"""
from __future__ import annotations

from typing import Any

import msgspec

from web import sse

#: A ``ranks`` event that encodes to at most this many bytes goes out whole; past it the
#: samples are bounded, and the bounded event aims at this size.
RANKS_EVENT_BYTES = 12 * 1024 * 1024
#: The least room for samples in a bounded event (a run whose entries alone fill
#: :data:`RANKS_EVENT_BYTES` still refreshes this many bytes of samples an event).
RESOURCES_EVENT_BYTES = 2 * 1024 * 1024
#: A bounded run goes back to whole events once all its samples would fit in this share of
#: :data:`RANKS_EVENT_BYTES` (hysteresis: a run near the bound does not flip every event).
_UNBOUND_SHARE = 0.75
#: ``,"resources":`` beside a sample in an entry: what leaving one out saves.
_KEY_BYTES = len(b',"resources":')

_encode = msgspec.json.Encoder().encode  # the same output as web.sse's encoder


class SampleRotation:
    """What one run's stream last carried of each rank's sample, and its ``ranks`` events.

    ``carried``: rank -> (fingerprint of the sample's JSON, the event turn it was carried
    in); ``big``: the run's events are bounded now; ``base``: the bytes of the last bounded
    event without its samples.
    """

    __slots__ = ("carried", "big", "turn", "base")

    def __init__(self) -> None:
        self.carried: dict[Any, tuple[int, int]] = {}
        self.big = False
        self.turn = 0
        self.base = 0

    def bound(self, entries: list[Any], whole: int = 0) -> tuple[list[Any], int, int]:
        """``entries`` with the samples this event carries (the rest without the key), the
        bytes all their samples would take and the bytes of those carried. ``whole``: the
        bytes of this event unbounded, when it was encoded (the first bounded event: its
        entries without samples are measured from it)."""
        self.turn += 1
        turn = self.turn
        carried = self.carried
        kept: dict[Any, tuple[int, int]] = {}
        changed: list[tuple[int, int, bytes, int]] = []  # (turn carried, index, json, print)
        total = 0
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or "resources" not in entry:
                continue
            raw = _encode(entry["resources"])
            total += len(raw) + _KEY_BYTES
            fingerprint = hash(raw)
            rank = entry.get("rank")
            prev = carried.get(rank)
            if prev is not None:
                kept[rank] = prev
                if prev[0] == fingerprint:
                    continue
            changed.append((prev[1] if prev is not None else 0, i, raw, fingerprint))
        if whole:
            self.base = whole - total
        changed.sort(key=lambda c: (c[0], c[1]))  # least recently carried first, rank order
        room = start = max(RESOURCES_EVENT_BYTES, RANKS_EVENT_BYTES - self.base)
        carry: dict[int, bytes] = {}
        for _, i, raw, fingerprint in changed:
            size = len(raw) + _KEY_BYTES
            if size > room:
                continue
            room -= size
            carry[i] = raw
            kept[entries[i].get("rank")] = (fingerprint, turn)
        self.carried = kept
        out = []
        for i, entry in enumerate(entries):
            if isinstance(entry, dict) and "resources" in entry:
                raw_or_none = carry.get(i)
                if raw_or_none is None:
                    entry = {k: v for k, v in entry.items() if k != "resources"}
                else:  # the key where it was, its JSON as already encoded
                    res = msgspec.Raw(raw_or_none)
                    entry = {k: res if k == "resources" else v for k, v in entry.items()}
            out.append(entry)
        return out, total, start - room


    def event(self, payload: list[Any], seq: int) -> bytes:
        """The SSE ``ranks`` event of ``payload`` (the run's ranks, hardware already bounded:
        :meth:`web.runstate.RunState.ranks_event`) as of ``seq``, at most about
        :data:`RANKS_EVENT_BYTES` plus the hardware bound (module docstring)."""
        whole = 0
        if not self.big:
            data = sse.json_event("ranks", seq, payload)
            if len(data) <= RANKS_EVENT_BYTES:
                self.carried.clear()  # every event carries all: nothing to remember
                return data
            self.big, whole = True, len(data)
        bounded, total, carried_bytes = self.bound(payload, whole)
        data = sse.json_event("ranks", seq, bounded)
        self.base = len(data) - carried_bytes
        if self.base + total <= RANKS_EVENT_BYTES * _UNBOUND_SHARE:
            self.big = False  # the next event goes out whole again
        return data
