"""A ``rankboard web --workers N`` pool seen from outside: which worker answered (the
``X-Rankboard-Worker`` header), an SSE stream pinned to a given worker, the pool's worker
processes and their metrics ports, and checks on the ids of a stream.

Nothing sleeps to synchronise: every wait polls a condition against a deadline.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional

import psutil

from tests.support.http import SSEClient, fetch
from tests.support.polling import wait_for
from tests.support.procs import Proc

WORKER = "x-rankboard-worker"


def worker_of(resp: Any) -> Optional[int]:
    """The worker slot that answered an HTTP response (None: not a pool's worker)."""
    value = resp.headers.get(WORKER) if hasattr(resp.headers, "get") else None
    return int(value) if value else None


def start_pool(spawner: Callable[..., Proc], endpoints: Any, *extra: str, workers: int = 2,
               env: Optional[dict[str, str]] = None) -> Proc:
    """``rankboard web --workers N`` on an ephemeral loopback port against the broker at
    ``endpoints`` (``.publish``, ``.snapshot``); returns once every worker has answered
    ``/healthz`` 200 itself."""
    proc = spawner("web", "--publish", endpoints.publish, "--snapshot", endpoints.snapshot,
                   "--host", "127.0.0.1", "--port", "0", "--workers", str(workers), *extra,
                   env=env)
    port = proc.wait_dashboard(timeout=40)
    wait_healthy_workers(port, workers)
    return proc


def wait_healthy_workers(port: int, workers: int, timeout: float = 30.0) -> None:
    """Poll ``/healthz`` on new connections until each of the ``workers`` slots has
    answered 200 (the kernel picks the worker per connection)."""
    seen: set[int] = set()

    def all_seen() -> bool:
        r = fetch(port, "/healthz")
        slot = worker_of(r)
        if r.status == 200 and slot is not None:
            seen.add(slot)
        return seen == set(range(1, workers + 1))

    wait_for(all_seen, timeout=timeout, what=f"/healthz 200 from each of {workers} workers")


def sse_on_worker(port: int, path: str, slot: int, headers: Optional[dict[str, str]] = None,
                  timeout: float = 30.0) -> SSEClient:
    """An SSE stream that the kernel placed on worker ``slot``: connect again until it is."""
    def attempt() -> Optional[SSEClient]:
        try:
            client = SSEClient(port, path, headers)
        except EOFError:  # closed before its headers: a worker stopping, say
            return None
        got = client.headers.get(WORKER)
        if client.status == 200 and got == str(slot):
            return client
        client.close()
        return None

    return wait_for(attempt, timeout=timeout, what=f"an SSE stream on worker {slot}")


def worker_pids(proc: Proc) -> dict[int, int]:
    """``{slot: pid}`` of a pool's worker processes (read off their command lines)."""
    out: dict[int, int] = {}
    for child in psutil.Process(proc.proc.pid).children():
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if "--worker-id" in cmd:
            out[int(cmd[cmd.index("--worker-id") + 1])] = child.pid
    return out


def metrics_ports(proc: Proc, workers: int) -> dict[int, int]:
    """``{slot: port}`` of the workers' ``--metrics-port 0`` listeners, from their logs."""
    rx = re.compile(r"web\[(\d+)\] web\.serve: web metrics on http://[^:]+:(\d+)/metrics")

    def found() -> Optional[dict[int, int]]:
        ports = {int(m.group(1)): int(m.group(2))
                 for line in proc.lines["stderr"] if (m := rx.search(line))}
        return ports if len(ports) == workers else None

    return wait_for(found, what="every worker's metrics port")


def epoch_events(events: list[dict[str, Any]]) -> list[tuple[int, int, Any]]:
    """``(id, epoch, record)`` of the ``epoch`` events of a stream."""
    return [(int(e["id"]), e["data"]["epoch"], e["data"]) for e in events
            if e["event"] == "epoch"]


def assert_increasing_ids(events: list[dict[str, Any]]) -> None:
    ids = [int(e["id"]) for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids), ids


def metric(text: str, name: str) -> Optional[float]:
    """The value of an unlabelled sample ``name`` in a Prometheus exposition."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None
