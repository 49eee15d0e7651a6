"""The journal's data dir on disk: its lock, its format version, and moving files aside.

One broker per dir (an ``flock`` on ``LOCK``), one format per dir (``VERSION``), and a file
that cannot be used is renamed next to itself rather than deleted, so no bytes a user might
want back are lost. Everything here is a plain function of paths: ``broker/journal.py``
calls it.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from typing import Union

from broker.journal_codec import FORMAT_VERSION, VERSION_PREFIX, VERSION_TEXT

__all__ = ["JournalError", "take_lock", "check_version", "set_aside", "remove", "write_all"]

log = logging.getLogger("broker.journal")


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
