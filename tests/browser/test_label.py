"""The run's label (PROTOCOL.md section 7.5) on the page, in a real Chromium: a plain
torchrun job is a bare UUID, so the page shows the register's label first and the id beside
it, as text (a label is the job's string: it never reaches innerHTML)."""
from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.support.browser import HOSTILE, Stack, epoch

pytestmark = pytest.mark.browser

UUID = "3f9c1e2a-7b4d-4c8e-9a1f-5d2e6b8c0a17"


def test_a_uuid_run_shows_its_register_label_first_and_the_id_beside(stack: Stack, page: Any) -> None:
    label = f"train_gpt {HOSTILE}"
    for r in range(2):
        stack.send(wire.Register(run=UUID, rank=r, world_size=2, host="node-a", local_rank=r,
                                 total_epochs=2, label=label))
    epoch(stack, UUID, 0, range(2), loss=1.5)
    stack.wait_run(UUID, epochs=1)
    page.goto(f"{stack.url}/#run={UUID}")
    expect(page.locator("#run-name")).to_have_text(label)
    expect(page.locator("#run-id")).to_have_text(UUID)
    expect(page.locator("#run-picker option", has_text="train_gpt")).to_have_count(1)
    assert page.evaluate("window.__pwned === undefined")
    page.errors.check()


def test_compare_shows_each_runs_whole_id_under_its_label(stack: Stack, page: Any) -> None:
    """Demo-like ids share a long prefix: cut with an ellipsis they all read alike."""
    runs = [f"demo-steps-20261203-164816-{i}" for i in (1, 2, 3)]
    for i, run in enumerate(runs, 1):
        stack.send(wire.Register(run=run, rank=0, world_size=1, host="node-a",
                                 label=f"demo steps · round {i}"))
        epoch(stack, run, 0, range(1), loss=1.0)
    for run in runs:
        stack.wait_run(run, epochs=1)
    page.goto(f"{stack.url}/#run={runs[0]}")
    page.locator("#compare-btn").click()
    for i, run in enumerate(runs, 1):
        name = page.locator(f'#compare-view .compare-run[data-run="{run}"] .compare-run-name')
        expect(name).to_contain_text(f"demo steps · round {i}")
        expect(name.locator(".compare-run-id")).to_have_text(run)
        assert name.evaluate("e => e.scrollWidth <= e.clientWidth + 1")  # nothing cut off
    page.errors.check()
