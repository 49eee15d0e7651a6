"""Hugging Face Trainer: examples/transformers_example.py under torchrun with 2 processes on
the CPU (no run id in the environment) against a real broker."""
from __future__ import annotations

import sys

from tests.integrations.support import EXAMPLES, REPO, example_env, run_script, torchrun

SCRIPT = str(EXAMPLES / "transformers_example.py")


def test_torchrun_trainer_reports_steps_from_both_ranks_and_completes(broker) -> None:
    # 96 samples / 4 per device / 2 processes = 12 steps per epoch, 2 epochs
    proc = run_script([*torchrun(2), SCRIPT, "--epochs", "2", "--samples", "96"],
                      example_env(broker), cwd=REPO)
    runs = broker.runs()
    assert len(runs) == 1, f"the two processes must agree on one run id, got {runs}"
    run = runs[0]
    assert run.startswith("GPT2LMHeadModel-")
    snap = broker.wait_ended(run)
    header = snap["header"]
    assert header["status"] == "complete", proc.stderr[-3000:]
    assert header["world_size"] == 2
    assert header["total_epochs"] == 2
    meta = header["metadata"]
    assert meta["framework"] == "transformers"
    assert meta["training_arguments"]["logging_steps"] == 1
    assert meta["training_arguments"]["per_device_train_batch_size"] == 4
    assert meta["model_config"]["n_embd"] == 16
    assert sorted(r["rank"] for r in snap["ranks"]) == [0, 1]

    records = [r for _, r in snap["records"]]
    assert [r["epoch"] for r in records] == [0, 1]
    for rec in records:
        assert rec["missing_ranks"] == []
        assert rec["metrics"]["loss"] > 0
        assert "learning_rate" in rec["metrics"]

    points = broker.step_points(run)
    assert sorted(points) == [0, 1]
    for rank, mine in points.items():
        assert sorted(mine) == list(range(1, 25)), (rank, sorted(mine))
        for step, p in mine.items():
            assert p["metrics"]["loss"] > 0
            assert p["metrics"]["learning_rate"] > 0
            assert p["samples"] == 4
            assert p["tokens"] > 0
            if step > 1:
                assert p["step_ms"] is not None and p["step_ms"] > 0
    # the Trainer averages loss over processes before logging: both ranks send the same
    assert all(points[0][s]["metrics"]["loss"] == points[1][s]["metrics"]["loss"]
               for s in range(1, 25))
    # ... while step times are each rank's own
    assert any(points[0][s]["step_ms"] != points[1][s]["step_ms"] for s in range(2, 25))
    # every step's tokens add up to the job's (16 tokens x 4 samples x 2 processes)
    assert all(points[0][s]["tokens"] + points[1][s]["tokens"] == 128 for s in range(1, 25))
    assert header["steps_done"] == 24
    assert {"loss", "learning_rate"} <= set(header["step_metrics"])
    assert "train_runtime" not in header["step_metrics"]
    assert all(r["step_ms"] is not None for r in snap["ranks"])


def test_a_train_that_raises_ends_failed(broker) -> None:
    """The Trainer has no exception event: the exit guard sends finish("error")."""
    proc = run_script([sys.executable, SCRIPT, "--epochs", "1", "--samples", "32",
                       "--fail-step", "3"], example_env(broker), cwd=REPO, expect_ok=False)
    assert "failing on purpose at step 3" in proc.stderr
    (run,) = broker.runs()
    header = broker.wait_ended(run)["header"]
    assert header["status"] == "failed"
    assert [f.status for f in broker.frames(run, "finish")] == ["error"]
    assert sorted(broker.step_points(run)[0]) == [1, 2, 3]
