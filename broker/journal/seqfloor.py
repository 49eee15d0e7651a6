"""``SEQFLOOR``: the ids a broker issued while its journal writes failed (PROTOCOL 8.4/8.5).

Every run's journal holds a reservation (``KIND_SEQ_HI``) that each id it issued stays below,
written before the ids are used, so a restart continues above them. On a full disk that
reservation cannot be written: the broker goes on serving (and issuing ids) from memory,
and a restart, even a SIGKILL, before space returns would start the run's ids again below
ones the webs have seen. This file closes that gap: 4 KiB written (allocated) when the
journal opens, while the disk still has room, then only ever overwritten in place, which
needs no new block on the filesystems a data dir lives on (ext4, xfs, tmpfs; a
copy-on-write filesystem may refuse even that, and then only this guarantee is lost,
logged). While writes fail, the highest reservation of any run is written here; at load
every run's ids continue above it. One number for all runs: a run's ids may jump after
such a restart (its web re-snapshots on the new broker instance anyway), never go back.

Format: 8 bytes big-endian value and the CRC-32 of those 8 bytes, at offset 0; anything
else (a file an older broker never wrote, a torn write) reads as 0.
"""
from __future__ import annotations

import logging
import os
import struct
import zlib

__all__ = ["SeqFloor", "FILE_NAME"]

log = logging.getLogger("broker.journal.journal")

FILE_NAME = "SEQFLOOR"
_SIZE = 4096
_RECORD = struct.Struct(">QI")


class SeqFloor:
    """The data dir's ``SEQFLOOR`` (module docstring): :attr:`value` as read at open, and
    :meth:`raise_to` while writes fail."""

    def __init__(self, data_dir: str) -> None:
        self.path = os.path.join(data_dir, FILE_NAME)
        self.value = 0  # the floor as read at open (0: none)
        self._written = 0  # the value last written (or read)
        self._fd: int | None = None

    def open(self) -> None:
        """Read the floor and keep the file open, allocated, for in-place writes."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            log.warning("journal: cannot open %s (%s): ids issued while writes fail may be "
                        "reissued after a restart", self.path, exc.strerror or exc)
            return
        try:
            head = os.pread(fd, _RECORD.size, 0)
            if len(head) == _RECORD.size:
                value, crc = _RECORD.unpack(head)
                if crc == zlib.crc32(head[:8]):
                    self.value = self._written = value
            if os.fstat(fd).st_size < _SIZE:
                os.pwrite(fd, b"\0" * _SIZE, 0)  # allocate its blocks now, while there is room
                self._write(fd, self._written)
                os.fsync(fd)
        except OSError as exc:
            log.warning("journal: cannot prepare %s (%s): ids issued while writes fail may "
                        "be reissued after a restart", self.path, exc.strerror or exc)
            os.close(fd)
            return
        self._fd = fd

    def raise_to(self, value: int) -> None:
        """Write ``value`` in place if it is above the last one written (no new block)."""
        if value <= self._written or self._fd is None:
            return
        try:
            self._write(self._fd, value)
        except OSError as exc:
            log.warning("journal: cannot write %s: %s", self.path, exc.strerror or exc)
            return
        self._written = value

    @staticmethod
    def _write(fd: int, value: int) -> None:
        body = value.to_bytes(8, "big")
        os.pwrite(fd, _RECORD.pack(value, zlib.crc32(body)), 0)

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None
