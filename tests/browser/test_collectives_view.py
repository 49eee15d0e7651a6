"""The collective verdict on the page (PROTOCOL.md section 7.2) in a real headless Chromium:
against the real stack (``rankboard up``), ``collectives`` frames sent as the agents send
them make the trouble card lead with the sentence that names the rank the others wait for,
above the stack groups, with ``GET /collectives`` serving the same verdict; and a saved
report.html carries it. An op name built to run script stays inert text."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from rankboard.export import report_of_sink
from tests.support.browser import ARTIFACTS, HOSTILE, Stack
from tests.support.polling import wait_for
from tests.support.reportrun import build_run, stacks
from web.report import render

pytestmark = pytest.mark.browser

WORLD = 4
SENTENCE = "rank 2 has not entered gloo:all_reduce #2501 of group 0, where ranks 0–1, 3 wait"


def coll(run: str, rank: int, enqueued: int, op: str = "gloo:all_reduce") -> wire.Collectives:
    return wire.Collectives(
        run=run, rank=rank, reason="stall", taken_at=time.time(),
        groups=[wire.ProcessGroupStatus(pg="0", desc="default_pg", size=WORLD,
                                        last_enqueued=enqueued, last_completed=enqueued - 1)],
        entries=[wire.CollectiveEntry(pg="0", seq=s, op=op, input_sizes=[[4, 8]])
                 for s in range(enqueued - 2, enqueued + 1)])


def stall(run: str, rank: int) -> wire.Stacks:
    frames = [wire.StackFrame(file="/job/train.py", line=41, function="train_step"),
              wire.StackFrame(file="/venv/torch/distributed.py", line=7, function="all_reduce")]
    return wire.Stacks(run=run, rank=rank, reason="stall", taken_at=time.time(), idle_s=75.0,
                       threads=[wire.ThreadStack(name="MainThread", frames=frames, main=True)])


def test_the_trouble_card_leads_with_the_verdict(stack: Stack, page: Any) -> None:
    run = "coll-hang"
    for rank in range(WORLD):
        stack.send(wire.Register(run=run, rank=rank, world_size=WORLD, host=f"node-{rank // 2}"))
    page.goto(f"{stack.url}/#run={run}")
    expect(page.locator("#run-picker")).to_have_value(run)
    for rank in range(WORLD):
        stack.send(stall(run, rank))
    # ranks 0, 1 and 3 wait in #2501; rank 2 never entered it; rank 3 is in something else
    stack.send(coll(run, 0, 2501), coll(run, 1, 2501), coll(run, 2, 2500),
               coll(run, 3, 2501, op=HOSTILE))
    verdict = page.locator("#stall-view [data-testid=collective-verdict]")
    expect(verdict.locator(".verdict-line").nth(0)).to_have_text(SENTENCE, timeout=15_000)
    expect(verdict.locator(".verdict-line").nth(1)).to_contain_text(
        f"rank 3 is in {HOSTILE} [[4,8]], not gloo:all_reduce #2501 of group 0")
    # above the stack groups
    expect(page.locator("#stall-view [data-testid=stall-group]").first).to_be_visible()
    above = page.evaluate("""() => {
        const v = document.querySelector('#stall-view [data-testid=collective-verdict]');
        const g = document.querySelector('#stall-view [data-testid=stall-group]');
        return !!(v.compareDocumentPosition(g) & Node.DOCUMENT_POSITION_FOLLOWING);
    }""")
    assert above
    assert page.evaluate("() => window.__pwned") is None
    assert page.locator("#stall-view img").count() == 0
    body = stack.get_json(f"/api/runs/{run}/collectives")
    [group] = body["groups"]
    assert group["behind"] == [{"rank": 2, "last_enqueued": 2500, "op": "gloo:all_reduce"}]
    assert [m["rank"] for m in group["mismatched"]] == [3]
    assert [r["rank"] for r in body["ranks"]] == [0, 1, 2, 3]

    def alerts() -> dict[str, Any]:
        return {a["kind"]: a for a in stack.get_json(f"/api/runs/{run}")["alerts"]
                if a["kind"].startswith("collective")}

    wait_for(lambda: len(alerts()) == 2, 15.0, "the two collective alerts in the header")
    assert alerts()["collective_behind"]["message"] == (
        "not in gloo:all_reduce #2501 of group 0 where 3 ranks wait")
    assert alerts()["collective_mismatch"]["rank"] == 3
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#stall-view").screenshot(path=str(ARTIFACTS / "collectives.png"))
    # the rank moves on (a steps frame): its frame is no longer current, the verdict follows
    stack.send(wire.Steps(run=run, rank=2, steps=[1], times=[time.time()], step_ms=[5.0]))
    wait_for(lambda: stack.get_json(f"/api/runs/{run}/collectives")["groups"][0]["behind"] == [],
             15.0, "rank 2 no longer behind")
    expect(verdict.locator(".verdict-line").nth(0)).not_to_have_text(SENTENCE, timeout=15_000)
    page.errors.check()


def test_the_report_carries_the_verdict(page: Any, tmp_path: Path) -> None:
    rep = report_of_sink(build_run(None, "coll-report", ranks=4, epochs=2, steps=50))
    rep.stacks = stacks([0, 1, 3])
    rep.collectives = {"groups": [{
        "pg": "0", "desc": "default_pg", "size": 4, "seq": 2501, "op": "gloo:all_reduce",
        "waiting": [0, 1, 3], "behind": [{"rank": 2, "last_enqueued": 2500, "op": HOSTILE}],
        "absent": [], "mismatched": []}], "ranks": []}
    path = tmp_path / "r.html"
    path.write_bytes("".join(render(rep)).encode("utf-8"))
    page.goto(path.resolve().as_uri())
    card = page.locator("[data-testid=collective-verdict]")
    expect(card.locator(".verdict-line")).to_have_text(SENTENCE)
    # it leads: above the stall groups
    assert page.evaluate("""() => {
        const v = document.querySelector('[data-testid=collective-verdict]');
        const g = document.querySelector('[data-testid=stall-groups]');
        return !!(v.compareDocumentPosition(g) & Node.DOCUMENT_POSITION_FOLLOWING);
    }""")
    assert page.evaluate("() => window.__pwned") is None
    page.errors.check()
