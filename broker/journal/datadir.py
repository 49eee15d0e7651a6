"""The journal's data dir on disk: its lock, its format version, and moving files aside.

One broker per dir (an ``flock`` on ``LOCK``), one format per dir (``VERSION``), and a file
that cannot be used is renamed next to itself rather than deleted, so no bytes a user might
want back are lost. Everything here is a plain function of paths: ``broker/journal/journal.py``
calls it.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from typing import Union

from broker.journal.codec import FORMAT_VERSION, VERSION_PREFIX, VERSION_TEXT

__all__ = ["JournalError", "take_lock", "check_version", "set_aside", "remove", "write_all"]

log = logging.getLogger("broker.journal.journal")


class JournalError(RuntimeError):
    """The data dir cannot be used at all (another broker holds it, or a newer format)."""


def take_lock(data_dir: str) -> int:
    """``flock`` the dir's ``LOCK`` file; its fd (closing it unlocks). :class:`JournalError`
    when another broker holds it."""
    fd = os.open(os.path.join(data_dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise JournalError(f"data dir {data_dir} is in use by another broker") from None
        raise
    return fd


def check_version(data_dir: str) -> None:
    """Write ``VERSION`` if missing (or unreadable); :class:`JournalError` if it names
    another format."""
    path = os.path.join(data_dir, "VERSION")
    try:
        with open(path, "rb") as f:
            text = f.read(256)
    except FileNotFoundError:
        with open(path, "wb") as f:
            f.write(VERSION_TEXT)
        return
    if text == VERSION_TEXT:
        return
    if text.startswith(VERSION_PREFIX):
        found = text.strip().decode("ascii", "replace")
        raise JournalError(f"data dir {data_dir} holds journal format {found!r}; "
                           f"this broker reads {FORMAT_VERSION}")
    log.warning("journal: %s is unreadable (%r); rewriting it", path, text[:40])
    with open(path, "wb") as f:
        f.write(VERSION_TEXT)


def set_aside(path: str, why: str) -> bool:
    """Move an unusable journal out of the way (keeping its bytes) so the run can
    start a new one; False when even that fails."""
    dest = f"{path}.unreadable-{int(time.time())}"
    try:
        os.replace(path, dest)
    except OSError as exc:
        log.warning("journal: skipping %s (%s); cannot move it aside: %s", path, why, exc)
        return False
    log.warning("journal: skipping %s (%s); moved to %s", path, why, dest)
    return True


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError as exc:
        log.warning("journal: cannot delete %s: %s", path, exc)


def write_all(fd: int, data: Union[bytes, bytearray], offset: int) -> None:
    """pwrite ``data`` at ``offset``, looping over short writes."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def cut_damage(path: str, header: bytes, body: bytes, damaged: list[tuple[int, int]],
               end: int) -> int | None:
    """Set the ``damaged`` byte ranges of a journal's ``body`` (the bytes after ``header``)
    aside in ``<path>.damaged-<time>`` and rewrite the journal without them, and without
    anything past ``end`` (a torn tail). Returns the journal's new size; None when a write
    failed, and then the journal is as it was (a later start finds the same damage).

    The set-aside file is written and synced before the journal is replaced, and the
    journal is replaced by rename, so a crash in between loses no byte."""
    aside = f"{path}.damaged-{int(time.time())}"
    tmp = f"{path}.rewrite"
    view = memoryview(body)
    keep: list[memoryview] = []
    pos = 0
    for start, stop in damaged:
        keep.append(view[pos:start])
        pos = stop
    keep.append(view[pos:end])
    try:
        with open(aside, "ab") as f:  # (a second damage within the same second: appended)
            for start, stop in damaged:
                f.write(view[start:stop])
            f.flush()
            os.fsync(f.fileno())
        with open(tmp, "wb") as f:
            f.write(header)
            for part in keep:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("journal: cannot set the damaged bytes of %s aside: %s; leaving the file "
                    "as it is", path, exc)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return None
    log.warning("journal: %s: %d damaged bytes in %d places moved to %s; the entries after "
                "them are kept", path, sum(b - a for a, b in damaged), len(damaged), aside)
    return size
