"""Coalescing of large last-write-wins frames within one ingest batch (pure, no sockets).

Why: ZeroMQ's PULL socket hands the broker one message from each connected sender in turn,
whatever a message costs to apply. A sender flooding valid 4 MiB ``metadata`` frames (1 MiB
of JSON each: milliseconds of parsing apiece) therefore got one frame applied for every
frame of every honest run, and a 64-rank run's burst of a few hundred small frames waited
a parse per frame (issue 19: the honest run's epochs 1-20 s late in the hostile soak).
Receiving is cheap; applying is not. So a batch takes such frames aside instead of
applying them as they come, keeps only the newest of each run (``metadata`` is **last write
wins**, PROTOCOL 2: the whole blob is replaced, so a blob replaced before it was applied
can change nothing), and applies what is left after the batch's other frames.

Only ``metadata`` qualifies: ``svg`` latches on first arrival (its later frames are already
dropped cheaply by the sink), ``hardware`` frames are small, and ``stacks``/``steps``
frames carry state that a later frame does not replace whole.

What a reader may notice: a superseded frame is never parsed, so it is counted as
``metadata_superseded`` (not applied; docs/PROTOCOL.md reject reasons) rather than as
accepted or as ``bad_metadata_json``; and a taken-aside frame is applied after the small
frames of its batch, so its ``run`` event follows theirs. The end state is the one of
applying every frame in order, except when the newest blob of a batch is malformed: then
the run keeps the blob it had before the batch (the superseded ones were never checked).
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple, Union

import msgspec

__all__ = ["COALESCE_MIN_BYTES", "Coalescer", "HeldSamples", "peek_metadata", "peek_metadata_run"]

#: What a received message may be: bytes, or a zero-copy buffer of one (ingest.py).
Buffer = Union[bytes, memoryview]

#: Messages this large or larger are looked at for coalescing; smaller ones are applied as
#: they arrive (a peek costs ~1 us, their apply not much more). 64 KiB: an honest run's
#: metadata (hyperparameters) is a few KiB, so it takes the ordinary path.
COALESCE_MIN_BYTES = 64 * 1024


class _Peek(msgspec.Struct, gc=False):
    """The two keys a coalescing decision needs; every other key is skipped unread (a
    msgspec Struct skips unknown fields without building them, so a 4 MiB frame costs a
    few microseconds here)."""

    type: str = ""
    run: str = ""
    rank: int = -1


_peek = msgspec.msgpack.Decoder(_Peek).decode


def peek_metadata(raw: Buffer) -> Tuple[str, int] | None:
    """``(run, rank)`` of ``raw`` when it is a ``metadata`` frame, else None (not metadata,
    or not even a map with string ``type`` and ``run``: the ordinary path rejects and
    counts it). The journal's replay uses it too (:mod:`broker.journal.replay`)."""
    try:
        head = _peek(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    if head.type != "metadata" or not head.run:
        return None
    return head.run, head.rank


def peek_metadata_run(raw: Buffer) -> str | None:
    """The run of ``raw`` when it is a ``metadata`` frame, else None."""
    got = peek_metadata(raw)
    return None if got is None else got[0]


class Coalescer:
    """One batch's taken-aside ``metadata`` frames, newest per run, in arrival order.

    A frame under COALESCE_MIN_BYTES is taken only to replace one of its run already aside
    (else that older, larger blob would be applied after it and win); other small frames,
    metadata of other runs included, are applied as they come and checked as usual.

    ``offer(raw)`` -> ``(taken, freed)``: ``taken`` when the frame was kept aside (the caller
    must not apply it now), ``freed`` the byte size of the frame it superseded (0 if none),
    which the caller's byte budget gets back. ``take()`` returns the kept frames (oldest
    first) and empties the batch; ``superseded`` counts frames dropped unapplied since the
    last ``take``'s caller read it (the ingest loop, :mod:`broker.ingest`, hands the count to
    :class:`broker.runs.Runs`).
    """

    __slots__ = ("held", "superseded")

    def __init__(self) -> None:
        #: run -> its newest frame aside; read-only outside, where the ingest loop tests "is
        #: anything aside?" per message by this dict's truth (a C slot; ``len(self)`` would
        #: be a Python call per message)
        self.held: Dict[str, Buffer] = {}
        self.superseded = 0

    def __len__(self) -> int:
        return len(self.held)

    def offer(self, raw: Buffer) -> Tuple[bool, int]:
        run = peek_metadata_run(raw)
        if run is None:
            return False, 0
        if len(raw) < COALESCE_MIN_BYTES and run not in self.held:
            return False, 0  # small, and nothing of its run aside: the ordinary path
        old = self.held.pop(run, None)  # popped: the newest goes to the end (arrival order)
        self.held[run] = raw
        if old is None:
            return True, 0
        self.superseded += 1
        return True, len(old)

    def take(self) -> List[Buffer]:
        kept = list(self.held.values())
        self.held.clear()
        return kept


class HeldSamples:
    """One batch's newest ``resources`` frame of each (run, rank), decoded, held back from
    the sink until the batch ends or another frame of the run arrives (issue 17).

    Why: under load a batch (up to 1,000 messages) holds several samples of each rank of a
    sampler-heavy run, and applying each one through the sink and the journal cost ~3 us
    beyond its decode, where only the newest is state: a rank's sample is last write wins,
    every frame of a batch is received at the same ``now`` (so the rank's ``last_seen`` and
    the run's ``updated_at`` end the same), and the journal itself keeps only the newest
    sample of each rank until another frame of the run is written. What an older sample
    still does is kept with it: every held frame, the replaced ones too, stays listed in
    arrival order until its run's samples are applied, and then feeds the GPU alert rules
    (which compare each sample with the one before, and must see every XID), all of the
    run's in one call, before the newest are applied. Alerts are raised in arrival order
    within the run, at the batch's time, as without holding (issue 17: fed one by one as
    they arrived, the two calls a sample cost ~1.1 k of a frame's ~24 k instructions).
    Each frame is counted as accepted as it arrives. Holding the replaced frames until the
    batch's end is bounded by the batch itself (the ingest loop's ``batch_limit`` messages and
    ``INGEST_BATCH_BYTES``), as holding the newest of each rank already was. Every frame is
    decoded and validated as it arrives, and a rank out of the run's range is never held (it
    is rejected as before), so nothing is lost unchecked.

    Order is kept where it can show: a frame of the run that is not a ``resources`` frame
    (a ``metrics`` frame's own sample, a ``register`` that changes the world size) releases
    the run's held samples first, and a frame naming a run not in memory releases every
    run's (it may evict one). A randomized test holds the end state (header, alerts, ranks,
    records, sequence numbers, counters) equal to applying every frame in order. What
    remains: a rank's newest sample reaches the journal when it is applied, after the
    batch's frames of other runs, which no state depends on (each run has its own file).
    """

    __slots__ = ("runs", "replaced")

    def __init__(self) -> None:
        #: run -> (rank -> (frame, raw), newest last; every frame held, as they arrived).
        #: :meth:`broker.runs.Runs.ingest` puts frames in itself (popping a rank's older
        #: frame first, so the newest goes last, and counting it in ``replaced``): it is the
        #: per-frame path of a sampler flood
        self.runs: Dict[str, Tuple[Dict[int, Tuple[Any, Buffer]], List[Any]]] = {}
        #: frames replaced by a newer one of their rank before the sink saw them
        self.replaced = 0

    def __bool__(self) -> bool:
        return bool(self.runs)

    def take(self, run: str) -> Tuple[List[Tuple[Any, Buffer]], List[Any]]:
        """The newest held frame of each rank of ``run`` (oldest first) and every frame
        held for it as they arrived, no longer held."""
        entry = self.runs.pop(run, None)
        return (list(entry[0].values()), entry[1]) if entry else ([], [])

    def take_all(self) -> Iterator[Tuple[str, List[Tuple[Any, Buffer]], List[Any]]]:
        """:meth:`take` of every run, run by run in the order their runs were first held."""
        runs, self.runs = self.runs, {}
        for run, (ranks, arrived) in runs.items():
            yield run, list(ranks.values()), arrived
