"""``rankboard demo`` as a new user sees it: real agent processes, the real page, a
screenshot in artifacts/demo.png for a human to look at."""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Iterator

import pytest
from playwright.sync_api import expect

from rankboard.demo import failure_plan
from tests.support.browser import ARTIFACTS, Stack, coloured, wait_drawn
from tests.support.polling import wait_for as wait_until

pytestmark = pytest.mark.browser


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path / "data", ["demo", "--port", "0", "--no-browser", "--ranks", "4",
                                  "--hosts", "2", "--epochs", "8", "--epoch-seconds", "0.5"])
    try:
        s.start()
        yield s
    finally:
        s.close()


def test_demo_dashboard_is_live_and_clean(demo: Stack, page: Any) -> None:
    def running_run() -> Any:
        runs = [r for r in demo.get_json("/api/runs") if not r["run"].startswith("demo-steps-")]
        return runs[0]["run"] if runs and (runs[0]["epochs_done"] or 0) >= 1 else None

    run = wait_until(running_run, 30.0, "the demo's first epoch")
    page.goto(f"{demo.url}/#run={run}")
    expect(page.locator("#run-picker")).to_have_value(run)
    expect(page.locator("#rank-tabs [data-rank]")).to_have_count(4, timeout=15_000)

    def epochs_shown() -> int:
        text = page.locator("#epoch-count").text_content() or "0/"
        return int(text.split("/")[0] or 0)

    first = epochs_shown()
    # (a busy machine may open the page near the run's end; the run fails at its epoch 6,
    # the demo's first failure, so it closes 6 epochs: rankboard/demo.py failure_plan)
    target = min(first + 2, failure_plan(4, 8)[1])
    wait_until(lambda: epochs_shown() >= target, 20.0, "the demo run to advance on the page")
    expect(page.locator("#hardware")).to_contain_text("node-a")
    expect(page.locator("#metadata")).to_contain_text("world_size")
    for chart in ("metrics", "resources"):
        wait_drawn(page, f'canvas[data-chart="{chart}"]')
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo.png"), full_page=True)
    assert coloured(page, 'canvas[data-chart="metrics"]') > 30
    page.errors.check()

    # the step job beside it: live step charts, and its slow last rank named by its data wait
    # (its steps are synchronous, as DDP's are: every rank's step takes the slowest's time, so
    # the step times do not tell it apart; its wait for data does)
    def steps_started() -> Any:  # the step job starts a moment after the epoch job
        return next((r["run"] for r in demo.get_json("/api/runs")
                     if r["run"].startswith("demo-steps-")), None)

    steps_run = wait_until(steps_started, 30.0, "the demo's step run")
    page.goto(f"{demo.url}/#run={steps_run}")
    for name in ("loss", "lr", "grad_norm", "step_ms", "samples_per_s", "tokens_per_s"):
        expect(page.locator(f'[data-step-chart="{name}"]')).to_be_visible(timeout=15_000)
    wait_until(lambda: coloured(page, '[data-step-chart="loss"] canvas') > 30, 15.0, "step loss drawn")
    # slow because of its data: the line above the straggler board says so (PROTOCOL 7.1)
    expect(page.locator("#data-cause")).to_contain_text("rank 3 waits", timeout=15_000)
    expect(page.locator("#data-cause")).to_contain_text("input-bound on that rank")
    page.screenshot(path=str(ARTIFACTS / "demo-steps.png"), full_page=True)
    page.errors.check()

    demo.proc.send_signal(signal.SIGINT)
    assert demo.proc.wait(timeout=20) == 0
