"""The data wait on the page (PROTOCOL.md 7.1) in Chromium: the cause line above the straggler
board, each rank's ``data_ms`` on the board and in the rank table, and the saved report.

Frames go in through the real broker's ingest; what the page shows is read from the DOM.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from broker.run.sink import RunSink
from rank_agent import protocol as wire
from rankboard.export import report_of_sink
from tests.browser.test_report import open_offline
from tests.browser.test_steps_page import T0, open_run, register, wait_steps
from tests.support.browser import Stack
from web.report import render

pytestmark = pytest.mark.browser


def data_steps(run: str, rank: int, steps: range, data_ms: float, step_ms: float = 400.0) -> Any:
    s = list(steps)
    return wire.Steps(run=run, rank=rank, steps=s, times=[T0 + x for x in s],
                      step_ms=[step_ms] * len(s), metrics={"loss": [1.0] * len(s)},
                      data_ms=[data_ms] * len(s))


def test_one_input_bound_rank_is_named_above_the_board(stack: Stack, page: Any) -> None:
    run = "data-straggler"
    register(stack, run, world=8, per_host=4)
    for r in range(8):
        stack.send(data_steps(run, r, range(0, 60), 310.0 if r == 5 else 10.0 + r % 4))
    wait_steps(stack, run, 59)
    open_run(page, stack, run)
    # the others: 10, 11, 12, 13, 10, 12, 13 -> median 12
    cause = page.locator("#data-cause")
    expect(cause).to_be_visible()
    expect(cause).to_have_text(
        "rank 5 waits 310 ms a step for data, median 12 ms: input-bound on that rank")
    # the rank table's column, sortable: rank 5 first
    page.locator('#rank-table [data-sort="dataMs"]').click()
    first = page.locator("#rank-table tbody tr").first
    expect(first).to_have_attribute("data-rank", "5")
    expect(first).to_contain_text("310")
    # the cause line sits above the board's chips, in the straggler card
    above = page.evaluate("""() => {
        const c = document.getElementById('data-cause'), m = document.getElementById('straggler-marks');
        return c.closest('#straggler-card') !== null &&
               !!(c.compareDocumentPosition(m) & Node.DOCUMENT_POSITION_FOLLOWING);
    }""")
    assert above
    page.errors.check()


def test_the_whole_job_waiting_is_named(stack: Stack, page: Any) -> None:
    run = "data-bound-job"
    register(stack, run, world=4, per_host=4)
    for r in range(4):
        stack.send(data_steps(run, r, range(0, 40), 140.0, step_ms=400.0))
    wait_steps(stack, run, 39)
    open_run(page, stack, run)
    expect(page.locator("#data-cause")).to_have_text("the whole job waits for data: 35 % of each step")
    page.errors.check()


def test_a_wait_longer_than_its_step_reads_as_such(stack: Stack, page: Any) -> None:
    """Issue 38: a data_ms of 1e307 beside a step_ms of 1 made a share whose percentage read
    "Infinity %"; a share past 1 (waits longer than their steps) is said as that."""
    run = "data-absurd"
    register(stack, run, world=2, per_host=2)
    for r in range(2):
        stack.send(data_steps(run, r, range(0, 10), 1e307, step_ms=1.0))
    wait_steps(stack, run, 9)
    open_run(page, stack, run)
    expect(page.locator("#data-cause")).to_have_text(
        "the whole job waits for data: more than its whole step (check the ranks' data_ms)")
    page.errors.check()


def test_no_cause_no_line(stack: Stack, page: Any) -> None:
    run = "data-fine"
    register(stack, run, world=4, per_host=4)
    for r in range(4):
        stack.send(data_steps(run, r, range(0, 40), 20.0, step_ms=400.0))
    wait_steps(stack, run, 39)
    open_run(page, stack, run)
    expect(page.locator('#rank-table tr[data-rank="2"]')).to_contain_text("20")
    expect(page.locator("#data-cause")).to_be_hidden()
    page.errors.check()


def test_the_report_carries_the_cause_and_the_column(page: Any, tmp_path: Path) -> None:
    run = "data-report"
    sink = RunSink(run, step_close_after=1000.0)
    t = 1.0
    for r in range(4):
        sink.apply(wire.decode(wire.encoder.encode(wire.Register(
            run=run, rank=r, world_size=4, host="node-a", local_rank=r))), t)
    for s in range(0, 30, 10):
        t += 1.5
        for r in range(4):
            sink.apply(wire.decode(wire.encoder.encode(
                data_steps(run, r, range(s, s + 10), 250.0 if r == 3 else 8.0))), t)
    sink.tick(t + 2)
    sink.settle(t + 3)
    path = tmp_path / "data-report.html"
    path.write_bytes("".join(render(report_of_sink(sink))).encode("utf-8"))
    attempted = open_offline(page, path)
    expect(page.locator("#data-cause")).to_have_text(
        "rank 3 waits 250 ms a step for data, median 8 ms: input-bound on that rank")
    expect(page.locator('#rank-table tr[data-rank="3"]')).to_contain_text("250")
    assert attempted == []
    page.errors.check()


def test_the_cause_line_reads_the_brokers_median(stack: Stack, page: Any) -> None:
    """Issue 44 item 5: the median in the cause line is the header entry's ``median_ms``
    (what the broker compared the rank with), not one the page works out again from the
    ranks array: a header whose entry says 12 reads 12 whatever the ranks hold, and an
    entry without one (no median: nothing to say of the rank) falls to the share line."""
    page.goto(f"{stack.url}/")
    got = page.evaluate("""async () => {
      const { dataCause } = await import("/static/datawait.js");
      const entry = { rank: 5, host: "h", data_ms: 310, step_ms: 400, median_ms: 12.4 };
      return [dataCause({ data_stragglers: [entry], data_share: 0.1 }),
              dataCause({ data_stragglers: [{ ...entry, median_ms: null }], data_share: 0.3 })];
    }""")
    assert got == ["rank 5 waits 310 ms a step for data, median 12 ms: input-bound on that rank",
                   "the whole job waits for data: 30 % of each step"]
    page.errors.check()


def test_a_ranks_data_wait_reads_as_the_rank_tables_column(stack: Stack, page: Any) -> None:
    """Issue 44 item 5: the straggler chip's data wait is ``fmt.js``'s ``fmtMs``, the format
    of the rank table's "data wait" column, not a second format of its own."""
    page.goto(f"{stack.url}/")
    got = page.evaluate("""async () => {
      const { dataFig } = await import("/static/datawait.js");
      const { fmtMs } = await import("/static/fmt.js");
      return [310, 4.5, 12.34, 1234].map((v) => [dataFig(v), `data ${fmtMs(v)}`])
        .concat([[dataFig(null), null]]);
    }""")
    assert got == [["data 310 ms"] * 2, ["data 4.5 ms"] * 2, ["data 12.3 ms"] * 2,
                   ["data 1.23 s"] * 2, [None, None]]
    page.errors.check()
