"""The journal's open files: one :class:`RunFile` per run held (its write buffer and
bookkeeping), and :class:`Handles`, the bounded set of open descriptors they write through.

Writes are positioned (``pwrite`` at the run's known end), so a failed or partial write is
cut back to the last entry boundary and the file never holds a torn entry followed by good
ones. At most ``max_open_files`` descriptors are open (least recently written closed
first); fsync happens at most once per ``fsync_interval`` (None: only at close).
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict

from broker.journal.codec import HEADER, KIND_SEQ_HI, SEQ, entry
from broker.journal.datadir import write_all
from broker.journal.noops import Unchanged
from broker.journal.statenotes import StateNotes
from broker.journal.stepblocks import StepBlocks
from rank_agent.protocol import Resources

__all__ = ["RunFile", "Handles"]

log = logging.getLogger("broker.journal.journal")

#: While writes fail, a run's buffer is dropped (logged) once it, or all runs' buffers
#: together, hold more than this (bounded memory on a full or read-only disk).
_MAX_BUFFER = 64 * 1024 * 1024
#: Failed writes are logged at most once per this many seconds (PROTOCOL 8.4), with the
#: count since the last line: a full disk fails every run's write on every retry.
FAIL_LOG_S = 60.0


class RunFile:
    """The journal of one run: its write buffer, open handle and bookkeeping."""

    __slots__ = (
        "run", "path", "fd", "buf", "size", "pending", "started", "seq_hi",
        "noted_records", "noted_complete", "noted_seq", "track_records", "write_failed",
        "noted_steps", "unchanged", "flight", "stacks_bytes", "state", "buf_frames",
        "missing_frames",
    )

    def __init__(self, run: str, path: str) -> None:
        self.run = run
        self.path = path
        self.fd: int | None = None
        self.buf = bytearray()
        self.size: int | None = None  # bytes on disk at a known entry boundary; None: unknown
        # rank -> (receive time, frame) of the newest resources frame not yet written
        self.pending: dict[int, tuple[float, Resources]] = {}
        self.started = False  # has a frame been written (or buffered) for this run?
        self.seq_hi = 0
        self.noted_records = 0
        self.noted_complete = 0
        # sink.seq at the last full note_seq (-1: none yet). Records and completions are
        # numbered, so while sink.seq stays the same there is nothing new to note.
        self.noted_seq = -1
        # False when the file holds a history the live sink does not (a run created afresh
        # over an existing file): its record indices would not match, so do not note them.
        self.track_records = True
        self.write_failed = False
        self.noted_steps = 0  # rows of sink.steps already journaled
        self.unchanged = Unchanged()  # what the file holds of frames whose repeats are no-ops
        self.flight = StepBlocks()  # what its STEPS blocks were written from
        self.stacks_bytes = 0  # bytes of ``stacks`` frames in the file (MAX_STACKS_BYTES)
        self.state = StateNotes()  # what the file holds of the run's STATE parts (8.5)
        #: frames in ``buf`` (PROTOCOL 8.4: what a dropped buffer cost is said in frames)
        self.buf_frames = 0
        #: frames of this run dropped unwritten while writes failed (logged when they work)
        self.missing_frames = 0


class Handles:
    """Open descriptors of run files (an LRU bounded by ``max_open_files``) and their fsync."""

    def __init__(self, runs_dir: str, *, max_open_files: int,
                 fsync_interval: float | None) -> None:
        self.runs_dir = runs_dir
        self.max_open_files = max_open_files
        self.fsync_interval = fsync_interval
        self.open: OrderedDict[str, RunFile] = OrderedDict()  # LRU of open handles
        self._unsynced: dict[str, RunFile] = {}
        self._last_sync = time.monotonic()
        #: bytes dropped unwritten while writes failed (_MAX_BUFFER bit)
        self.dropped_bytes = 0
        #: writes (of one run's buffer) that failed: a read-only or full data dir shows on
        #: /metrics, not only in the log
        self.write_failures = 0
        #: PROTOCOL 8.4: runs whose latest write failed (the journal is "failing" while any
        #: is, or while ``probe_failed``), and the failures not yet logged (once a minute)
        self.failing: set[str] = set()
        self.probe_failed = False
        self._fail_log_at = -FAIL_LOG_S
        self._ok_log_at = -FAIL_LOG_S
        self._fail_unlogged = 0

    def fd(self, st: RunFile) -> int:
        if st.fd is not None:
            self.open.move_to_end(st.run)
            return st.fd
        flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(st.path, flags, 0o644)
        except FileNotFoundError:
            os.makedirs(self.runs_dir, exist_ok=True)
            fd = os.open(st.path, flags, 0o644)
        try:
            size = os.fstat(fd).st_size
            if st.size is None or st.size > size:
                st.size = size
            if st.size < len(HEADER):
                # New (or torn at creation): start the file over with its header.
                os.ftruncate(fd, 0)
                write_all(fd, HEADER, 0)
                st.size = len(HEADER)
        except OSError:
            os.close(fd)
            raise
        st.fd = fd
        self.open[st.run] = st
        while len(self.open) > self.max_open_files:
            _, oldest = self.open.popitem(last=False)
            if oldest is not st:
                self.close(oldest)
        return fd

    def write(self, st: RunFile, total_buffered: int = 0) -> None:
        """Write the run's buffer at its known end. A failed write is cut back to the last
        entry boundary so that the file never holds a torn entry followed by good ones."""
        try:
            fd = self.fd(st)
            assert st.size is not None
            write_all(fd, st.buf, st.size)
        except OSError as exc:
            self._failed(st, exc, total_buffered)
            return
        if st.write_failed:
            self._works_again(st)
        st.size += len(st.buf)
        st.buf.clear()
        st.buf_frames = 0
        self.probe_failed = False
        self._unsynced[st.run] = st

    def _failed(self, st: RunFile, exc: OSError, total_buffered: int) -> None:
        """A write of ``st``'s buffer failed: counted, logged at most once a minute, cut back
        to the last entry boundary, the buffer kept for the next try (dropped, and its
        frames counted as missing, beyond :data:`_MAX_BUFFER`)."""
        self.write_failures += 1
        self._fail_unlogged += 1
        st.write_failed = True
        self.failing.add(st.run)
        mono = time.monotonic()
        if mono - self._fail_log_at >= FAIL_LOG_S:
            log.error("journal: cannot write %s: %s (%d failed writes since the last line, "
                      "%d runs failing; runs stay in memory and on every stream; retrying)",
                      st.path, exc.strerror or exc, self._fail_unlogged, len(self.failing))
            self._fail_log_at = mono
            self._fail_unlogged = 0
        if st.fd is not None and st.size is not None:
            try:
                os.ftruncate(st.fd, st.size)
            except OSError:
                pass
        if len(st.buf) > _MAX_BUFFER or total_buffered > _MAX_BUFFER:
            log.error("journal: dropping %d buffered bytes (%d frames) of run %r: the disk "
                      "has refused them too long", len(st.buf), st.buf_frames, st.run)
            self.dropped_bytes += len(st.buf)
            st.missing_frames += st.buf_frames
            st.buf_frames = 0
            st.buf.clear()
            if st.seq_hi:
                # the reservation is kept (PROTOCOL 8.5): ids issued while writes failed
                # stay below what a restart starts from, once this is written
                st.buf += entry(SEQ.pack(KIND_SEQ_HI, st.seq_hi))

    def _works_again(self, st: RunFile) -> None:
        st.write_failed = False
        self.failing.discard(st.run)
        if st.missing_frames:
            log.warning("journal: writing %s works again; %d frames of run %r are missing "
                        "from disk (dropped while writes failed)", st.path, st.missing_frames,
                        st.run)
            st.missing_frames = 0
        if not self.failing:
            mono = time.monotonic()
            if mono - self._ok_log_at >= FAIL_LOG_S:  # (a flapping disk: once a minute)
                self._ok_log_at = mono
                log.warning("journal: writing works again (%s)", st.path)

    def close(self, st: RunFile, *, sync: bool | None = None) -> None:
        """Close the run's handle; ``sync`` None: fsync if fsyncs are on and it has unsynced
        writes."""
        if sync is None:
            sync = self.fsync_interval is not None and st.run in self._unsynced
        self.open.pop(st.run, None)
        if st.fd is None:
            return
        fd, st.fd = st.fd, None
        try:
            if sync:
                os.fsync(fd)
        except OSError as exc:
            log.warning("journal: fsync of %s failed: %s", st.path, exc)
        finally:
            os.close(fd)
            self._unsynced.pop(st.run, None)

    def sync_due(self) -> None:
        """fsync what was written, if ``fsync_interval`` has passed since the last time."""
        if self.fsync_interval is not None and self._unsynced:
            mono = time.monotonic()
            if mono - self._last_sync >= self.fsync_interval:
                self._last_sync = mono
                self.sync_all()

    def close_all(self) -> None:
        """fsync and close every handle."""
        for st in list(self.open.values()):
            self.close(st, sync=True)

    def sync_all(self) -> None:
        for st in list(self._unsynced.values()):
            if st.fd is not None:
                try:
                    os.fsync(st.fd)
                except OSError as exc:
                    log.warning("journal: fsync of %s failed: %s", st.path, exc)
        self._unsynced.clear()

    def truncate(self, st: RunFile) -> None:
        """Cut the file back to ``st.size`` (a bad tail found at load)."""
        assert st.size is not None
        try:
            fd = self.fd(st)
            os.ftruncate(fd, st.size)
        except OSError as exc:
            log.warning("journal: cannot cut the bad tail of %s: %s", st.path, exc)
