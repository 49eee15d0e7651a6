"""``bench/frame_instructions.py`` drives what BENCHMARKS.md's instruction counts measure.

CI has no valgrind, so this runs each case's inner loop (``--inner``: the frames through the
path, no counting) and checks it ran whole: every frame through the broker, the lanes or the
closes, each case's own checks passed (the broker accepted every frame; with ``--hold`` no
step closed, without it some did; a lane dropped none). A harness that stopped measuring
what its docstring says would fail here rather than print a figure.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "frame_instructions.py"


@pytest.mark.parametrize("args, frames", [
    (["steps"], 10240),
    (["steps", "--hold"], 10240),
    (["lane"], 10240),
    (["sketch"], 10240),
    (["decode"], 10240),
    (["resources"], 10240),
    (["lane", "--case", "resources"], 10240),
    (["decode", "--case", "resources"], 10240),
    (["close"], 40),
])
def test_each_case_runs_its_frames_whole(args: list[str], frames: int) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--inner"], cwd=str(REPO),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(rf"^frames {frames}$", proc.stderr, re.M), proc.stderr[-3000:]
