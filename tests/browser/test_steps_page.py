"""Step charts, the straggler board, run comparison and the 1,024-rank page in Chromium.

Frames go in through the real broker's ingest as training ranks send them; what the page
shows is read back from the page itself: the step charts' drawn columns and data
(``window.__rankboard``, a read-only view of what each chart holds and drew), canvas
pixels, and the DOM. Never from the API.
"""
from __future__ import annotations

import json
import math
import random
import time
from typing import Any, Iterable, List
from urllib.parse import quote

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.support.browser import ARTIFACTS, HOSTILE, Stack, coloured, sample, wait_js
from tests.support.polling import wait_for as wait_until
from tests.support.tcpproxy import Proxy

pytestmark = pytest.mark.browser

T0 = 1_700_000_000.0


def send_steps(stack: Stack, run: str, rank: int, steps: Iterable[int], *,
               step_ms: float = 100.0, loss: Any = None, metrics: Any = None,
               samples: int = 32, tokens: int = 4096) -> None:
    """Steps frames (<= 1024 points each) of one rank: loss decays, lr and grad_norm."""
    steps = list(steps)
    for i in range(0, len(steps), 1024):
        chunk = steps[i:i + 1024]
        ms = [step_ms * (1.0 + 0.02 * ((s * 7 + rank) % 5)) for s in chunk]
        losses = [loss(s) if callable(loss) else 2.0 * 0.999**s + 0.1 + 0.01 * rank for s in chunk]
        m = {"loss": losses, "lr": [3e-4] * len(chunk), "grad_norm": [1.0 + 0.1 * rank] * len(chunk)}
        if metrics:
            m.update({k: [v] * len(chunk) for k, v in metrics.items()})
        stack.send(wire.Steps(run=run, rank=rank, steps=chunk,
                              times=[T0 + s * step_ms / 1000.0 for s in chunk], step_ms=ms,
                              samples=[samples] * len(chunk), tokens=[tokens] * len(chunk),
                              metrics=m))


def register(stack: Stack, run: str, world: int, per_host: int = 4, total: int = 0) -> None:
    for r in range(world):
        stack.send(wire.Register(run=run, rank=r, world_size=world, host=f"node-{r // per_host:03d}",
                                 local_rank=r % per_host, total_epochs=total))


def steps_done(stack: Stack, run: str) -> Any:
    try:
        return stack.get_json(f"/api/runs/{run}")["steps_done"]
    except Exception:  # noqa: BLE001 - not there yet
        return None


def wait_steps(stack: Stack, run: str, last: int, timeout: float = 30.0) -> None:
    wait_until(lambda: (steps_done(stack, run) or -1) >= last, timeout, f"{run} step {last} closed")


def open_run(page: Any, stack: Stack, run: str) -> None:
    page.goto(f"{stack.url}/#run={run}")
    expect(page.locator("#run-picker")).to_have_value(run)


def chart(page: Any, name: str) -> Any:
    return page.evaluate("(n) => window.__rankboard.stepChart(n)", name)


def chart_data(page: Any, name: str) -> Any:
    return page.evaluate("(n) => window.__rankboard.stepData(n)", name)


def wait_chart(page: Any, name: str, pred: Any, what: str, timeout: float = 15.0) -> Any:
    def ok() -> Any:
        snap = chart(page, name)
        return snap if snap and pred(snap) else None
    return wait_until(ok, timeout, what)


def drawn_steps(snap: Any) -> List[int]:
    """Steps covered by the drawn columns of the first series."""
    return [int(c[7]) for c in snap["series"][0]["columns"]]


# --------------------------------------------------------------------------------- tests

def test_step_charts_draw_history_then_live_steps(stack: Stack, page: Any) -> None:
    run = "steps-live"
    register(stack, run, world=4)
    for r in range(4):
        send_steps(stack, run, r, range(0, 400), step_ms=130.0 if r == 2 else 100.0)
    wait_steps(stack, run, 399)
    open_run(page, stack, run)
    section = page.locator("#step-section")
    expect(section).to_be_visible()
    # history from /steps up to the stream's steps_done, at about the chart's width
    snap = wait_chart(page, "loss", lambda s: s["range"][1] == 399, "loss history drawn")
    assert snap["cut"] == 399 and snap["range"][0] == 0
    fetches = page.evaluate("window.__rankboard.stepFetches()")
    assert any("metric=loss&end=399&points=" in f for f in fetches)
    # every step metric, plus step time and throughput, each with a drawn mean line
    for name in ("loss", "grad_norm", "lr", "step_ms", "samples_per_s", "tokens_per_s"):
        expect(page.locator(f'[data-step-chart="{name}"]')).to_be_visible()
    names = page.locator("#step-section [data-step-chart]").evaluate_all(
        "els => els.filter(e => !e.hidden).map(e => e.dataset.stepChart)")
    assert names[0] == "loss"
    assert coloured(page, '[data-step-chart="loss"] canvas') > 30

    # live steps are appended to the drawn range
    for r in range(4):
        send_steps(stack, run, r, range(400, 460), step_ms=130.0 if r == 2 else 100.0)
    snap = wait_chart(page, "loss", lambda s: s["range"][1] == 459, "live steps appended")
    live = page.evaluate("window.__rankboard.liveSteps()")
    assert live == list(range(400, 460))
    # hover: step, mean, min/max and the slowest rank (exact for live steps; for history
    # buckets, the rank most often slowest)
    canvas = page.locator('[data-step-chart="step_ms"] canvas')
    box = canvas.bounding_box()
    assert box is not None
    p = snap["plot"]
    tip = page.locator('[data-step-chart="step_ms"] .chart-tip')
    page.mouse.move(box["x"] + p["left"] + p["width"] * 455 / 459, box["y"] + p["top"] + p["height"] / 2)
    expect(tip).to_contain_text("step 45")
    expect(tip).to_contain_text("ranks ")
    expect(tip).to_contain_text("slowest rank: 2")
    page.mouse.move(box["x"] + p["left"] + p["width"] * 0.3, box["y"] + p["top"] + p["height"] / 2)
    expect(tip).to_contain_text("most often slowest: rank 2")
    page.mouse.move(0, 0)
    # x axis: wall time and time since start map the same steps
    page.locator("#step-x").select_option("time")
    snap_t = wait_chart(page, "loss", lambda s: s["axis"] == "time", "a wall-time axis")
    assert snap_t["range"] == [0, 459]
    page.locator("#step-x").select_option("elapsed")
    wait_chart(page, "loss", lambda s: s["axis"] == "elapsed", "an elapsed-time axis")
    page.locator("#step-x").select_option("step")
    # a steps-only run: no empty epoch panel
    expect(page.locator("#metrics-card")).to_be_hidden()
    expect(page.locator("#log-card")).to_be_hidden()
    expect(page.locator("#ranks-card")).to_be_visible()
    expect(page.locator("#step-stat")).to_contain_text("459")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "steps-live.png"), full_page=True)
    page.errors.check()


SPIKE_STEP = 123_457
SPIKE = 50.0


def test_a_one_step_spike_in_200k_steps_is_visible_and_zoom_refetches(stack: Stack, page: Any) -> None:
    run = "spike-200k"
    register(stack, run, world=1)
    send_steps(stack, run, 0, range(200_000), step_ms=50.0,
               loss=lambda s: SPIKE if s == SPIKE_STEP else 1.0 + 0.5 * ((s // 1000) % 2))
    wait_steps(stack, run, 199_999, timeout=120)
    open_run(page, stack, run)
    snap = wait_chart(page, "loss", lambda s: s["range"] == [0, 199_999], "200k steps drawn")
    cols = snap["series"][0]["columns"]
    # one drawn column per device pixel at most, each holding many steps
    assert len(cols) <= snap["columns"] and max(c[7] for c in cols) > 100
    spike = [c for c in cols if c[0] <= SPIKE_STEP <= c[1]]
    assert len(spike) == 1 and spike[0][4] == SPIKE, spike  # hi of its column is the spike
    assert all(c[4] <= 1.5 for c in cols if c is not spike[0])
    # and it is on the canvas: the envelope of that column reaches the spike's height
    x = snap["plot"]["left"] + (spike[0][8] + 0.5) / snap["plot"]["dpr"]
    y_spike = spike[0][9]
    lit = page.evaluate("""([x, y]) => {
      const c = document.querySelector('[data-step-chart="loss"] canvas');
      const d = c.getContext('2d').getImageData(Math.floor(x) - 1, Math.floor(y), 3, 4).data;
      let n = 0;
      for (let i = 0; i < d.length; i += 4) if (Math.max(d[i], d[i+1], d[i+2]) - Math.min(d[i], d[i+1], d[i+2]) > 40) n++;
      return n;
    }""", [x, y_spike + 1])
    assert lit > 0, "the spike's envelope is not on the canvas"

    # drag to zoom around the spike, twice: each zoom refetches its range at the chart's width
    canvas = page.locator('[data-step-chart="loss"] canvas')
    box = canvas.bounding_box()
    assert box is not None

    def drag_around(step: int, s: Any, half_px: float) -> None:
        p = s["plot"]
        lo, hi = s["range"]
        cx = box["x"] + p["left"] + (step - lo) / (hi - lo) * p["width"]
        cy = box["y"] + p["top"] + p["height"] / 2
        page.mouse.move(cx - half_px, cy)
        page.mouse.down()
        page.mouse.move(cx + half_px, cy, steps=4)
        page.mouse.up()

    before = len(page.evaluate("window.__rankboard.stepFetches()"))
    drag_around(SPIKE_STEP, snap, 6)
    snap = wait_chart(page, "loss", lambda s: s["view"] is not None and s["range"][1] - s["range"][0] < 20_000
                      and any(c[0] <= SPIKE_STEP <= c[1] and c[4] == SPIKE for c in s["series"][0]["columns"]),
                      "first zoom drawn")
    fetches = page.evaluate("window.__rankboard.stepFetches()")[before:]
    lo, hi = snap["range"]
    assert any(f"metric=loss&start={lo}&end={hi}&points=" in f for f in fetches), fetches
    drag_around(SPIKE_STEP, snap, 8)

    def full_resolution(s: Any) -> bool:
        c = s["series"][0]["columns"]
        return (s["range"][1] - s["range"][0] < 300 and all(x[7] == 1 for x in c)
                and len(c) == s["range"][1] - s["range"][0] + 1)
    snap = wait_chart(page, "loss", full_resolution, "second zoom at full resolution")
    at = [c for c in snap["series"][0]["columns"] if c[0] == SPIKE_STEP]
    assert at and at[0][2] == SPIKE and at[0][1] == SPIKE_STEP
    # the other step charts followed the zoom
    assert chart(page, "step_ms")["range"] == snap["range"]
    page.locator('[data-action="steps-reset-zoom"]').click()
    wait_chart(page, "loss", lambda s: s["range"] == [0, 199_999] and s["view"] is None, "zoom reset")
    page.errors.check()


def assert_each_step_once(buckets: List[List[float]], first: int, last: int) -> None:
    """Buckets [first, last, count] ascending, disjoint, and together every step once."""
    assert buckets[0][0] == first and buckets[-1][1] == last, (buckets[:2], buckets[-2:])
    for a, b in zip(buckets, buckets[1:]):
        assert b[0] > a[1], f"overlap: {a} then {b}"
    assert sum(b[2] for b in buckets) == last - first + 1, "a step is missing or held twice"


def test_reconnect_leaves_no_gap_and_no_duplicate(stack: Stack, page: Any) -> None:
    run = "steps-reconnect"
    register(stack, run, world=2)
    for r in range(2):
        send_steps(stack, run, r, range(0, 200))
    wait_steps(stack, run, 199)
    with Proxy(stack.url) as proxy:
        page.goto(f"{proxy.url}/#run={run}")
        wait_chart(page, "loss", lambda s: s["range"][1] == 199, "history drawn")
        assert page.evaluate("window.__rankboard.stepCut()") == 199
        for r in range(2):
            send_steps(stack, run, r, range(200, 260))
        wait_chart(page, "loss", lambda s: s["range"][1] == 259, "live steps drawn")
        assert_each_step_once(chart_data(page, "loss"), 0, 259)

        # the network drops (every connection cut, new ones refused); steps close meanwhile;
        # the network comes back, the browser reconnects by itself, more steps close
        proxy.drop(refuse=True)
        expect(page.locator("#conn")).not_to_have_attribute("data-state", "live")
        for r in range(2):
            send_steps(stack, run, r, range(260, 340))
        wait_steps(stack, run, 339)
        proxy.resume()
        wait_until(lambda: (page.evaluate("window.__rankboard.stepCut()") or 0) >= 339, 20,
                   "the reconnection's cut")
        for r in range(2):
            send_steps(stack, run, r, range(340, 400))
        wait_chart(page, "loss", lambda s: s["range"][1] == 399, "steps after the reconnect drawn")
        for name in ("loss", "step_ms", "samples_per_s"):
            assert_each_step_once(chart_data(page, name), 0, 399)
        assert page.evaluate("window.__rankboard.liveSteps()") == list(range(340, 400))
    # the cut itself is logged by the browser (the stream's chunked body ended mid-way);
    # nothing else may be
    page.errors[:] = [e for e in page.errors if "net::ERR_" not in e]
    page.errors.check()


STRIP_PIXEL = """([row, rowH]) => {
  const c = document.querySelector('canvas[data-chart="straggler-strip"]');
  const d = c.getContext('2d').getImageData(c.width - 3, Math.floor((row + 0.5) * rowH), 1, 1).data;
  return [d[0], d[1], d[2]];
}"""


def test_straggler_board_marks_the_slow_rank(stack: Stack, page: Any) -> None:
    run = "stragglers"
    register(stack, run, world=8, per_host=4)
    for r in range(8):
        stack.send(wire.Resources(run=run, rank=r, sample=sample(r, util=95.0 if r != 5 else 71.0)))
        send_steps(stack, run, r, range(0, 120), step_ms=150.0 if r == 5 else 100.0)
    wait_steps(stack, run, 119)
    open_run(page, stack, run)
    board = page.locator("#straggler-card")
    expect(board).to_be_visible()
    expect(page.locator('#rank-table tr[data-rank="5"] [data-mark="straggler"]')).to_be_visible()
    expect(page.locator('#rank-table [data-mark="straggler"]')).to_have_count(1)
    expect(board.locator('[data-mark="straggler"][data-rank="5"]')).to_contain_text("100%")
    # the board is sortable: by slowest share, rank 5 comes first; by step time too
    page.locator('#rank-table [data-sort="slowShare"]').click()
    expect(page.locator("#rank-table tbody tr").first).to_have_attribute("data-rank", "5")
    page.locator('#rank-table [data-sort="rank"]').click()
    expect(page.locator("#rank-table tbody tr").first).to_have_attribute("data-rank", "0")
    page.locator('#rank-table [data-sort="stepMs"]').click()
    expect(page.locator("#rank-table tbody tr").first).to_have_attribute("data-rank", "5")
    # the strip: rank 5's row is hot (amber to red), another rank's is not
    for r in range(8):  # keep the ranks reporting so the strip gets columns
        send_steps(stack, run, r, range(120, 140), step_ms=150.0 if r == 5 else 100.0)
    wait_js(page, "window.__rankboard.stripColumns() >= 1")
    row_h = 18
    # the strip is drawn on the next animation frame after its column arrived: poll the pixel
    hot = wait_until(lambda: (lambda px: px if px[0] > 200 and px[0] - px[2] > 100 else None)(
        page.evaluate(STRIP_PIXEL, [5, row_h])), 10, "rank 5's strip row hot")
    cool = page.evaluate(STRIP_PIXEL, [1, row_h])
    assert hot[0] > 200 and hot[0] - hot[2] > 100, hot
    assert cool[0] < 120, cool
    # a click on the chip opens the rank, with its step figures
    board.locator('[data-mark="straggler"][data-rank="5"]').click()
    expect(page.locator("#panel-rank")).to_be_visible()
    expect(page.locator("#rank-kpis")).to_contain_text("slowest share")
    expect(page.locator("#rank-kpis")).to_contain_text("100.0%")
    page.errors.check()


def epochs(stack: Stack, run: str, world: int, n: int, loss0: float) -> None:
    for e in range(n):
        for r in range(world):
            stack.send(wire.Metrics(run=run, rank=r, epoch=e, avg_loss=loss0 * 0.8**e, batches=10,
                                    samples=320, epoch_ms=1000.0, scalars={"acc": (0.5 + 0.04 * e, 1)}))


def test_comparison_overlays_two_runs_and_the_link_reproduces_it(stack: Stack, page: Any) -> None:
    for run, loss0 in (("cmp-a", 3.0), ("cmp-b", 2.0)):
        register(stack, run, world=2, total=6)
        epochs(stack, run, 2, 6, loss0)
        for r in range(2):
            send_steps(stack, run, r, range(0, 300), loss=lambda s, l0=loss0: l0 * 0.995**s)
        stack.wait_run(run, epochs=6)
        wait_steps(stack, run, 299)

    # from a run: the compare button, then tick the second run
    open_run(page, stack, "cmp-a")
    page.locator("#compare-btn").click()
    view = page.locator("#compare-view")
    expect(view).to_be_visible()
    expect(page.locator("#run-view")).to_be_hidden()
    expect(view.locator('[data-run="cmp-a"] input')).to_be_checked()
    view.locator('[data-run="cmp-b"] input').check()
    wait_until(lambda: "compare=cmp-a,cmp-b" in page.evaluate("location.hash"), 5, "hash")

    def two_series(s: Any) -> bool:
        return s is not None and len(s["series"]) == 2 and all(len(x["columns"]) == 6 for x in s["series"])
    snap = wait_until(lambda: two_series(page.evaluate("window.__rankboard.compareChart()"))
                      and page.evaluate("window.__rankboard.compareChart()"), 10, "two epoch series")
    assert [s["name"] for s in snap["series"]] == ["cmp-a", "cmp-b"]
    assert snap["series"][0]["columns"][0][2] == pytest.approx(3.0)
    assert snap["series"][1]["columns"][0][2] == pytest.approx(2.0)
    legend = view.locator(".legend-item")
    expect(legend).to_have_count(2)
    expect(view.locator("#compare-metric option")).to_contain_text(["loss", "acc"])

    # step x axis: the runs' /steps series
    view.locator("#compare-x").select_option("step")
    wait_until(lambda: (lambda s: s and s["x"] == "step" and len(s["series"]) == 2
                        and all(x["columns"] and x["columns"][-1][1] == 299 for x in s["series"]))(
        page.evaluate("window.__rankboard.compareChart()")), 10, "two step series")
    assert page.evaluate("location.hash") == "#compare=cmp-a,cmp-b&metric=loss&x=step"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=True)

    # a link reproduces the view in a fresh page
    fresh = page.context.new_page()
    fresh.goto(f"{stack.url}/#compare=cmp-a,cmp-b&metric=acc&x=epoch")
    wait_until(lambda: (lambda s: s and s["metric"] == "acc" and len(s["series"]) == 2
                        and all(len(x["columns"]) == 6 for x in s["series"]))(
        fresh.evaluate("window.__rankboard.compareChart()")), 10, "the linked view")
    expect(fresh.locator("#compare-metric")).to_have_value("acc")
    fresh.close()
    # back to the run
    view.locator("#compare-close").click()
    expect(page.locator("#run-view")).to_be_visible()
    expect(page.locator("#run-name")).to_have_text("cmp-a")
    page.errors.check()


def test_a_steps_only_run_gets_epoch_panels_with_its_first_epoch(stack: Stack, page: Any) -> None:
    run = "steps-then-epoch"
    register(stack, run, world=2)
    for r in range(2):
        send_steps(stack, run, r, range(0, 50))
    wait_steps(stack, run, 49)
    open_run(page, stack, run)
    expect(page.locator('[data-step-chart="loss"]')).to_be_visible()
    for card in ("#metrics-card", "#resources-card", "#log-card"):
        expect(page.locator(card)).to_be_hidden()
    expect(page.locator("#epoch-progress")).to_be_hidden()
    # the step charts and the rank table come first
    order = page.evaluate("""() => ['#step-section', '#ranks-card', '#config-card']
        .map(s => document.querySelector(s).getBoundingClientRect().top)""")
    assert order == sorted(order)
    epochs(stack, run, 2, 1, 1.5)
    # one epoch: its row in the log, but no chart of one dot on an axis of -1..1 (issue 34)
    expect(page.locator("#log-card")).to_be_visible()
    expect(page.locator("#log-table tbody tr")).to_have_count(1)
    expect(page.locator("#metrics-card")).to_be_hidden()
    epochs(stack, run, 2, 2, 1.4)
    expect(page.locator("#metrics-card")).to_be_visible()
    expect(page.locator("#log-table tbody tr")).to_have_count(2)
    expect(page.locator('[data-step-chart="loss"]')).to_be_visible()
    page.errors.check()


def test_hostile_metric_names_render_as_text(stack: Stack, page: Any) -> None:
    run = "hostile-steps"
    register(stack, run, world=1)
    send_steps(stack, run, 0, range(0, 30), metrics={HOSTILE: 1.0, "<script>window.__pwned=2</script>": 2.0})
    stack.send(wire.Metrics(run=run, rank=0, epoch=0, avg_loss=1.0, batches=1, samples=1,
                            epoch_ms=1.0, scalars={HOSTILE: (1.0, 1)}))
    wait_steps(stack, run, 29)
    open_run(page, stack, run)
    titles = page.locator("#step-section .chart-title")
    expect(titles.filter(has_text=HOSTILE)).to_have_count(1)
    expect(titles.filter(has_text="<script>")).to_have_count(1)
    wait_until(lambda: (chart(page, HOSTILE) or {}).get("series") and
               chart(page, HOSTILE)["series"][0]["columns"], 10, "the hostile-named chart drawn")
    page.locator("#compare-btn").click()
    page.locator("#compare-x").select_option("step")
    expect(page.locator("#compare-metric option").filter(has_text=HOSTILE)).to_have_count(1)
    page.locator("#compare-metric").select_option(HOSTILE)
    wait_until(lambda: (lambda s: s and s["metric"] == HOSTILE and s["series"][0]["columns"])(
        page.evaluate("window.__rankboard.compareChart()")), 10, "hostile metric compared")
    # a hostile comparison link: run ids and metric from the hash are only ever text
    page.goto(f"{stack.url}/#compare={quote(HOSTILE)},{run}&metric={quote(HOSTILE)}&x=epoch")
    expect(page.locator("#compare-runs")).to_contain_text(HOSTILE)
    expect(page.locator("#compare-metric")).to_have_value(HOSTILE)
    assert page.locator('img[src="x"], #step-section script, #compare-view script').count() == 0
    assert page.evaluate("typeof window.__pwned") == "undefined"
    page.errors.check()


def big_sample(rank: int) -> wire.ResourceSample:
    gib = 2**30
    util = 40.0 if rank % 97 == 3 else 88.0 + rank % 9
    vram = int((50 + rank % 20) * gib)
    return wire.ResourceSample(
        cpu_percent=30.0 + rank % 40, ram_used_bytes=600 * gib, ram_total_bytes=2048 * gib,
        gpu_util_percent=util, vram_allocated_bytes=vram, vram_total_bytes=80 * gib,
        gpus=[wire.GpuSample(device_index=rank % 8, name="NVIDIA H100 80GB HBM3", util_percent=util,
                             vram_allocated_bytes=vram, vram_total_bytes=80 * gib)])


def big_run(stack: Stack, run: str, world: int = 1024, per_host: int = 8, failed: int = 40,
            slow: int = 517, n_steps: int = 40, n_epochs: int = 2) -> None:
    """A 1,024-rank run on 128 hosts: resources, steps (one slow rank), two epochs, and
    ``failed`` ranks that finished with an error (one alert each)."""
    register(stack, run, world=world, per_host=per_host, total=10)
    for r in range(world):
        stack.send(wire.Hardware(run=run, rank=r, summary="AMD EPYC 9654 | NVIDIA H100 80GB HBM3"))
        stack.send(wire.Resources(run=run, rank=r, sample=big_sample(r)))
    for r in range(world):
        send_steps(stack, run, r, range(0, n_steps), step_ms=160.0 if r == slow else 100.0)
    for e in range(n_epochs):
        for r in range(world):
            stack.send(wire.Metrics(run=run, rank=r, epoch=e, avg_loss=2.0 - 0.3 * e, batches=100,
                                    samples=3200 if r != slow else 2000, epoch_ms=60000.0))
    for r in range(world - failed, world):
        stack.send(wire.Finish(run=run, rank=r, status="error"))


def test_a_1024_rank_run_fits_in_about_three_screens(stack: Stack, page: Any) -> None:
    run = "ranks-1024"
    big_run(stack, run)
    stack.wait_run(run, epochs=2, timeout=60)
    wait_steps(stack, run, 39, timeout=60)
    page.set_viewport_size({"width": 1440, "height": 900})
    open_run(page, stack, run)
    expect(page.locator("#rank-count")).to_contain_text("1,024", timeout=20_000)
    wait_chart(page, "loss", lambda s: s["range"][1] == 39, "step charts drawn")
    wait_js(page, "window.__rankboard.heatmapCells() === 2048", timeout=30.0)
    # scale: a picker instead of 1,024 tabs, a heatmap instead of 1,024 tiles, one page of
    # the table, grouped alerts
    expect(page.locator("#rank-tabs [data-rank]")).to_have_count(0)
    expect(page.locator("#rank-picker-btn")).to_be_visible()
    expect(page.locator("#heat-card")).to_be_visible()
    expect(page.locator(".gpu-tile")).to_have_count(0)
    expect(page.locator("#rank-table tbody tr")).to_have_count(12)
    expect(page.locator("#rank-pager")).to_contain_text("1–12 of 1,024")
    # worst first: the failed ranks, then the slow one
    first = page.locator("#rank-table tbody tr").first
    expect(first).to_have_attribute("data-status", "error")
    group = page.locator('#alerts .alert-group[data-kind="rank_error"]')
    expect(group).to_contain_text("40 ranks failed")
    expect(page.locator("#alerts .alert")).to_have_count(1)
    height = page.evaluate("document.documentElement.scrollHeight")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "ranks-1024.png"), full_page=True)
    # about three screens: 3.4 since v3 (the report link, the stall card's slot and the
    # colour-by choice of the heatmap header add a few pixels)
    assert height <= 3.4 * 900, f"the page is {height} px tall"
    group.locator('[data-action="toggle-alerts"]').click()
    expect(page.locator('#alerts .alert-group-list .alert[data-kind="rank_error"]')).to_have_count(40)

    # the straggler is marked among 1,024
    expect(page.locator('#straggler-marks [data-mark="straggler"][data-rank="517"]')).to_be_visible()
    # the rank picker: search, pick
    page.locator("#rank-picker-btn").click()
    page.locator("#rank-search").fill("517")
    expect(page.locator(".rank-list [data-rank]").first).to_have_attribute("data-rank", "517")
    page.locator("#rank-search").press("Enter")
    expect(page.locator("#panel-rank")).to_be_visible()
    expect(page.locator("#rank-kpis")).to_have_attribute("data-rank", "517")
    expect(page.locator("#rank-picker-btn")).to_contain_text("rank 517")
    # worst first without a query
    page.locator("#rank-picker-btn").click()
    expect(page.locator(".rank-list [data-rank]").first).to_have_attribute("data-rank", "984")
    page.keyboard.press("Escape")
    page.locator("#tab-home").click()
    # hover on the heatmap names a rank and its host; a click opens it
    canvas = page.locator('canvas[data-chart="rank-heatmap"]')
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + 3, box["y"] + 22)
    tip = page.locator("#heatmap .chart-tip")
    expect(tip).to_contain_text("rank 0 · node-000")
    page.mouse.click(box["x"] + 3, box["y"] + 22)
    expect(page.locator("#rank-kpis")).to_have_attribute("data-rank", "0")
    page.errors.check()


def realistic(s: int, rank: int, rng: random.Random) -> dict[str, float]:
    warm = 200
    lr = 3e-4 * (s + 1) / warm if s < warm else 3e-4 * 0.5 * (1 + math.cos(math.pi * (s - warm) / 9000))
    loss = (2.6 * math.exp(-s / 900) + 1.9 + 0.25 * math.exp(-s / 6000)) * (1 + rng.gauss(0, 0.025))
    grad = abs(0.9 * math.exp(-s / 1500) + 0.35 + rng.gauss(0, 0.06))
    if s == 1700:
        grad, loss = 9.5, loss * 1.4  # a bad batch
    return {"loss": loss, "lr": lr, "grad_norm": grad}


def send_realistic(stack: Stack, run: str, rank: int, steps: range, slow: int, rng: random.Random,
                   t0: float) -> None:
    ms = 420.0 * (1.22 if rank == slow else 1.0)
    for i in range(0, len(steps), 1024):
        chunk = list(steps[i:i + 1024])
        vals = [realistic(s, rank, rng) for s in chunk]
        stack.send(wire.Steps(
            run=run, rank=rank, steps=chunk, times=[t0 + s * 0.42 for s in chunk],
            step_ms=[ms * (1 + rng.gauss(0, 0.03)) for _ in chunk], samples=[32] * len(chunk),
            tokens=[32 * 2048] * len(chunk),
            metrics={k: [v[k] for v in vals] for k in ("loss", "lr", "grad_norm")}))


def test_screenshots_of_a_realistic_step_run(stack: Stack, page: Any) -> None:
    """An 8-rank LLM-style run mid-training (history + live steps, one slow rank), saved for
    a human: artifacts/steps-overview.png, step-charts.png, straggler-board.png."""
    run = "gpt2-medium-ddp-0412"
    world, slow = 8, 6
    rng = random.Random(11)
    register(stack, run, world=world, per_host=4, total=3)
    stack.send(wire.Metadata(run=run, rank=0, json=json.dumps(
        {"model": "gpt2-medium", "seq_len": 2048, "micro_batch": 4, "grad_accum": 8,
         "optimizer": {"name": "AdamW", "lr": 3e-4, "betas": [0.9, 0.95]}})))
    for r in range(world):
        stack.send(wire.Hardware(run=run, rank=r, summary="AMD EPYC 9654 96-Core | NVIDIA H100 80GB HBM3"),
                   wire.Resources(run=run, rank=r, sample=sample(r, util=71.0 if r == slow else 96.0)))
    t0 = time.time() - 2400 * 0.42
    for r in range(world):
        send_realistic(stack, run, r, range(0, 2400), slow, rng, t0)
    wait_steps(stack, run, 2399, timeout=60)
    for r in range(world):
        stack.send(wire.Metrics(run=run, rank=r, epoch=0, avg_loss=2.9, batches=1200,
                                samples=38400, epoch_ms=504000.0, scalars={"grad_norm": (0.8, 1)}))
    page.set_viewport_size({"width": 1600, "height": 1000})
    open_run(page, stack, run)
    wait_chart(page, "loss", lambda s: s["range"][1] >= 2399, "history drawn")
    # ~10 s live at 10 steps/s so the straggler strip fills a little
    step = 2400
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for r in range(world):
            send_realistic(stack, run, r, range(step, step + 3), slow, rng, t0)
        for r in range(world):
            stack.send(wire.Resources(run=run, rank=r, sample=sample(r, util=71.0 if r == slow else 96.0)))
        step += 3
        time.sleep(0.3)
    wait_chart(page, "loss", lambda s: s["range"][1] >= step - 1, "live steps drawn")
    expect(page.locator('#straggler-marks [data-mark="straggler"][data-rank="6"]')).to_be_visible()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "steps-overview.png"), full_page=True)
    page.locator("#step-section").screenshot(path=str(ARTIFACTS / "step-charts.png"))
    page.locator("#straggler-card").screenshot(path=str(ARTIFACTS / "straggler-board.png"))
    # the same charts against wall time
    page.locator("#step-x").select_option("time")
    wait_chart(page, "loss", lambda s: s["axis"] == "time", "wall-time axis")
    page.locator("#step-section").screenshot(path=str(ARTIFACTS / "step-charts-time.png"))
    page.errors.check()
