"""Fixtures for the framework integration tests: a REAL broker (``BrokerServer`` in a thread
on ephemeral loopback endpoints) that the examples/ scripts report to from REAL training
processes (Lightning DDP, torchrun, Accelerate), and helpers that read back what the broker
holds: its snapshot (header, ranks, epoch records, closed steps) over the snapshot socket,
and every frame it accepted (decoded), tapped from its accept hook.

These tests need torch, lightning, transformers and accelerate: ``tox -e integrations``
installs them; the default ``py`` env runs without them and leaves this folder out
(``--ignore=tests/integrations`` in tox.ini). Run from an environment without the
frameworks, the folder is not collected, with a line in the report header saying so; under
CI (``CI`` set) a missing framework is an error instead, so CI cannot pass by skipping.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Iterator, Optional

import pytest

FRAMEWORKS = ("torch", "lightning", "transformers", "accelerate")
MISSING = [name for name in FRAMEWORKS if importlib.util.find_spec(name) is None]

if MISSING:
    if os.environ.get("CI"):
        raise RuntimeError(f"tests/integrations need {', '.join(MISSING)}: run them with "
                           "`tox -e integrations`")
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header(config: Any) -> Optional[str]:
    if MISSING:
        return (f"tests/integrations NOT collected: {', '.join(MISSING)} missing "
                "(run `tox -e integrations`)")
    return None


if not MISSING:
    from tests.support.integrations import TappedBroker, Web

    @pytest.fixture
    def broker() -> Iterator[TappedBroker]:
        b = TappedBroker()
        yield b
        b.stop()

    @pytest.fixture
    def web(broker: TappedBroker) -> Iterator[Web]:
        """A real ``rankboard web`` process on the ``broker``: the dashboard's HTTP API."""
        w = Web(broker)
        yield w
        w.stop()
