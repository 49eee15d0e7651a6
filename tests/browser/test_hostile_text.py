"""Issue 38, item 7, in a real Chromium against ``rankboard up``: a label and a host name
holding bidirectional overrides do not reorder the page's text around them (``dom.js``
isolates them), and a 1,000-rank mismatch draws a verdict of about a screen, not a line a
rank (``collectives.js``)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from rankboard.export import report_of_sink
from tests.support import reportrun
from tests.support.browser import Stack, epoch
from web.report import render

pytestmark = pytest.mark.browser

RLO = "\u202e"  # RIGHT-TO-LEFT OVERRIDE, never closed

#: (first, last) x of a text node's first and last characters as drawn: first < last when
#: the text reads left to right as written.
GLYPHS_JS = """(el) => {
    const node = [...el.childNodes].find((n) => n.nodeType === Node.TEXT_NODE);
    const text = node.textContent;
    const at = (i) => { const r = document.createRange(); r.setStart(node, i); r.setEnd(node, i + 1);
                        return r.getBoundingClientRect().x; };
    const chars = [...text].map((c, i) => [c, i]).filter(([c]) => /[a-z0-9]/i.test(c));
    return [at(chars[0][1]), at(chars[chars.length - 1][1]), chars.length];
}"""


def test_overrides_in_a_label_and_a_host_stay_in_their_own_text(stack: Stack, page: Any) -> None:
    run = "bidi-run"
    for r in range(2):
        stack.send(wire.Register(run=run, rank=r, world_size=2, host=f"node{RLO}-{r}",
                                 local_rank=r, total_epochs=2, label=f"evil{RLO} label"))
    epoch(stack, run, 0, range(2), loss=1.5)
    stack.wait_run(run, epochs=1)
    page.goto(f"{stack.url}/#cluster")
    row = page.locator(f'[data-testid=cluster-view] tr[data-run="{run}"]')
    expect(row.locator(".run-id")).to_contain_text(run, timeout=15_000)
    # the run id comes after the label in the same line: it reads "bidi-run", not "nur-idib"
    first, last, _ = row.locator(".run-id").evaluate(GLYPHS_JS)
    assert first < last, (first, last)
    # the label is still the label, its own characters as sent
    assert RLO in row.locator(".run-link").text_content()
    page.goto(f"{stack.url}/#run={run}")
    expect(page.locator("#run-name")).to_contain_text("label")
    page.errors.check()


def test_a_thousand_rank_mismatch_draws_about_a_screen(stack: Stack, page: Any) -> None:
    run, world = "wide-mismatch", 1000
    for r in range(world):
        stack.send(wire.Register(run=run, rank=r, world_size=world, host=f"n{r // 8}",
                                 local_rank=r % 8))
    page.goto(f"{stack.url}/#run={run}")
    expect(page.locator("#run-picker")).to_have_value(run, timeout=15_000)
    now = time.time()
    for r in range(world):  # every rank in #2501, each with its own sizes
        stack.send(wire.Collectives(
            run=run, rank=r, reason="stall", taken_at=now,
            groups=[wire.ProcessGroupStatus(pg="0", desc="default_pg", size=world,
                                            last_enqueued=2501, last_completed=2500)],
            entries=[wire.CollectiveEntry(pg="0", seq=2501, op="nccl:all_reduce",
                                          input_sizes=[[r + 1, 8]])]))
    verdict = page.locator("#stall-view [data-testid=collective-verdict]")
    expect(verdict.locator(".verdict-line").last).to_contain_text("more sentences like these",
                                                                  timeout=30_000)
    lines = verdict.locator(".verdict-line")
    assert lines.count() <= 12
    assert verdict.evaluate("e => e.getBoundingClientRect().height") < 900
    mismatched = stack.get_json(f"/api/runs/{run}/collectives")["groups"][0]["mismatched"]
    assert len(mismatched) > 12  # the API keeps them all
    page.errors.check()


def test_a_saved_report_isolates_them_too(page: Any, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """report.html is made of the same modules (dom.js): a host's override stays in the host."""
    monkeypatch.setattr(reportrun, "host_of", lambda rank: f"node{RLO}-{rank // 4}")
    rep = report_of_sink(reportrun.build_run(None, "bidi-report", ranks=8, epochs=2, steps=200))
    path = tmp_path / "r.html"
    path.write_bytes("".join(render(rep)).encode("utf-8"))
    page.goto(path.resolve().as_uri())
    # no sibling text follows a host in the report's default view, so this checks the text
    # itself: every text holding the override is a closed isolate (what ends it there)
    texts = page.evaluate("""() => [...document.querySelectorAll("body *:not(script)")]
        .flatMap((el) => [...el.childNodes])
        .filter((n) => n.nodeType === Node.TEXT_NODE && n.textContent.includes("\\u202e"))
        .map((n) => n.textContent)""")
    assert texts, "no host on the report"
    for text in texts:
        assert text.startswith("\u2068") and text.endswith("\u2069"), repr(text)
    page.errors.check()
