"""Fixtures for the web's socket tests: a REAL broker (``BrokerServer`` in a thread on
ephemeral loopback endpoints, tmp data dir), REAL ``rankboard`` web/up/demo subprocesses (the
web is gevent-patched, so it runs out of this unpatched test process) and a raw PUSH socket
that sends real wire frames. The classes behind them, the HTTP and SSE clients and
``start_web`` are in ``tests/support``.

Nothing here sleeps to synchronise: every wait polls a condition against a deadline.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest

from tests.support.brokers import Broker, BrokerRef, Pusher
from tests.support.procs import Proc, start_web


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    """A broker in a thread; ``broker.restart()`` keeps its endpoints and data dir."""
    holder = {"b": Broker(tmp_path / "data")}
    yield BrokerRef(holder)  # type: ignore[misc]
    holder["b"].stop()


@pytest.fixture
def pusher(broker: Broker) -> Iterator[Pusher]:
    p = Pusher(broker.ingest)
    yield p
    p.close()


@pytest.fixture
def spawn() -> Iterator[Callable[..., Proc]]:
    """``spawn(*args, env=...)`` starts a rankboard subprocess, killed at teardown."""
    procs: list[Proc] = []

    def start(*args: str, env: Optional[dict[str, str]] = None) -> Proc:
        proc = Proc(list(args), env)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.close()


@pytest.fixture
def web(spawn: Callable[..., Proc], broker: Broker) -> Proc:
    return start_web(spawn, broker)
