"""Helpers the tests share that are not fixtures: polling, subprocesses, sockets, HTTP/SSE
clients, frame builders, generators.

Fixtures stay in the ``conftest.py`` files (which call these); test modules and ``bench/``
import from here, never from a ``conftest`` or another test module, so that nothing depends on
pytest's conftest loading order and the benchmarks can use the same real-process plumbing.
"""
from __future__ import annotations

from pathlib import Path

#: the repository root (children run with it as their working directory)
REPO = Path(__file__).resolve().parents[2]
