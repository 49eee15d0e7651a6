"""Issue 32, Low: alert texts never print non-finite numbers (``stalled infs``, ``SM nan
MHz``) and a negative ``idle_s`` is rejected by the schema."""
from __future__ import annotations

import math

from broker.run.gpualerts import GpuAlertRules
from broker.runs import Runs
from broker.stacks.feed import stall_message
from rank_agent.protocol import (
    GpuSample,
    ResourceSample,
    StackFrame,
    Stacks,
    ThreadStack,
    encoder,
)
from tests.support.frames import register


def stall(idle: float) -> Stacks:
    return Stacks(run="r", rank=0, reason="stall", taken_at=1.0, idle_s=idle, threads=[
        ThreadStack(name="MainThread", main=True, frames=[
            StackFrame(file="t.py", line=3, function="all_reduce", code="")])])


def test_a_negative_or_nan_idle_is_a_schema_reject() -> None:
    runs = Runs()
    runs.ingest(encoder.encode(register(run="r")), 1.0)
    for idle in (-3.0, math.nan):
        assert runs.ingest(encoder.encode(stall(idle)), 2.0) == []
    assert runs.rejected.get("schema") == 2
    runs.ingest(encoder.encode(stall(70.0)), 2.0)
    assert runs.rejected.get("schema") == 2  # a valid one still applies


def test_an_infinite_idle_is_said_without_numbers() -> None:
    assert stall_message(stall(math.inf)) == "stalled for an unknown time in all_reduce (t.py:3)"
    assert stall_message(stall(75.4)) == "stalled 75s in all_reduce (t.py:3)"


def test_a_throttle_alert_with_a_nan_clock_leaves_the_clock_out() -> None:
    rules = GpuAlertRules()
    gpu = GpuSample(device_index=0, name="H100", sm_clock_mhz=math.nan,
                    throttle_reasons=["hw_thermal"])
    rules.feed(0, ResourceSample(gpus=[gpu]))
    (alert,) = rules.feed(0, ResourceSample(gpus=[gpu]))
    assert alert.message == "hw_thermal throttling on GPU 0"
    assert "nan" not in alert.message
