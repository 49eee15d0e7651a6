"""The benchmarks run end to end (``bench/run_all.py --quick``) and print well-formed lines.

This checks the shape of the output, never a speed: every benchmark name is present, each
line is a JSON object with the required keys, and values are numbers.
"""
from __future__ import annotations

import importlib.util
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


def listed(block_start: str) -> set[str]:
    """The quoted figure names of run_all.py's literal block that starts ``block_start``."""
    source = (REPO / "bench" / "run_all.py").read_text(encoding="utf-8")
    block = source.split(block_start, 1)[1].split("\n}", 1)[0]
    return set(re.findall(r'^\s+"([a-z0-9_]+)"', block, re.M))


def quick_names() -> set[str]:
    """What ``--quick`` prints: every figure but the full run's own and those whose package
    (Lightning) this env lacks."""
    missing = {name for name in listed("OPTIONAL_FIGURES = {")
               if importlib.util.find_spec("lightning") is None}
    return target_names() - listed("FULL_ONLY_FIGURES = {") - missing


NAMES = quick_names()


@pytest.mark.timeout(620)
def test_run_all_quick_prints_every_benchmark_as_json_lines() -> None:
    # the benchmarks that once ran only by hand run here too (issue 44 item 7)
    assert {"ingest_ratio", "steps_ingest_frames_per_s", "log_step_p99_us",
            "runs_api_3000_p99_ms", "shard_return_s", "metrics_65536_ranks_s",
            "stacks_request_flood_step_ratio", "webhook_trickle_good_url_delay_s"} <= NAMES
    assert {"largest_sse_event_mib", "dump_budget_rss_web_mib"} <= target_names() - NAMES
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run_all.py"), "--quick"],
        cwd=str(REPO), capture_output=True, text=True, timeout=600,
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
