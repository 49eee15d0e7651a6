"""The journal's file format: entries, their kinds, and splitting a file's bytes into them.

A journal file is :data:`HEADER`, then entries. An entry is ``<u32 length><u32
crc32(body)><body>`` (little endian), ``body = <u8 kind> payload``; ``kind`` is one of:

====  ===============  ====================================================================
 1    FRAME            ``<f64 receive time>`` + the frame's MessagePack bytes
 2    SEQ_HI           ``<u64 seq_hi>``: every id issued so far (and until the next one) <= it
 3    RECORD_SEQ       ``<u32 index><u64 seq>``: ``sink.record_seqs[index]``
 4    COMPLETE_SEQ     ``<u64 seq>``: seq of the run's ``complete`` event (0: reopened)
 5    STEPS            MessagePack of a :meth:`StepStore.to_wire` block: published closed steps
 6    STATE            ``<u8 part>`` + MessagePack: state a replay of frames cannot rebuild
                     (PROTOCOL 8.5), the part's latest whole value; parts in :data:`STATE_PARTS`
====  ===============  ====================================================================

Unknown kinds with a good CRC are skipped by readers (room for additions without a version
bump). :func:`scan_entries` also reads past damage in the middle of a file (PROTOCOL 6): a
bad entry followed by good ones costs only the bad bytes. It finds the next good entry by
looking, byte by byte, for a plausible entry head (a known kind, a length that fits it) whose
CRC matches; a torn tail (no good entry after the damage) ends the scan as before. This module is pure: bytes in, bytes out, no files (``broker/journal/journal.py`` owns them).
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

import msgspec
import numpy as np

__all__ = ["FORMAT_VERSION", "HEADER", "MAX_ENTRY", "Scan", "read_entries", "scan_entries"]

#: Bumped on any change a v1 reader could not follow.
FORMAT_VERSION = 1
VERSION_TEXT = b"rankboard-journal %d\n" % FORMAT_VERSION
VERSION_PREFIX = b"rankboard-journal "
#: First bytes of every journal file (self-describing even when copied out of its dir).
HEADER = b"rankboard journal v1\n"
HEADER_PREFIX = b"rankboard journal v"

KIND_FRAME = 1
KIND_SEQ_HI = 2
KIND_RECORD_SEQ = 3
KIND_COMPLETE_SEQ = 4
KIND_STEPS = 5
KIND_STATE = 6
#: The parts a STATE entry may hold, by their byte (``broker/journal/statenotes.py``): the
#: alert list, the GPU rules' counters, ``collectives_last``, the ranks' step figures.
STATE_PARTS = {1: "alerts", 2: "gpu", 3: "collectives_last", 4: "figures"}
STATE_PART_BYTES = {name: code for code, name in STATE_PARTS.items()}

#: Bytes of step blocks per journal entry at most (an entry is at most MAX_ENTRY).
STEP_BLOCK_BYTES = 2 * 1024 * 1024
block_encoder = msgspec.msgpack.Encoder()
block_decoder = msgspec.msgpack.Decoder(dict)

ENTRY_HEAD = struct.Struct("<II")  # length of body, crc32 of body
FRAME_HEAD = struct.Struct("<Bd")  # kind, receive time
SEQ = struct.Struct("<BQ")
RECORD_SEQ = struct.Struct("<BIQ")
#: Largest body a reader accepts: what the u32 length can say. A frame is at most 4 MiB, but
#: a STEPS block of one row is not bounded by it (64 names per rank, each rank its own: a
#: 1,700-rank step is 5 MB, and a row cannot be split); a bad length is caught as a short
#: entry or by the CRC anyway.
MAX_ENTRY = 2**32 - 1


def entry(body_head: bytes, payload: bytes = b"") -> bytes:
    """One whole entry: its length and CRC, then ``body_head`` + ``payload``."""
    crc = zlib.crc32(payload, zlib.crc32(body_head)) if payload else zlib.crc32(body_head)
    return ENTRY_HEAD.pack(len(body_head) + len(payload), crc) + body_head + payload


def append_frame(buf: bytearray, t: float, raw: bytes) -> None:
    """Append a FRAME entry to ``buf`` (as :func:`entry` would, without first copying the
    frame's bytes into a temporary)."""
    head = FRAME_HEAD.pack(KIND_FRAME, t)
    buf += ENTRY_HEAD.pack(len(head) + len(raw), zlib.crc32(raw, zlib.crc32(head)))
    buf += head
    buf += raw


def read_entries(data: bytes) -> tuple[list[tuple[int, memoryview]], int, str | None]:
    """Split a journal file's bytes (after the header) into ``(kind, payload)`` entries.

    Returns the entries, the byte offset just past the last good one, and why reading
    stopped early (None when every byte was consumed).
    """
    view = memoryview(data)
    entries: list[tuple[int, memoryview]] = []
    pos, end = 0, len(view)
    head = ENTRY_HEAD.size
    while pos < end:
        if end - pos < head:
            return entries, pos, "truncated entry header"
        length, crc = ENTRY_HEAD.unpack_from(view, pos)
        if length < 1 or length > MAX_ENTRY:
            return entries, pos, f"bad entry length {length}"
        if end - pos - head < length:
            return entries, pos, f"truncated entry ({end - pos - head} of {length} bytes)"
        body = view[pos + head:pos + head + length]
        if zlib.crc32(body) != crc:
            return entries, pos, "checksum mismatch"
        entries.append((body[0], body[1:]))
        pos += head + length
    return entries, pos, None


#: Where a scan looks for the next good entry after damage, how many bytes it examines at a
#: time (numpy filters each window's candidate heads; only candidates pay a CRC).
_RESYNC_WINDOW = 1 << 20
#: A candidate entry after damage is believed only if its body is at most this long: every
#: FRAME is (4 MiB frames) and STEPS blocks are cut at 2 MiB unless one row is larger; an
#: oversized STEPS block right after damage is lost with it. Bounds the CRC work per
#: candidate, so a scan through garbage costs about its length, not its square.
RESYNC_MAX_BODY = 8 * 1024 * 1024
#: body length of the fixed-size kinds
_FIXED = {KIND_SEQ_HI: SEQ.size, KIND_RECORD_SEQ: RECORD_SEQ.size, KIND_COMPLETE_SEQ: SEQ.size}
_MSGPACK_MAPS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}  # first byte of a MessagePack map


@dataclass
class Scan:
    """What :func:`scan_entries` found: the good entries, the damaged byte ranges between
    them (each followed by a good entry) and a torn tail."""

    entries: list[tuple[int, memoryview]] = field(default_factory=list)
    #: ``[start, end)`` offsets of damaged bytes, each followed by a good entry
    damaged: list[tuple[int, int]] = field(default_factory=list)
    #: why the first damaged range was judged bad (for the log)
    damage_reason: str | None = None
    #: offset just past the last good entry (the torn tail, if any, starts here)
    end: int = 0
    #: why the tail was cut (None: every byte after the last damage was read)
    problem: str | None = None
    #: where each of :attr:`entries` starts (its length head), for setting one aside
    offsets: list[int] = field(default_factory=list)


def _bad_entry(view: memoryview, pos: int) -> str | None:
    """Why the entry at ``pos`` cannot be read (None: it can)."""
    end = len(view)
    head = ENTRY_HEAD.size
    if end - pos < head:
        return "truncated entry header"
    length, crc = ENTRY_HEAD.unpack_from(view, pos)
    if length < 1 or length > MAX_ENTRY:
        return f"bad entry length {length}"
    if end - pos - head < length:
        return f"truncated entry ({end - pos - head} of {length} bytes)"
    if zlib.crc32(view[pos + head:pos + head + length]) != crc:
        return "checksum mismatch"
    return None


def _plausible(view: memoryview, pos: int, length: int) -> bool:
    """Does a candidate head at ``pos`` name a body the writer could have written?"""
    kind = view[pos + 8]
    fixed = _FIXED.get(kind)
    if fixed is not None:
        return length == fixed
    if kind == KIND_FRAME:
        return length > FRAME_HEAD.size and view[pos + 8 + FRAME_HEAD.size] in _MSGPACK_MAPS
    if kind == KIND_STEPS:
        return length > 1 and view[pos + 9] in _MSGPACK_MAPS
    if kind == KIND_STATE:
        return length > 2 and view[pos + 9] in STATE_PARTS
    return False


def resync(view: memoryview, start: int) -> int | None:
    """Offset of the first good entry at or after ``start`` (None: none): a known kind, a
    length that fits both the kind and :data:`RESYNC_MAX_BODY`, and a matching CRC."""
    end = len(view)
    head = ENTRY_HEAD.size
    arr = np.frombuffer(view, dtype=np.uint8)
    for w0 in range(start, end - head, _RESYNC_WINDOW):
        w1 = min(w0 + _RESYNC_WINDOW, end - head)  # candidate heads in [w0, w1)
        b = arr[w0:w1 + head + 1].astype(np.uint32)
        n = w1 - w0
        length = b[0:n] | (b[1:n + 1] << 8) | (b[2:n + 2] << 16) | (b[3:n + 3] << 24)
        kind = b[8:n + 8]
        room = end - head - np.arange(w0, w1)
        ok = ((kind >= KIND_FRAME) & (kind <= KIND_STATE) & (length >= 1)
              & (length <= np.minimum(room, RESYNC_MAX_BODY)))
        for off in np.flatnonzero(ok).tolist():
            pos = w0 + off
            if _plausible(view, pos, int(length[off])) and _bad_entry(view, pos) is None:
                return pos
    return None


def scan_entries(data: bytes) -> Scan:
    """Split a journal file's bytes (after the header) into entries, reading past damage in
    the middle: a bad entry followed by a good one is skipped as a damaged range."""
    view = memoryview(data)
    out = Scan()
    entries = out.entries
    pos, end = 0, len(view)
    head = ENTRY_HEAD.size
    while pos < end:
        why = _bad_entry(view, pos)
        if why is not None:
            nxt = resync(view, pos + 1)
            if nxt is None:
                out.problem = why
                break
            if out.damage_reason is None:
                out.damage_reason = why
            out.damaged.append((pos, nxt))
            pos = nxt
            continue
        (length,) = struct.unpack_from("<I", view, pos)
        body = view[pos + head:pos + head + length]
        entries.append((body[0], body[1:]))
        out.offsets.append(pos)
        pos += head + length
    out.end = pos
    return out
