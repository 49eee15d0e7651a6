"""What the web holds of one run, and one SSE client of it.

:class:`RunState` keeps a run's header, ranks, epoch records, completion and closed steps
with the sequence number of each, and the SSE bytes of its records encoded once for every
replay; :class:`Subscriber` is one client's bounded queue. Both are plain data that
:class:`web.hub.Hub` mutates while it follows the feed; neither touches a socket.
"""
from __future__ import annotations

import math
import time
from typing import Any

import gevent
import gevent.queue

from broker.run.steps.eta import step_eta
from broker.run.steps.line import MAX_SUPERSEDED, EpochLine, StepLine
from broker.run.steps.store import StepStore
from web import sse
from web.ranksbound import SampleRotation
from web.resourcetimeline import ResourceTimeline

#: Sentinel the hub puts into a client's queue to end its stream.
_CLOSE = None
#: The most event bytes one SSE client may have queued (PROTOCOL 4, SECURITY.md): an item
#: that would take a client past it drops the client as slow. A count of events alone does
#: not bound memory: one ``ranks`` event of a 65,536-rank run is ~17 MB, and 256 of them
#: queued for a client that never reads pinned gigabytes (issue 19, finding 7). The bytes
#: are shared with every other client, so this bounds what one client can keep alive.
MAX_QUEUED_BYTES = 64 * 1024 * 1024


class Subscriber:
    """One SSE connection: a queue of ``(seq, sse_bytes)`` items bounded twice, by count
    (``maxsize`` events) and by bytes (``max_bytes`` of queued event bytes).

    The hub never blocks on a subscriber: a full queue means the client is too slow (or not
    reading at all), so it is dropped: its queue is replaced by the close sentinel, and the
    greenlet serving it (which may be stuck in a socket write to a client that never reads)
    is killed so the connection is released. :attr:`queued_bytes` counts the bytes of the
    items in the queue; the reader gives them back with :meth:`taken`.
    """

    __slots__ = ("run", "queue", "greenlet", "dropped", "closed", "queued_bytes", "max_bytes",
                 "full")

    def __init__(self, run: str, maxsize: int, max_bytes: int = MAX_QUEUED_BYTES) -> None:
        self.run = run
        self.queue: gevent.queue.Queue = gevent.queue.Queue(maxsize)
        #: the gevent greenlet serving this client, set by the app; killed on drop
        self.greenlet: gevent.Greenlet | None = None
        self.dropped = False
        self.closed = False
        #: bytes of the events now in the queue (taken out by the reader: :meth:`taken`)
        self.queued_bytes = 0
        self.max_bytes = max_bytes
        #: why the last :meth:`offer` failed: ``"queue_events"`` or ``"queue_bytes"``
        self.full = ""

    def offer(self, item: tuple[int, bytes]) -> bool:
        """Queue ``item`` without blocking; False (with :attr:`full` saying which bound)
        when it would take the queue past its count or its bytes."""
        size = len(item[1])
        if self.queued_bytes + size > self.max_bytes:
            self.full = "queue_bytes"
            return False
        try:
            self.queue.put_nowait(item)
        except gevent.queue.Full:
            self.full = "queue_events"
            return False
        self.queued_bytes += size
        return True

    def taken(self, item: tuple[int, bytes]) -> None:
        """The reader took ``item`` out of the queue: its bytes no longer count."""
        self.queued_bytes = max(0, self.queued_bytes - len(item[1]))

    def close(self) -> None:
        """End the stream: empty the queue and leave only the close sentinel."""
        if self.closed:
            return
        self.closed = True
        self.queued_bytes = 0
        while True:
            try:
                self.queue.get_nowait()
            except gevent.queue.Empty:
                break
        self.queue.put_nowait(_CLOSE)


class RunState:
    """What the web knows of one run, with the sequence number of each piece."""

    __slots__ = ("run", "seq", "header", "ranks", "ranks_seq", "ranks_full", "records",
                 "complete", "svg", "steps", "subscribers", "_record_bytes", "_header_event",
                 "hardware_sent", "samples_sent", "resources", "line", "epoch_line")

    def __init__(self, run: str) -> None:
        self.run = run
        #: the last sequence number applied
        self.seq = 0
        self.header: dict[str, Any] = {}
        #: the public ranks array (the feed's extra "loss" and "gpu_xids" stripped)
        self.ranks: list[dict[str, Any]] = []
        #: the sequence number the ranks array is as of (its ``ranks`` event's, or the
        #: snapshot's): the page orders the snapshot's ranks against its stream's by it
        self.ranks_seq = 0
        #: the feed's ranks array as received (with "loss" and "gpu_xids", for /metrics)
        self.ranks_full: list[dict[str, Any]] = []
        #: (seq, record) in ascending epoch order
        self.records: list[tuple[int, dict[str, Any]]] = []
        #: (seq, status) of the "complete" event while the run is ended
        self.complete: tuple[int, str] | None = None
        #: the model graph (only run snapshots carry it; a live header only says has_svg)
        self.svg: str | None = None
        #: closed steps, as published (``steps`` events; snapshots carry them columnar)
        self.steps = StepStore()
        #: (8.1) the attempts along the line of closed steps and the superseded records
        self.line = StepLine(self.steps)
        self.epoch_line = EpochLine()
        self.subscribers: set[Subscriber] = set()
        #: rank -> the hardware string this run's SSE stream last carried (big runs only:
        #: :func:`ranks_payload`)
        self.hardware_sent: dict[Any, str] = {}
        #: what this run's SSE stream last carried of each rank's sample (big runs only:
        #: :mod:`web.ranksbound`)
        self.samples_sent = SampleRotation()
        #: the cluster's resources over time, a point per ranks update at most every
        #: ``every`` seconds (:mod:`web.resourcetimeline`)
        self.resources = ResourceTimeline()
        #: seq -> the record's "epoch" event bytes, encoded once (replays reuse them)
        self._record_bytes: dict[int, bytes] = {}
        #: (id, closed steps, bytes) of the last replayed ``run`` header event: a burst of
        #: connecting clients (all at the same position) shares one encoding; reset with the
        #: header
        self._header_event: tuple[int, int, bytes] | None = None

    def public_header(self) -> dict[str, Any]:
        """The run header of PROTOCOL 4 with every key present, even before the broker's
        first ``run`` event (absent = null). ``steps_done``/``step_metrics`` are this web's
        own closed steps (the broker's header is only as fresh as its last ``run`` event):
        the no-gap, no-overlap rule of ``steps`` events is kept against them."""
        header: dict[str, Any] = {
            "run": self.run, "status": "waiting", "world_size": None, "total_epochs": None,
            "label": None, "shard": 0, "hash": None, "port": None, "metadata": None, "hardware": "",
            "has_svg": False, "hosts": [], "alerts": [], "started_at": None, "updated_at": None,
            "data_share": None, "data_stragglers": [],  # 7.1
            "collectives_last": None,  # 8.5
            "failure": None,  # 8.2
            "nonfinite": [], "nonfinite_more": 0, "replica_divergence": [],  # 8.3
            "attempt": 0, "attempts": [], "alert_attempts": {},  # 8.1
        }
        header.update(self.header)
        header["attempts"] = self._attempt_figures(header["attempts"])
        header["steps_done"] = self.steps.last_step
        header["step_metrics"] = self.line.metric_names()  # (8.1: superseded ones' too)
        # 8.5: against this web's own closed steps too, as steps_done (null when unknown)
        total = header.get("total_steps")
        header["total_steps"] = (total if isinstance(total, int) and not isinstance(total, bool)
                                 and total > 0 else None)
        header["eta_secs"] = step_eta(header["total_steps"], self.steps)
        return header

    def _attempt_figures(self, attempts: Any) -> Any:
        """The header's ``attempts`` with each entry's step and epoch figures from this web's
        own line, superseded records and epoch records (as ``steps_done``: the broker's
        header is only as fresh as its last ``run`` event, and steps and epochs close
        between two of them). Entries are copied, the broker's header left as it came."""
        if not isinstance(attempts, list) or not attempts:
            return attempts
        epochs: dict[int, list[int]] = {}
        superseded: dict[int, int] = {}
        for rec in [r for _, r in self.records] + self.epoch_line.superseded:
            a, e = rec.get("attempt", 0), rec.get("epoch")
            if isinstance(a, int) and isinstance(e, int):
                c = epochs.setdefault(a, [e, e])
                c[0], c[1] = min(c[0], e), max(c[1], e)
        for rec in self.epoch_line.superseded:
            a = rec.get("attempt", 0)
            superseded[a] = superseded.get(a, 0) + 1
        out = []
        for entry in attempts:
            if not isinstance(entry, dict) or not isinstance(entry.get("attempt"), int):
                out.append(entry)
                continue
            k = entry["attempt"]
            span = epochs.get(k)
            out.append({**entry, **self.line.figures(k),
                        "first_epoch": span[0] if span else None,
                        "last_epoch": span[1] if span else None,
                        "superseded_epochs": max(superseded.get(k, 0),
                                                 entry.get("superseded_epochs") or 0)})
        return out

    def record_event(self, seq: int, record: dict[str, Any]) -> bytes:
        data = self._record_bytes.get(seq)
        if data is None:
            data = self._record_bytes[seq] = sse.json_event("epoch", seq, record)
        return data

    def header_event(self, position: int) -> bytes:
        """The replay's ``run`` event (the public header with id ``position``), encoded once
        per header and position however many clients subscribe."""
        cached = self._header_event
        rows = self.steps.rows
        if cached is None or cached[0] != position or cached[1] != rows:
            cached = self._header_event = (position, rows, sse.json_event(
                "run", position, self.public_header()))
        return cached[2]

    def set_header(self, header: Any) -> None:
        self._header_event = None
        header = dict(header) if isinstance(header, dict) else {}
        svg = header.pop("svg", None)  # tolerated, never published: the header shape is exact
        if isinstance(svg, str) and svg:
            self.svg = svg
        self.header = header

    def ranks_event(self, seq: int) -> bytes:
        """The SSE ``ranks`` event of the ranks as of ``seq``, bounded in bytes: hardware
        (:func:`ranks_payload`) and samples (:mod:`web.ranksbound`)."""
        return self.samples_sent.event(ranks_payload(self.hardware_sent, self.ranks), seq)

    def set_ranks(self, ranks: Any, seq: int, now: float | None = None,
                  public: list[Any] | None = None) -> None:
        """The ranks as of ``seq``, received at ``now`` (default: the clock), which is when
        the cluster's resources point from their samples is (:mod:`web.resourcetimeline`).
        ``public``: :func:`public_ranks` of ``ranks`` when already made (off the loop)."""
        self.ranks_seq = seq
        self.ranks_full = ranks if isinstance(ranks, list) else []
        self.ranks = public_ranks(self.ranks_full) if public is None else public
        self.resources.add(time.time() if now is None else now, self.ranks_full)

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any]) -> RunState:
        """Build from a broker run snapshot (``RunSink.snapshot()``); KeyError/TypeError if malformed."""
        state = cls(str(snap["run"]))
        state.seq = int(snap["seq"])
        state.set_header(snap["header"])
        svg = snap.get("svg")
        if isinstance(svg, str) and svg:
            state.svg = svg
        state.set_ranks(snap.get("ranks") or [], state.seq)
        state.records = [(int(seq), rec) for seq, rec in snap.get("records") or []]
        complete = snap.get("complete")
        state.complete = (int(complete[0]), str(complete[1])) if complete else None
        steps = snap.get("steps")
        if steps:
            state.steps.extend_wire(steps)
        line = snap.get("line")  # 8.1 (absent from an older broker's snapshot)
        if isinstance(line, dict):
            state.line.load_wire(line)
        sup = snap.get("epochs_superseded")
        if isinstance(sup, list):
            state.epoch_line.superseded = [r for r in sup if isinstance(r, dict)]
        return state

    def steps_records(self, r0: int) -> list[dict[str, Any]]:
        """The line's closed step records from row ``r0`` on, each with its ``attempt``
        (8.1: SSE ``steps`` records carry it)."""
        records = self.steps.records(r0)
        for rec, att in zip(records, self.line.attempts_of(r0, self.steps.rows).tolist()):
            rec["attempt"] = att
        return records

    def add_epoch(self, seq: int, record: Any) -> None:
        """An ``epoch`` event: a record of a newer attempt at or below the last held epoch
        supersedes the held ones from its epoch on (8.1), then it is appended."""
        if isinstance(record, dict) and self.records:
            att, ep = record.get("attempt", 0), record.get("epoch")
            cut = len(self.records)
            while cut and isinstance(ep, int) and self.records[cut - 1][1].get("epoch", -1) >= ep \
                    and self.records[cut - 1][1].get("attempt", 0) < att:
                cut -= 1
            sup = self.epoch_line.superseded
            for s, rec in self.records[cut:]:
                sup.append(rec)
                self._record_bytes.pop(s, None)
            del self.records[cut:]
            if len(sup) > MAX_SUPERSEDED:  # (the oldest attempt's first, as the broker)
                sup.sort(key=lambda r: r.get("attempt", 0))
                del sup[: len(sup) - MAX_SUPERSEDED]
        self.records.append((seq, record))


#: Hardware characters in one SSE ``ranks`` event past which an entry carries its
#: ``hardware`` only when it changed (issue 32, finding 5: 20,480 ranks x 4 KB of hardware
#: made every ranks event ~80 MiB, past a client's queue, so every viewer was dropped).
HARDWARE_EVENT_CHARS = 1024 * 1024


def ranks_payload(sent: dict[Any, str], new: list[Any]) -> list[Any]:
    """The SSE ``ranks`` event's array: ``new`` as is while its hardware strings total at
    most :data:`HARDWARE_EVENT_CHARS`. Past that, an entry carries ``hardware`` only when it
    differs from what this run's stream last carried for the rank (``sent``, updated here),
    and changed strings go out at most :data:`HARDWARE_EVENT_CHARS` an event (the rest in
    the next events); an entry without the key keeps the hardware the page has
    (``web/static/store.js``); ``/api/runs/<run>`` always carries every string."""
    total = 0
    for entry in new:
        if isinstance(entry, dict):
            hw = entry.get("hardware")
            if isinstance(hw, str):
                total += len(hw)
    if total <= HARDWARE_EVENT_CHARS:
        sent.clear()  # every event carries all: nothing to remember
        return new
    room = HARDWARE_EVENT_CHARS
    out = []
    for entry in new:
        if isinstance(entry, dict) and "hardware" in entry:
            rank, hw = entry.get("rank"), entry.get("hardware")
            size = len(hw) if isinstance(hw, str) else 0
            if rank in sent and sent[rank] == hw or size > room:
                entry = {k: v for k, v in entry.items() if k != "hardware"}
            else:
                room -= size
                sent[rank] = hw  # type: ignore[assignment]
        out.append(entry)
    return out


#: Keys of a feed ranks entry that only ``/metrics`` reads (the last loss, the XID tallies).
FEED_ONLY_RANK_KEYS = frozenset(("loss", "gpu_xids"))


def public_rank(entry: Any) -> Any:
    """A feed ranks entry without the feed-only keys (PROTOCOL 4's shape is exact)."""
    if isinstance(entry, dict) and not FEED_ONLY_RANK_KEYS.isdisjoint(entry):
        return {k: v for k, v in entry.items() if k not in FEED_ONLY_RANK_KEYS}
    return entry


def public_ranks(ranks: list[Any]) -> list[Any]:
    """Every entry of a feed ranks array without the feed-only keys (:func:`public_rank`)."""
    return [public_rank(r) for r in ranks]


def finite(value: Any) -> float | None:
    """``value`` as a float if it is a finite number, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    f = float(value)
    return f if math.isfinite(f) else None

