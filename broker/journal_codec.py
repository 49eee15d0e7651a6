"""The journal's file format: entries, their kinds, and splitting a file's bytes into them.

A journal file is :data:`HEADER`, then entries. An entry is ``<u32 length><u32
crc32(body)><body>`` (little endian), ``body = <u8 kind> payload``; ``kind`` is one of:

====  ===============  ====================================================================
 1    FRAME            ``<f64 receive time>`` + the frame's MessagePack bytes
 2    SEQ_HI           ``<u64 seq_hi>``: every id issued so far (and until the next one) <= it
 3    RECORD_SEQ       ``<u32 index><u64 seq>``: ``sink.record_seqs[index]``
 4    COMPLETE_SEQ     ``<u64 seq>``: seq of the run's ``complete`` event (0: reopened)
 5    STEPS            MessagePack of a :meth:`StepStore.to_wire` block: published closed steps
====  ===============  ====================================================================

Unknown kinds with a good CRC are skipped by readers (room for additions without a version
bump). This module is pure: bytes in, bytes out, no files (``broker/journal.py`` owns them).
"""
from __future__ import annotations

import struct
import zlib

import msgspec

__all__ = ["FORMAT_VERSION", "HEADER", "MAX_ENTRY", "read_entries"]

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
