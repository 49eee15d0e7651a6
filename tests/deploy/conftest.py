"""Fixtures for the deploy tests: the web tests' broker, PUSH socket and process spawner (the
nginx test runs a real pool behind a real nginx). The deploy files and the tools that check
them are in ``tests/support/deploy.py``.
"""
from __future__ import annotations

from tests.web.conftest import broker, pusher, spawn  # noqa: F401  (fixtures re-exported)
