"""Rebuilding a run from its journal entries: replay the frames into a fresh sink, restore
the closed-step blocks, and give the sink ids above any issued before the restart.

The sink is pure and deterministic, so the journal does not store state: it stores what the
sink was fed and replays it here. Ids cannot be recomputed (ticks are not replayed), so they
come from the SEQ_HI, RECORD_SEQ and COMPLETE_SEQ entries. What frames cannot rebuild
(PROTOCOL 8.5) comes from STATE entries (``broker/journal/statenotes.py``), the last of each
part: the alert list where it stands among the frames (the frames after it raise what they
raise, as they did live), the GPU rules' counters, ``collectives_last`` and the ranks' step
figures once every frame is replayed. A journal written before STATE entries existed
replays as it always did. This module does no file I/O:
``broker/journal/journal.py`` reads the file, decides what to do with a bad one, and writes.
"""
from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field
from typing import Iterable

import msgspec

from broker.coalesce import peek_metadata
from broker.journal.codec import (
    KIND_COMPLETE_SEQ,
    KIND_FRAME,
    KIND_RECORD_SEQ,
    KIND_SEQ_HI,
    KIND_STATE,
    KIND_STEPS,
    STATE_PARTS,
    block_decoder,
)
from broker.journal.noops import Unchanged
from broker.run.sink import Rejected, RunSink
from rank_agent import protocol

__all__ = ["Replayed", "replay"]

log = logging.getLogger("broker.journal.journal")


@dataclass
class Replayed:
    """A run rebuilt from its entries, and what the writer needs to carry on appending."""

    sink: RunSink
    frames: int  # FRAME entries read
    applied: int  # of which the sink accepted
    last_time: float | None  # receive time of the newest applied frame
    noted_records: int  # records whose id is in the journal (a prefix)
    noted_complete: int  # the completion id in the journal (0: none)
    unchanged: Unchanged  # what the file holds of the frames whose repeats are no-ops
    stacks_bytes: int = 0  # bytes of the ``stacks`` frames in the file (the journal's budget)
    #: indexes of the entries whose replay raised (not a sink's ``Rejected``): the journal
    #: sets their bytes aside, so the next start does not meet them again
    failed: list[int] = field(default_factory=list)


#: The id entries: kind -> where their u64 id starts in the payload.
_IDS = {KIND_SEQ_HI: 0, KIND_RECORD_SEQ: 4, KIND_COMPLETE_SEQ: 0}

#: Journaled ``metadata`` frames at least this large are looked at before the replay.
_LARGE_METADATA = 4096


def _superseded_metadata(entries: list[tuple[int, memoryview]]) -> dict[int, protocol.Metadata]:
    """Stand-ins for the large metadata frames that a later one replaced: entry index ->
    the same rank's frame carrying the *last* large blob's JSON (and, at the last one's own
    index, that frame as decoded here, so it is not decoded twice).

    Why: every journaled metadata frame was valid, and the last write wins, so parsing each
    replaced blob again rebuilt nothing that lasts, yet a run that received a flood of
    1 MiB blobs took milliseconds a blob to reload (a run evicted at ``--max-runs`` reloads
    on its next frame, on the broker's only thread: seconds of stalled ingest for every
    run). A stand-in keeps the frame's other effects (its rank seen, the run's first frame
    time) and parses nothing: the sink skips a blob equal to the one it holds, so the last
    blob is parsed once, where it first stands in (small metadata frames between them are
    replayed as they are, so the order of blobs the sink sees ends the same)."""
    large: list[tuple[int, str, int]] = []
    for i, (kind, payload) in enumerate(entries):
        if kind == KIND_FRAME and len(payload) >= 8 + _LARGE_METADATA:
            head = peek_metadata(payload[8:])
            if head is not None:
                large.append((i, head[0], head[1]))
    if len(large) < 2:
        return {}
    last = large[-1][0]
    try:
        final = protocol.decode(bytes(entries[last][1][8:]))
    except Exception:  # the replay loop reports a frame it cannot decode
        return {}
    if not isinstance(final, protocol.Metadata):
        return {}
    stand_ins = {i: protocol.Metadata(run=run, rank=rank, json=final.json)
                 for i, run, rank in large[:-1] if rank >= 0}
    stand_ins[last] = final  # decoded once here: the replay takes it as it is
    return stand_ins


def _last_state(entries: list[tuple[int, memoryview]]) -> dict[str, int]:
    """part -> the index of its last STATE entry (the only one of each that is read)."""
    last: dict[str, int] = {}
    for i, (kind, payload) in enumerate(entries):
        if kind == KIND_STATE and len(payload):
            part = STATE_PARTS.get(payload[0])
            if part is not None:
                last[part] = i
    return last


def _restore(sink: RunSink, part: str, payload: memoryview, path: str) -> None:
    """Give the sink one STATE part; a part it cannot take is logged and skipped (the run
    keeps what its frames rebuilt)."""
    try:
        sink.restore_state(part, _state_decoder.decode(payload[1:]))
    except Exception as exc:  # replay is total (issue 38): a part costs only itself
        log.warning("journal: %s: the run's %s cannot be restored (%s: %s); keeping what "
                    "its frames rebuild", path, part, type(exc).__name__, exc)


_state_decoder = msgspec.msgpack.Decoder()


def replay(run: str, path: str, entries: Iterable[tuple[int, memoryview]], *,
           stale_after: float, step_close_after: float, now: float | None) -> Replayed:
    """Feed ``entries`` to a fresh sink and number it: ``sink.seq`` ends above every id
    issued before (records and completion keep theirs where the journal has them). ``path``
    is for log lines only. Never raises for a bad entry (logged once per kind of trouble).

    Total: any exception applying one entry (an undecodable frame, a sink bug a frame
    accepted live reaches only at replay, a block of closed steps that does not restore, a
    short id entry) costs that entry only; its index is in :attr:`Replayed.failed`. Issue
    38: one ``steps`` frame whose data wait overflowed a percentage made the restore of its
    closed steps raise, and the broker never started again."""
    sink = RunSink(run, stale_after=stale_after, step_close_after=step_close_after)
    step_failures = 0
    seq_hi = 0
    record_seqs: dict[int, int] = {}
    complete_seq = 0
    last_time: float | None = None
    frames = applied = failures = 0
    failed: list[int] = []
    unchanged = Unchanged()
    stacks_bytes = 0
    entries = list(entries)
    superseded = _superseded_metadata(entries)
    last_state = _last_state(entries)  # part -> index of its last STATE entry
    at_end: list[tuple[str, int]] = []
    sink.replaying = True
    for i, (kind, payload) in enumerate(entries):
        if kind == KIND_FRAME:
            frames += 1
            try:
                (t,) = struct.unpack_from("<d", payload)
                stand_in = superseded.get(i) if superseded else None
                frame = stand_in if stand_in is not None else protocol.decode(bytes(payload[8:]))
                if type(frame) is protocol.Stacks or type(frame) is protocol.Collectives:
                    stacks_bytes += len(payload) - 8
                sink.apply(frame, t)
                applied += 1
                unchanged.keep(frame, True)
            except Rejected:
                pass  # accepted then, rejected now: the sink's rules changed; skip it
            except Exception as exc:  # undecodable or a sink bug: never fatal at start
                if not failures:
                    log.warning("journal: %s: replaying a frame failed (%s: %s); "
                                "skipping such frames", path, type(exc).__name__, exc)
                failures += 1
                failed.append(i)
                continue
            last_time = t if last_time is None else max(last_time, t)
        elif kind in _IDS:
            try:
                (seq,) = struct.unpack_from("<Q", payload, _IDS[kind])
                if kind == KIND_SEQ_HI:
                    seq_hi = max(seq_hi, seq)
                elif kind == KIND_RECORD_SEQ:
                    record_seqs[struct.unpack_from("<I", payload)[0]] = seq
                else:
                    complete_seq = seq
            except struct.error as exc:  # shorter than its kind (a CRC-good foreign entry)
                log.warning("journal: %s: an id entry of kind %d cannot be read (%s); "
                            "skipping it", path, kind, exc)
                failed.append(i)
        elif kind == KIND_STATE:
            part = STATE_PARTS.get(payload[0]) if len(payload) else None
            if part is not None and last_state.get(part) == i:
                if part == "alerts":  # where it stands: later frames raise on top of it
                    _restore(sink, part, payload, path)
                else:
                    at_end.append((part, i))
        elif kind == KIND_STEPS:
            try:
                sink.restore_steps(block_decoder.decode(payload))
            except (ValueError, KeyError, TypeError, msgspec.DecodeError) as exc:
                if not step_failures:
                    log.warning("journal: %s: a block of closed steps cannot be restored "
                                "(%s); skipping such blocks", path, exc)
                step_failures += 1
            except Exception as exc:  # a sink bug the block reaches: never fatal at start
                if not step_failures:
                    log.warning("journal: %s: restoring a block of closed steps failed (%s: "
                                "%s); skipping such blocks", path, type(exc).__name__, exc)
                step_failures += 1
                failed.append(i)
        # other kinds: written by a newer minor version; nothing to do with them
    if failures > 1:
        log.warning("journal: %s: %d frames could not be replayed", path, failures)
    if "collectives_last" not in last_state and last_time is not None:
        try:  # (an earlier version's journal: no STATE entries)
            sink.settle_verdict(last_time)
        except Exception as exc:  # replay is total: the verdict is then formed live
            log.warning("journal: %s: settling the collective verdict failed (%s: %s)",
                        path, type(exc).__name__, exc)
    sink.replaying = False
    for part, i in at_end:
        _restore(sink, part, entries[i][1], path)

    # Ids after the restart start above everything issued before it.
    base = max(sink.seq, seq_hi, complete_seq, max(record_seqs.values(), default=0))
    seqs: list[int] = []
    known = 0  # records whose id is in the journal (a prefix)
    prev = 0
    for i in range(len(sink.records)):
        seq = record_seqs.get(i)
        if seq is None or seq <= prev or known < i:
            # Unknown (its note was lost with a torn tail): a fresh id above all before.
            base += 1
            seq = base
        else:
            known += 1
        seqs.append(seq)
        prev = seq
    sink.record_seqs[:] = seqs
    noted_complete = 0
    if sink.complete is not None:
        if complete_seq > prev:
            cseq = noted_complete = complete_seq
        else:
            base += 1
            cseq = base
        sink.complete = (cseq, sink.complete[1])
    sink.seq = base
    if now is not None:
        sink.liveness_floor = now
    # dumps are kept, but a rank is stalled only by a dump received since (section 2)
    sink.forget_stalls()
    return Replayed(sink, frames, applied, last_time, known, noted_complete, unchanged,
                    stacks_bytes, failed)
