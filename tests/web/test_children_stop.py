"""The one terminate-then-kill (issue 44 item 5, :mod:`web.children`): real child processes,
one that stops on SIGTERM and one that ignores it, stopped together within one grace period,
the stubborn one SIGKILLed, both reaped; a child already gone is no error."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

from web.children import terminate, terminate_all

#: a child that says it is ready, then sleeps; ``IGNORE`` makes it ignore SIGTERM first
CHILD = "import signal, sys, time\n{ignore}print('ready', flush=True)\ntime.sleep(60)\n"
IGNORE = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"


def child(ignore_term: bool) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(ignore=IGNORE if ignore_term
                                                                 else "")],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"  # (handler set)
    return proc


def test_all_signalled_at_once_the_stubborn_one_killed_after_the_grace() -> None:
    polite = [child(False) for _ in range(3)]
    stubborn = child(True)
    t0 = time.monotonic()
    terminate_all([stubborn, *polite], timeout=1.0)
    took = time.monotonic() - t0
    assert [p.returncode for p in polite] == [-signal.SIGTERM] * 3
    assert stubborn.returncode == -signal.SIGKILL
    # one grace period for all (the stubborn one first in the list), not one each
    assert took < 1.0 * 2.5, took
    for p in (stubborn, *polite):
        assert p.stdout is not None
        p.stdout.close()


def test_a_child_already_gone_is_no_error() -> None:
    proc = child(False)
    proc.kill()
    proc.wait()
    terminate(proc, timeout=0.5)
    terminate_all([proc, proc], timeout=0.5)
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout is not None
    proc.stdout.close()
