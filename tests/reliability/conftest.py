"""Fixtures for the reliability and security tests: REAL ``rankboard`` processes (broker and
web, killed and restarted with real signals), real sockets on 127.0.0.1 ephemeral ports.

The process spawner is the web tests'; a broker *subprocess* (``start_broker``, whose
endpoints are learnt from its "bound at" log lines so that it can be SIGKILLed and restarted
on the same ports) and the other helpers are in ``tests/support/procs.py``.
"""
from __future__ import annotations

from typing import Iterator

import pytest
import zmq

from tests.web.conftest import spawn  # noqa: F401  (fixture re-exported)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()
