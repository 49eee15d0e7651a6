"""The comparison reads as its runs do (issue 43 item 5), in Chromium over the real stack:
the legend names each run by its label (the id beside it only when two chosen runs share
one), not by its id; and a step run on the epoch axis, where it has one epoch record at most
and drew as a lone dot that looked like data, is left out with a line saying where it is."""
from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.browser.test_steps_page import send_steps, wait_steps
from tests.support.browser import Stack, epoch
from tests.support.polling import wait_for

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def labelled(stack: Stack) -> Stack:
    for run, label in (("cmpl-epochs", "resnet sweep a"), ("cmpl-steps", "gpt steps"),
                       ("cmpl-twin1", "train"), ("cmpl-twin2", "train")):
        stack.send(wire.Register(run=run, rank=0, world_size=1, host="node-a", label=label))
    for run in ("cmpl-epochs", "cmpl-twin1", "cmpl-twin2"):
        for e in range(3):
            epoch(stack, run, e, range(1), loss=2.0 - 0.3 * e)
        stack.wait_run(run, epochs=3)
    send_steps(stack, "cmpl-steps", 0, range(0, 100))
    wait_steps(stack, "cmpl-steps", 99)
    wait_for(lambda: any(r["run"] == "cmpl-steps" and r["steps_done"] == 99
                         for r in stack.get_json("/api/runs")), 10, "the step run listed")
    return stack


def _snap(page: Any) -> Any:
    return page.evaluate("window.__rankboard.compareChart()")


def test_the_legend_names_runs_by_label_and_a_step_run_is_not_a_dot(labelled: Stack, page: Any) -> None:
    stack = labelled
    page.goto(f"{stack.url}/#compare=cmpl-epochs,cmpl-steps&metric=loss&x=epoch")
    view = page.locator("#compare-view")
    expect(view.locator(".legend-item .legend-name")).to_have_text(["resnet sweep a", "gpt steps"])
    wait_for(lambda: (lambda s: s and len(s["series"]) == 2 and len(s["series"][0]["columns"]) == 3
                      and s["series"][1]["columns"] == [])(_snap(page)), 10, "the epoch run only")
    expect(view.locator(".chart-status")).to_contain_text(
        "1 step run (gpt steps): on the step axis only (x axis: step)")
    view.locator("#compare-x").select_option("step")
    wait_for(lambda: (lambda s: s and s["x"] == "step" and s["series"][1]["columns"]
                      and s["series"][1]["columns"][-1][1] == 99)(_snap(page)), 10, "the step run drawn")
    expect(view.locator(".chart-status")).to_have_text("")
    page.errors.check()


def test_two_runs_of_one_label_are_told_apart(labelled: Stack, page: Any) -> None:
    page.goto(f"{labelled.url}/#compare=cmpl-twin1,cmpl-twin2&metric=loss&x=epoch")
    expect(page.locator("#compare-view .legend-item .legend-name")).to_have_text(
        ["train (cmpl-twin1)", "train (cmpl-twin2)"])
    page.errors.check()


def test_a_step_run_is_named_once_the_run_list_arrives_after_the_chart(labelled: Stack, page: Any) -> None:
    """A link opened directly draws the epoch chart before the page has its run list (which
    is what says a run logs steps): the chart is drawn again when the list arrives, not at
    the next 10 s refresh. The list's answer is held at the door to make that order sure."""
    held: list = []
    url = f"{labelled.url}/api/runs"

    def hold(route: Any) -> None:
        held.append(route)

    page.route(lambda u: u == url, hold)
    page.goto(f"{labelled.url}/#compare=cmpl-epochs,cmpl-steps&metric=loss&x=epoch")
    wait_for(lambda: (lambda s: s and len(s["series"]) == 2
                      and len(s["series"][0]["columns"]) == 3)(_snap(page)), 10, "the epoch chart drawn")
    view = page.locator("#compare-view")
    assert view.locator(".chart-status").text_content() == ""
    assert held, "the run list was asked for"
    page.unroute(lambda u: u == url, hold)
    for route in held:
        route.continue_()
    expect(view.locator(".chart-status")).to_contain_text(
        "1 step run (gpt steps): on the step axis only (x axis: step)", timeout=5000)
    page.errors.check()
