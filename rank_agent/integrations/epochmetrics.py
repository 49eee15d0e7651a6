"""Which of Lightning's ``callback_metrics`` an epoch record carries as scalars.

A metric logged with ``on_step=True, on_epoch=True`` appears three times: ``acc_step`` (the
last batch), ``acc_epoch`` and ``acc`` (both the epoch's value). Sent as they come, the epoch
chart drew ``acc`` and ``acc_epoch`` as one line twice. Kept: the plain name, once. Pure (no
framework import), so the rule is tested without torch.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping


def epoch_scalars(metrics: Mapping[str, Any]) -> Dict[str, Any]:
    """``metrics`` without the ``*_step`` forms, and without ``X_epoch`` where ``X`` is there."""
    kept = {name: value for name, value in metrics.items() if not name.endswith("_step")}
    return {name: value for name, value in kept.items()
            if not (name.endswith("_epoch") and name[: -len("_epoch")] in kept)}
