"""Fixtures for the scale-out tests: REAL processes (a broker, ``rankboard web --workers N``
pools, several webs on one broker), real sockets on 127.0.0.1 ephemeral ports.

The fixtures (the broker, the PUSH socket playing the ranks, the process spawner) are the web
tests'; the helpers a pool needs (which worker answered, a stream pinned to a worker, the
worker processes) are in ``tests/support/pool.py``.
"""
from __future__ import annotations

from tests.web.conftest import broker, pusher, spawn  # noqa: F401  (fixtures re-exported)
