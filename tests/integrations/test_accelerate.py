"""Accelerate: examples/accelerate_example.py under real torchrun (2 CPU processes) against a
real broker: one run per job, named as ``RankAgent.from_env`` names it, every process a rank
(PROTOCOL.md section 5, the Accelerate bullet); the tracker alone, the tracker with the
README's per-rank recipe, ``log_with="rankboard"``, and a failing process."""
from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any, Dict

from tests.support.integrations import EXAMPLES, REPO, example_env, run_script, torchrun

SCRIPT = str(EXAMPLES / "accelerate_example.py")
STEPS = 16  # 256 samples / 16 per batch / 2 processes = 8 steps per epoch, 2 epochs


def _job(broker: Any, *flags: str, expect_ok: bool = True) -> tuple[str, Any]:
    """Run the example under torchrun with RANKBOARD_RUN set, as a user names a run."""
    run = f"exp-{uuid.uuid4().hex[:10]}"
    env = example_env(broker, RANKBOARD_RUN=run)
    proc = run_script([*torchrun(2, run_id=uuid.uuid4().hex[:12]), SCRIPT, "--epochs", "2",
                       *flags], env, cwd=REPO, expect_ok=expect_ok)
    return run, proc


def _one_run_of_two_ranks(broker: Any, web: Any, run: str) -> Dict[str, Any]:
    assert web.runs() == [run]  # no prefixed run beside it
    state = web.wait_ended(run)
    assert state["world_size"] == 2
    assert sorted(r["rank"] for r in state["ranks"]) == [0, 1]
    assert {f.rank for f in broker.frames(run, "register")} == {0, 1}  # both processes seen
    return state


def test_tracker_alone_makes_one_run_with_every_process_a_rank(broker, web) -> None:
    run, _ = _job(broker, "--no-recipe")
    state = _one_run_of_two_ranks(broker, web, run)
    assert state["status"] == "complete"
    # the tracker's constructor ran in every process: each sends hardware and resources
    assert {f.rank for f in broker.frames(run, "hardware")} == {0, 1}
    assert {f.rank for f in broker.frames(run, "resources")} == {0, 1}
    assert state["metadata"]["framework"] == "accelerate"
    assert state["metadata"]["config"] == {"lr": 0.05, "batch_size": 16, "epochs": 2}
    assert state["steps_done"] == STEPS
    assert state["step_metrics"] == ["loss", "lr"]
    loss = web.steps(run, "loss")
    assert [b[0] for b in loss] == list(range(1, STEPS + 1)) and all(b[2] > 0 for b in loss)
    finishes = {f.rank: f.status for f in broker.frames(run, "finish")}
    assert finishes == {0: "ok", 1: "ok"}
    # the logged values come from the main process, where Accelerate calls the tracker
    assert {f.rank for f in broker.frames(run, "steps")} == {0}


def test_tracker_and_per_rank_recipe_share_one_agent_and_merge_per_step(broker, web) -> None:
    run, _ = _job(broker)
    state = _one_run_of_two_ranks(broker, web, run)
    assert state["status"] == "complete"
    assert state["steps_done"] == STEPS
    assert all(r["step"] == STEPS and r["step_ms"] > 0 for r in state["ranks"])
    rows = web.steps_csv(run)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert all(int(r["n"]) == 2 and int(r["samples"]) == 32 for r in rows)  # both ranks
    assert all(float(r["step_ms_max"]) > 0 for r in rows[1:])
    loss = web.steps(run, "loss")  # the tracker's values, in the same step points
    assert [b[0] for b in loss] == list(range(1, STEPS + 1)) and all(b[2] > 0 for b in loss)
    # one agent per process: one register each (the tracker's), one finish each
    assert sorted(f.rank for f in broker.frames(run, "register")) == [0, 1]
    assert sorted(f.rank for f in broker.frames(run, "finish")) == [0, 1]


def test_log_with_rankboard_by_name_adopts_the_recipes_agent(broker, web) -> None:
    run, _ = _job(broker, "--by-name")
    state = _one_run_of_two_ranks(broker, web, run)
    assert state["status"] == "complete"
    assert state["metadata"]["project_name"] == "tiny-accelerate"
    assert state["metadata"]["config"]["epochs"] == 2
    rows = web.steps_csv(run)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert all(int(r["n"]) == 2 for r in rows)
    assert len(web.steps(run, "loss")) == STEPS


def test_log_with_rankboard_without_a_launcher_id_names_the_run_by_project(broker, web) -> None:
    run_script([sys.executable, SCRIPT, "--epochs", "1", "--by-name", "--no-recipe"],
               example_env(broker), cwd=REPO)
    (tracked,) = web.runs()
    assert tracked.startswith("tiny-accelerate-")
    state = web.wait_ended(tracked)
    assert state["status"] == "complete"
    assert state["world_size"] == 1
    assert state["metadata"]["config"]["epochs"] == 1
    assert [int(r["step"]) for r in web.steps_csv(tracked)] == list(range(1, 17))


def test_a_failing_process_fails_the_run(broker, web) -> None:
    run, proc = _job(broker, "--fail-rank", "1", expect_ok=False)
    assert "process 1 failing on purpose" in proc.stderr
    state = _one_run_of_two_ranks(broker, web, run)
    assert state["status"] == "failed"
    assert {f.rank: f.status for f in broker.frames(run, "finish")} == {0: "ok", 1: "error"}
    assert {a["kind"] for a in state["alerts"]} == {"rank_error"}
    # 8.2: the failing process's exception, through the exit rule
    err = {f.rank: f.error for f in broker.frames(run, "finish")}
    assert err[0] is None and (err[1].type, err[1].message) == (
        "RuntimeError", "process 1 failing on purpose")
    assert state["failure"]["first"]["rank"] == 1


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
