"""Lightning: examples/lightning_example.py in 2 DDP processes (CPU, gloo) against a real
broker and a real web, as a user runs it: the run the dashboard's HTTP API shows, its ranks,
steps and epochs; a failing fit; the zero-config entry point."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from tests.support import polling
from tests.support.integrations import EXAMPLES, REPO, example_env, run_script

SCRIPT = str(EXAMPLES / "lightning_example.py")


def test_ddp_fit_reports_both_ranks_steps_epochs_and_completes(broker, web) -> None:
    run_script([sys.executable, SCRIPT, "--devices", "2", "--epochs", "2"],
               example_env(broker), cwd=REPO)
    runs = web.runs()
    assert len(runs) == 1, f"the two ranks must agree on one run id, got {runs}"
    run = runs[0]
    assert run.startswith("TinyRegressor-")
    state = web.wait_ended(run)
    assert state["status"] == "complete"
    assert state["world_size"] == 2
    assert state["total_epochs"] == 2
    assert state["total_steps"] == 16  # 8.5: trainer.estimated_stepping_batches
    meta = state["metadata"]
    assert meta["framework"] == "lightning"
    assert meta["hyperparameters"] == {"lr": 0.05, "hidden": 16, "fail_epoch": -1}
    assert meta["trainer"]["max_epochs"] == 2
    assert meta["trainer"]["strategy"] == "DDPStrategy"
    assert [r["rank"] for r in state["ranks"]] == [0, 1]
    for rank in state["ranks"]:
        assert rank["status"] == "finished"
        assert rank["step"] == 16 and rank["step_ms"] > 0
    # RANKBOARD_BROKER is set, so the entry point adds a callback too; it steps aside for the
    # script's own: one register per rank, not two
    assert sorted(f.rank for f in broker.frames(run, "register")) == [0, 1]

    records = state["records"]
    assert [r["epoch"] for r in records] == [0, 1]
    for rec in records:
        assert rec["missing_ranks"] == []
        assert rec["metrics"]["loss"] > 0
        # an epoch-level logged metric, as a scalar, once: Lightning's ``mae_epoch`` twin of
        # ``mae`` is left out (rank_agent/integrations/epochmetrics.py)
        assert "mae" in rec["metrics"] and "mae_epoch" not in rec["metrics"]
        assert "mae_step" not in rec["metrics"]
        assert [g["chunk_ratio"] for g in rec["gpu_metrics"]] == [0.5, 0.5]

    # 256 samples / 16 per batch / 2 ranks = 8 optimizer steps per epoch per rank
    assert state["steps_done"] == 16
    assert state["step_metrics"] == ["loss", "mae_step"]
    rows = web.steps_csv(run)
    assert [int(r["step"]) for r in rows] == list(range(1, 17))
    for row in rows:
        assert int(row["n"]) == 2, row  # both ranks reported every step
        assert int(row["samples"]) == 32
        assert float(row["loss_min"]) > 0 and float(row["mae_step_mean"]) > 0
        if row["step"] != "1":
            assert float(row["step_ms_min"]) > 0
    loss = web.steps(run, "loss")
    assert [b[0] for b in loss] == list(range(1, 17))
    assert all(b[7] == 1 and b[5] <= b[2] <= b[6] for b in loss)  # per step: min <= mean <= max


def test_a_fit_that_raises_in_epoch_1_ends_failed(broker, web) -> None:
    proc = run_script([sys.executable, SCRIPT, "--devices", "2", "--epochs", "2",
                       "--fail-epoch", "1"], example_env(broker), cwd=REPO, expect_ok=False)
    assert "failing on purpose in epoch 1" in proc.stderr
    (run,) = web.runs()
    state = web.wait_ended(run)
    assert state["status"] == "failed"
    assert [r["epoch"] for r in state["records"]] == [0]
    # the ranks array follows the completion by up to a second (ranks events are throttled
    # to one a second): polled with a deadline, as the header is
    polling.wait_for(lambda: [r["status"] for r in web.run(run)["ranks"]] == ["error", "error"],
                     10, "both ranks shown as error")
    assert {a["kind"] for a in state["alerts"]} == {"rank_error"}
    finishes = {f.rank: f.status for f in broker.frames(run, "finish")}
    assert finishes == {0: "error", 1: "error"}
    # 8.2: on_exception's exception goes with the finish, and the board names it
    errors = {f.rank: f.error for f in broker.frames(run, "finish")}
    assert {(e.type, e.message) for e in errors.values()} == {
        ("RuntimeError", "failing on purpose in epoch 1")}
    assert all(e.frames for e in errors.values())
    first = web.run(run)["failure"]["first"]
    assert (first["kind"], first["type"]) == ("error", "RuntimeError")


def test_zero_config_entry_point_adds_the_callback_when_rankboard_broker_is_set(broker) -> None:
    run_script([sys.executable, SCRIPT, "--zero-config", "--epochs", "1"], example_env(broker),
               cwd=REPO)
    (run,) = broker.runs()
    snap = broker.wait_ended(run)
    assert snap["header"]["status"] == "complete"
    assert snap["header"]["world_size"] == 1
    assert len(snap["records"]) == 1
    assert sorted(broker.step_points(run)[0]) == list(range(1, 17))


def test_the_entry_point_factory_returns_nothing_without_rankboard_broker(monkeypatch) -> None:
    from importlib.metadata import entry_points

    from rank_agent.integrations.lightning import RankboardCallback, callbacks_factory

    (ep,) = [e for e in entry_points(group="lightning.pytorch.callbacks_factory")
             if e.name == "rankboard"]
    assert ep.load() is callbacks_factory
    monkeypatch.delenv("RANKBOARD_BROKER", raising=False)
    assert callbacks_factory() == []
    monkeypatch.setenv("RANKBOARD_BROKER", "  ")
    assert callbacks_factory() == []
    monkeypatch.setenv("RANKBOARD_BROKER", "tcp://127.0.0.1:5585")
    (cb,) = callbacks_factory()
    assert isinstance(cb, RankboardCallback) and cb.auto


def test_a_trainer_without_rankboard_broker_gets_no_callback() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RANKBOARD_BROKER"}
    code = ("import lightning.pytorch as pl; from rank_agent.integrations.lightning import "
            "RankboardCallback as C; t = pl.Trainer(logger=False, enable_progress_bar=False); "
            "print(sum(isinstance(c, C) for c in t.callbacks))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0"


def test_the_callback_pickles_without_an_agent_and_checks_its_keywords() -> None:
    """ddp_spawn pickles callbacks into its workers: nothing may be open in __init__."""
    from rank_agent.integrations.lightning import RankboardCallback

    cb = RankboardCallback(run="r1", linger_ms=100, sample_interval=None)
    assert cb.agent is None
    clone = pickle.loads(pickle.dumps(cb))
    assert clone.agent_kwargs == {"run": "r1", "linger_ms": 100}
    assert clone.sample_interval is None and clone.agent is None
    with pytest.raises(TypeError, match="brokr"):
        RankboardCallback(brokr="tcp://x:1")
