"""A step chart's y axis when a few steps stand far above the rest (the demo's 12 s stall
among ~120 ms steps, a checkpoint's step): on a linear axis every other step lay flat on the
floor, so the chart turns to a log axis by itself when its largest value is over 50x its
median, as it already did past two decades between its smallest and largest. A chart
without such a step stays linear, and the user's choice of the toggle wins."""
from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser.test_steps_page import open_run, register, send_steps, wait_chart, wait_steps
from tests.support.browser import Stack

pytestmark = pytest.mark.browser


def log_button(page: Any, name: str) -> Any:
    return page.locator(f'[data-step-chart="{name}"] [data-action="log"]')


def test_a_stall_step_turns_the_step_time_chart_to_a_log_axis(stack: Stack, page: Any) -> None:
    run = "scale-stall"
    register(stack, run, world=2)
    for r in range(2):
        send_steps(stack, run, r, range(0, 100), step_ms=120.0)
        send_steps(stack, run, r, [100], step_ms=12_000.0)  # the stall
        send_steps(stack, run, r, range(101, 200), step_ms=120.0)
    wait_steps(stack, run, 199)
    open_run(page, stack, run)
    wait_chart(page, "step_ms", lambda s: s["range"] == [0, 199], "the step times drawn")
    expect(log_button(page, "step_ms")).to_have_attribute("aria-pressed", "true")
    # loss and the rates have no such step: linear
    expect(log_button(page, "loss")).to_have_attribute("aria-pressed", "false")
    # the user's choice wins over the rule
    log_button(page, "step_ms").click()
    expect(log_button(page, "step_ms")).to_have_attribute("aria-pressed", "false")
    for r in range(2):
        send_steps(stack, run, r, range(200, 220), step_ms=120.0)
    wait_chart(page, "step_ms", lambda s: s["range"] == [0, 219], "more steps drawn")
    expect(log_button(page, "step_ms")).to_have_attribute("aria-pressed", "false")
    page.errors.check()


def test_a_learning_rate_schedule_stays_linear(stack: Stack, page: Any) -> None:
    """Issue 43 item 5: warmup then cosine to ~0 spans decades by design; on a log axis it
    read as a cliff to 1e-9 at its end. A schedule (lr, learning_rate, Lightning's lr-Adam)
    stays linear by itself; a measurement spanning the same decades still turns to log."""
    import math

    from rank_agent import protocol as wire
    from tests.browser.test_steps_page import T0

    run = "scale-lr"
    register(stack, run, world=2)
    n = 400
    lr = [3e-4 * (s + 1) / 40 if s < 40 else 3e-4 * 0.5 * (1 + math.cos(math.pi * (s - 40) / (n - 41))) + 1e-9
          for s in range(n)]
    noise = [10.0 ** (-(s % 5)) for s in range(n)]  # a measurement over 4 decades: log by itself
    for r in range(2):
        stack.send(wire.Steps(run=run, rank=r, steps=list(range(n)),
                              times=[T0 + s * 0.1 for s in range(n)], step_ms=[100.0] * n,
                              metrics={"lr": lr, "lr-AdamW/pg1": lr, "spread": noise}))
    wait_steps(stack, run, n - 1)
    open_run(page, stack, run)
    for name in ("lr", "lr-AdamW/pg1", "spread"):
        wait_chart(page, name, lambda s: s["range"] == [0, n - 1], f"{name} drawn")
    expect(log_button(page, "lr")).to_have_attribute("aria-pressed", "false")
    expect(log_button(page, "lr-AdamW/pg1")).to_have_attribute("aria-pressed", "false")
    expect(log_button(page, "spread")).to_have_attribute("aria-pressed", "true")
    log_button(page, "lr").click()  # the user may still ask for it
    expect(log_button(page, "lr")).to_have_attribute("aria-pressed", "true")
    page.errors.check()
