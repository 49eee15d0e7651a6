"""A restarted job on the page (PROTOCOL 8.1), in a real headless Chromium against the real
stack (``rankboard up``), frames sent as the ranks' agents send them (``register.proc``, one id
a process). Two ranks close steps 0–99 and epochs 0–3; rank 1 dies; new processes resume from
step 50 and epoch 2. A page open across the restart keeps drawing without a reload: the line
drops what the new attempt supersedes and re-appends, the superseded records appear faint, a
"restart 1" marker at the new attempt's first step says on hover why the previous attempt
ended, and the header says what the restart cost. A page opened after the restart shows the
same, and so does the run's saved ``report.html`` opened offline. The rules themselves (attempts.js) are checked through the page's module.

What the page shows is read back from the page (``window.__rankboard``: the charts' drawn
columns, series and markers; the DOM), never from the API.
"""
from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.browser.test_report import open_offline
from tests.support import restartrun as rr
from tests.support.browser import ARTIFACTS, Stack, wait_js
from tests.support.polling import wait_for

pytestmark = pytest.mark.browser

HOVER = ("attempt 1 ended: rank 1 (node-b) failed: RuntimeError: CUDA error: an illegal "
         "memory access was encountered")
#: 50 superseded steps (50–99) × 60 s a step × 2 ranks = 6,000 GPU-seconds
COST = "attempt 2 · 50 steps re-run ≈ 1.7 GPU-hours"


def header(stack: Stack, run: str) -> Dict[str, Any]:
    try:
        return dict(stack.get_json(f"/api/runs/{run}"))
    except Exception:  # noqa: BLE001 - not there yet
        return {}


def first_attempt(stack: Stack, run: str) -> None:
    """Attempt 0: steps 0–99 and epochs 0–3 closed (as the web serves them)."""
    rr.register(stack.send, run, 0)
    rr.steps(stack.send, run, 0, 0, 99)
    rr.epochs(stack.send, run, 0, 0, 3)
    wait_for(lambda: header(stack, run).get("steps_done") == 99
             and len(header(stack, run).get("records") or []) == 4, 30.0, f"{run} attempt 0")


def restart(stack: Stack, run: str) -> None:
    """Rank 1 fails; new processes register (attempt 1) and re-run steps 50–79, epoch 2."""
    rr.die(stack.send, run, time.time() - 3600.0)
    rr.register(stack.send, run, 1)
    rr.steps(stack.send, run, 1, 50, 79)
    rr.epochs(stack.send, run, 1, 2, 2)


def step_chart(page: Any, name: str = "loss") -> Any:
    return page.evaluate("(n) => window.__rankboard.stepChart(n)", name)


def epoch_chart(page: Any) -> Any:
    return page.evaluate("() => window.__rankboard.epochChart()")


def series(snap: Any, faint: bool) -> List[Any]:
    return [s for s in (snap or {}).get("series", []) if bool(s.get("faint")) == faint]


def wait_page(page: Any, what: str, pred: Callable[[], Any], timeout: float = 30.0) -> Any:
    return wait_for(pred, timeout, what)


def line_is(snap: Any, first: int, last: int, value: Callable[[int], float]) -> bool:
    """The chart's line holds exactly one column per step first..last, each its value."""
    lines = series(snap, False)
    if len(lines) != 1:
        return False
    cols = lines[0]["columns"]
    steps = [c[0] for c in cols]
    return (steps == list(range(first, last + 1)) and all(c[0] == c[1] for c in cols)
            and all(abs(c[2] - value(c[0])) < 1e-6 for c in cols))


def the_line_after(s: int) -> float:
    return rr.loss_of(1 if s >= 50 else 0, s)


def check_restart_drawn(page: Any) -> None:
    """The line 0–79 (50–79 the new attempt's), attempt 1's 50–99 faint, the markers and
    their hover, the epoch chart likewise, and the cost line."""
    wait_page(page, "the line re-run from step 50",
              lambda: line_is(step_chart(page), 0, 79, the_line_after))

    def faint_ok() -> bool:
        ghosts = series(step_chart(page), True)
        return (len(ghosts) == 1 and ghosts[0]["name"] == "loss · attempt 1 (superseded)"
                and [c[0] for c in ghosts[0]["columns"]] == list(range(50, 100))
                and all(abs(c[2] - rr.loss_of(0, c[0])) < 1e-6 for c in ghosts[0]["columns"]))
    wait_page(page, "attempt 1's steps 50–99 faint", faint_ok)
    # the marker at the new attempt's first step, on every step chart, with its hover
    for name in ("loss", "step_ms"):
        def marked(n: str = name) -> bool:
            return [(m["step"], m["text"], m["hover"]) for m in step_chart(page, n)["markers"]
                    ] == [(50, "restart 1", HOVER)]
        wait_page(page, f"the restart marker on {name}", marked)
    canvas = page.locator('canvas[data-chart="step-metric"][data-metric="loss"]')
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    snap = step_chart(page)  # after the scroll: the same geometry
    marker = snap["markers"][0]
    page.mouse.move(box["x"] + marker["x"], box["y"] + snap["plot"]["top"] + 20)
    tip = page.locator('[data-step-chart="loss"] .tip-marker')
    expect(tip).to_have_text(f"restart 1: {HOVER}")

    # the epoch chart: the line 0, 1, 2 (2 re-run), attempt 1's epochs 2–3 faint, a marker
    def epochs_ok() -> bool:
        e = epoch_chart(page)
        loss = [s for s in e["series"] if s["name"] == "loss"]
        ghosts = [g for g in e["ghosts"] if g["name"] == "loss · attempt 1 (superseded)"]
        return (e["x"] == [0, 1, 2] and bool(loss)
                and abs(loss[0]["values"][2] - rr.loss_of(1, 20)) < 1e-6
                and len(ghosts) == 1 and ghosts[0]["x"] == [2, 3]
                and [(m["step"], m["text"], m["hover"]) for m in e["markers"]]
                == [(2, "restart 1", HOVER)])
    wait_page(page, "the epoch chart across the restart", epochs_ok)
    e = epoch_chart(page)
    canvas = page.locator("#metrics-card canvas")
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    e = epoch_chart(page)
    page.mouse.move(box["x"] + e["markers"][0]["x"], box["y"] + e["plot"]["top"] + 20)
    tip = page.locator("#metrics-card .tip-marker")
    expect(tip).to_have_text(f"restart 1: {HOVER}")
    expect(page.locator("#metrics-card .chart-tip")).to_contain_text("loss · attempt 1 (superseded)")
    expect(page.get_by_test_id("attempt-line")).to_have_text(COST)
    expect(page.get_by_test_id("epoch-progress").locator("#epoch-count")).to_have_text("3/6")


def test_the_page_across_a_restart_keeps_drawing(stack: Stack, page: Any) -> None:
    run = "restart-live"
    first_attempt(stack, run)
    page.goto(f"{stack.url}/#run={run}")
    wait_page(page, "attempt 0's line",
              lambda: line_is(step_chart(page), 0, 99, lambda s: rr.loss_of(0, s)))
    wait_js(page, "window.__rankboard.epochChart().x.length === 4")
    # a run that never restarted: no cost line, no marker, nothing faint
    expect(page.get_by_test_id("attempt-line")).to_be_hidden()
    assert step_chart(page)["markers"] == [] and series(step_chart(page), True) == []
    page.evaluate("() => { window.__sameDocument = 1; }")
    for r in range(rr.WORLD):  # a `ranks` event: a strip column of the old processes
        stack.send(wire.Resources(run=run, rank=r, sample=wire.ResourceSample(cpu_percent=5.0)))
    wait_js(page, "window.__rankboard.stripTimes().length > 0")

    old_columns = set(page.evaluate("() => window.__rankboard.stripTimes()"))
    restart(stack, run)
    check_restart_drawn(page)
    page.screenshot(path=str(ARTIFACTS / "restart-live.png"))
    # the straggler strip started afresh with the new attempt: no column of the old processes
    assert old_columns.isdisjoint(page.evaluate("() => window.__rankboard.stripTimes()"))
    # live: the page dropped and re-appended (a rewind), and never reloaded
    assert page.evaluate("() => window.__sameDocument") == 1
    assert page.evaluate("() => window.__rankboard.stepRewinds()") >= 1
    assert page.evaluate("() => window.__rankboard.liveSteps()") == list(range(50, 80))
    page.errors.check()


def test_a_page_opened_after_the_restart(stack: Stack, page: Any) -> None:
    run = "restart-later"
    first_attempt(stack, run)
    restart(stack, run)
    wait_for(lambda: header(stack, run).get("steps_done") == 79
             and header(stack, run).get("attempt") == 1, 30.0, "attempt 1 closed 79")
    page.goto(f"{stack.url}/#run={run}")
    check_restart_drawn(page)
    assert page.evaluate("() => window.__rankboard.stepRewinds()") == 0  # all of it fetched
    page.errors.check()


def test_the_report_draws_the_restart(stack: Stack, page: Any, tmp_path: Path) -> None:
    """The web's report.html of the restarted run, opened from a file with no network: the
    line, the superseded records faint (embedded), the markers with their hover, the cost."""
    run = "restart-report"
    first_attempt(stack, run)
    restart(stack, run)
    # the report is the run as the web holds it then: once its header says the rewind (a
    # header may be up to a second behind the steps, PROTOCOL 8.1)
    def settled() -> bool:
        hd = header(stack, run)
        att = hd.get("attempts") or []
        return (hd.get("steps_done") == 79 and len(hd.get("records") or []) == 3
                and [(a["first_step"], a["superseded_steps"], a["first_epoch"]) for a in att]
                == [(0, 50, 0), (50, 0, 2)])
    wait_for(settled, 30.0, "attempt 1 closed, in the header")
    path = tmp_path / "restart.html"
    with urllib.request.urlopen(f"{stack.url}/api/runs/{run}/report.html", timeout=30) as resp:
        path.write_bytes(resp.read())
    attempted = open_offline(page, path)
    check_restart_drawn(page)
    # zoomed: the faint series is taken again for the view
    page.evaluate("() => window.__rankboard.zoom([60, 70])")

    def zoomed() -> bool:
        ghosts = series(step_chart(page), True)
        return len(ghosts) == 1 and [c[0] for c in ghosts[0]["columns"]] == list(range(60, 71))
    wait_page(page, "the faint series within the zoom", zoomed)
    assert attempted == []
    page.errors.check()


def test_an_elastic_job_that_came_back_smaller_leaves_no_rank_behind(stack: Stack,
                                                                      page: Any) -> None:
    """Three ranks, then the job comes back with two (a new attempt): the page open across it
    lists ranks 0 and 1 only in the rank table (no row of the gone rank 2), and the step
    re-run is charged to the three ranks that ran it."""
    run = "restart-elastic"
    t0 = time.time()
    for r in range(3):
        stack.send(wire.Register(run=run, rank=r, world_size=3, host="node-a", local_rank=r,
                                 proc=f"old-{r}"))
        stack.send(wire.Steps(run=run, rank=r, steps=[0, 1], times=[t0, t0 + 1.0],
                              step_ms=[100.0, 100.0], metrics={"loss": [1.0, 0.9]}))
    wait_for(lambda: header(stack, run).get("steps_done") == 1, 30.0, "3 ranks closed step 1")
    page.goto(f"{stack.url}/#run={run}")
    rows = page.locator("#rank-table tbody tr[data-rank]")
    expect(rows).to_have_count(3)
    for r in range(2):
        stack.send(wire.Register(run=run, rank=r, world_size=2, host="node-a", local_rank=r,
                                 proc=f"new-{r}"))
        stack.send(wire.Steps(run=run, rank=r, steps=[1, 2], times=[t0 + 5, t0 + 6],
                              step_ms=[100.0, 100.0], metrics={"loss": [0.8, 0.7]}))
    # step 1 re-run, charged to the 3 ranks that ran it: 1 × 100 ms × 3 = 0.3 GPU-seconds
    expect(page.get_by_test_id("attempt-line")).to_have_text(
        "attempt 2 · 1 step re-run ≈ 0.000083 GPU-hours", timeout=30_000)
    expect(rows).to_have_count(2, timeout=30_000)
    assert sorted(rows.evaluate_all("(rs) => rs.map((r) => Number(r.dataset.rank))")) == [0, 1]
    page.errors.check()


RULES = """async () => {
  const m = await import('/static/attempts.js');
  const att = (k, o) => ({attempt: k, started_at: 1, ended_at: null, world_size: 8,
    first_step: null, last_step: null, first_epoch: null, last_epoch: null,
    superseded_steps: 0, superseded_epochs: 0, cause: null, ...o});
  const hd = {attempt: 2, world_size: 8, attempts: [
    att(0, {first_step: 0, last_step: 2999, superseded_steps: 1000,
            cause: {rank: 5, host: 'node-b', kind: 'error', type: 'torch.OutOfMemoryError',
                    message: 'CUDA out of memory. Tried to allocate 2.00 GiB\\nmore'}}),
    att(1, {first_step: 2000, last_step: 2499, superseded_steps: 200, world_size: 8,
            cause: {rank: 3, host: 'node-a', kind: 'silent', type: '', message: ''}}),
    att(2, {first_step: 2300, last_step: 4000, first_epoch: 1, last_epoch: 1})]};
  const b = {n: 3, mean: [100, 15375, NaN], cnt: [1, 2, 5]};
  return {
    cost: m.restartCost(hd, 15375),
    never: m.restartCost({attempt: 0, attempts: [att(0, {})]}, 100),
    old: m.restartCost({}, 100),
    epochsOnly: m.restartCost({attempt: 1, attempts: [att(0, {superseded_epochs: 2}), att(1, {})]}, null),
    markers: m.restartMarkers(hd, 'step').map((x) => [x.step, x.text, x.hover]),
    epochMarkers: m.restartMarkers(hd, 'epoch').map((x) => [x.step, x.text]),
    ranges: m.supersededRanges(hd, 'step'),
    held: [m.heldAttempt(hd, 'step'), m.heldAttempt(hd, 'epoch'), m.heldAttempt({}, 'step')],
    rewind: [m.isRewind(3, 10, 2, 10), m.isRewind(3, 11, 2, 10), m.isRewind(2, 5, 2, 10),
             m.isRewind(undefined, 5, 0, 10)],
    median: m.medianStepMs(b),
    noCause: m.causeText(0, null),
  };
}"""


def test_the_attempt_rules(stack: Stack, page: Any) -> None:
    """attempts.js, as the page loads it: the cost line of the contract's example (1,200
    superseded steps × a median step of 15.375 s × 8 ranks ≈ 41 GPU-hours), nothing for a run
    that never restarted, the markers and their hover (the previous attempt's cause: type and
    the message's first line, rank, host), the superseded ranges, the rewind rule and the
    count-weighted median."""
    page.goto(f"{stack.url}/#cluster")
    got = page.evaluate(RULES)
    assert got["cost"] == "attempt 3 · 1,200 steps re-run ≈ 41 GPU-hours"
    assert got["never"] is None and got["old"] is None
    assert got["epochsOnly"] == "attempt 2 · 2 epochs re-run"
    assert got["markers"] == [
        [2000, "restart 1", "attempt 1 ended: rank 5 (node-b) failed: torch.OutOfMemoryError: "
                            "CUDA out of memory. Tried to allocate 2.00 GiB"],
        [2300, "restart 2", "attempt 2 ended: rank 3 (node-a) went silent"]]
    assert got["epochMarkers"] == [[1, "restart 2"]]
    assert got["ranges"] == [{"attempt": 0, "start": 2000}, {"attempt": 1, "start": 2300}]
    assert got["held"] == [2, 2, 0]
    assert got["rewind"] == [True, False, False, False]
    assert got["median"] == 15375  # 2 of 3 weighted steps are 15,375 ms; NaN left out
    assert got["noCause"] == "attempt 1 ended without a failure"
    page.errors.check()
