"""The page's "Cluster resources" (issue 34, item 5): a time series of the ranks' samples
(``GET /api/runs/<run>/resources``), shown for a run that logs steps and no epoch (before,
the chart was one point per epoch and a step-only run had none)."""
from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.browser.test_steps_page import open_run, register, send_steps, wait_steps
from tests.support.browser import Stack, wait_js
from tests.support.polling import wait_for

pytestmark = pytest.mark.browser
GIB = 1 << 30


def samples(stack: Stack, run: str, cpu: float) -> None:
    for r in range(2):
        stack.send(wire.Resources(run=run, rank=r, sample=wire.ResourceSample(
            cpu_percent=cpu + r, ram_used_bytes=8 * GIB, ram_total_bytes=64 * GIB,
            gpu_util_percent=90.0, vram_allocated_bytes=40 * GIB, vram_total_bytes=80 * GIB)))


def test_a_step_runs_resources_are_a_series_over_time(stack: Stack, page: Any) -> None:
    run = "resources-steps"
    register(stack, run, world=2)
    for r in range(2):
        send_steps(stack, run, r, range(0, 50))
    wait_steps(stack, run, 49)
    samples(stack, run, 10.0)
    open_run(page, stack, run)
    card = page.locator("#resources-card")
    # the samples change while the page is open: the series grows (the page reads it again
    # as the ranks update) until it has two points and the chart shows
    cpu = 10.0

    def two_points() -> Any:
        nonlocal cpu
        cpu += 5.0
        samples(stack, run, cpu)
        got = page.evaluate("window.__rankboard.resources()")
        return got if got["points"] >= 2 else None

    got = wait_for(two_points, 30, "two points of the series on the page", interval=0.5)
    assert got["kind"] == "time"
    expect(card).to_be_visible()
    wait_js(page, "(() => { const c = document.querySelector('#resources-card canvas');"
                  " return !!c && c.width > 0; })()")
    expect(card.locator(".chart-title")).to_contain_text("Cluster resources")
    for hidden in ("#metrics-card", "#log-card"):  # the epoch panels still wait for epochs
        expect(page.locator(hidden)).to_be_hidden()
    page.errors.check()
