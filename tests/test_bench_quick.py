"""The benchmarks run end to end (``bench/run_all.py --quick``) and print well-formed lines.

This checks the shape of the output, never a speed: every benchmark name is present, each
line is a JSON object with the required keys, and values are numbers.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KEYS = {"name", "value", "unit", "baseline", "ratio"}
NAMES = {
    "ingest_ratio", "epoch_close_4096_ms", "epoch_close_scaling", "e2e_latency_p50_ms",
    "e2e_latency_p99_ms", "fanout_1000_p99_ms", "fanout_kib_per_client", "agent_send_p99_us",
    "sampler_sample_us", "late_join_1024x100_s",
}


@pytest.mark.timeout(115)
def test_run_all_quick_prints_every_benchmark_as_json_lines() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run_all.py"), "--quick"],
        cwd=str(REPO), capture_output=True, text=True, timeout=110,
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
