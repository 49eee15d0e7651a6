"""``bench/frame_instructions.py`` drives what BENCHMARKS.md's instruction counts measure.

CI has no valgrind, so this runs each case's inner loop (``--inner``: the frames through the
path, no counting) and checks it ran whole: every frame through the broker or the closes,
each case's own checks passed (the broker accepted every frame; with ``--hold`` no step
closed, without it some did). A harness that stopped measuring
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
    (["sketch"], 10240),
    (["decode"], 10240),
    (["resources"], 10240),
    (["decode", "--case", "resources"], 10240),
    (["close"], 40),
])
def test_each_case_runs_its_frames_whole(args: list[str], frames: int) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--inner"], cwd=str(REPO),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(rf"^frames {frames}$", proc.stderr, re.M), proc.stderr[-3000:]


def test_inner_times_the_loop_it_counts() -> None:
    """``--inner`` reports the CPU and wall seconds spent inside the counted loop (what the
    ``time`` case divides by the frames): real, and no more than the process ran."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "sketch", "--inner"], cwd=str(REPO),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"^seconds ([\d.]+) ([\d.]+)$", proc.stderr, re.M)
    assert found, proc.stderr[-3000:]
    cpu, wall = float(found.group(1)), float(found.group(2))
    assert 0 < cpu and 0 < wall < 120


def test_time_case_prints_each_variant_against_decode() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "time", "--case", "resources",
                           "--rounds", "1"], cwd=str(REPO), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^  (decode \+ check|broker) +([\d.]+) us .* ratio ([\d.]+)$",
                      proc.stdout, re.M)
    assert [name for name, _, _ in rows] == ["decode + check", "broker"], proc.stdout
    assert float(rows[0][2]) == 1.0 and all(float(us) > 0 for _, us, _ in rows)
