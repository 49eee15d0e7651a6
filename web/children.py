"""Stopping child processes: SIGTERM, then SIGKILL for what is left after a deadline.

One helper for every place that stops a child it started (issue 44 item 5: the same
terminate-wait-kill was written in ``rankboard/process.py``, the ``--workers`` pool, the
demo, the benchmarks and the test support). It lives in the web layer, the lowest one that
starts children (the ``--workers`` pool, :mod:`web.workers`), so that pool can use it
without importing :mod:`rankboard` (``tests/test_layering.py``); :mod:`rankboard.process`
re-exports it.

Works on a ``subprocess.Popen``, gevent's or the standard one: only ``poll``, ``terminate``,
``wait`` and ``kill`` are called.
"""
from __future__ import annotations

import time
from typing import Any, Iterable

__all__ = ["terminate", "terminate_all"]


def terminate_all(procs: Iterable[Any], timeout: float = 5.0) -> None:
    """SIGTERM every process still running at once, then wait for them together: whatever
    is still running ``timeout`` seconds later is SIGKILLed; every one is reaped. Signalling
    all first means N children stop in about one grace period, not N. Never raises for a
    process that is already gone."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.terminate()
            except OSError:  # gone between the poll and the signal
                pass
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # (TimeoutExpired, gevent's Timeout)
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def terminate(proc: Any, timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; reaps the child."""
    terminate_all((proc,), timeout)
