"""The first failure on the page (PROTOCOL 8.2), in a real headless Chromium against the real
stack (``rankboard up``): a run whose ranks die leads with the rank that failed first ("rank
5 (node-b) failed first, HH:MM:SS: torch.OutOfMemoryError: CUDA out of memory…"), even
though its finish arrived after the others', its traceback folded and innermost first, then
the other groups; a hostile exception message is shown as text and runs nothing. The saved
``report.html``, opened offline, leads the same way and names the ranks that went silent."""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from broker.run.sink import RunSink
from rank_agent import protocol as wire
from rankboard.export import report_of_sink
from tests.browser.test_report import open_offline
from tests.support.browser import Stack, register
from tests.support.reportrun import build_run
from web.report import render

pytestmark = pytest.mark.browser

RUN = "died-run"
HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)\n"
       "If reserved but unallocated memory is large try setting max_split_size_mb")
FRAMES = [wire.StackFrame(file="train.py", line=88, function="<module>", code="main()"),
          wire.StackFrame(file="train.py", line=61, function="main", code="train(model)"),
          wire.StackFrame(file="model.py", line=17, function="forward", code="x = self.attn(x)")]


def error(tp: str, message: str, at: float, frames: list[wire.StackFrame] | None = None
          ) -> wire.ErrorInfo:
    return wire.ErrorInfo(type=tp, message=message, at=at, frames=frames or [])


def test_the_page_leads_a_failed_run_with_its_first_failure(stack: Stack, page: Any) -> None:
    hosts = ["node-a", "node-b"]
    register(stack, RUN, 8, 0, hosts=hosts)
    t = time.time()
    # the collective errors arrive first; rank 5's own finish (the cause) arrives last
    for r in (0, 1, 2, 6, 7):
        stack.send(wire.Finish(run=RUN, rank=r, status="error", error=error(
            "torch.distributed.DistBackendError",
            HOSTILE if r == 0 else f"[rank {r}] recv from rank 5 failed", t - 5.0 + r * 0.1)))
    stack.send(wire.Finish(run=RUN, rank=3, status="ok"))
    stack.send(wire.Finish(run=RUN, rank=4, status="error",
                           error=error("RuntimeError", "NCCL watchdog timeout", t - 4.0)))
    stack.send(wire.Finish(run=RUN, rank=5, status="error",
                           error=error("torch.OutOfMemoryError", OOM, t - 9.0, FRAMES)))
    page.goto(f"{stack.url}/#run={RUN}")
    first = page.get_by_test_id("failure-first")
    expect(first).to_have_text(re.compile(
        r"^rank 5 \(node-b\) failed first, \d\d:\d\d:\d\d: torch\.OutOfMemoryError: "
        r"CUDA out of memory\. Tried to allocate 2\.00 GiB \(GPU 0; 79\.15 GiB total "
        r"capacity\)…$"), timeout=15_000)
    expect(page.get_by_test_id("status")).to_have_attribute("data-status", "failed")
    card = page.get_by_test_id("failure")
    # it leads: above the alerts and the tabs
    card_top = card.bounding_box()["y"]
    assert card_top < page.locator("nav.tabs").bounding_box()["y"]
    assert card_top < page.get_by_test_id("alerts").bounding_box()["y"]
    expect(page.get_by_test_id("failure-message")).to_have_text(OOM)
    # the traceback is folded, innermost frame first
    fold = page.get_by_test_id("failure-traceback")
    assert fold.evaluate("(d) => d.open") is False
    fold.locator("summary").click()
    text = fold.locator("pre").inner_text()
    assert text.index("model.py:17 in forward") < text.index("train.py:61 in main") < \
        text.index("train.py:88 in <module>")
    assert "x = self.attn(x)" in text
    groups = page.get_by_test_id("failure-groups").locator("li").all_inner_texts()
    assert groups == [
        "5 ranks torch.distributed.DistBackendError: " + HOSTILE + " (ranks 0–2, 6–7)",
        "1 rank RuntimeError: NCCL watchdog timeout (rank 4)",
    ]
    # the rank table names each failed rank's exception type on its status
    status = page.locator('#rank-table tbody tr[data-rank="5"] .status-cell')
    expect(status).to_have_attribute("title", "failed: torch.OutOfMemoryError")
    # the hostile message is text: no element made of it, no script run
    assert card.locator("img, script").count() == 0
    assert page.evaluate("() => window.__pwned") is None
    page.errors.check()


def test_the_report_leads_with_the_failure_and_names_the_silent_ranks(
        tmp_path: Path, page: Any) -> None:
    t0 = time.time() - 4000.0
    sink: RunSink = build_run(None, "died:report", ranks=8, epochs=3, steps=500, t0=t0,
                              finish=False, hostile=False)
    t = t0 + 400.0
    # ranks 2 and 3 were killed (silent since the start); the others fail after them
    for r in (0, 1, 4, 5, 6, 7):
        sink.apply(wire.Resources(run="died:report", rank=r, sample=wire.ResourceSample()), t)
    for r in (0, 1, 4, 5, 6, 7):
        sink.apply(wire.Finish(run="died:report", rank=r, status="error", error=error(
            "torch.distributed.DistBackendError", "Connection reset by peer", t + r)), t + 10)
    sink.tick(t + 1000.0)  # ranks 2 and 3 turn stale
    f = sink.header()["failure"]
    assert f["first"]["kind"] == "silent" and f["silent"]["ranks"] == [2, 3]
    path = tmp_path / "died.html"
    path.write_text("".join(render(report_of_sink(sink))), encoding="utf-8")
    attempted = open_offline(page, path)
    first = page.get_by_test_id("failure-first")
    expect(first).to_have_text(re.compile(
        r"^rank 2 \(\S+\) went silent first, \d\d:\d\d:\d\d: killed, or crashed below Python$"))
    expect(page.get_by_test_id("failure-silent")).to_have_text(
        "2 ranks went silent: killed, or crashed below Python (ranks 2–3)")
    expect(page.get_by_test_id("failure-groups")).to_have_text(
        "6 ranks torch.distributed.DistBackendError: Connection reset by peer (ranks 0–1, 4–7)")
    assert attempted == []
    page.errors.check()
