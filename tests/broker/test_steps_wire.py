"""The ``steps`` frame's decode limits (PROTOCOL.md 2.4 and "Limits") through
``Runs.ingest``: every malformed frame rejected, counted and without effect; frames at the
limits accepted."""
from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from broker.runs import Runs
from rank_agent import protocol
from rank_agent.protocol import Steps, encoder
from tests.support.stepdrive import RUN, T0, reg, stp

# ---------------------------------------------------------------- decode limits via Runs.ingest


def raw_steps(**kw: Any) -> bytes:
    d: dict[str, Any] = {"type": "steps", "run": RUN, "rank": 0, "steps": [1, 2],
                         "times": [1.0, 2.0], "step_ms": [10.0, None]}
    d.update(kw)
    return protocol.encoder.encode(d)


P = 1024  # PROTOCOL 2: 1-1024 points (a literal: the test must not follow the code)
BAD_STEPS = [
    ("times_short", raw_steps(times=[1.0]), "steps_shape"),
    ("step_ms_long", raw_steps(step_ms=[1.0, 2.0, 3.0]), "steps_shape"),
    ("samples_short", raw_steps(samples=[1]), "steps_shape"),
    ("tokens_long", raw_steps(tokens=[1, 2, 3]), "steps_shape"),
    ("metric_short", raw_steps(metrics={"loss": [1.0]}), "steps_shape"),
    ("metric_empty", raw_steps(metrics={"ok": [1.0, 2.0], "loss": []}), "steps_shape"),
    ("repeated_step", raw_steps(steps=[1, 1]), "steps_shape"),
    ("decreasing", raw_steps(steps=[2, 1]), "steps_shape"),
    ("decreasing_late", raw_steps(steps=[1, 5, 3], times=[1.0] * 3, step_ms=[None] * 3),
     "steps_shape"),
    ("repeated_zero", raw_steps(steps=[0, 0]), "steps_shape"),
    # past the short-frame loop (8 points), the C-level pass
    ("long_repeat", raw_steps(steps=[*range(10), 9, 11], times=[1.0] * 12,
                              step_ms=[None] * 12), "steps_shape"),
    ("long_decreasing_end", raw_steps(steps=[*range(1, 12), 0], times=[1.0] * 12,
                                      step_ms=[None] * 12), "steps_shape"),
    ("long_metric_short", raw_steps(steps=list(range(12)), times=[1.0] * 12,
                                    step_ms=[None] * 12,
                                    metrics={"a": [1.0] * 12, "b": [1.0] * 11}), "steps_shape"),
    ("no_points", raw_steps(steps=[], times=[], step_ms=[]), "schema"),
    ("1025_points", raw_steps(steps=list(range(P + 1)), times=[1.0] * (P + 1),
                              step_ms=[None] * (P + 1)), "schema"),
    ("65_names", raw_steps(metrics={f"m{i}": [1.0, 2.0] for i in range(65)}), "schema"),
    ("long_name", raw_steps(metrics={"n" * 129: [1.0, 2.0]}), "schema"),
    ("step_str", raw_steps(steps=["1", "2"]), "schema"),
    ("step_float", raw_steps(steps=[1.0, 2.0]), "schema"),
    ("time_str", raw_steps(times=["a", 2.0]), "schema"),
    ("time_null", raw_steps(times=[None, 2.0]), "schema"),
    ("step_ms_str", raw_steps(step_ms=["x", None]), "schema"),
    ("metric_str", raw_steps(metrics={"loss": ["x", 1.0]}), "schema"),
    ("metric_bool", raw_steps(metrics={"loss": [True, 1.0]}), "schema"),
    ("metric_not_list", raw_steps(metrics={"loss": 1.0}), "schema"),
    ("metrics_list", raw_steps(metrics=[1.0, 2.0]), "schema"),
    ("samples_float", raw_steps(samples=[1.5, 2]), "schema"),
    ("negative_step", raw_steps(steps=[-1, 2]), "schema"),
    ("negative_samples", raw_steps(samples=[1, -1]), "schema"),
    ("negative_tokens", raw_steps(tokens=[-7, 1]), "schema"),
    ("missing_times", protocol.encoder.encode({"type": "steps", "run": RUN, "rank": 0,
                                               "steps": [1], "step_ms": [None]}), "schema"),
    ("steps_null", raw_steps(steps=None), "schema"),
]


@pytest.mark.parametrize("raw, reason", [(raw, reason) for _, raw, reason in BAD_STEPS],
                         ids=[name for name, _, _ in BAD_STEPS])
def test_bad_steps_frame_is_rejected_counted_and_has_no_effect(raw: bytes, reason: str) -> None:
    runs = Runs()
    assert runs.ingest(raw, T0) == []
    assert runs.rejected == {reason: 1} and runs.accepted == 0
    assert len(runs) == 0  # no run created
    # and on an existing run: nothing changes
    runs.ingest(encoder.encode(reg(0, 1)), T0)
    runs.ingest(encoder.encode(stp(0, [0])), T0 + 1)
    sink = runs.get(RUN)
    assert sink is not None
    before = msgspec.msgpack.encode([sink.snapshot(), sink.late_steps, sink.updated_at])
    assert runs.ingest(raw, T0 + 2) == []
    assert runs.rejected == {reason: 2}
    assert msgspec.msgpack.encode([sink.snapshot(), sink.late_steps, sink.updated_at]) == before


OK_STEPS = [
    ("1024_points", raw_steps(steps=list(range(P)), times=[1.0] * P, step_ms=[None] * P)),
    ("64_names", raw_steps(metrics={f"m{i}": [1.0, None] for i in range(64)})),
    ("128_char_name", raw_steps(metrics={"\u00e9" * 128: [1.0, 2.0]})),
    ("one_point", raw_steps(steps=[0], times=[1.0], step_ms=[None])),
    ("samples_not_sent", raw_steps(samples=[], tokens=[])),
    ("int_and_nonfinite_values", raw_steps(metrics={"loss": [1, math.nan]},
                                          times=[math.inf, 2], step_ms=[-math.inf, 3])),
    ("gaps", raw_steps(steps=[0, 2**62], times=[1.0, 2.0])),
    ("unknown_key", raw_steps(extra={"x": [1, 2]})),
]


@pytest.mark.parametrize("raw", [raw for _, raw in OK_STEPS], ids=[n for n, _ in OK_STEPS])
def test_steps_frames_at_the_limits_are_accepted(raw: bytes) -> None:
    runs = Runs()
    runs.ingest(raw, T0)
    assert runs.rejected == {} and runs.accepted == 1 and RUN in runs


def test_check_steps_rejects_directly() -> None:
    with pytest.raises(protocol.BadSteps):
        protocol.check_steps(Steps(run=RUN, rank=0, steps=[3, 2], times=[1.0, 1.0],
                                   step_ms=[None, None]))
    assert protocol.BadSteps.reason == "steps_shape"
