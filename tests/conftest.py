"""The whole suite runs with its own state directory.

A broker's default data dir, and the control channel's secret an agent finds there when no
other is configured (``rank_agent/controlauth.py``), live under ``$XDG_STATE_HOME``: a
developer's own ``~/.local/state/rankboard`` (a real broker's runs and secret) must neither be
written by the tests nor change what an agent in a test obeys. Set before any test runs, so
every subprocess inherits it.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_STATE: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    state = tempfile.mkdtemp(prefix="rankboard-tests-state-")
    _STATE.append(state)
    os.environ["XDG_STATE_HOME"] = state


def pytest_unconfigure(config: pytest.Config) -> None:
    for state in _STATE:
        shutil.rmtree(state, ignore_errors=True)
