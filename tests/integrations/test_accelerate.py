"""Accelerate: examples/accelerate_example.py against a real broker: the tracker's one-rank
run from the main process (2 processes under torchrun), the README's per-rank recipe in the
same job, and ``log_with="rankboard"``."""
from __future__ import annotations

import subprocess
import sys
import uuid

from tests.integrations.support import EXAMPLES, REPO, example_env, run_script, torchrun

SCRIPT = str(EXAMPLES / "accelerate_example.py")


def test_tracker_and_per_rank_recipe_in_a_two_process_job(broker, web) -> None:
    job = uuid.uuid4().hex[:12]
    # 256 samples / 16 per batch / 2 processes = 8 steps per epoch, 2 epochs
    run_script([*torchrun(2, run_id=job), SCRIPT, "--epochs", "2"], example_env(broker), cwd=REPO)
    assert sorted(web.runs()) == sorted([f"accelerate-{job}", job])

    # the tracker: the main process as a one-rank run, accelerator.log values as steps
    tracked = web.wait_ended(f"accelerate-{job}")
    assert tracked["status"] == "complete"
    assert tracked["world_size"] == 1
    assert tracked["metadata"]["framework"] == "accelerate"
    assert tracked["metadata"]["config"] == {"lr": 0.05, "batch_size": 16, "epochs": 2}
    assert tracked["steps_done"] == 16
    assert tracked["step_metrics"] == ["loss", "lr"]
    loss = web.steps(f"accelerate-{job}", "loss")
    assert [b[0] for b in loss] == list(range(1, 17)) and all(b[2] > 0 for b in loss)
    assert [f.status for f in broker.frames(f"accelerate-{job}", "finish")] == ["ok"]

    # the per-rank recipe: every process's step times, and the run completes
    per_rank = web.wait_ended(job)
    assert per_rank["status"] == "complete"
    assert per_rank["world_size"] == 2
    assert per_rank["steps_done"] == 16
    assert all(r["step"] == 16 and r["step_ms"] > 0 for r in per_rank["ranks"])
    rows = web.steps_csv(job)
    assert [int(r["step"]) for r in rows] == list(range(1, 17))
    assert all(int(r["n"]) == 2 and int(r["samples"]) == 32 for r in rows)
    assert all(float(r["step_ms_max"]) > 0 for r in rows[1:])


def test_log_with_rankboard_by_name(broker, web) -> None:
    run_script([sys.executable, SCRIPT, "--epochs", "1", "--by-name"], example_env(broker),
               cwd=REPO)
    (tracked,) = [r for r in web.runs() if r.startswith("tiny-accelerate-")]
    state = web.wait_ended(tracked)
    assert state["status"] == "complete"
    assert state["world_size"] == 1
    assert state["metadata"]["config"]["epochs"] == 1
    assert [int(r["step"]) for r in web.steps_csv(tracked)] == list(range(1, 17))


TRACKER_SCRIPT = """
import sys
from rank_agent.integrations.accelerate import RankboardTracker
tracker = RankboardTracker(run=sys.argv[1], sample_interval=None)
tracker.start()
tracker.store_init_configuration({"lr": 0.1})
for step in range(1, 4):
    tracker.log({"loss": 1.0 / step}, step=step)
if sys.argv[2] == "raise":
    raise RuntimeError("training blew up")
# "forget": the script never calls accelerator.end_training()
"""


def test_a_script_that_raises_fails_the_tracker_run_and_one_that_forgets_end_training_does_not(
        broker) -> None:
    for run, how in (("blew-up", "raise"), ("forgot", "forget")):
        proc = subprocess.run([sys.executable, "-c", TRACKER_SCRIPT, run, how],
                              env=example_env(broker), cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert (proc.returncode != 0) == (how == "raise"), proc.stderr
    assert broker.wait_ended("blew-up")["header"]["status"] == "failed"
    assert broker.wait_ended("forgot")["header"]["status"] == "complete"
    assert sorted(broker.step_points("forgot")[0]) == [1, 2, 3]
