"""The benchmarks run end to end (``bench/run_all.py --quick``) and print well-formed lines.

This checks the shape of the output, never a speed: every benchmark name is present, each
line is a JSON object with the required keys, and values are numbers.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KEYS = {"name", "value", "unit", "baseline", "ratio"}


def target_names() -> set[str]:
    """Every benchmark listed in bench/run_all.py's TARGETS, with a target or without one
    (read from its source, so this test imports none of the benchmarks' dependencies)."""
    source = (REPO / "bench" / "run_all.py").read_text(encoding="utf-8")
    block = source.split("TARGETS: dict[str, tuple[float, str] | None] = {", 1)[1].split("\n}", 1)[0]
    return set(re.findall(r'^\s+"([a-z0-9_]+)":', block, re.M))


NAMES = target_names()


@pytest.mark.timeout(400)
def test_run_all_quick_prints_every_benchmark_as_json_lines() -> None:
    assert {"ingest_ratio", "steps_ingest_frames_per_s", "log_step_p99_us"} <= NAMES
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run_all.py"), "--quick"],
        cwd=str(REPO), capture_output=True, text=True, timeout=390,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    seen = set()
    for line in lines:
        obj = json.loads(line)
        assert isinstance(obj, dict) and set(obj) == KEYS, line
        assert isinstance(obj["name"], str) and isinstance(obj["unit"], str)
        assert isinstance(obj["value"], (int, float)) and math.isfinite(obj["value"]), line
        for key in ("baseline", "ratio"):
            assert obj[key] is None or isinstance(obj[key], (int, float)), line
        seen.add(obj["name"])
    assert seen == NAMES
    assert len(lines) == len(NAMES)
