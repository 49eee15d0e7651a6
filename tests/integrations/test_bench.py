"""bench/lightning_overhead.py runs (in this env: it needs lightning) and prints one JSON line
of the shape bench/*.py print. It checks the shape, never a speed."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.support.integrations import REPO


def test_lightning_overhead_quick_prints_one_result_line() -> None:
    out = subprocess.run([sys.executable, str(REPO / "bench" / "lightning_overhead.py"), "--quick"],
                         cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    res = json.loads(line)
    assert res["name"] == "lightning_step_overhead_us" and res["unit"] == "us"
    assert isinstance(res["value"], float) and res["baseline"] > 0 and res["ratio"] > 0
    assert res["_extra"]["hook_us"] > 0 and res["_extra"]["fits"] == 2
