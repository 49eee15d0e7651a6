"""The answer to a hang, kept (PROTOCOL.md 8.5), in a real headless Chromium: against the
real stack (``rankboard up``) the trouble card shows the header's ``collectives_last``, with
its time, once the hang's frames are no longer current; and ``rankboard export`` of a job
that hung and whose broker was then SIGKILLed writes a report.html that carries the verdict
and its ``collective_behind`` alert; a report carries the header's ``failure`` as text."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from rankboard.export import report_of_sink
from tests.support import REPO
from tests.support.brokers import Pusher
from tests.support.browser import HOSTILE, Stack
from tests.support.journalrun import state_parts
from tests.support.polling import wait_for
from tests.support.procs import Proc, start_broker, start_web
from tests.support.reportrun import build_run
from tests.web.conftest import spawn  # noqa: F401  (fixture re-exported)
from web.report import render

pytestmark = pytest.mark.browser

SENTENCE = "rank 2 has not entered gloo:all_reduce #101 of group 0, where ranks 0–1 wait"
#: "last collective verdict, 2026-12-06 04:58:07": the card says when
TITLE = re.compile(r"last collective verdict, \d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def coll(run: str, rank: int, enqueued: int, op: str = "gloo:all_reduce") -> wire.Collectives:
    return wire.Collectives(
        run=run, rank=rank, reason="stall", taken_at=time.time(),
        groups=[wire.ProcessGroupStatus(pg="0", desc="default_pg", size=3,
                                        last_enqueued=enqueued, last_completed=enqueued - 1)],
        entries=[wire.CollectiveEntry(pg="0", seq=s, op=op, input_sizes=[[4, 8]])
                 for s in range(enqueued - 2, enqueued + 1)])


def hang(run: str) -> list[Any]:
    """Three ranks: 0 and 1 wait in #101, rank 2 never entered it."""
    return [*(wire.Register(run=run, rank=r, world_size=3, host=f"node-{r}") for r in range(3)),
            coll(run, 0, 101), coll(run, 1, 101), coll(run, 2, 100)]


def step(run: str, rank: int) -> wire.Steps:
    return wire.Steps(run=run, rank=rank, steps=[1], times=[time.time()], step_ms=[5.0])


def test_the_trouble_card_keeps_the_answer_once_no_frame_is_current(stack: Stack, page: Any) -> None:
    run = "kept-hang"
    stack.send(*hang(run))
    page.goto(f"{stack.url}/#run={run}")
    expect(page.locator("#run-picker")).to_have_value(run)
    live = page.locator("#stall-view [data-testid=collective-verdict]").first
    expect(live.locator(".verdict-line").first).to_have_text(SENTENCE, timeout=15_000)
    expect(page.locator("#stall-view [data-testid=collective-last]")).to_have_count(0)
    # the hang ends: ranks 0 and 1 step again first (fewer wait: the answer stays), then 2
    stack.send(step(run, 0), step(run, 1))
    wait_for(lambda: stack.get_json(f"/api/runs/{run}/collectives")["groups"][0]["waiting"] == [2],
             15.0, "only rank 2's frame current")
    stack.send(step(run, 2))
    wait_for(lambda: stack.get_json(f"/api/runs/{run}/collectives")["groups"] == [], 15.0,
             "no group listed")
    last = page.locator("#stall-view [data-testid=collective-last]")
    expect(last.locator(".verdict-line").first).to_have_text(SENTENCE, timeout=15_000)
    expect(last.locator("h4")).to_have_text(TITLE)
    kept = stack.get_json(f"/api/runs/{run}")["collectives_last"]
    assert kept["groups"][0]["counts"] == {"waiting": 2, "behind": 1, "absent": 0, "mismatched": 0}
    page.errors.check()


def test_export_of_a_hung_then_killed_job_carries_the_verdict(
        spawn: Callable[..., Proc], page: Any, tmp_path: Path) -> None:  # noqa: F811
    run = "killed-hang"
    data = tmp_path / "data"
    broker, eps = start_broker(spawn, data)
    pusher = Pusher(eps.ingest)
    try:
        pusher.send(*hang(run))
        # the broker wrote the verdict and its alert (a handshake on its journal, not a sleep)
        wait_for(lambda: state_parts(data, run).get("collectives_last") is not None
                 and "collective_behind" in {a["kind"] for a in state_parts(data, run).get(
                     "alerts", {}).get("alerts", [])}, 30.0, "the verdict journaled")
        broker.proc.kill()  # the job and its broker die; the data dir is all that is left
        assert broker.proc.wait(10) == -9
    finally:
        pusher.close()
    out = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "rankboard", "export", run, "-o", str(out),
                           "--data-dir", str(data)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    page.goto(out.resolve().as_uri())
    card = page.locator("[data-testid=collective-last]")
    expect(card.locator(".verdict-line").first).to_have_text(SENTENCE)
    expect(card.locator(".card-title")).to_have_text(re.compile("Collectives: " + TITLE.pattern))
    expect(page.locator("#alerts")).to_contain_text("not in gloo:all_reduce #101 of group 0 where 2 ranks wait")
    page.errors.check()


def test_a_restarted_broker_brings_back_the_ranks_step_figures_and_the_board(
        spawn: Callable[..., Proc], page: Any, tmp_path: Path) -> None:  # noqa: F811
    """Steps are not journaled as frames; the ranks' figures still come back, so after a
    restart the rank table shows each rank's step time and data wait and only the slow rank
    is the straggler (before 8.5 no rank had a step time and the board was wrong)."""
    run = "figures-back"
    data = tmp_path / "data"
    broker, eps = start_broker(spawn, data)
    pusher = Pusher(eps.ingest)
    try:
        for r in range(2):
            pusher.register(run, r, 2, host=f"node-{r}")
        now = time.time()
        for r, ms in ((0, 100.0), (1, 300.0)):
            pusher.send(wire.Steps(run=run, rank=r, steps=list(range(40)),
                                   times=[now + i for i in range(40)], step_ms=[ms] * 40,
                                   data_ms=[ms / 10] * 40))
        wait_for(lambda: sorted((f[0], f[1], f[2]) for f in state_parts(data, run).get(
            "figures", [])) == [(0, 39, 100.0), (1, 39, 300.0)], 30.0, "the figures journaled")
        broker.proc.kill()
        assert broker.proc.wait(10) == -9
    finally:
        pusher.close()
    start_broker(spawn, data, endpoints=eps)
    web = start_web(spawn, eps)
    page.goto(f"http://127.0.0.1:{web.port}/#run={run}")
    expect(page.locator("#run-picker")).to_have_value(run)
    row0, row1 = (page.locator(f'#rank-table tr[data-rank="{r}"]') for r in (0, 1))
    expect(row0.locator("td[data-col=stepMs]")).to_have_text("100 ms", timeout=15_000)
    expect(row1.locator("td[data-col=stepMs]")).to_have_text("300 ms")
    expect(row1.locator("td[data-col=dataMs]")).to_have_text("30 ms")
    expect(row1.locator('[data-mark="straggler"]')).to_be_visible()
    expect(row0.locator("[data-mark]")).to_have_count(0)
    page.errors.check()


def test_the_report_carries_the_failure_when_the_header_has_one(page: Any, tmp_path: Path) -> None:
    """8.5: report.html carries the header's ``failure`` (8.2) as text, whatever builds it."""
    rep = report_of_sink(build_run(None, "failed-report", ranks=4, epochs=1, steps=30,
                                   failed_rank=2))
    rep.header = dict(rep.header, failure={
        "first": {"rank": 2, "host": "node-1", "kind": "error", "at": 1_800_000_000.0,
                  "type": "torch.OutOfMemoryError", "message": f"CUDA out of memory {HOSTILE}\nmore",
                  "frames": []},
        "groups": [{"type": "torch.OutOfMemoryError", "message": "CUDA out of memory",
                    "ranks": [2], "count": 1, "first_at": 1_800_000_000.0}],
        "groups_more": 0, "silent": {"ranks": [0, 1, 3], "count": 3}})
    path = tmp_path / "r.html"
    path.write_bytes("".join(render(rep)).encode("utf-8"))
    page.goto(path.resolve().as_uri())
    # the live page's failure card (web/static/failureview.js), first in the report too
    expect(page.locator("[data-testid=failure-first]")).to_contain_text(
        "rank 2 (node-1) failed first")
    expect(page.locator("[data-testid=failure-first]")).to_contain_text(
        f"torch.OutOfMemoryError: CUDA out of memory {HOSTILE}")
    expect(page.locator("[data-testid=failure-silent]")).to_contain_text("3 ranks went silent")
    assert page.evaluate("() => window.__pwned") is None
    page.errors.check()
