"""Fixtures for the reliability and security tests: REAL ``rankboard`` processes (broker and
web, killed and restarted with real signals), real sockets on 127.0.0.1 ephemeral ports.

The process, HTTP and SSE helpers are the web tests' (``tests/web/conftest.py``); this file
adds a broker *subprocess* (``python -m rankboard broker``) whose endpoints are learnt from
its "bound at" log lines, so that it can be SIGKILLed and restarted on the same ports.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import zmq

from tests.web.conftest import Proc, spawn  # noqa: F401  (fixture re-exported)

ANY = "tcp://127.0.0.1:*"


class Endpoints:
    """A broker's bound endpoints, shaped like the web tests' ``broker`` (``start_web`` reads
    ``.publish`` and ``.snapshot``)."""

    def __init__(self, ingest: str, publish: str, snapshot: str) -> None:
        self.ingest, self.publish, self.snapshot = ingest, publish, snapshot

    def as_dict(self) -> dict[str, str]:
        return {"ingest": self.ingest, "publish": self.publish, "snapshot": self.snapshot}


def start_broker(spawner: Callable[..., Proc], data_dir: Path, *extra: str,
                 endpoints: Endpoints | None = None) -> tuple[Proc, Endpoints]:
    """``rankboard broker`` on ``endpoints`` (default: ephemeral loopback ports); waits until
    all three sockets are bound and returns the process and the bound endpoints."""
    eps = endpoints.as_dict() if endpoints else {"ingest": ANY, "publish": ANY, "snapshot": ANY}
    proc = spawner("broker", "--ingest", eps["ingest"], "--publish", eps["publish"],
                 "--snapshot", eps["snapshot"], "--data-dir", str(data_dir), *extra)
    found = {name: proc.wait_line(rf"broker {name} bound at (\S+)", stream="stderr").group(1)
             for name in ("ingest", "publish", "snapshot")}
    return proc, Endpoints(**found)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def no_traceback(*procs: Any) -> None:
    for proc in procs:
        err = proc.output("stderr")
        assert "Traceback" not in err, err[-3000:]


def cleaned(text: str) -> str:
    return re.sub(r"\s+", " ", text)
