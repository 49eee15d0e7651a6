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
