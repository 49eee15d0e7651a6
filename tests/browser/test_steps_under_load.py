"""Live step charts under load (issue 34, item 1), in a real Chromium against the real stack:
the CPU saturated, history answers slow, the SSE connection cut mid-run. One page is open
from before the run's first step, another opens mid-run; both must end holding every step
of loss, grad_norm, lr and step time exactly once, and draw up to the last one."""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Iterator, List

import pytest
from playwright.sync_api import expect

from tests.browser.test_steps_page import (
    assert_each_step_once,
    register,
    send_steps,
    wait_steps,
)
from tests.support.browser import Stack
from tests.support.polling import wait_for
from tests.support.tcpproxy import Proxy

pytestmark = pytest.mark.browser

RUN = "steps-under-load"
WORLD = 2
LAST = 599
METRICS = ("loss", "grad_norm", "lr", "step_ms")


class SlowProxy(Proxy):
    """The test's cuttable proxy, whose answers to ``/steps`` history fetches are held back a
    random 0-1.2 s (a busy web): live ``steps`` events then overtake them."""

    def __init__(self, upstream: str, seed: int, fail_first: int = 0) -> None:
        self.rng = random.Random(seed)
        self.fail_left = fail_first  # the first N /steps requests: the connection cut instead
        super().__init__(upstream)

    def _pipe(self, client: socket.socket, server: socket.socket) -> None:
        due = threading.Event()  # per connection: a /steps answer is due
        for a, b, up in ((client, server, True), (server, client, False)):
            self._start_pump(self._pump2, a, b, up, due)

    def _pump2(self, src: Any, dst: Any, up: bool, due: threading.Event) -> None:
        try:
            while data := src.recv(65536):
                if up and b"/steps?" in data and self.fail_left > 0:
                    self.fail_left -= 1
                    return  # the finally closes both ends: the fetch fails
                if up and b"/steps?" in data:
                    due.set()
                elif not up and due.is_set():
                    due.clear()
                    time.sleep(self.rng.uniform(0.0, 1.2))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self.close_pair(src, dst)


@pytest.fixture
def busy_cpu() -> Iterator[None]:
    """Every core busy (nice 10, so the stack and the browser still get the CPU they need to
    finish, only later), for the length of one test."""
    procs = [subprocess.Popen([sys.executable, "-c", "import os; os.nice(10)\nwhile True: pass"])
             for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def live_page(browser: Any, url: str) -> Any:
    ctx = browser.new_context(viewport={"width": 1440, "height": 900})
    page = ctx.new_page()
    errors: List[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{url}/#run={RUN}")
    page.errors_seen = errors
    return page


def complete(page: Any) -> bool:
    for name in METRICS:
        data = page.evaluate("(n) => window.__rankboard.stepData(n)", name)
        snap = page.evaluate("(n) => window.__rankboard.stepChart(n)", name)
        if not data or not snap or not snap.get("range") or snap["range"][1] != LAST:
            return False
        if data[-1][1] != LAST:
            return False
    return True


def test_charts_hold_every_step_once_after_cuts_and_slow_history(
        stack: Stack, browser: Any, busy_cpu: None) -> None:
    register(stack, RUN, world=WORLD)
    with SlowProxy(stack.url, seed=34) as proxy:
        early = live_page(browser, proxy.url)  # open before the first step: cut = none
        wait_for(lambda: early.evaluate("window.__rankboard && window.__rankboard.stepCut !== undefined"),
                 20, "the page up")
        late = None
        for start in range(0, LAST + 1, 20):
            for r in range(WORLD):
                send_steps(stack, RUN, r, range(start, start + 20))
            if start in (160, 360):
                proxy.drop()  # the SSE connections cut mid-run; the browser reconnects
            if start == 240:
                late = live_page(browser, proxy.url)  # opened mid-run, history answers slow
            wait_steps(stack, RUN, start + 19)  # paced: one burst of 20 steps at a time
        assert late is not None
        for page in (early, late):
            wait_for(lambda p=page: complete(p), 60, "every chart drawn to the last step")
            for name in METRICS:
                assert_each_step_once(page.evaluate("(n) => window.__rankboard.stepData(n)", name), 0, LAST)
            assert page.errors_seen == []
            page.context.close()


def test_a_failed_history_fetch_is_asked_again(stack: Stack, browser: Any) -> None:
    """A page opened mid-run whose first /steps fetches fail (a busy web, a proxy that cut
    them) must still end with the history: the charts ask again instead of keeping only the
    live steps ("waiting for steps…" with the data one reload away)."""
    run = "steps-history-retry"
    register(stack, run, world=WORLD)
    for r in range(WORLD):
        send_steps(stack, run, r, range(0, 300))
    wait_steps(stack, run, 299)
    with SlowProxy(stack.url, seed=7, fail_first=8) as proxy:
        ctx = browser.new_context(viewport={"width": 1440, "height": 900})
        page = ctx.new_page()
        page.goto(f"{proxy.url}/#run={run}")
        wait_for(lambda: page.evaluate("window.__rankboard.stepCut()") == 299, 20, "the cut")
        for r in range(WORLD):
            send_steps(stack, run, r, range(300, 340))

        def whole() -> bool:
            for name in METRICS:
                data = page.evaluate("(n) => window.__rankboard.stepData(n)", name)
                if not data or data[0][0] > 1 or data[-1][1] != 339:
                    return False
            return True

        wait_for(whole, 30, "history and live steps in every chart")
        assert proxy.fail_left == 0  # the failures did happen
        for name in METRICS:
            assert_each_step_once(page.evaluate("(n) => window.__rankboard.stepData(n)", name), 0, 339)
        ctx.close()


def test_a_link_to_a_run_not_listed_yet_waits_for_it(stack: Stack, page: Any) -> None:
    """A link opened just before its run's first frame (the run list the page fetched does
    not hold it yet) must not open another run in its place and overwrite the link: the
    page said nothing of the steps run, its charts never came, a reload drew them."""
    register(stack, "older-run", world=1)
    send_steps(stack, "older-run", 0, range(0, 5))
    wait_steps(stack, "older-run", 4)
    page.goto(f"{stack.url}/#run=linked-run")
    expect(page.locator("#empty-state h2")).to_have_text("Waiting for run linked-run")
    assert page.evaluate("location.hash") == "#run=linked-run"
    register(stack, "linked-run", world=1)
    send_steps(stack, "linked-run", 0, range(0, 30))
    expect(page.locator("#run-picker")).to_have_value("linked-run", timeout=15_000)
    wait_for(lambda: (page.evaluate("(n) => window.__rankboard.stepData(n)", "loss") or [[0, 0]])[-1][1] == 29,
             20, "the linked run's steps drawn")
    # (the page's first look at the link is a 404, as for any run the web does not hold)
    page.errors[:] = [e for e in page.errors if "status of 404" not in e]
    page.errors.check()
