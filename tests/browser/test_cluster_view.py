"""The cluster view (PROTOCOL 7.4) in Chromium, over the real stack: linked from the run
picker, it lists every run (status counts, a status filter, a search, sorting) and every
host, suspects first, each incident a link that opens its run at its rank. A host named like
markup and a run label like markup stay text. Loading ``/#cluster`` opens no run stream.
A screenshot is left in artifacts/cluster-view.png."""
from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.support.browser import ARTIFACTS, HOSTILE, Stack, wait_js
from tests.support.polling import wait_for as wait_until

pytestmark = pytest.mark.browser

XID_RUN = "cl-xid"
SCRIPT_RUN = "javascript:void.0"


def _xid(rank: int) -> wire.ResourceSample:
    return wire.ResourceSample(gpu_util_percent=90.0, gpus=[wire.GpuSample(
        device_index=0, name="H100", util_percent=90.0, xid_errors=[79])])


@pytest.fixture(scope="module")
def cluster(stack: Stack) -> Stack:
    """Four runs on four hosts: one GPU on the markup-named host reports an XID; two jobs
    fail on node-9 (one rank of two: the host's trouble, not the job's); one job trains on 8
    ranks."""
    for r in range(2):
        stack.send(wire.Register(run=XID_RUN, rank=r, world_size=2,
                                 host=HOSTILE if r == 1 else "node-1", local_rank=0))
    stack.send(wire.Svg(run=XID_RUN, rank=0, svg="<svg xmlns='http://www.w3.org/2000/svg'/>",
                        label=HOSTILE))
    stack.send(wire.Resources(run=XID_RUN, rank=1, sample=_xid(1)))
    for run in ("cl-fail-a", "cl-fail-b"):  # node-9's rank fails, half of each run (8.5)
        stack.send(wire.Register(run=run, rank=0, world_size=2, host="node-1", local_rank=2),
                   wire.Register(run=run, rank=1, world_size=2, host="node-9", local_rank=0),
                   wire.Finish(run=run, rank=1, status="error"),
                   wire.Finish(run=run, rank=0, status="ok"))
    # a run id that would be a script URL if a link ever used it bare
    stack.send(wire.Register(run=SCRIPT_RUN, rank=0, world_size=1, host="node-1", local_rank=1))
    for r in range(8):
        stack.send(wire.Register(run="cl-big", rank=r, world_size=8, host=f"node-{2 + r // 4}",
                                 local_rank=r % 4, total_epochs=3))

    def ready() -> bool:
        hosts = stack.get_json("/api/hosts")
        return (sum(h["suspect"] for h in hosts) == 2 and len(stack.get_json("/api/runs")) == 5
                and len(stack.get_json("/api/runs?status=failed")) == 2)
    wait_until(ready, 20, "the suspects on /api/hosts")
    return stack


def _rows(page: Any, testid: str, attr: str) -> list[str]:
    return page.eval_on_selector_all(f"[data-testid={testid}] tbody tr",
                                     f"(rows) => rows.map((r) => r.dataset.{attr})")


def test_the_cluster_view_from_the_picker(cluster: Stack, page: Any) -> None:
    page.goto(cluster.url + "/")
    expect(page.locator("#run-view")).to_be_visible(timeout=10_000)
    page.click("[data-testid=cluster-link]")
    view = page.locator("[data-testid=cluster-view]")
    expect(view).to_be_visible()
    assert page.evaluate("() => location.hash") == "#cluster"
    expect(page.locator("#run-view")).to_be_hidden()
    wait_js(page, "window.__rankboard.cluster().hosts >= 5 && "
                  "window.__rankboard.cluster().runs >= 5")

    # runs: every run, newest first, with the counts per status
    runs = _rows(page, "cluster-runs", "run")
    assert set(runs) >= {XID_RUN, "cl-fail-a", "cl-fail-b", "cl-big", SCRIPT_RUN}
    counts = page.locator("[data-testid=cluster-counts]")
    expect(counts.locator("[data-status=failed]")).to_have_text("failed 2")
    expect(counts.locator("[data-status='']")).to_contain_text("all ")

    # the status filter
    counts.locator("[data-status=failed]").click()
    wait_until(lambda: sorted(_rows(page, "cluster-runs", "run")) == ["cl-fail-a", "cl-fail-b"],
               5, "only the failed runs")
    counts.locator("[data-status=failed]").click()  # off again: every run
    wait_until(lambda: len(_rows(page, "cluster-runs", "run")) == len(runs), 5, "every run")

    # the search (run id or label, any case)
    page.fill("[data-testid=cluster-search]", "CL-FAIL-B")
    wait_until(lambda: _rows(page, "cluster-runs", "run") == ["cl-fail-b"], 5, "one run found")
    page.fill("[data-testid=cluster-search]", "onerror")  # a substring of the hostile label
    wait_until(lambda: _rows(page, "cluster-runs", "run") == [XID_RUN], 5, "found by label")
    page.fill("[data-testid=cluster-search]", "")

    # sort by world size, largest first, then smallest first
    page.click("[data-testid=cluster-runs] [data-sort=world]")
    wait_until(lambda: _rows(page, "cluster-runs", "run")[0] == "cl-big", 5, "biggest first")
    page.click("[data-testid=cluster-runs] [data-sort=world]")
    wait_until(lambda: _rows(page, "cluster-runs", "run")[-1] == "cl-big", 5, "biggest last")

    # hosts: suspects first, the hostile name as text, reasons shown
    hosts = _rows(page, "cluster-hosts", "host")
    assert set(hosts[:2]) == {HOSTILE, "node-9"}
    hostile = page.locator("[data-testid=cluster-hosts] tr[data-suspect=true] td.host",
                           has_text="onerror")
    expect(hostile).to_have_text(HOSTILE)
    expect(page.locator("[data-testid=cluster-hosts]")).to_contain_text(f"gpu_xid in {XID_RUN}")
    expect(page.locator("[data-testid=cluster-hosts]")).to_contain_text("incidents in 2 runs")
    assert page.locator("[data-testid=cluster-view] img").count() == 0  # no markup ran
    assert page.evaluate("() => window.__pwned") is None
    script_link = page.locator(f"[data-testid=cluster-runs] tr[data-run='{SCRIPT_RUN}'] a")
    assert script_link.get_attribute("href") == "#run=javascript%3Avoid.0"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "cluster-view.png"), full_page=True)

    # an incident opens its run at its rank
    link = page.locator("[data-testid=cluster-hosts] a.incident[data-kind=gpu_xid]")
    assert link.get_attribute("href") == f"#run={XID_RUN}&rank=1"
    link.click()
    expect(page.locator("#run-view")).to_be_visible()
    expect(view).to_be_hidden()
    expect(page.locator("[data-testid=run-name]")).to_have_text(HOSTILE)
    expect(page.locator("#panel-rank")).to_be_visible()
    assert page.evaluate("() => window.__pwned") is None
    page.errors.check()


def test_loading_cluster_opens_no_run(cluster: Stack, page: Any) -> None:
    page.goto(cluster.url + "/#cluster")
    wait_js(page, "window.__rankboard.cluster().hosts >= 5")
    expect(page.locator("#run-view")).to_be_hidden()
    assert page.evaluate("() => window.__rankboard.ranksLoads()") == 0
    # the picker is filled from the view's own /api/runs answer
    wait_until(lambda: page.locator("#run-picker option").count() >= 5, 5, "the picker filled")
    # the picker leaves the view for the run
    page.select_option("#run-picker", "cl-big")
    expect(page.locator("#run-view")).to_be_visible()
    expect(page.locator("[data-testid=cluster-view]")).to_be_hidden()
    assert page.evaluate("() => location.hash") == "#run=cl-big"
    page.errors.check()


def test_the_page_filters_and_sorts_as_the_api_does(cluster: Stack, page: Any) -> None:
    """``selectRuns``/``statusCounts`` (cluster.js, no DOM): the substring rule of ``q`` (the
    box's blanks around ignored), every status or the chosen ones, missing values last, ties
    in the server's order."""
    page.goto(cluster.url + "/#cluster")
    out = page.evaluate("""async () => {
      const m = await import("/static/cluster.js");
      const runs = [
        {run: "r1", status: "complete", world_size: 8, started_at: 3, updated_at: 9, label: "Sweep A"},
        {run: "r2", status: "failed", world_size: null, started_at: 2, updated_at: null, label: null},
        {run: "R3", status: "training", world_size: 8, started_at: 1, updated_at: 7, label: null},
        {run: "r4", status: "waiting", world_size: 64, started_at: null, updated_at: 8, label: "x"},
      ];
      const ids = (l) => l.map((r) => r.run);
      const all = new Set();
      return {
        counts: m.statusCounts(runs),
        byStartDesc: ids(m.selectRuns(runs, all, "", {key: "started", desc: true})),
        byWorldDesc: ids(m.selectRuns(runs, all, "", {key: "world", desc: true})),
        byWorldAsc: ids(m.selectRuns(runs, all, "", {key: "world", desc: false})),
        byStatus: ids(m.selectRuns(runs, all, "", {key: "status", desc: false})),
        byUpdate: ids(m.selectRuns(runs, all, "", {key: "updated", desc: true})),
        failedOrWaiting: ids(m.selectRuns(runs, new Set(["failed", "waiting"]), "",
                                          {key: "started", desc: true})),
        search: ids(m.selectRuns(runs, all, " sWeEp ", {key: "started", desc: true})),
        searchId: ids(m.selectRuns(runs, all, "r3", {key: "started", desc: true})),
      };
    }""")
    assert out["counts"] == {"waiting": 1, "training": 1, "complete": 1, "failed": 1}
    assert out["byStartDesc"] == ["r1", "r2", "R3", "r4"]  # no start: last
    assert out["byWorldDesc"] == ["r4", "r1", "R3", "r2"]  # 8 = 8: the server's order
    assert out["byWorldAsc"] == ["r1", "R3", "r4", "r2"]
    assert out["byStatus"] == ["r2", "R3", "r4", "r1"]  # failed, training, waiting, complete
    assert out["byUpdate"] == ["r1", "r4", "R3", "r2"]
    assert out["failedOrWaiting"] == ["r2", "r4"]
    assert out["search"] == ["r1"] and out["searchId"] == ["R3"]
    page.errors.check()
