"""The demo's hosts table blames one host (issue 37, PROTOCOL 8.5 "Hosts, fairly"): one
round of ``rankboard demo`` (an epoch run and a step run of 4 real agent processes on 2
simulated hosts, a hang every rank waits out, a GPU that reports an XID) ends with exactly
the XID's host suspect in the cluster view, not both hosts because every waiting rank raised
``stalled`` on its own host."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from playwright.sync_api import expect

from tests.support.browser import Stack, wait_js
from tests.support.polling import wait_for

pytestmark = pytest.mark.browser


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path / "data", ["demo", "--port", "0", "--no-browser", "--ranks", "4",
                                  "--hosts", "2", "--epochs", "4", "--epoch-seconds", "0.5",
                                  "--rounds", "1"])
    try:
        s.start()
        yield s
    finally:
        s.close()


def test_the_demos_hosts_table_marks_exactly_the_xid_host(demo: Stack, page: Any) -> None:
    def round_done() -> Any:
        runs = demo.get_json("/api/runs")
        # the epoch run fails (8.2); the step run fails too, at 80 % of its steps, and is
        # restarted (8.1): its round is over when its second attempt completes
        status = {("steps" if r["run"].startswith("demo-steps-") else "epochs"): r["status"]
                  for r in runs}
        return runs if len(runs) == 2 and status == {"epochs": "failed",
                                                     "steps": "complete"} else None

    runs = wait_for(round_done, 180.0, "the demo's round: both runs ended")
    steps_run = next(r["run"] for r in runs if r["run"].startswith("demo-steps-"))
    header = demo.get_json(f"/api/runs/{steps_run}")
    assert header["total_steps"] == 100 and header["eta_secs"] == 0.0  # its end (8.5)
    kinds = {(a["kind"], a["rank"]) for a in header["alerts"]}
    # the hang: every rank stalled (the run's trouble); the XID on rank 2, on node-b
    assert {("stalled", r) for r in range(4)} <= kinds, kinds
    assert ("gpu_xid", 2) in kinds
    xid_host = next(h["host"] for h in header["hosts"] if 2 in h["ranks"])
    assert xid_host == "node-b"

    hosts = demo.get_json("/api/hosts")
    assert [h["host"] for h in hosts if h["suspect"]] == [xid_host], hosts
    by_name = {h["host"]: h for h in hosts}
    # node-a's ranks waited with everyone (the run's trouble, no host's) but its rank 1 is
    # the one the hang waited for: the collective verdict names it, one incident, one run
    assert [(i["kind"], i["rank"]) for i in by_name["node-a"]["incidents"]] == [
        ("collective_behind", 1)]
    assert not by_name["node-a"]["suspect"]
    assert f"gpu_xid in {steps_run}" in by_name[xid_host]["reasons"]

    page.goto(f"{demo.url}/#cluster")
    wait_js(page, "window.__rankboard.cluster().hosts >= 2")
    table = page.locator("[data-testid=cluster-hosts]")
    suspects = table.locator("tbody tr[data-suspect=true]")
    expect(suspects).to_have_count(1, timeout=10_000)
    expect(suspects.locator("td.host")).to_have_text(xid_host)
    expect(table.locator("tbody tr")).to_have_count(2)
    page.errors.check()
