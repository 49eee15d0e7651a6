"""report.html in a real headless Chromium, opened from ``file://`` with every network
request blocked (and none attempted): its charts drawn from the embedded data, hover, zoom
within the embedded resolution, log scale, every rank's host in the (sortable, paginated)
table, hostile metadata and metric names shown as text with no script run, light and dark.
Screenshots of a small run and a 1,024-rank run go to artifacts/ for a human to look at."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rankboard.export import report_of_sink
from tests.support.browser import ARTIFACTS, Stack, coloured, epoch, register, wait_drawn, wait_js
from tests.support.reportrun import HOSTILE, HOSTILE_METRIC, build_run, host_of, stacks
from web.report import render


def write_report(tmp: Path, name: str, stall: list[int] | None = None, **kw: Any) -> Path:
    path = tmp / f"{name}.html"
    rep = report_of_sink(build_run(None, name, **kw))
    if stall:
        rep.stacks = stacks(stall)
    path.write_text("".join(render(rep)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_report(tmp_path_factory.mktemp("report"), "small-run", ranks=8, epochs=6,
                        steps=20000, failed_rank=5, stall=[1, 2, 3, 6])


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_report(tmp_path_factory.mktemp("report"), "big-run", ranks=1024, epochs=30,
                        steps=200_000, hostile=False)


def open_offline(page: Any, path: Path) -> list[str]:
    """Open ``path`` from file:// with every request but the file itself aborted; the list
    of requests the page attempted (filled as it runs)."""
    url = path.resolve().as_uri()
    attempted: list[str] = []

    def route(r: Any) -> None:
        if r.request.url == url:
            r.continue_()
        else:
            attempted.append(r.request.url)
            r.abort()
    page.route("**", route)
    page.on("request", lambda req: attempted.append(req.url) if req.url != url else None)
    page.goto(url)
    wait_drawn(page, '[data-step-chart="loss"] canvas')
    return attempted


STEP_CHARTS = ("loss", HOSTILE_METRIC, "step_ms", "samples_per_s")


def test_small_report_offline(page: Any, small: Path) -> None:
    page.emulate_media(color_scheme="dark")
    attempted = open_offline(page, small)
    for name in STEP_CHARTS:
        sel = f'[data-step-chart="{name}"] canvas'
        assert page.locator(f'[data-step-chart="{name}"]').count() == 1, name
        wait_drawn(page, sel)
    wait_drawn(page, "#metrics-card canvas")
    wait_drawn(page, "#resources-card canvas")
    assert page.evaluate("() => document.documentElement.dataset.theme") == "dark"
    # header, KPIs, footer
    assert page.locator("[data-testid=status]").inner_text().strip().lower() == "failed"
    assert page.locator("#epoch-count").inner_text() == "6/6"
    assert page.locator("#report-run").inner_text() == "small-run"
    assert "rankboard 0." in page.locator("[data-testid=report-footer]").inner_text()
    assert page.locator("#kpi-loss").inner_text() not in ("", "—")
    # hostile strings: text, never markup, never run
    assert page.evaluate("() => window.__pwned") is None
    assert json.dumps(HOSTILE)[1:-1] in page.locator("#metadata").inner_text()  # JSON text
    assert HOSTILE in page.locator("#hardware").inner_text()
    title = page.locator(f'[data-step-chart="{HOSTILE_METRIC}"]').inner_text()
    assert HOSTILE_METRIC.replace("\u2028", "") in title.replace("\u2028", "").replace("\n", "")
    assert page.evaluate("() => document.scripts.length") == 2
    assert page.evaluate("() => document.querySelectorAll('[onerror], iframe, object, embed')"
                         ".length") == 0
    srcs = page.evaluate("() => [...document.querySelectorAll('[src],[href]')]"
                         ".map((e) => e.getAttribute('src') || e.getAttribute('href'))")
    assert srcs and all(s.startswith(("data:", "#")) for s in srcs), srcs
    graph = page.locator("#graph img")
    assert graph.get_attribute("src").startswith("data:image/svg+xml;base64,")
    page.wait_for_function("() => document.querySelector('#graph img').complete")
    # alerts and the stall groups (innermost frame first, the function name as text)
    assert "rank 5" in page.locator("#alerts").inner_text()
    stall = page.locator("[data-testid=stall-groups]")
    assert "4 ranks: 1–3, 6" in stall.inner_text()
    frames = stall.locator("pre").inner_text().splitlines()
    assert frames[0].startswith("torch/distributed.py:2050 in all_reduce")
    assert HOSTILE in stall.inner_text()
    # every rank with its host
    rows = page.locator("#rank-table tbody tr")
    assert rows.count() == 8
    hosts = page.locator("#rank-table tbody td.host").all_inner_texts()
    assert sorted(hosts) == sorted(host_of(r) for r in range(8))
    # hover: the tooltip names a step and a value (the chart scrolled into view: the failed
    # run's failure card, 8.2, leads the page above it)
    page.locator('[data-step-chart="loss"] canvas').scroll_into_view_if_needed()
    box = page.locator('[data-step-chart="loss"] canvas').bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
    tip = page.locator('[data-step-chart="loss"] .chart-tip')
    tip.wait_for(state="visible")
    assert "step" in tip.inner_text().lower()
    # zoom within the embedded resolution: every chart shows only [5000, 6000]
    page.evaluate("() => window.__rankboard.zoom([5000, 6000])")
    wait_js(page, "(() => { const d = window.__rankboard.stepData('loss');"
                  " return d.length && d.every((b) => b[1] >= 5000 && b[0] <= 6000); })()")
    data = page.evaluate("() => window.__rankboard.stepData('loss')")
    assert sum(b[2] for b in data) >= 1000
    page.locator("[data-action=steps-reset-zoom]").click()
    wait_js(page, "window.__rankboard.stepData('loss').length > 0"
                  " && window.__rankboard.stepData('loss')[0][0] === 0")
    # log scale on the step-time chart
    log_btn = page.locator('[data-step-chart="step_ms"] button', has_text="log")
    before = log_btn.get_attribute("aria-pressed")
    log_btn.click()
    wait_js(page, "document.querySelector('[data-step-chart=\"step_ms\"] [data-action=log]')"
                  f".getAttribute('aria-pressed') !== '{before}'")
    wait_drawn(page, '[data-step-chart="step_ms"] canvas')
    # the per-rank picture of rank 3
    page.locator("#tab-rank-3").click()
    assert page.locator("#panel-rank").is_visible()
    assert "H100" in page.locator("#rank-hardware").inner_text() or \
        page.locator("#rank-hardware").inner_text()
    page.locator("#tab-home").click()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
    assert attempted == [], f"the report tried the network: {attempted}"
    page.errors.check()


def test_small_report_light(page: Any, small: Path) -> None:
    page.emulate_media(color_scheme="light")
    attempted = open_offline(page, small)
    assert page.evaluate("() => document.documentElement.dataset.theme") == "light"
    bg = page.evaluate("() => getComputedStyle(document.body).backgroundColor")
    assert bg == "rgb(244, 245, 248)"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "report-light.png"), full_page=True)
    assert attempted == []
    page.errors.check()


def test_big_report_every_rank_paginated(page: Any, big: Path) -> None:
    page.emulate_media(color_scheme="dark")
    attempted = open_offline(page, big)
    for name in ("loss", "step_ms", "tokens_per_s"):
        wait_drawn(page, f'[data-step-chart="{name}"] canvas')
    wait_js(page, "window.__rankboard.heatmapCells() >= 1024")
    assert coloured(page, "#metrics-card canvas") > 30
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "report-1024.png"), full_page=True)
    # sort by rank, then walk every page of the table: all 1,024 ranks with their hosts
    page.locator("[data-sort=rank]").click()
    seen: dict[int, str] = {}
    for _ in range(200):
        for row in page.evaluate("() => [...document.querySelectorAll('#rank-table tbody tr')]"
                                 ".map((tr) => [Number(tr.dataset.rank),"
                                 " tr.querySelector('td.host').textContent])"):
            seen[row[0]] = row[1]
        nxt = page.locator("[data-action=next-page]")
        if nxt.is_disabled():
            break
        nxt.click()
    assert seen == {r: host_of(r) for r in range(1024)}
    assert attempted == []
    page.errors.check()


def test_dashboard_download_report_link(stack: Stack, page: Any, tmp_path: Path) -> None:
    """The live page's "download report" link saves the run's report.html, which then opens
    offline and shows the run."""
    run = "dl:run"
    register(stack, run, world=2, total=3)
    epoch(stack, run, 0, range(2), loss=2.0)
    stack.wait_run(run, epochs=1)
    page.goto(f"{stack.url}/#run={run}")
    link = page.locator("#report-link")
    link.wait_for(state="visible")
    assert link.get_attribute("href") == "/api/runs/dl%3Arun/report.html"
    with page.expect_download() as dl:
        link.click()
    assert dl.value.suggested_filename == "dl_run.html"
    saved = tmp_path / "dl_run.html"
    dl.value.save_as(str(saved))
    page.errors.check()
    offline = page.context.new_page()
    offline.errors = []
    offline.on("pageerror", lambda exc: offline.errors.append(str(exc)))
    url = saved.resolve().as_uri()
    attempted: list[str] = []
    offline.route("**", lambda r: r.continue_() if r.request.url == url
                  else (attempted.append(r.request.url), r.abort()))
    offline.goto(url)
    wait_drawn(offline, "#metrics-card canvas")
    assert offline.locator("#run-id").inner_text() == run or \
        offline.locator("#run-name").inner_text() == run
    assert attempted == [] and offline.errors == []
