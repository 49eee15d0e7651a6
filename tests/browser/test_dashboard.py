"""The dashboard page in a real headless Chromium against the real stack (``rankboard up``).

Frames go in through the broker's ingest exactly as a training rank sends them; the page
is only ever driven and read like a user would see it (plus canvas pixels and ``window``
for the script-injection checks). Every wait polls with a deadline (Playwright's
``expect``, or ``page.evaluate`` in ``wait_until``), never a sleep. Not
``page.wait_for_function``: its polling compiles a string in the page, which the page's
CSP (no ``unsafe-eval``) rightly refuses.
"""
from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.support.browser import (
    ARTIFACTS,
    HOSTILE,
    Stack,
    coloured,
    epoch,
    register,
    sample,
    wait_drawn,
    wait_js,
)
from tests.support.polling import wait_for as wait_until

pytestmark = pytest.mark.browser

HOSTILE_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" width="120" height="40">'
               "<script>window.__pwned=1</script>"
               '<rect onload="window.__pwned=1" width="100" height="30" fill="#5794f2"/></svg>')
GRAPH_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" width="360" height="120" '
             'font-family="sans-serif" font-size="13">'
             '<rect x="10" y="40" width="90" height="36" rx="6" fill="#dbe8ff" stroke="#345"/>'
             '<text x="55" y="63" text-anchor="middle">input</text>'
             '<rect x="135" y="40" width="90" height="36" rx="6" fill="#ffe6cc" stroke="#345"/>'
             '<text x="180" y="63" text-anchor="middle">backbone</text>'
             '<rect x="260" y="40" width="90" height="36" rx="6" fill="#d5f5d5" stroke="#345"/>'
             '<text x="305" y="63" text-anchor="middle">head</text>'
             '<path d="M100 58H135M225 58H260" stroke="#345" stroke-width="2"/></svg>')

def open_run(page: Any, stack: Stack, run: str) -> None:
    page.goto(f"{stack.url}/#run={run}")
    expect(page.locator("#run-picker")).to_have_value(run)


# --------------------------------------------------------------------------------- tests

def test_live_run_advances_without_reload(stack: Stack, page: Any) -> None:
    run = "live-advance"
    register(stack, run, world=2, total=6)
    stack.send(wire.Svg(run=run, rank=0, svg=GRAPH_SVG, label="tiny-mlp", hash="abc123def456"),
               wire.Metadata(run=run, rank=0, json=json.dumps({"lr": 0.001, "batch": 64})),
               wire.Hardware(run=run, rank=0, summary="Test CPU | Test GPU"))
    epoch(stack, run, 0, range(2), loss=2.0)
    stack.wait_run(run, epochs=1)

    open_run(page, stack, run)
    expect(page.locator("#run-name")).to_have_text("tiny-mlp")
    expect(page.locator("#run-hash")).to_contain_text("abc123")
    expect(page.locator("#epoch-count")).to_have_text("1/6")
    expect(page.locator("#status")).to_have_attribute("data-status", "training")
    expect(page.locator("#hardware")).to_contain_text("node-a: Test CPU | gr=0 lr=0: Test GPU")
    expect(page.locator("#metadata")).to_contain_text('"batch": 64')
    expect(page.locator("#csv-link")).to_have_attribute(
        "href", f"/api/runs/{run}/history.csv")
    img = page.locator("#graph img")
    expect(img).to_have_attribute("src", f"/api/runs/{run}/graph.svg?v=abc123def456")
    wait_js(page, "document.querySelector('#graph img').naturalWidth > 0")

    # live: more epochs arrive while the page stays open
    for e in (1, 2):
        epoch(stack, run, e, range(2), loss=2.0 - 0.5 * e)
    expect(page.locator("#epoch-count")).to_have_text("3/6")
    expect(page.locator("#log-table tbody tr")).to_have_count(3)
    expect(page.locator("#log-table tbody tr").first).to_have_attribute("data-epoch", "2")
    expect(page.locator("#log-table thead th")).to_have_text(
        ["epoch", "duration", "loss", "acc", "lr", "missing ranks"])
    wait_drawn(page, 'canvas[data-chart="metrics"]')
    wait_drawn(page, 'canvas[data-chart="resources"]')
    expect(page.locator("#rank-table tbody tr")).to_have_count(2)
    # the local-rank column reads "local" (as "lr" it read as learning rate), with a title
    local = page.locator('#rank-table [data-sort="local"]')
    expect(local).to_have_text("local")
    expect(local).to_have_attribute("title", re.compile("local rank"))
    expect(page.locator('#rank-table tr[data-rank="1"] td').nth(2)).to_have_text("1")

    # a dropped connection: epochs sent meanwhile arrive once, nothing is duplicated
    page.context.set_offline(True)
    epoch(stack, run, 3, range(2), loss=0.8)
    page.context.set_offline(False)
    epoch(stack, run, 4, range(2), loss=0.7)
    expect(page.locator("#epoch-count")).to_have_text("5/6")
    rows = page.locator("#log-table tbody tr")
    expect(rows).to_have_count(5)
    assert rows.evaluate_all("rs => rs.map(r => r.dataset.epoch)") == ["4", "3", "2", "1", "0"]

    # the run ends
    epoch(stack, run, 5, range(2), loss=0.6)
    for r in range(2):
        stack.send(wire.Finish(run=run, rank=r))
    expect(page.locator("#status")).to_have_attribute("data-status", "complete")
    expect(page.locator("#epoch-count")).to_have_text("6/6")
    expect(page.locator("#eta")).to_have_text("done")
    page.errors.check()


def test_rank_tabs_appear_for_late_ranks_before_any_epoch(stack: Stack, page: Any) -> None:
    run = "late-ranks"
    stack.send(wire.Register(run=run, rank=0, world_size=4, host="node-a", total_epochs=10))
    stack.wait_run(run)
    open_run(page, stack, run)
    expect(page.locator("#status")).to_have_attribute("data-status", "waiting")
    expect(page.locator('#rank-tabs [data-rank="0"]')).to_be_visible()
    expect(page.locator("#rank-tabs [data-rank]")).to_have_count(1)

    # rank 2 only registers, rank 3 only sends a resources frame: no epoch has closed
    stack.send(wire.Register(run=run, rank=2, world_size=4, host="node-b", local_rank=0))
    stack.send(wire.Resources(run=run, rank=3, sample=sample(3, util=77.0)))
    expect(page.locator('#rank-tabs [data-rank="2"]')).to_be_visible()
    expect(page.locator('#rank-tabs [data-rank="3"]')).to_be_visible()
    expect(page.locator("#rank-tabs [data-rank]")).to_have_count(3)
    expect(page.locator("#epoch-count")).to_have_text("0/10")

    # a rank tab shows that rank's own view, with its live GPU sample charted
    page.locator('#rank-tabs [data-rank="3"]').click()
    expect(page.locator("#panel-rank")).to_be_visible()
    expect(page.locator("#panel-home")).to_be_hidden()
    expect(page.locator("#rank-kpis")).to_contain_text("77%")
    wait_drawn(page, 'canvas[data-chart="rank-util"]')
    page.locator('#rank-tabs [data-rank="2"]').click()
    expect(page.locator("#rank-kpis")).to_contain_text("node-b")
    page.locator("#tab-home").click()
    expect(page.locator("#panel-home")).to_be_visible()
    page.errors.check()


def test_ranks_that_change_while_the_page_connects_are_shown(stack: Stack, page: Any) -> None:
    """The stream replays the header and the records, never the ranks: a ranks change
    published between the page's snapshot and its stream's subscription must still reach
    the page (it used to wait for the ranks' next change: never, for a finished rank), and
    a snapshot answer that a newer ``ranks`` event overtook must not turn the page back."""
    run = "ranks-race"
    register(stack, run, world=2, total=3)
    epoch(stack, run, 0, range(2))

    def rank_status(rank: int) -> Any:
        ranks = stack.get_json(f"/api/runs/{run}")["ranks"]
        return next((r["status"] for r in ranks if r["rank"] == rank), None)

    wait_until(lambda: rank_status(1) == "ok", 10, "both ranks known to the web")

    def row(rank: int) -> Any:
        return page.locator(f'#rank-table tr[data-rank="{rank}"]')

    # 1. the stream is held at the door while rank 1 fails; then let in
    held: list = []

    def hold(route: Any) -> None:
        held.append(route)

    page.route(f"**/api/runs/{run}/events", hold)
    page.goto(f"{stack.url}/#run={run}")
    wait_until(lambda: page.evaluate("() => 1") and held, 10, "the page's stream request")
    stack.send(wire.Finish(run=run, rank=1, status="error"))
    wait_until(lambda: rank_status(1) == "error", 10, "rank 1 failed, as the web sees it")
    held.pop().continue_()
    expect(row(1)).to_have_attribute("data-status", "error")
    page.unroute(f"**/api/runs/{run}/events", hold)

    # 2. the snapshot answer is held (as the server gave it) while rank 0 finishes, then
    # delivered after the stream's newer ranks event
    page.route(f"**/api/runs/{run}", hold)
    page.reload()
    wait_until(lambda: page.evaluate("() => 1") and held, 10, "the page's snapshot request")
    route = held.pop()
    before = route.fetch()
    assert before.headers["x-rankboard-ranks-seq"].isdigit()
    stack.send(wire.Finish(run=run, rank=0))
    expect(row(0)).to_have_attribute("data-status", "finished")
    loads = page.evaluate("() => window.__rankboard.ranksLoads()")
    route.fulfill(response=before)
    wait_js(page, f"window.__rankboard.ranksLoads() === {loads + 1}")
    expect(row(0)).to_have_attribute("data-status", "finished")
    page.errors.check()


def test_hostile_content_is_text_and_never_runs(stack: Stack, page: Any) -> None:
    run = "hostile"
    stack.send(wire.Register(run=run, rank=0, world_size=1, host=f"<b>{HOSTILE}</b>",
                             total_epochs=3))
    stack.send(wire.Svg(run=run, rank=0, svg=HOSTILE_SVG, label=HOSTILE, hash="h1"),
               wire.Metadata(run=run, rank=0, json=json.dumps({"x": HOSTILE})),
               wire.Hardware(run=run, rank=0, summary=f"{HOSTILE} | {HOSTILE}"))
    stack.send(wire.Metrics(run=run, rank=0, epoch=0, avg_loss=float("nan"), batches=1,
                            samples=1, epoch_ms=10.0, scalars={HOSTILE: (1.0, 1)}))
    stack.wait_run(run, epochs=1)
    open_run(page, stack, run)

    expect(page.locator("#run-name")).to_have_text(HOSTILE)
    expect(page.locator("#metadata")).to_contain_text(f'"x": "{HOSTILE}"')
    expect(page.locator("#hardware")).to_contain_text(f"<b>{HOSTILE}</b>: {HOSTILE}")
    expect(page.locator("#rank-table tbody")).to_contain_text(f"<b>{HOSTILE}</b>")
    expect(page.locator("#log-table thead")).to_contain_text(HOSTILE)
    expect(page.locator("#run-picker option", has_text=HOSTILE)).to_have_count(1)
    # the NaN loss is news: an alert, and a dash instead of a number
    expect(page.locator('#alerts [data-kind="nonfinite_loss"]')).to_be_visible()
    expect(page.locator("#kpi-loss")).to_have_text("—")
    # the hostile svg is only ever an <img>; wait until it has loaded (or failed)
    img = page.locator("#graph img")
    expect(img).to_have_attribute("src", f"/api/runs/{run}/graph.svg?v=h1")
    wait_js(page, "document.querySelector('#graph img').complete")
    assert page.locator("#graph svg, #graph script").count() == 0
    assert page.locator('img[src="x"], b').count() == 0
    assert page.evaluate("typeof window.__pwned") == "undefined"
    page.errors.check()


def test_run_picker_switches_runs_cleanly(stack: Stack, page: Any) -> None:
    for run, world in (("picker-a", 1), ("picker-b", 3)):
        register(stack, run, world=world, total=4)
        stack.send(wire.Svg(run=run, rank=0, svg=GRAPH_SVG, label=f"label-{run}", hash=run))
        epoch(stack, run, 0, range(world))
    stack.wait_run("picker-a", epochs=1)
    stack.wait_run("picker-b", epochs=1)
    open_run(page, stack, "picker-a")
    expect(page.locator("#run-name")).to_have_text("label-picker-a")
    expect(page.locator("#rank-tabs [data-rank]")).to_have_count(1)

    page.locator("#run-picker").select_option("picker-b")
    expect(page.locator("#run-name")).to_have_text("label-picker-b")
    expect(page.locator("#rank-tabs [data-rank]")).to_have_count(3)
    expect(page.locator("#log-table tbody tr")).to_have_count(1)
    expect(page.locator("#csv-link")).to_have_attribute("href", "/api/runs/picker-b/history.csv")
    expect(page.locator("#graph img")).to_have_attribute(
        "src", "/api/runs/picker-b/graph.svg?v=picker-b")
    assert page.evaluate("location.hash") == "#run=picker-b"
    # the new run's stream is live; the old one's is closed
    epoch(stack, "picker-b", 1, range(3))
    expect(page.locator("#epoch-count")).to_have_text("2/4")
    epoch(stack, "picker-a", 1, range(1))
    stack.wait_run("picker-a", epochs=2)
    expect(page.locator("#log-table tbody tr")).to_have_count(2)
    expect(page.locator("#run-name")).to_have_text("label-picker-b")
    page.errors.check()


def test_chart_controls(stack: Stack, page: Any) -> None:
    run = "chart-controls"
    register(stack, run, world=2, total=20)
    for e in range(8):
        epoch(stack, run, e, range(2), loss=3.0 * 0.8**e)
    stack.wait_run(run, epochs=8)
    open_run(page, stack, run)
    canvas = 'canvas[data-chart="metrics"]'
    wait_drawn(page, canvas)
    card = page.locator('[data-chart-card="metrics"]')

    # legend: click solos a series, clicking it again restores all
    legend = card.locator(".legend-item")
    expect(legend).to_have_count(3)
    card.locator('.legend-item[data-series="loss"]').click()
    expect(card.locator(".legend-item.off")).to_have_count(2)
    card.locator('.legend-item[data-series="loss"]').click()
    expect(card.locator(".legend-item.off")).to_have_count(0)

    # log toggle (loss beside a 3e-4 learning rate starts in log scale automatically)
    log_btn = card.locator('[data-action="log"]')
    expect(log_btn).to_have_attribute("aria-pressed", "true")
    log_btn.click()
    expect(log_btn).to_have_attribute("aria-pressed", "false")

    # hover tooltip with the values of the epoch under the pointer
    box = page.locator(canvas).bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] * 0.5)
    tip = card.locator(".chart-tip")
    expect(tip).to_be_visible()
    expect(tip).to_contain_text("loss")

    # drag to zoom on x, then reset
    reset = card.locator('[data-action="reset-zoom"]')
    expect(reset).to_be_hidden()
    page.mouse.move(box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.5)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.7, box["y"] + box["height"] * 0.5, steps=5)
    page.mouse.up()
    expect(reset).to_be_visible()
    reset.click()
    expect(reset).to_be_hidden()

    # smoothing slider
    card.locator('input[type="range"]').fill("0.6")
    expect(card.locator(".tool-value")).to_have_text("0.60")
    wait_drawn(page, canvas)

    # PNG download of one chart
    with page.expect_download() as dl:
        card.locator('[data-action="png"]').click()
    assert dl.value.suggested_filename == "metrics.png"
    page.errors.check()


def test_screenshot_of_a_realistic_multi_rank_run(stack: Stack, page: Any) -> None:
    """A 2-host x 4-GPU run mid-training, saved to artifacts/dashboard.png for a human."""
    run = "resnet50-ddp-1234"
    rng = random.Random(7)
    hosts = ["gpu-node-a", "gpu-node-b"]
    register(stack, run, world=8, total=40, hosts=hosts)
    for r in range(8):
        stack.send(wire.Hardware(run=run, rank=r,
                                 summary="AMD EPYC 7763 64-Core | NVIDIA H100 80GB HBM3"))
    stack.send(wire.Svg(run=run, rank=0, svg=GRAPH_SVG, label="resnet50-imagenet",
                        hash="9f3c2a1be4d07788"),
               wire.Metadata(run=run, rank=0, json=json.dumps({
                   "model": "resnet50", "dataset": "imagenet-1k", "epochs": 40,
                   "batch_size": 256, "amp": True,
                   "optimizer": {"name": "AdamW", "lr": 3e-4, "weight_decay": 0.05},
                   "scheduler": {"name": "cosine", "warmup_epochs": 2}})))
    loss = 6.9
    for e in range(14):
        ranks = range(8) if e != 9 else range(7)  # rank 7 misses epoch 9
        epoch(stack, run, e, ranks, loss=loss * rng.uniform(0.98, 1.02), slow=5)
        loss *= rng.uniform(0.84, 0.95)
    stack.wait_run(run, epochs=14)
    page.set_viewport_size({"width": 1600, "height": 1000})
    open_run(page, stack, run)
    expect(page.locator("#epoch-count")).to_have_text("14/40")
    expect(page.locator('#rank-table [data-mark="slowest"]')).to_have_count(1)
    expect(page.locator('#rank-table tr[data-rank="5"] [data-mark="slowest"]')).to_be_visible()
    expect(page.locator('#log-table tr[data-epoch="9"] td.missing')).to_have_text("7")
    wait_js(page, "document.querySelector('#graph img').naturalWidth > 0")
    for chart in ("metrics", "resources"):
        wait_drawn(page, f'canvas[data-chart="{chart}"]')
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

    page.locator('#rank-tabs [data-rank="5"]').click()
    for chart in ("rank-util", "rank-throughput", "rank-share"):
        wait_drawn(page, f'canvas[data-chart="{chart}"]')
    page.screenshot(path=str(ARTIFACTS / "dashboard-rank.png"), full_page=True)
    assert coloured(page, 'canvas[data-chart="rank-throughput"]') > 30
    page.errors.check()
