"""Accelerate: examples/accelerate_example.py against a real broker: the tracker's one-rank
run from the main process (2 processes under torchrun), the README's per-rank recipe in the
same job, and ``log_with="rankboard"``."""
from __future__ import annotations

import subprocess
import sys
import uuid

from tests.integrations.support import EXAMPLES, REPO, example_env, run_script, torchrun

SCRIPT = str(EXAMPLES / "accelerate_example.py")


def test_tracker_and_per_rank_recipe_in_a_two_process_job(broker) -> None:
    job = uuid.uuid4().hex[:12]
    # 256 samples / 16 per batch / 2 processes = 8 steps per epoch, 2 epochs
    run_script([*torchrun(2, run_id=job), SCRIPT, "--epochs", "2"], example_env(broker), cwd=REPO)
    assert sorted(broker.runs()) == sorted([f"accelerate-{job}", job])

    # the tracker: the main process as a one-rank run, accelerator.log values as steps
    tracked = broker.wait_ended(f"accelerate-{job}")
    header = tracked["header"]
    assert header["status"] == "complete"
    assert header["world_size"] == 1
    assert header["metadata"]["framework"] == "accelerate"
    assert header["metadata"]["config"] == {"lr": 0.05, "batch_size": 16, "epochs": 2}
    points = broker.step_points(f"accelerate-{job}")
    assert list(points) == [0]
    assert sorted(points[0]) == list(range(1, 17))
    assert all(p["metrics"]["loss"] > 0 and p["metrics"]["lr"] == 0.05
               for p in points[0].values())
    assert header["steps_done"] == 16
    assert header["step_metrics"] == ["loss", "lr"]
    assert [f.status for f in broker.frames(f"accelerate-{job}", "finish")] == ["ok"]

    # the per-rank recipe: every process's step times, and the run completes
    per_rank = broker.wait_ended(job)
    assert per_rank["header"]["status"] == "complete"
    assert per_rank["header"]["world_size"] == 2
    points = broker.step_points(job)
    assert sorted(points) == [0, 1]
    for mine in points.values():
        assert sorted(mine) == list(range(1, 17))
        assert all(p["samples"] == 16 for p in mine.values())
        assert all(mine[s]["step_ms"] > 0 for s in range(2, 17))
    assert per_rank["header"]["steps_done"] == 16
    assert all(r["step_ms"] is not None for r in per_rank["ranks"])


def test_log_with_rankboard_by_name(broker) -> None:
    run_script([sys.executable, SCRIPT, "--epochs", "1", "--by-name"], example_env(broker),
               cwd=REPO)
    (tracked,) = [r for r in broker.runs() if r.startswith("tiny-accelerate-")]
    header = broker.wait_ended(tracked)["header"]
    assert header["status"] == "complete"
    assert header["world_size"] == 1
    assert header["metadata"]["config"]["epochs"] == 1
    assert sorted(broker.step_points(tracked)[0]) == list(range(1, 17))


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
