"""The straggler strip says what it shows (issue 43 item 5), in Chromium over the real
stack: it starts when the page opened (the web keeps no history of it), and a lockstep run,
whose every rank steps as long as the slowest, draws an even strip that now says so
instead of reading as "no straggler"; a run with a slow rank says nothing of lockstep."""
from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser.test_steps_page import open_run, register, send_steps, wait_steps
from tests.support.browser import Stack

pytestmark = pytest.mark.browser


@pytest.mark.parametrize("slow, even", [(None, True), (3, False)])
def test_the_strip_says_since_when_and_lockstep(stack: Stack, page: Any, slow: Any, even: bool) -> None:
    run = f"strip-{'even' if even else 'slow'}"
    register(stack, run, world=4)
    open_run(page, stack, run)
    # batches until the strip has two columns (one per ranks update, which come while the
    # ranks step: a strip's column is a live update, not a fetch)
    start = 0
    while start < 1500 and page.evaluate("window.__rankboard.stripColumns()") < 2:
        for r in range(4):
            send_steps(stack, run, r, range(start, start + 100), step_ms=160.0 if r == slow else 100.0)
        wait_steps(stack, run, start + 99)
        start += 100
    assert page.evaluate("window.__rankboard.stripColumns()") >= 2
    what = page.locator("#strip-what")
    expect(what).to_contain_text("since this page opened at", timeout=15_000)
    if even:
        expect(what).to_contain_text("even: the ranks step in lockstep")
    else:
        expect(what).not_to_contain_text("lockstep")
    page.errors.check()
