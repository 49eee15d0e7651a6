"""Smaller stall-view points of issue 34 (item 7), in a real Chromium against the real stack:
a requested dump whose answers stand where the stall dumps stand is one line, not the same
groups again, and no raw request id shows; a ``stalled`` alert names its file as the stall
view does (``torch/c10d.py``), the whole path in its title."""
from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.support.browser import Stack

pytestmark = pytest.mark.browser

RUN = "stall-answers"
WORLD = 4
DEEP = "/opt/conda/envs/train/lib/python3.11/site-packages/torch/distributed/c10d.py"
FRAMES = [wire.StackFrame(file="/job/train.py", line=41, function="train_step", code="loss.backward()"),
          wire.StackFrame(file=DEEP, line=2050, function="all_reduce", code="work.wait()")]


def dump(rank: int, reason: str, request_id: str = "") -> wire.Stacks:
    return wire.Stacks(run=RUN, rank=rank, reason=reason, request_id=request_id,
                       taken_at=time.time(), idle_s=75.0 if reason == "stall" else 0.0,
                       threads=[wire.ThreadStack(name="MainThread", frames=FRAMES, main=True)])


def test_an_answer_like_the_stall_is_one_line_and_alerts_use_short_files(stack: Stack, page: Any) -> None:
    for r in range(WORLD):
        stack.send(wire.Register(run=RUN, rank=r, world_size=WORLD, host="node-a", local_rank=r))
    stack.send(*(dump(r, "stall") for r in range(WORLD)))
    page.goto(f"{stack.url}/#run={RUN}")
    view = page.locator("#stall-view")
    expect(view.locator("[data-testid=stall-group]")).to_have_count(1)

    req = urllib.request.Request(f"{stack.url}/api/runs/{RUN}/stacks", method="POST",
                                 data=json.dumps({"kind": "stacks"}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        request_id = json.loads(resp.read())["request_id"]
    stack.send(*(dump(r, "request", request_id) for r in range(WORLD)))
    expect(view.locator(".stall-agree")).to_have_text(
        "the requested dump: 4 ranks still where the groups above show")
    expect(view.locator("[data-testid=stall-group]")).to_have_count(1)
    assert request_id not in (view.text_content() or "")

    group = page.locator('#alerts .alert-group[data-kind="stalled"]')
    expect(group).to_be_visible()
    group.locator(".alert-toggle").click()
    msg = page.locator('#alerts .alert-group-list .alert[data-kind="stalled"] .alert-msg').first
    expect(msg).to_have_text("stalled 75s in all_reduce (distributed/c10d.py:2050)")
    assert msg.get_attribute("title") == f"stalled 75s in all_reduce ({DEEP}:2050)"
    page.errors.check()
