"""Scrape ``/metrics`` of a :mod:`tests.support.metricsweb` child while probing ``/healthz``.

:func:`start` runs the child and returns it with its port; :func:`probe` times one scrape (in
a thread) and every ``/healthz`` answered while it runs (from this thread, back to back), so
a scrape that holds the web's event loop shows as a slow probe.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

from tests.support import REPO
from tests.support.http import fetch


def start(ranks: int, gpus_per_rank: int = 1) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.metricsweb", str(ranks), str(gpus_per_rank)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the child serves (or dies: "")
    if not line.startswith("port "):
        proc.kill()
        raise AssertionError(f"metrics web did not start: {line!r}")
    return proc, int(line.split()[1])


def stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def probe(port: int, timeout: float = 120.0) -> dict[str, Any]:
    """One scrape and the ``/healthz`` latencies (seconds) measured while it ran."""
    out: dict[str, Any] = {}

    def scrape() -> None:
        t0 = time.perf_counter()
        resp = fetch(port, "/metrics", timeout=timeout)
        out["scrape_s"] = time.perf_counter() - t0
        out["status"], out["text"] = resp.status, resp.body.decode()

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    latencies: list[float] = []
    deadline = time.monotonic() + timeout
    while thread.is_alive() and time.monotonic() < deadline:
        t0 = time.perf_counter()
        resp = fetch(port, "/healthz", timeout=timeout)
        elapsed = time.perf_counter() - t0
        if thread.is_alive() or "scrape_s" not in out:  # answered during the scrape
            latencies.append(elapsed)
        assert resp.status in (200, 503)  # an answer (503: no broker heartbeat here)
    thread.join(timeout)
    out["healthz_s"] = latencies
    return out
