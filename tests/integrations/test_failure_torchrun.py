"""The first failure for real (PROTOCOL 8.2): a 2-rank torchrun job on CPU (gloo,
tests/integrations/failure_child.py) whose ranks use a bare ``RankAgent`` (no ``with``, no
``finish``): rank 1 raises ``MemoryError``, rank 0 then fails in the collective. The exit
rule reports both exceptions; the broker's ``failure`` names rank 1 first (its ``at`` is the
earlier, whichever finish arrives first), the other in its own group, and the dashboard (a
real ``rankboard web`` process, in a real headless Chromium) leads with it. Each rank's
traceback still prints on the job's output."""
from __future__ import annotations

import re
import subprocess
import urllib.parse
import uuid
from typing import Any

from tests.browser.conftest import CHROMIUM, CHROMIUM_ARGS
from tests.support import polling
from tests.support.integrations import REPO, example_env, torchrun

CHILD = str(REPO / "tests" / "integrations" / "failure_child.py")


def test_a_memory_error_on_one_rank_is_named_first(broker: Any, web: Any) -> None:
    run = f"died-{uuid.uuid4().hex[:8]}"
    env = example_env(broker, RANKBOARD_RUN=run, FAILURE_ODD="1")
    # a long monitor interval: torchrun would otherwise SIGTERM rank 0 as soon as it saw
    # rank 1 exit, before rank 0's own failure is told (a killed rank is silent: stale)
    out = subprocess.run([*torchrun(2), "--monitor-interval", "5", CHILD], cwd=REPO, env=env,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)
    log = out.stdout + out.stderr
    assert out.returncode != 0, log[-4000:]
    assert "MemoryError: CUDA out of memory (simulated)" in log  # the traceback still prints

    def failed() -> Any:
        if run not in broker.runs():
            return None
        snap = broker.snapshot(run)
        return snap if snap["header"]["status"] == "failed" else None

    snap = polling.wait_for(failed, 60, "the run to fail on the broker")
    failure = snap["header"]["failure"]
    first = failure["first"]
    assert (first["rank"], first["kind"], first["type"]) == (1, "error", "MemoryError"), log[-4000:]
    assert first["message"] == "CUDA out of memory (simulated): tried to allocate 20.00 GiB at step 4"
    assert [f["function"] for f in first["frames"]][-2:] == ["main", "load_batch"]
    types = [g["type"] for g in failure["groups"]]
    assert types[0] == "MemoryError" and len(types) == 2, failure["groups"]
    assert failure["groups"][1]["ranks"] == [0]  # the collective's victim, after the cause
    by_rank = {r["rank"]: r for r in snap["ranks"]}
    assert by_rank[1]["error"]["type"] == "MemoryError"
    assert by_rank[0]["error"]["at"] > by_rank[1]["error"]["at"]

    # the dashboard names the first (the web is as fresh as the broker within a second)
    polling.wait_for(lambda: web.run(run).get("failure") == failure, 30, "the web's header")
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{web.port}/#run={urllib.parse.quote(run, safe='')}")
            expect(page.get_by_test_id("failure-first")).to_have_text(re.compile(
                r"^rank 1 \(\S+\) failed first, \d\d:\d\d:\d\d: MemoryError: CUDA out of "
                r"memory \(simulated\): tried to allocate 20\.00 GiB at step 4$"),
                timeout=20_000)
        finally:
            browser.close()
