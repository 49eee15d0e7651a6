"""Hugging Face Trainer: examples/transformers_example.py under torchrun with 2 processes on
the CPU (no run id in the environment) against a real broker."""
from __future__ import annotations

import sys

import pytest

from tests.support.integrations import EXAMPLES, REPO, example_env, run_script, torchrun

SCRIPT = str(EXAMPLES / "transformers_example.py")


def test_torchrun_trainer_reports_steps_from_both_ranks_and_completes(broker, web) -> None:
    # 96 samples / 4 per device / 2 processes = 12 steps per epoch, 2 epochs
    run_script([*torchrun(2), SCRIPT, "--epochs", "2", "--samples", "96"], example_env(broker),
               cwd=REPO)
    runs = web.runs()
    assert len(runs) == 1, f"the two processes must agree on one run id, got {runs}"
    run = runs[0]
    assert run.startswith("GPT2LMHeadModel-")
    state = web.wait_ended(run)
    assert state["status"] == "complete"
    assert state["world_size"] == 2
    assert state["total_epochs"] == 2
    assert state["total_steps"] == 24  # 8.5: state.max_steps
    meta = state["metadata"]
    assert meta["framework"] == "transformers"
    assert meta["training_arguments"]["logging_steps"] == 1
    assert meta["training_arguments"]["per_device_train_batch_size"] == 4
    assert meta["model_config"]["n_embd"] == 16
    assert [r["rank"] for r in state["ranks"]] == [0, 1]
    assert all(r["step"] == 24 and r["step_ms"] > 0 for r in state["ranks"])

    records = state["records"]
    assert [r["epoch"] for r in records] == [0, 1]
    for rec in records:
        assert rec["missing_ranks"] == []
        assert rec["metrics"]["loss"] > 0
        assert rec["metrics"]["learning_rate"] > 0

    assert state["steps_done"] == 24
    assert {"loss", "learning_rate", "grad_norm"} <= set(state["step_metrics"])
    assert not {"train_runtime", "train_loss", "epoch"} & set(state["step_metrics"])
    rows = web.steps_csv(run)
    assert [int(r["step"]) for r in rows] == list(range(1, 25))
    for row in rows:
        assert int(row["n"]) == 2, row
        assert int(row["samples"]) == 8
        assert int(row["tokens"]) == 128  # 16 tokens x 4 samples x 2 processes
        # the Trainer averages loss over processes before on_log: the ranks agree ...
        assert row["loss_min"] == row["loss_max"] and float(row["loss_mean"]) > 0
        assert float(row["learning_rate_mean"]) > 0
    # ... while the step times are each process's own (the straggler board)
    assert any(r["step_ms_min"] != r["step_ms_max"] for r in rows[1:])
    assert {r["slowest_rank"] for r in rows[1:]} <= {"0", "1"}
    assert sum(r["slowest_share"] for r in state["ranks"]) == pytest.approx(1.0)


def test_a_train_that_raises_ends_failed(broker, web) -> None:
    """The Trainer has no exception event: the exit guard sends finish("error")."""
    proc = run_script([sys.executable, SCRIPT, "--epochs", "1", "--samples", "32",
                       "--fail-step", "3"], example_env(broker), cwd=REPO, expect_ok=False)
    assert "failing on purpose at step 3" in proc.stderr
    (run,) = web.runs()
    state = web.wait_ended(run)
    assert state["status"] == "failed"
    assert [f.status for f in broker.frames(run, "finish")] == ["error"]
    # 8.2: the exit guard sends the uncaught exception itself
    (err,) = [f.error for f in broker.frames(run, "finish")]
    assert (err.type, err.message) == ("RuntimeError", "failing on purpose at step 3")
    assert [int(r["step"]) for r in web.steps_csv(run)] == [1, 2, 3]
