"""The stall view (``web/static/stallview.js``, ``profileview.js``) in a real headless
Chromium against the real stack (``rankboard up``): stall dumps sent as a rank's agent sends
them make the run say so at the top without a click (stalled ranks, groups innermost first
with their source lines), a rank's own dump shows every thread, a profile answer shows its
heaviest stacks with their share; function names, files, code and thread names built to run
script (``<img onerror>``, ``</script>``) stay inert text; the request buttons work, and are
absent from a ``--read-only`` web. A screenshot of the stall view is saved under
``artifacts/``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire
from tests.support.browser import ARTIFACTS, HOSTILE, Stack, wait_js
from tests.support.polling import wait_for

pytestmark = pytest.mark.browser

SCRIPT_CLOSE = "</script><script>window.__pwned=2</script>"
WORLD = 4


def frame(function: str, file: str, line: int, code: str = "") -> wire.StackFrame:
    return wire.StackFrame(file=file, line=line, function=function, code=code)


#: ranks 0-2 hang in a "collective" whose name is hostile; rank 3 in the data loader
COLLECTIVE = [frame("<module>", "/job/train.py", 90, "main()"),
              frame("train_step", "/job/train.py", 41, "loss.backward()"),
              frame("backward", "/venv/torch/autograd.py", 200, f"x = {HOSTILE!r}"),
              frame(HOSTILE, "/venv/torch/distributed.py", 7, SCRIPT_CLOSE)]
LOADER = [frame("<module>", "/job/train.py", 90, "main()"),
          frame("train_step", "/job/train.py", 35, "batch = next(it)"),
          frame("__next__", "/venv/torch/dataloader.py", 630, "data = self._next_data()")]


def stall(run: str, rank: int, frames: list[wire.StackFrame]) -> wire.Stacks:
    return wire.Stacks(run=run, rank=rank, reason="stall", taken_at=time.time(), idle_s=75.0,
                       threads=[wire.ThreadStack(name="MainThread", frames=frames, main=True),
                                wire.ThreadStack(name=SCRIPT_CLOSE, frames=[
                                    frame("wait", "/usr/lib/threading.py", 320, "waiter.acquire()")])])


def hang(stack: Stack, run: str) -> None:
    for rank in range(WORLD):
        stack.send(wire.Register(run=run, rank=rank, world_size=WORLD, host=f"node-{rank // 2}",
                                 local_rank=rank % 2))
    for rank in range(WORLD):
        stack.send(stall(run, rank, COLLECTIVE if rank < 3 else LOADER))


def open_run(page: Any, stack: Stack, run: str) -> None:
    page.goto(f"{stack.url}/#run={run}")
    expect(page.locator("#run-picker")).to_have_value(run)


def inert(page: Any) -> None:
    assert page.evaluate("() => window.__pwned") is None
    assert page.locator("#stall-view img, #stall-view script").count() == 0


def ask(page: Any, button: Any, said: str) -> None:
    """Click a request button until the page says ``said`` (a 429, the web's one request per
    run a second, is clicked again: the test does not depend on the machine's speed)."""
    message = page.locator("#stall-view .stall-message")

    def answered() -> bool:
        button.click()
        wait_js(page, "!/^(asking|profiling)/.test(document.querySelector("
                      "'#stall-view .stall-message').textContent)")
        text = message.text_content() or ""
        assert said in text or "(429)" in text, text
        return said in text

    wait_for(answered, 10.0, said, interval=0.3)


def test_straggler_profile_beside_the_median_rank(stack: Stack, page: Any) -> None:
    """A run-wide profile of a run with a straggler: the slowest rank's profile (by
    ``step_ms``) beside the median rank's, each with its own heaviest stacks."""
    run = "stall-profile"
    step_ms = {0: 100.0, 1: 102.0, 2: 110.0, 3: 300.0}
    for rank in range(WORLD):
        stack.send(wire.Register(run=run, rank=rank, world_size=WORLD, host="node-a",
                                 local_rank=rank))
    now = time.time()
    for rank, ms in step_ms.items():
        stack.send(wire.Steps(run=run, rank=rank, steps=list(range(5)),
                              times=[now + i for i in range(5)], step_ms=[ms] * 5))
    open_run(page, stack, run)
    wait_js(page, "document.querySelectorAll('#rank-table tbody tr').length === 4")

    def ranks_timed() -> bool:
        ranks = stack.get_json(f"/api/runs/{run}")["ranks"]
        return all(r.get("step_ms") is not None for r in ranks)

    wait_for(ranks_timed, 15.0, "step_ms of every rank")
    for rank in range(WORLD):
        work = "slow_io" if rank == 3 else "matmul"
        stack.send(wire.Stacks(
            run=run, rank=rank, reason="request", request_id="cafe000000000002",
            taken_at=time.time(), samples=50, seconds=0.5, profile=[
                wire.ProfileEntry(stack=["train_step (/job/t.py:1)", f"{work} (/job/t.py:9)"],
                                  count=40),
                wire.ProfileEntry(stack=["train_step (/job/t.py:1)", "log (/job/t.py:5)"],
                                  count=10)]))
    pair = page.locator("#stall-view .profiles.side-by-side")
    expect(pair.locator("[data-testid=profile]")).to_have_count(2, timeout=15_000)
    expect(pair.locator(".profile-title").nth(0)).to_contain_text("rank 3 (slowest)")
    expect(pair.locator(".profile-title").nth(1)).to_contain_text("rank 1 (median)")
    expect(pair.locator("[data-testid=profile]").nth(0).locator(".stack-line").nth(0)).to_have_text(
        "slow_io ← train_step")
    expect(pair.locator("[data-testid=profile]").nth(1).locator(".stack-line").nth(0)).to_have_text(
        "matmul ← train_step")
    expect(pair.locator(".share-pct").nth(0)).to_have_text("80.0%")
    page.errors.check()


@pytest.fixture(scope="module")
def read_only_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("rankboard-ro"), command=[
        "up", "--port", "0", "--ingest", "tcp://127.0.0.1:*", "--publish", "tcp://127.0.0.1:*",
        "--snapshot", "tcp://127.0.0.1:*", "--stale-after", "60", "--read-only"])
    try:
        s.start()
        yield s
    finally:
        s.close()


def test_stall_view_groups_hostile_frames_as_text(stack: Stack, page: Any) -> None:
    run = "stall-view"
    hang(stack, run)
    open_run(page, stack, run)
    view = page.locator("#stall-view")
    expect(view).to_be_visible()
    expect(view).to_have_attribute("data-state", "stalled")
    expect(view.locator(".stall-title")).to_contain_text("4 ranks not stepping")
    groups = view.locator("[data-testid=stall-group]")
    expect(groups).to_have_count(2)
    # largest first, innermost frame first, the hostile name as the literal text it is
    expect(groups.nth(0).locator(".group-text")).to_have_text(
        f"3 ranks in {HOSTILE} ← backward ← train_step ← …")
    expect(groups.nth(1).locator(".group-text")).to_have_text(
        "rank 3 in __next__ ← train_step ← <module>")
    # one shared stack open without a click: the odd one out, where the others' rank stands
    assert page.evaluate("""() => [...document.querySelectorAll(
        '#stall-view [data-testid=stall-group] details.group-stack')].map((d) => d.open)""") == [False, True]
    first_frames = groups.nth(0).locator(".frame")
    expect(first_frames.nth(0).locator(".frame-fn")).to_have_text(HOSTILE)
    expect(first_frames.nth(0).locator(".frame-code")).to_have_text(SCRIPT_CLOSE)
    expect(first_frames.nth(0).locator(".frame-where")).to_have_text("torch/distributed.py:7")
    inert(page)

    # one rank's own dump: every thread, the training thread open
    groups.nth(1).locator(".rank-chip", has_text="3").click()
    rank = view.locator("[data-testid=stall-rank]")
    expect(rank).to_contain_text("rank 3 · node-1")
    expect(rank.locator(".stall-thread")).to_have_count(2)
    expect(rank.locator(".thread-name").nth(1)).to_have_text(SCRIPT_CLOSE)
    inert(page)

    # the run's buttons: a dump request is accepted (202) and said so
    ask(page, view.locator("[data-testid=dump-run]"), "dump requested from every rank")
    expect(rank.locator("[data-testid=profile-rank]")).to_be_visible()

    # a profile answer (as an agent sends one) arrives by SSE and shows its heaviest stacks
    fetches = page.evaluate("() => window.__rankboard.stacksFetches()")
    profile = [wire.ProfileEntry(stack=["<module> (/job/train.py:90)", "train_step (/job/train.py:41)",
                                        f"{HOSTILE} (/venv/x.py:7)"], count=75),
               wire.ProfileEntry(stack=["<module> (/job/train.py:90)", "train_step (/job/train.py:35)",
                                        "__next__ (/venv/torch/dataloader.py:630)"], count=25)]
    stack.send(wire.Stacks(run=run, rank=3, reason="request", request_id="feedbeef00000001",
                           taken_at=time.time(), profile=profile, samples=100, seconds=1.0))
    block = view.locator("[data-testid=profile]")
    expect(block).to_have_count(1)
    expect(block.locator(".profile-title")).to_have_text("rank 3")  # no step times: no "slowest"
    expect(block.locator(".share-pct").nth(0)).to_have_text("75.0%")
    expect(block.locator(".stack-line").nth(0)).to_have_text(f"{HOSTILE} ← train_step ← <module>")
    expect(block.locator(".icicle-cell", has_text="train_step")).to_have_count(2)
    assert page.evaluate("() => window.__rankboard.stacksFetches()") > fetches
    inert(page)

    # any rank can be asked from its tab, stalled in a group or not
    rank.locator("button", has_text="close").click()
    expect(rank).to_have_count(0)
    page.locator('#rank-tabs [data-rank="2"]').click()
    expect(rank).to_contain_text("rank 2 · node-1")
    ask(page, rank.locator("[data-testid=profile-rank]"), "profile requested from rank 2")
    page.locator("#tab-home").click()
    expect(rank).to_have_count(0)

    # a burst of dumps: the page reads /stacks at most once a second, not once per event
    events = page.evaluate("() => window.__rankboard.stacksEvents()")
    fetches = page.evaluate("() => window.__rankboard.stacksFetches()")
    started = time.monotonic()

    def burst() -> bool:
        stack.send(stall(run, 0, COLLECTIVE))
        return bool(page.evaluate("() => window.__rankboard.stacksEvents()") - events >= 6)

    wait_for(burst, 20.0, "six SSE stacks events", interval=0.1)
    elapsed = time.monotonic() - started
    read = page.evaluate("() => window.__rankboard.stacksFetches()") - fetches
    assert 1 <= read <= elapsed + 1, (read, elapsed)

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot: Path = ARTIFACTS / "stall_view.png"
    page.evaluate("() => window.scrollTo(0, 0)")  # the sticky top bar stays above the card
    box = view.bounding_box()
    assert box is not None
    page.screenshot(path=str(shot), full_page=True, clip={
        "x": box["x"], "y": box["y"] + page.evaluate("() => window.scrollY"),
        "width": box["width"], "height": box["height"]})
    assert shot.stat().st_size > 10_000
    page.errors.check()


def test_read_only_web_shows_stalls_without_buttons(read_only_stack: Stack, page: Any) -> None:
    run = "stall-ro"
    hang(read_only_stack, run)
    open_run(page, read_only_stack, run)
    view = page.locator("#stall-view")
    expect(view).to_have_attribute("data-state", "stalled")
    expect(view.locator("[data-testid=stall-group]")).to_have_count(2)
    assert page.evaluate("() => document.body.dataset.readOnly") == "true"
    view.locator(".rank-chip", has_text="0").first.click()
    expect(view.locator("[data-testid=stall-rank]")).to_be_visible()
    wait_js(page, "document.querySelectorAll('#stall-view .stall-thread').length === 2")
    assert page.locator("#stall-view button", has_text="dump stacks").count() == 0
    assert page.locator("#stall-view button", has_text="profile").count() == 0
    assert page.locator("[data-testid^=dump-], [data-testid^=profile-]").count() == 0
    page.errors.check()


def test_an_ended_run_says_requests_cannot_be_answered(stack: Stack, page: Any) -> None:
    """Issue 43 item 4: "dump stacks" on a finished run was accepted (202) and the page
    waited forever; now the buttons are disabled with the reason, and the API says 409."""
    run = "ended-1"
    for rank in range(2):
        stack.send(wire.Register(run=run, rank=rank, world_size=2, host="node-0", local_rank=rank))
    for rank in range(2):
        stack.send(wire.Finish(run=run, rank=rank, status="ok"))
    open_run(page, stack, run)
    note = page.locator("[data-testid=stall-ended]")
    expect(note).to_contain_text("the run has ended (complete)")
    expect(page.locator("[data-testid=dump-run]")).to_be_disabled()
    expect(page.locator("[data-testid=profile-run]")).to_be_disabled()


def test_a_profile_during_a_hang_shows_the_rank_the_others_wait_for(stack: Stack, page: Any) -> None:
    """Issue 43 item 1: "profile 5 s" during a hang showed two waiting ranks (the slowest by
    step time, the median): the hung rank's profile, the odd stall group's (rank 3 in the
    loader while 0-2 wait in a collective), leads, beside a waiting one."""
    run = "stall-hang-profile"
    now = time.time()
    for rank in range(WORLD):
        stack.send(wire.Register(run=run, rank=rank, world_size=WORLD, host="node-a",
                                 local_rank=rank))
        # rank 0 was the slowest before the hang: it must not be the one shown first
        stack.send(wire.Steps(run=run, rank=rank, steps=list(range(5)),
                              times=[now + i for i in range(5)],
                              step_ms=[300.0 if rank == 0 else 100.0 + rank] * 5))
    wait_for(lambda: all(r.get("step_ms") is not None
                         for r in stack.get_json(f"/api/runs/{run}")["ranks"]), 15.0, "step_ms")
    for rank in range(WORLD):
        stack.send(stall(run, rank, COLLECTIVE if rank < 3 else LOADER))
    open_run(page, stack, run)
    expect(page.locator("#stall-view [data-testid=stall-group]")).to_have_count(2, timeout=15_000)
    for rank in range(WORLD):
        work = "__next__ (/venv/torch/dataloader.py:630)" if rank == 3 else "all_reduce (/venv/d.py:7)"
        stack.send(wire.Stacks(
            run=run, rank=rank, reason="request", request_id="cafe000000000003",
            taken_at=time.time(), samples=50, seconds=0.5, profile=[
                wire.ProfileEntry(stack=["train_step (/job/t.py:1)", work], count=50)]))
    pair = page.locator("#stall-view .profiles")
    expect(pair.locator(".profile-title").nth(0)).to_contain_text(
        "rank 3 (the others wait for it)", timeout=15_000)
    expect(pair.locator("[data-testid=profile]").nth(0).locator(".stack-line").nth(0)).to_have_text(
        "__next__ ← train_step")
    page.errors.check()
