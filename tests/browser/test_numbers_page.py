"""Numbers that go wrong on the page (PROTOCOL.md 8.3) in a real headless Chromium, against
the real stack (``rankboard up``): the trouble card names the first non-finite rank and step,
and a replica that disagrees with its rank, host and since when; each metric's step chart
marks the step; a metric name built to run script stays inert text; a saved report.html says
the same."""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.support.browser import HOSTILE, Stack
from tests.support.polling import wait_for

pytestmark = pytest.mark.browser

WORLD = 64
FIRST, LAST = 41_190, 41_211
NAN_AT, ODD_FROM = 41_205, 41_200


def host(rank: int) -> str:
    return "node-" + "abcdefghijklmnopq"[(rank + 4) // 4]  # rank 7 on node-c


def frames(run: str) -> list[Any]:
    steps = list(range(FIRST, LAST + 1))
    now = time.time()
    out = []
    for rank in range(WORLD):
        loss = [math.nan if (rank in (13, 40, 50) and s >= NAN_AT) else 2.0 + rank / 100
                for s in steps]
        gn = [1.5 + (0.25 if rank == 7 and s >= ODD_FROM else 0.0) for s in steps]
        hostile = [math.inf if (rank == 9 and s == LAST) else 1.0 for s in steps]
        out.append(wire.Steps(run=run, rank=rank, steps=steps, times=[now] * len(steps),
                              step_ms=[100.0] * len(steps),
                              metrics={"loss": loss, "grad_norm": gn, HOSTILE: hostile}))
    return out


NONFINITE = "loss is nan at step 41,205 on rank 13 first (3 ranks)"
DIVERGENCE = ("grad_norm on rank 7 disagrees with the other 63 ranks since step 41,200 "
              "(12 steps): silent data corruption? node-c")


def test_the_trouble_card_names_the_first_nan_rank_and_the_odd_replica(
        stack: Stack, page: Any, tmp_path: Path) -> None:
    run = "numbers-page"
    for rank in range(WORLD):
        stack.send(wire.Register(run=run, rank=rank, world_size=WORLD, host=host(rank),
                                 replicated=["grad_norm"]))
    page.goto(f"{stack.url}/#run={run}")
    expect(page.locator("#run-picker")).to_have_value(run)
    stack.send(*frames(run))
    card = page.locator("#stall-view [data-testid=numbers-trouble]")
    expect(card.locator(".verdict-line").nth(0)).to_have_text(NONFINITE, timeout=20_000)
    expect(card.locator(".verdict-line").nth(1)).to_have_text(
        f"{HOSTILE} is inf at step 41,211 on rank 9 first (1 rank)")
    expect(card.locator(".verdict-line").nth(2)).to_have_text(DIVERGENCE)
    assert page.evaluate("() => window.__pwned") is None
    assert page.locator("#stall-view img").count() == 0

    def marks(metric: str) -> Any:
        snap = page.evaluate("(m) => window.__rankboard.stepChart(m)", metric)
        return [m["step"] for m in (snap or {}).get("markers", [])] or None

    assert wait_for(lambda: marks("loss"), 20.0, "the loss chart's marker") == [NAN_AT]
    assert wait_for(lambda: marks("grad_norm"), 20.0, "the grad_norm chart's marker") == [ODD_FROM]
    # the report, saved from the web, says the same
    report = tmp_path / "numbers.html"
    status, body = stack_get(stack, f"/api/runs/{run}/report.html")
    assert status == 200
    report.write_bytes(body)
    page.goto(report.resolve().as_uri())
    saved = page.locator("[data-testid=numbers-trouble] .verdict-line")
    expect(saved.nth(0)).to_have_text(NONFINITE)
    expect(saved.nth(2)).to_have_text(DIVERGENCE)
    assert page.evaluate("() => window.__pwned") is None
    page.errors.check()


def stack_get(stack: Stack, path: str) -> tuple[int, bytes]:
    import urllib.request
    with urllib.request.urlopen(stack.url + path, timeout=30) as r:  # noqa: S310 (loopback)
        return r.status, r.read()
