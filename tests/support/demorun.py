"""What the demo's tests read of a running ``rankboard demo``: its step job's runs, by the
id prefix the demo gives them (``rankboard/demo.py``)."""
from __future__ import annotations

from typing import Optional

from tests.support.http import get_json

STEP_RUN_PREFIX = "demo-steps-"


def step_runs(port: int) -> list[str]:
    """The demo's step runs listed by the web at ``port``, newest first (as ``/api/runs`` lists them)."""
    return [r["run"] for r in get_json(port, "/api/runs") or [] if r["run"].startswith(STEP_RUN_PREFIX)]


def newest_step_run(port: int) -> Optional[str]:
    """The newest of :func:`step_runs`, or None before the step job's first run registers."""
    runs = step_runs(port)
    return runs[0] if runs else None
