"""``rankboard demo --rounds 1 --data-dir DIR``: one round of each job, each run labelled,
then no new run while the dashboard stays up; the runs stay in DIR, so ``rankboard export``
finds them after the demo. The epoch job's run fails, its first failure named (8.2)."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.http import get_json
from tests.support.polling import wait_for


def test_one_round_then_no_new_run_and_the_runs_export(spawn: Any, tmp_path: Path) -> None:
    data = tmp_path / "demo-data"
    demo = spawn("demo", "--port", "0", "--ranks", "2", "--hosts", "1", "--epochs", "2",
                 "--epoch-seconds", "0.3", "--no-browser", "--rounds", "1", "--data-dir", str(data))
    port = demo.wait_dashboard(timeout=30)

    def both_done() -> Any:
        out = demo.output()
        return out.count("round(s) done; no new run") == 2 and out
    wait_for(both_done, timeout=90, what="both jobs' one round")
    runs = get_json(port, "/api/runs")
    assert sorted(r["label"] for r in runs) == ["demo steps · round 1", "demo-cnn · demo epochs · round 1"]
    by_label = {r["label"]: r for r in runs}
    # the epoch job fails every round: rank 1 runs out of memory first, rank 0 after it in
    # the collective (8.2); the step job completes
    steps_run = by_label["demo steps · round 1"]
    assert steps_run["status"] == "complete"
    # the step job failed at 80 % of its steps and was restarted from its checkpoint (8.1):
    # one run, two attempts, the first's cause the rank whose GPU fell off the bus
    header = get_json(port, f"/api/runs/{steps_run['run']}")
    assert header["attempt"] == 1
    first, second = header["attempts"]
    assert first["cause"]["type"] == "torch.AcceleratorError"
    assert (first["last_step"], second["first_step"]) == (79, 72)
    assert first["superseded_steps"] == 8
    assert header["steps_done"] == 99
    epoch_run = by_label["demo-cnn · demo epochs · round 1"]
    assert epoch_run["status"] == "failed"
    failure = get_json(port, f"/api/runs/{epoch_run['run']}")["failure"]
    assert (failure["first"]["rank"], failure["first"]["type"]) == (1, "torch.OutOfMemoryError")
    assert [(g["type"], g["ranks"]) for g in failure["groups"]] == [
        ("torch.OutOfMemoryError", [1]), ("torch.distributed.DistBackendError", [0])]
    assert demo.stop(signal.SIGINT, timeout=20) == 0
    assert "Traceback" not in demo.output()
    for r in runs:
        out = tmp_path / f"{r['run']}.html"
        done = subprocess.run([sys.executable, "-m", "rankboard", "export", r["run"],
                               "--data-dir", str(data), "-o", str(out)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert out.stat().st_size > 10_000
