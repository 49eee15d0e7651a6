"""The README's own addresses for a test: 127.0.0.1:8585 for the web and 5585-5587 for the
broker, held by one test at a time on this machine.

A test of the README's exact commands cannot move them to ephemeral ports, so it takes a
machine-wide lock (a ``flock`` on a file in the temp dir: every worktree and CI job on the
host shares it) and then waits, against a deadline, for the ports to be free. A port that
stays taken fails the test loudly, naming the port and who may hold it: skipping would hide
exactly the newcomer's path the test is there to keep working.
"""
from __future__ import annotations

import fcntl
import os
import socket
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator

#: The web's and the broker's default ports (PROTOCOL 1).
DEFAULT_PORTS = (8585, 5585, 5586, 5587)
LOCK_FILE = os.path.join(tempfile.gettempdir(), "rankboard-default-ports.lock")


def busy(port: int) -> bool:
    """Whether ``127.0.0.1:port`` is taken now (bound as the web binds, SO_REUSEADDR)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@contextmanager
def default_ports(timeout: float = 180.0) -> Iterator[None]:
    """Hold the machine-wide lock and wait until every default port is free (AssertionError
    naming the busy ones past ``timeout``)."""
    deadline = time.monotonic() + timeout
    with open(LOCK_FILE, "a+") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"another test held {LOCK_FILE} for {timeout:.0f} s") from None
                time.sleep(0.2)  # polling a lock held by another process: nothing to wait on
        try:
            while True:
                taken = [p for p in DEFAULT_PORTS if busy(p)]
                if not taken:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"the README's ports {taken} stay in use on this machine (a rankboard "
                        f"up or demo left running?): this test runs the README's commands "
                        f"exactly, on 8585 and 5585-5587; free them and rerun")
                time.sleep(0.5)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
