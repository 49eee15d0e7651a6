"""What a newcomer sees of the layout (issue 34, item 5), in a real Chromium: the rank table
of a step run, badges included, fits its card at 1440 and 1024 px; a step run with its one
closing epoch gets no one-dot epoch chart, and its comparison opens by step; a run without a
model graph has no empty graph card, and a graph is not a white panel on the dark page."""
from __future__ import annotations

import urllib.request
from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.browser.test_dashboard import GRAPH_SVG
from tests.browser.test_steps_page import register, send_steps, wait_steps
from tests.support.browser import ARTIFACTS, Stack
from tests.support.polling import wait_for

pytestmark = pytest.mark.browser

RUN = "layout-steps"


def step_run(stack: Stack) -> None:
    """The step run, once per module's stack (the tests share it)."""
    if RUN in [r["run"] for r in stack.get_json("/api/runs")]:
        return
    register(stack, RUN, world=8)
    for r in range(8):
        send_steps(stack, RUN, r, range(0, 120), step_ms=130.0 if r == 7 else 100.0)
    wait_steps(stack, RUN, 119)
    for r in range(8):  # the step job's one closing epoch
        stack.send(wire.Metrics(run=RUN, rank=r, epoch=0, avg_loss=1.0, batches=120,
                                samples=3840, epoch_ms=12000.0 * (1.3 if r == 7 else 1.0)))
    stack.wait_run(RUN, epochs=1)

    def marked() -> bool:  # the ranks array is refreshed about once a second
        ranks = stack.get_json(f"/api/runs/{RUN}")["ranks"]
        return any(r["rank"] == 7 and (r.get("slowest_share") or 0) > 0.5 for r in ranks)
    wait_for(marked, 15.0, "rank 7's slowest share")


FITS = """() => {
  const t = document.getElementById('rank-table');
  const card = document.getElementById('ranks-card').getBoundingClientRect();
  const badges = [...t.querySelectorAll('.badge')].map(b => b.getBoundingClientRect().right);
  return {over: t.scrollWidth - t.parentElement.clientWidth,
          badges: badges.length, clipped: badges.filter(r => r > card.right - 4).length};
}"""


@pytest.mark.parametrize("width", [1440, 1024])
def test_the_rank_table_of_a_step_run_fits_with_its_badges(stack: Stack, browser: Any, width: int) -> None:
    step_run(stack)
    ctx = browser.new_context(viewport={"width": width, "height": 900})
    page = ctx.new_page()
    page.goto(f"{stack.url}/#run={RUN}")
    expect(page.locator('#rank-table tr[data-rank="7"] [data-mark="straggler"]')).to_be_visible()
    fit = page.evaluate(FITS)
    assert fit["over"] <= 0 and fit["badges"] >= 1 and fit["clipped"] == 0, fit
    ctx.close()


def test_a_step_run_shows_no_one_dot_chart_no_empty_graph_and_compares_by_step(
        stack: Stack, page: Any) -> None:
    step_run(stack)
    page.goto(f"{stack.url}/#run={RUN}")
    expect(page.locator("#log-table tbody tr")).to_have_count(1)
    expect(page.locator("#metrics-card")).to_be_hidden()
    expect(page.locator("#graph-card")).to_be_hidden()
    page.locator("#compare-btn").click()
    expect(page.locator("#compare-x")).to_have_value("step")
    page.errors.check()


def test_a_model_graph_sits_in_the_dark_page(stack: Stack, page: Any) -> None:
    run = "layout-graph"
    stack.send(wire.Register(run=run, rank=0, world_size=1, host="node-a"),
               wire.Svg(run=run, rank=0, svg=GRAPH_SVG, label="tiny", hash="ab12"),
               wire.Metrics(run=run, rank=0, epoch=0, avg_loss=1.0, batches=1, samples=1,
                            epoch_ms=10.0))
    stack.wait_run(run, epochs=1)
    page.goto(f"{stack.url}/#run={run}")
    img = page.locator("#graph img")
    expect(img).to_be_visible()
    assert "invert" in img.evaluate("e => getComputedStyle(e).filter")
    page.errors.check()


@pytest.mark.parametrize("run,width", [(RUN, 1024), ("wide", 1440), ("wide", 1024)])
def test_the_saved_reports_rank_table_fits_too(stack: Stack, browser: Any, tmp_path: Any,
                                               run: str, width: int) -> None:
    step_run(stack)
    if run == "wide":
        wide_run(stack)
        run = WIDE
    saved = tmp_path / "report.html"
    with urllib.request.urlopen(f"{stack.url}/api/runs/{run}/report.html", timeout=30) as resp:
        saved.write_bytes(resp.read())
    ctx = browser.new_context(viewport={"width": width, "height": 900})
    page = ctx.new_page()
    url = saved.resolve().as_uri()
    page.route("**", lambda r: r.continue_() if r.request.url == url else r.abort())
    page.goto(url)
    expect(page.locator('#rank-table tr[data-rank="7"] [data-mark="straggler"]')).to_be_visible()
    fit = page.evaluate(FITS)
    assert fit["over"] <= 0 and fit["clipped"] == 0, fit
    ctx.close()


WIDE = "layout-wide"
#: host names as clusters spell them (a scheduler's FQDN), long enough to push a table wide
HOSTS = [f"gpu-worker-a100-rack{17 + i}-slot0{i}.train.cluster.example" for i in range(2)]


def wide_run(stack: Stack) -> None:
    """The widest rank table a step run shows: every column (epoch and step columns, GPU
    health tags, the data wait of issue 33), long host names, and more than one badge on a
    row; once per module's stack."""
    if WIDE in [r["run"] for r in stack.get_json("/api/runs")]:
        return
    gib = 2**30
    for r in range(8):
        stack.send(wire.Register(run=WIDE, rank=r, world_size=8, host=HOSTS[r // 4],
                                 local_rank=r % 4, total_epochs=1))
        gpu = wire.GpuSample(
            device_index=r % 4, name="NVIDIA A100-SXM4-80GB", util_percent=97.0 - r,
            vram_allocated_bytes=71 * gib, vram_total_bytes=80 * gib, temperature_c=84.0,
            power_w=399.0, throttle_reasons=["hw_thermal", "sw_power_cap"] if r in (6, 7) else [],
            xid_errors=[79] if r == 7 else [], ecc_uncorrected=2 if r == 7 else 0)
        stack.send(wire.Resources(run=WIDE, rank=r, sample=wire.ResourceSample(
            cpu_percent=40.0, ram_used_bytes=300 * gib, ram_total_bytes=1024 * gib,
            gpu_util_percent=97.0 - r, vram_allocated_bytes=71 * gib, vram_total_bytes=80 * gib,
            gpus=[gpu])))
    for r in range(8):
        steps = list(range(0, 120))
        slow = 1.3 if r == 7 else 1.0
        stack.send(wire.Steps(run=WIDE, rank=r, steps=steps,
                              times=[1.7e9 + s * 0.1 for s in steps],
                              step_ms=[1234.5 * slow * (1.0 + 0.01 * (s % 3)) for s in steps],
                              data_ms=[456.7 * slow if r == 7 else 12.3 for _ in steps],
                              samples=[64] * len(steps), tokens=[65536] * len(steps),
                              metrics={"loss": [2.0] * len(steps)}))
    wait_steps(stack, WIDE, 119)
    for r in range(8):
        stack.send(wire.Metrics(run=WIDE, rank=r, epoch=0, avg_loss=1.0, batches=120,
                                samples=7680, epoch_ms=150000.0 * (1.3 if r == 7 else 1.0)))
    stack.wait_run(WIDE, epochs=1)

    def marked() -> bool:
        ranks = stack.get_json(f"/api/runs/{WIDE}")["ranks"]
        return any(r["rank"] == 7 and (r.get("slowest_share") or 0) > 0.5 for r in ranks)
    wait_for(marked, 15.0, "rank 7's slowest share")


@pytest.mark.parametrize("width", [1440, 1024])
def test_the_widest_rank_table_fits_with_its_badges(stack: Stack, browser: Any, width: int) -> None:
    """Every column a step run can show, long host names and stacked badges, inside the card
    (the step run's table overflowed at 1440 px, badges clipped). A screenshot per width in
    artifacts/ for a human to look at."""
    wide_run(stack)
    ctx = browser.new_context(viewport={"width": width, "height": 900})
    page = ctx.new_page()
    page.goto(f"{stack.url}/#run={WIDE}")
    row = page.locator('#rank-table tr[data-rank="7"]')
    expect(row.locator('[data-mark="straggler"]')).to_be_visible()
    expect(row.locator('[data-col="health"]')).not_to_be_empty()
    expect(row.locator('[data-col="dataMs"]')).not_to_have_text("—")
    fit = page.evaluate(FITS)
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#ranks-card").screenshot(path=str(ARTIFACTS / f"rank-table-{width}.png"))
    assert fit["over"] <= 0 and fit["badges"] >= 1 and fit["clipped"] == 0, fit
    ctx.close()


def test_a_step_run_with_one_epoch_sets_the_straggler_board_beside_resources_now(
        stack: Stack, page: Any) -> None:
    """With its one closing epoch a step run hides its epoch charts; "Resources now" sat
    alone on its row then, beside two-thirds of empty page (the demo's finished step run at
    1440 px). The straggler board takes that place, as it does before the first epoch."""
    step_run(stack)
    page.goto(f"{stack.url}/#run={RUN}")
    expect(page.locator("#straggler-card")).to_be_visible()
    expect(page.locator("#metrics-card")).to_be_hidden()
    wait_for(lambda: page.evaluate("""() => {
        const a = document.getElementById('straggler-card').getBoundingClientRect();
        const b = document.getElementById('resources-now').getBoundingClientRect();
        return Math.abs(a.top - b.top) < 2 && a.right < b.left;
    }"""), 10.0, "the straggler board and 'Resources now' on one row")
