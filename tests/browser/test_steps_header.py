"""The step run's header figures (issue 34's leftovers): the steps/s under the step time is a
live rate, measured over the last live batches, so it shows only while the run trains; a
finished run's header says what the step time is (the mean over ranks), not the rate its
last batches happened to have."""
from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.browser.test_steps_page import open_run, register, send_steps, wait_steps
from tests.support.browser import Stack
from tests.support.polling import wait_for

pytestmark = pytest.mark.browser


def test_a_finished_run_shows_no_live_rate(stack: Stack, page: Any) -> None:
    run = "header-rate"
    register(stack, run, world=2)
    for r in range(2):
        send_steps(stack, run, r, range(0, 20))
    wait_steps(stack, run, 19)
    open_run(page, stack, run)
    sub = page.locator("#kpi-epoch-time-sub")
    expect(page.locator("#kpi-time-label")).to_have_text("step time", timeout=15_000)
    # live batches, one after the other: a rate from two or more of them
    last = 19
    for start in range(20, 220, 20):
        for r in range(2):
            send_steps(stack, run, r, range(start, start + 20))
        last = start + 19
        wait_steps(stack, run, last)
        if "steps/s" in (sub.text_content() or ""):
            break
    expect(sub).to_contain_text("steps/s", timeout=10_000)
    for r in range(2):
        stack.send(wire.Finish(run=run, rank=r, status="ok"))
    wait_for(lambda: stack.get_json(f"/api/runs/{run}")["status"] == "complete", 15, "complete")
    # no live rate; the figure says it is the last step's (issue 43 item 3)
    expect(sub).to_have_text(f"at step {last}, run complete", timeout=10_000)
    page.errors.check()
