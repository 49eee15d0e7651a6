"""The cluster view's layout and the connection badge, in Chromium over the real stack
(issue 43, item 2): at 1024 and 1440 px the runs table shows every column without a
horizontal scroll, and the hosts table's reasons wrap inside their cell instead of running
over the neighbouring columns; ``/#cluster`` and a ``#compare=`` link opened directly say
"live" once the web answers (they have no run stream to say it), and a web whose broker does
not answer says so instead of "connecting" forever. Screenshots in artifacts/."""
from __future__ import annotations

import socket
import subprocess
import sys
from typing import Any, Iterator

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.support import REPO
from tests.support.browser import ARTIFACTS, Stack, wait_js
from tests.support.polling import wait_for

pytestmark = pytest.mark.browser

#: run ids as long as a real job's (a torchrun UUID plus a prefix): no space to break at
LONG = [f"pretrain-llama-{i}-3f9c2a7e-41d6-4b8e-9a0f-c2d18e5b7a{i:02d}" for i in range(3)]


@pytest.fixture(scope="module")
def crowded(stack: Stack) -> Stack:
    """Three runs with long ids whose rank 0 runs on node-x, whose GPU reports an XID in
    each: three reasons on one host."""
    for run in LONG:
        for rank in range(2):
            stack.send(wire.Register(run=run, rank=rank, world_size=2, host=f"node-{'xy'[rank]}",
                                     local_rank=0, total_epochs=10))
        stack.send(wire.Resources(run=run, rank=0, sample=wire.ResourceSample(gpus=[
            wire.GpuSample(device_index=0, name="H100", xid_errors=[79])])))

    def ready() -> bool:
        hosts = stack.get_json("/api/hosts")
        return any(len(h["reasons"]) >= 3 for h in hosts)
    wait_for(ready, 20, "node-x suspect with a reason per run")
    return stack


@pytest.mark.parametrize("width", [1024, 1440])
def test_cluster_tables_fit_and_reasons_wrap(crowded: Stack, page: Any, width: int) -> None:
    page.set_viewport_size({"width": width, "height": 900})
    page.goto(f"{crowded.url}/#cluster")
    wait_js(page, "document.querySelectorAll('[data-testid=cluster-hosts] .reason').length >= 3")
    wait_js(page, "document.querySelectorAll('[data-testid=cluster-runs] tbody tr').length >= 3")
    # every column of the runs table in view: its wrap does not scroll sideways
    over = page.evaluate("""() => {
        const t = document.querySelector('[data-testid=cluster-runs]');
        const wrap = t.parentElement;
        return wrap.scrollWidth - wrap.clientWidth;
    }""")
    assert over <= 1, f"the runs table is {over}px wider than its card at {width}px"
    # each reason stays inside its cell (it used to run over the runs/ranks columns)
    spill = page.evaluate("""() => [...document.querySelectorAll(
            '[data-testid=cluster-hosts] .reason')].map((el) => {
        const cell = el.closest('td').getBoundingClientRect();
        const r = el.getBoundingClientRect();
        return Math.max(0, r.right - cell.right, cell.left - r.left);
    })""")
    assert max(spill) <= 1, spill
    page.screenshot(path=str(ARTIFACTS / f"cluster-layout-{width}.png"), full_page=True)
    page.errors.check()


def test_cluster_and_compare_opened_directly_say_live(crowded: Stack, page: Any) -> None:
    page.goto(f"{crowded.url}/#cluster")
    expect(page.locator("#conn")).to_have_attribute("data-state", "live")
    expect(page.locator("#conn-text")).to_have_text("live")
    page.goto("about:blank")
    page.goto(f"{crowded.url}/#compare={LONG[0]},{LONG[1]}&metric=loss&x=epoch")
    expect(page.locator("#conn")).to_have_attribute("data-state", "live")
    page.errors.check()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def orphan_web() -> Iterator[str]:
    """``rankboard web`` whose broker endpoints nobody binds: its /healthz is 503."""
    pub, snap = _free_port(), _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rankboard", "web", "--publish", f"tcp://127.0.0.1:{pub}",
         "--snapshot", f"tcp://127.0.0.1:{snap}", "--host", "127.0.0.1", "--port", "0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        url = ""
        for line in proc.stdout:
            if "dashboard: http://" in line:
                url = line.split("dashboard: ", 1)[1].split()[0].rstrip("/")
                break
        assert url, "the web printed no dashboard line"
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_web_without_a_broker_says_no_broker_answers(orphan_web: str, page: Any) -> None:
    page.goto(orphan_web)
    expect(page.locator("#conn-text")).to_have_text("no broker answers")
    expect(page.locator("#conn")).to_have_attribute("data-state", "error")
