"""Attempts for real (PROTOCOL 8.1): a 2-rank torchrun job on CPU restarted by
``--max-restarts 1`` (tests/integrations/restart_child.py). Its first attempt logs steps
0-19 and dies (rank 1 raises); the second, in new processes, resumes from step 10 and ends
at 29. The broker shows one run: attempt 1 of 2, the line 0-29 with 10-29 the second
attempt's, the first attempt's 10-19 superseded and still served, and the restart alert."""
from __future__ import annotations

import subprocess
import uuid
from typing import Any

from broker.run.steps.store import wire_records
from tests.support import polling
from tests.support.integrations import REPO, example_env, torchrun

CHILD = str(REPO / "tests" / "integrations" / "restart_child.py")


def test_a_job_restarted_by_torchrun_is_one_run_with_two_attempts(broker: Any) -> None:
    run = f"restarted-{uuid.uuid4().hex[:8]}"
    env = example_env(broker, RANKBOARD_RUN=run)
    out = subprocess.run([*torchrun(2), "--max-restarts", "1", "--monitor-interval", "1",
                          CHILD], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "simulated crash on the first attempt" in log

    def complete() -> Any:
        if run not in broker.runs():
            return None
        snap = broker.snapshot(run)
        return snap if snap["header"]["status"] == "complete" else None

    snap = polling.wait_for(complete, 60, "the restarted run to complete")
    header = snap["header"]
    assert header["attempt"] == 1, header["attempts"]
    a0, a1 = header["attempts"]
    assert a0["ended_at"] == a1["started_at"] and a1["ended_at"] is None
    assert a0["first_step"] == 0 and a0["last_step"] >= 10, a0
    assert a0["superseded_steps"] == a0["last_step"] - 10 + 1
    assert (a1["first_step"], a1["last_step"], a1["world_size"]) == (10, 29, 2)
    assert header["steps_done"] == 29
    restart = [a for a in header["alerts"] if a["kind"] == "restart"]
    assert restart and restart[0]["message"] == \
        f"restart 1: the previous attempt reached step {a0['last_step']}"
    # the line: each step once, 0-9 of the first attempt (loss 1.0), 10-29 of the second
    records = wire_records(snap["steps"])
    assert [r["step"] for r in records] == list(range(30))
    assert {r["metrics"]["loss"][0] for r in records[:10]} == {1.0}
    assert {r["metrics"]["loss"][0] for r in records[10:]} == {2.0}
    # the superseded records are kept, unchanged
    chunks = snap["line"]["chunks"]
    assert [a for a, _ in chunks] == [0]
    old = wire_records(chunks[0][1])
    assert [r["step"] for r in old] == list(range(10, a0["last_step"] + 1))
    assert {r["metrics"]["loss"][0] for r in old} == {1.0}
    # the only ranks are the second attempt's processes, both finished
    assert sorted(r["rank"] for r in snap["ranks"]) == [0, 1]
    assert {r["status"] for r in snap["ranks"]} == {"finished"}
