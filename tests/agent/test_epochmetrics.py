"""Lightning's epoch metrics as epoch scalars (rank_agent/integrations/epochmetrics.py): a
metric logged on step and on epoch is one series, not ``acc`` and ``acc_epoch`` drawn twice."""
from __future__ import annotations

from rank_agent.integrations.epochmetrics import epoch_scalars


def test_a_metric_logged_on_step_and_epoch_is_one_scalar() -> None:
    metrics = {"acc": 0.9, "acc_step": 0.85, "acc_epoch": 0.9, "val_loss": 0.3,
               "lr_epoch": 1e-3, "loss_step": 1.0}
    assert epoch_scalars(metrics) == {"acc": 0.9, "val_loss": 0.3, "lr_epoch": 1e-3}
