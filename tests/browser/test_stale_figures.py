"""A live figure that is no longer live says so, and the answers stay on top (issue 43
item 3), in Chromium over the real stack: during a hang the header's step time and
throughput were the last step's, shown as if current ("1224 samples/s"); now they are
greyed and say at which step and why ("3 ranks stalled"), as they do once the run ended.
And the collective verdict's alert (`collective_behind`, which names the rank a hang waits
for) stays above newer repeats of `stalled` in the alert list."""
from __future__ import annotations

import time
from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.browser.test_collectives_view import coll, stall
from tests.support.browser import Stack
from tests.support.polling import wait_for

pytestmark = pytest.mark.browser

WORLD = 4


def steps(run: str, rank: int, first: int, n: int) -> wire.Steps:
    now = time.time()
    return wire.Steps(run=run, rank=rank, steps=list(range(first, first + n)),
                      times=[now - (n - i) * 0.1 for i in range(n)], step_ms=[100.0] * n,
                      samples=[64] * n, metrics={"loss": [1.0 / (1 + first + i) for i in range(n)]})


def test_a_hang_greys_the_step_figures_and_keeps_the_verdict_on_top(stack: Stack, page: Any) -> None:
    run = "stale-kpis"
    for rank in range(WORLD):
        stack.send(wire.Register(run=run, rank=rank, world_size=WORLD, host=f"node-{rank // 2}"))
    page.goto(f"{stack.url}/#run={run}")
    expect(page.locator("#run-picker")).to_have_value(run)
    for rank in range(WORLD):
        stack.send(steps(run, rank, 0, 30))
    wait_for(lambda: stack.get_json(f"/api/runs/{run}")["steps_done"] == 29, 15.0, "steps 0-29 closed")
    throughput = page.locator("#kpi-throughput")
    expect(throughput).not_to_have_text("—")
    expect(throughput).not_to_have_class("kpi-value mono kpi-stale")
    # the hang: rank 2 never enters the next all_reduce; then every other rank's stall dump
    stack.send(*(coll(run, rank, 31 if rank != 2 else 30) for rank in range(WORLD)))
    wait_for(lambda: any(a["kind"] == "collective_behind"
                         for a in stack.get_json(f"/api/runs/{run}")["alerts"]),
             15.0, "the collective_behind alert")
    for rank in (0, 1, 3):
        stack.send(stall(run, rank))
    expect(page.locator("#alerts [data-kind=stalled]").first).to_be_visible(timeout=15_000)
    # the answer above the newer stalled alerts
    expect(page.locator("#alerts > .alert").first).to_have_attribute("data-kind", "collective_behind")
    # the figures say they are the last step's, not the job's speed now
    expect(throughput).to_have_class("kpi-value mono kpi-stale")
    expect(page.locator("#kpi-throughput-sub")).to_have_text("samples/s at step 29 · 3 ranks stalled")
    expect(page.locator("#kpi-epoch-time-sub")).to_have_text("at step 29 · 3 ranks stalled")
    page.errors.check()


def test_a_finished_step_run_says_its_figures_are_its_last(stack: Stack, page: Any) -> None:
    run = "stale-done"
    for rank in range(2):
        stack.send(wire.Register(run=run, rank=rank, world_size=2, host="node-0"))
        stack.send(steps(run, rank, 0, 10))
        stack.send(wire.Finish(run=run, rank=rank))
    wait_for(lambda: stack.get_json(f"/api/runs/{run}")["status"] == "complete", 15.0, "complete")
    page.goto(f"{stack.url}/#run={run}")
    expect(page.locator("#kpi-throughput-sub")).to_have_text("samples/s at step 9, run complete")
    expect(page.locator("#kpi-throughput")).to_have_class("kpi-value mono kpi-stale")
    page.errors.check()


def test_a_run_without_samples_says_so(stack: Stack, page: Any) -> None:
    """Issue 43 item 5: "Resources now" of a finished run that never sampled showed four
    dashes, as if loading; it says the ranks sent none and how to send them."""
    run = "no-samples"
    for rank in range(2):
        stack.send(wire.Register(run=run, rank=rank, world_size=2, host="node-0"))
        stack.send(steps(run, rank, 0, 5))
        stack.send(wire.Finish(run=run, rank=rank))
    wait_for(lambda: stack.get_json(f"/api/runs/{run}")["status"] == "complete", 15.0, "complete")
    page.goto(f"{stack.url}/#run={run}")
    expect(page.locator("[data-testid=resources-none]")).to_have_text(
        "no resource samples: this run's ranks sent none (the agent samples CPU, RAM and GPU "
        "after agent.start_sampling())")
    # a run whose ranks sample has no such line
    stack.send(wire.Register(run="with-samples", rank=0, world_size=1, host="node-0"),
               wire.Resources(run="with-samples", rank=0,
                              sample=wire.ResourceSample(cpu_percent=50.0)))
    wait_for(lambda: any(r["resources"] for r in stack.get_json("/api/runs/with-samples")["ranks"]),
             15.0, "sampled")
    page.goto(f"{stack.url}/#run=with-samples")
    expect(page.locator("#resource-bars [data-resource=cpu] .bar-pct")).to_have_text("50%")
    expect(page.locator("[data-testid=resources-none]")).to_have_count(0)
    page.errors.check()
