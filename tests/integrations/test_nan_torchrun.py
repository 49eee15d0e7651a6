"""The first rank with a NaN, for real (PROTOCOL.md 8.3): a ``torchrun`` DDP job of three
gloo ranks on CPU (tests/integrations/nan_child.py) in which one rank's batch is poisoned with
a NaN at a known step, reporting to a real broker; the board names that rank and that step,
and the replicated gradient norm (NaN on every rank once the all-reduce spread it) goes to
the non-finite rule, not to the divergence rule: the replicas never disagree."""
from __future__ import annotations

import subprocess
import uuid
from typing import Any

from tests.support import polling
from tests.support.integrations import REPO, example_env, torchrun

CHILD = str(REPO / "tests" / "integrations" / "nan_child.py")
NAN_RANK, NAN_STEP = 1, 17


def test_the_board_names_the_rank_whose_batch_was_poisoned(broker: Any, web: Any) -> None:
    run = f"nan-{uuid.uuid4().hex[:8]}"
    env = example_env(broker, RANKBOARD_RUN=run, NAN_RANK=str(NAN_RANK), NAN_STEP=str(NAN_STEP))
    done = subprocess.run([*torchrun(3), CHILD], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    header = broker.wait_ended(run, timeout=60)["header"]
    assert header["status"] == "complete" and header["steps_done"] == 29
    by_metric = {e["metric"]: e for e in header["nonfinite"]}
    assert by_metric["loss"] == {"metric": "loss", "step": NAN_STEP, "rank": NAN_RANK,
                                 "host": by_metric["loss"]["host"], "ranks": [NAN_RANK],
                                 "attempt": 0}
    assert by_metric["loss"]["host"]  # the rank's host, as it registered
    # the all-reduce spread it: the replicated norm is NaN on every rank at that very step
    assert (by_metric["grad_norm"]["step"], by_metric["grad_norm"]["ranks"]) == (
        NAN_STEP, [0, 1, 2])
    assert header["replica_divergence"] == []
    alerts = {(a["kind"], a["rank"]): a["message"] for a in header["alerts"]}
    assert alerts[("nonfinite", NAN_RANK)] == (
        f"loss is nan at step {NAN_STEP}: first non-finite loss (1 rank)")
    assert alerts[("nonfinite", None)] == (
        f"grad_norm is nan at step {NAN_STEP}: first non-finite grad_norm (3 ranks)")
    assert not any(kind == "replica_divergence" for kind, _ in alerts)
    # the web serves the same
    served = polling.wait_for(lambda: web.run(run)["nonfinite"] or None, 20.0, "the web's header")
    assert served == header["nonfinite"]
