"""fork() in a test process, and waiting for the child with a deadline (the agent's fork
safety is tested in real children)."""
from __future__ import annotations

import os
import time
import warnings


def fork() -> int:
    """``os.fork()`` without the warning Python gives for forking a threaded process."""
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork() in a process with threads (ZeroMQ's I/O thread):
        # forking such a process is exactly what this test is about.
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def wait_child(pid: int, timeout: float = 15.0) -> int:
    """The child's exit code; a child still running after ``timeout`` is killed and fails
    the test (a hung child must not hang the suite)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)  # polling a child's exit, not synchronising on it
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("forked child hung")
