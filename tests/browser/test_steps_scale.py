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
