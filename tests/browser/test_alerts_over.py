"""Alerts that are over read as over, and finished ranks are healthy (issue 34, item 3), in a
real Chromium against the real stack: 8 ranks hang (8 ``stalled`` alerts, a red group),
step again (the group reads "all resolved", the box is no longer a red banner, and the rank
count says "8 stalled" while they hang, not "0 live"), then finish (``healthy ranks 8/8``,
every alert "resolved · run ended <time>")."""
from __future__ import annotations

import re
import time
from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.support.browser import Stack

pytestmark = pytest.mark.browser

WORLD = 8
RUN = "alerts-over"


def steps(rank: int, first: int, n: int) -> wire.Steps:
    now = time.time()
    return wire.Steps(run=RUN, rank=rank, steps=list(range(first, first + n)),
                      times=[now] * n, step_ms=[100.0] * n)


def stall(rank: int) -> wire.Stacks:
    frames = [wire.StackFrame(file="/job/train.py", line=41, function="train_step", code="")]
    return wire.Stacks(run=RUN, rank=rank, reason="stall", taken_at=time.time(), idle_s=60.0,
                       threads=[wire.ThreadStack(name="MainThread", frames=frames, main=True)])


def test_recovered_and_finished_runs_do_not_alarm(stack: Stack, page: Any) -> None:
    for r in range(WORLD):
        stack.send(wire.Register(run=RUN, rank=r, world_size=WORLD, host=f"node-{r // 4}",
                                 local_rank=r % 4))
    stack.send(*(steps(r, 1, 5) for r in range(WORLD)))
    stack.send(*(stall(r) for r in range(WORLD)))
    page.goto(f"{stack.url}/#run={RUN}")
    alerts = page.locator("#alerts")
    group = alerts.locator('.alert-group[data-kind="stalled"]')
    expect(group).to_have_attribute("data-state", "active")
    expect(group.locator(".alert-summary")).to_have_text("8 ranks stalled")
    expect(alerts).to_have_attribute("data-state", "active")
    expect(page.locator("#rank-count")).to_have_text("8/8 live · 8 stalled")

    stack.send(*(steps(r, 6, 5) for r in range(WORLD)))  # every rank steps again
    expect(group.locator(".alert-summary")).to_have_text("8 ranks were stalled · all resolved")
    expect(group).to_have_attribute("data-state", "resolved")
    expect(alerts).to_have_attribute("data-state", "resolved")
    expect(page.locator("#rank-count")).to_have_text("8/8 live")
    group.locator(".alert-toggle").click()
    expect(alerts.locator('.alert-group-list .alert[data-state="resolved"]')).to_have_count(WORLD)
    expect(alerts.locator(".alert-at").first).to_have_text("resolved · stepping again")

    stack.send(*(wire.Finish(run=RUN, rank=r) for r in range(WORLD)))
    expect(page.locator("#status")).to_have_attribute("data-status", "complete")
    expect(page.locator("#kpi-ranks")).to_have_text("8/8")
    expect(page.locator("#kpi-ranks")).not_to_have_class("bad")
    expect(alerts.locator(".alert-at").first).to_have_text(
        re.compile(r"^resolved · run ended \d\d:\d\d:\d\d$"))
    assert page.evaluate(
        "getComputedStyle(document.getElementById('alerts')).backgroundColor") == "rgba(0, 0, 0, 0)"
    page.errors.check()
