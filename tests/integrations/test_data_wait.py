"""The data wait through the integrations (PROTOCOL.md 7.1): a real Lightning fit and a real
Hugging Face Trainer under torchrun on the CPU (gloo, 2 ranks) whose rank 1 has a slow
``Dataset`` (tests/integrations/slowdata.py); the callbacks call ``batch_ready`` for the
user, and the broker names rank 1 in the header's ``data_stragglers``, raises its
``data_straggler`` alert, and every closed step carries ``data_ms``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.integrations import REPO, example_env, run_script, torchrun

SCRIPT = str(Path(__file__).with_name("slowdata.py"))


def check(web: Any, broker: Any) -> None:
    runs = web.runs()
    assert len(runs) == 1, runs
    run = runs[0]
    state = web.wait_ended(run)
    assert state["status"] == "complete"
    ranks = {r["rank"]: r for r in state["ranks"]}
    # rank 1 waits ~60 ms a step (4 samples x 15 ms) for its batch, rank 0 hardly at all
    assert ranks[1]["data_ms"] > 40, ranks
    assert ranks[0]["data_ms"] is not None and ranks[0]["data_ms"] < ranks[1]["data_ms"] / 2, ranks
    # while their step times are alike (rank 0 waits for rank 1 in the all-reduce)
    assert [e["rank"] for e in state["data_stragglers"]] == [1], state["data_stragglers"]
    entry = state["data_stragglers"][0]
    assert entry["data_ms"] == ranks[1]["data_ms"] and entry["step_ms"] == ranks[1]["step_ms"]
    alerts = [a for a in state["alerts"] if a["kind"] == "data_straggler"]
    assert [a["rank"] for a in alerts] == [1]
    assert alerts[0]["message"].startswith("waits ") and "a step for data (median" in alerts[0]["message"]
    assert "data_ms" not in state["step_metrics"]
    rows = web.steps_csv(run)
    with_data = [r for r in rows if r["data_ms_max"]]
    assert len(with_data) >= len(rows) - 1  # every step but the first has a wait
    # (a step at an epoch's start or end may load less: the loader's last, short batch)
    slow = [r for r in with_data if float(r["data_ms_max"]) > 40]
    assert len(slow) >= len(with_data) - 2, [(r["step"], r["data_ms_max"]) for r in rows]
    assert web.steps(run, "data_ms"), "/steps?metric=data_ms"


@pytest.mark.timeout(300)
def test_lightning_names_the_rank_with_the_slow_dataset(broker, web) -> None:
    run_script([*torchrun(2), SCRIPT, "lightning"], example_env(broker), cwd=REPO)
    check(web, broker)


@pytest.mark.timeout(300)
def test_trainer_names_the_rank_with_the_slow_dataset(broker, web) -> None:
    run_script([*torchrun(2), SCRIPT, "transformers"], example_env(broker), cwd=REPO)
    check(web, broker)
