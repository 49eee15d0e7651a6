"""A step run's end on the page (PROTOCOL 8.5): with ``total_steps`` the header's progress
counts steps ("step 200/1,000") and the ETA is the run's, instead of "epoch 0/1 0%" and
"ETA —" for the run's whole life; a step run that does not know its total keeps the epoch
figures."""
from __future__ import annotations

import re
from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.browser.test_steps_page import open_run, send_steps, wait_steps
from tests.support.browser import Stack

pytestmark = pytest.mark.browser


def _register(stack: Stack, run: str, world: int, total_steps: int) -> None:
    for r in range(world):  # one epoch of steps, as the demo's step job and most LM runs say
        stack.send(wire.Register(run=run, rank=r, world_size=world, host="node-000",
                                 local_rank=r, total_epochs=1, total_steps=total_steps))


def test_a_step_run_shows_step_progress_and_its_eta(stack: Stack, page: Any) -> None:
    run = "eta-steps"
    _register(stack, run, 2, 1000)
    for r in range(2):
        send_steps(stack, run, r, range(0, 200), step_ms=100.0)
    wait_steps(stack, run, 199)
    header = stack.get_json(f"/api/runs/{run}")
    assert header["total_steps"] == 1000
    # 800 steps left x the median step_ms (100 ms, +0-8 % per rank and step in send_steps)
    assert 80.0 <= header["eta_secs"] <= 80.0 * 1.09
    open_run(page, stack, run)
    expect(page.locator("#epoch-progress .stat-label")).to_have_text("step", timeout=15_000)
    expect(page.locator("#epoch-count")).to_have_text("200/1,000")
    expect(page.locator("#progress-pct")).to_have_text(re.compile(r"^20%"))
    expect(page.locator("#epoch-progress")).to_be_visible()
    expect(page.locator("#eta")).to_have_text(re.compile(r"^1m \d\ds$"), timeout=10_000)
    # more steps: the progress and the ETA follow the steps, not a header event
    for r in range(2):
        send_steps(stack, run, r, range(200, 900), step_ms=100.0)
    wait_steps(stack, run, 899)
    expect(page.locator("#epoch-count")).to_have_text("900/1,000", timeout=15_000)
    expect(page.locator("#eta")).to_have_text(re.compile(r"^\d+(\.\d)?s$"), timeout=10_000)
    page.errors.check()


def test_a_step_run_without_a_total_keeps_the_epoch_figures(stack: Stack, page: Any) -> None:
    run = "eta-unknown"
    _register(stack, run, 1, 0)
    send_steps(stack, run, 0, range(0, 50))
    wait_steps(stack, run, 49)
    assert stack.get_json(f"/api/runs/{run}")["eta_secs"] is None
    open_run(page, stack, run)
    expect(page.locator("#step-count")).to_have_text("49", timeout=15_000)
    expect(page.locator("#epoch-progress .stat-label")).to_have_text("epoch")
    expect(page.locator("#epoch-count")).to_have_text("0/1")
    expect(page.locator("#eta")).to_have_text("—")
    page.errors.check()
