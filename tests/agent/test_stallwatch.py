"""The stall watch (PROTOCOL.md section 2.5): real processes that hang in a named function
are dumped within ``stall_after`` + 1 s, repeatedly while the stall lasts, and stop being
dumped when the loop moves again; plus the watch's rules in process (automatic
``stall_after``, at most 10 dumps, off at 0, no thread left, fork)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, List

import pytest

from rank_agent.protocol import Stacks
from rank_agent.stallwatch import MAX_DUMPS, StallWatch, auto_stall_after
from tests.support import REPO
from tests.support.agent import Receiver, expect_line, reap, spawn
from tests.support.polling import wait_for


def main_thread(frame: Stacks) -> Any:
    mains = [t for t in frame.threads if t.main]
    assert len(mains) == 1, [t.name for t in frame.threads]
    assert frame.threads[0] is mains[0], "the training thread comes first"
    return mains[0]


def stalls(frames: List[Any]) -> List[Stacks]:
    return [f for f in frames if isinstance(f, Stacks) and f.reason == "stall"]


@pytest.mark.parametrize("on_thread", [False, True], ids=["main-thread", "trainer-thread"])
def test_hung_process_is_dumped_within_the_deadline_and_recovers(receiver: Receiver,
                                                                 on_thread: bool) -> None:
    after = 1.0
    proc = spawn("--push", receiver.endpoint, "--run", "hang-run", "--rank", "3",
                 "--stall-after", str(after), "--recover", "2.5",
                 *(["--thread"] if on_thread else []))
    try:
        expect_line(proc, "ready")
        expect_line(proc, "hanging")
        hung_at = time.monotonic()
        frames = receiver.wait_for(lambda fs: len(stalls(fs)) >= 2, timeout=10)
        first_at = time.monotonic()
        dumps = stalls(frames)
        first = dumps[0]
        # the child printed "hanging" right after its last note(): the first dump leaves
        # within stall_after + 1 s of it (receiving the second one took stall_after longer)
        assert first_at - hung_at <= 2 * after + 1.0 + 0.5
        assert first.run == "hang-run" and first.rank == 3 and first.request_id == ""
        assert after - 0.1 <= first.idle_s <= after + 1.0
        assert dumps[1].idle_s >= first.idle_s + after * 0.5  # repeated while it lasts
        main = main_thread(first)
        assert main.name == ("trainer" if on_thread else "MainThread")
        hang = main.frames[-1]  # innermost: readline is C, so the Python frame that called it
        assert hang.function == "hang_in_collective" and hang.file.endswith("diag_child.py")
        assert hang.code.startswith("sys.stdin.readline()  # blocks")
        assert main.frames[0].function in ("_run_module_as_main", "_bootstrap")
        assert "rankboard-stallwatch-3" in {t.name for t in first.threads}  # every thread

        # recovery: the loop moves for 2.5 s (> 2 x stall_after), then hangs elsewhere
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        expect_line(proc, "recovered")

        def where(frame: Stacks) -> str:
            return main_thread(frame).frames[-1].function
        frames = receiver.wait_for(lambda fs: any(where(f) == "second_hang" for f in stalls(fs)),
                                   timeout=10)
        places = [where(f) for f in stalls(frames)]
        # no dump while the loop moved, the first stall's dumps all came before the second's
        assert set(places) == {"hang_in_collective", "second_hang"}, places
        split = places.index("second_hang")
        assert all(p == "hang_in_collective" for p in places[:split])
        assert all(p == "second_hang" for p in places[split:])
        assert split <= 10
        # the new stall is counted from the recovery, not from the first hang
        assert stalls(frames)[split].idle_s <= after + 1.0
        proc.stdin.close()
        line = expect_line(proc, "closed")
        assert "rankboard" not in line  # no watcher thread left after close()
        assert proc.wait(10) == 0
    finally:
        reap(proc)


def collect() -> tuple[List[Stacks], Any]:
    got: List[Stacks] = []
    lock = threading.Lock()

    def send(frame: Stacks) -> None:
        with lock:
            got.append(frame)
    return got, send


def test_at_most_ten_dumps_per_stall_and_the_next_call_starts_a_new_count() -> None:
    got, send = collect()
    watch = StallWatch(send, "r", 0, 0.05)
    try:
        watch.note()
        watch.start()
        wait_for(lambda: len(got) >= MAX_DUMPS, 10, "ten dumps")
        # the eleventh would be due 0.05 s after the tenth: give it ten times that
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            assert len(got) == MAX_DUMPS
            time.sleep(0.02)
        assert all(b.idle_s > a.idle_s for a, b in zip(got, got[1:]))
        watch.note()  # the stall ends; a new one is counted afresh
        wait_for(lambda: len(got) > MAX_DUMPS, 5, "a dump of the next stall")
        assert got[MAX_DUMPS].idle_s < got[MAX_DUMPS - 1].idle_s
    finally:
        watch.close()


def test_no_dump_before_the_first_call_and_while_the_loop_moves() -> None:
    got, send = collect()
    watch = StallWatch(send, "r", 0, 0.3)
    try:
        watch.start()
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            time.sleep(0.02)
        assert got == []  # started, never called: nothing to watch yet
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            watch.note()
            time.sleep(0.02)
        assert got == []
        wait_for(lambda: got, 3, "a dump once the loop stops")
        assert main_thread(got[0]).name == threading.current_thread().name
    finally:
        watch.close()


def test_stall_after_zero_starts_nothing_and_close_leaves_no_thread() -> None:
    before = set(threading.enumerate())
    off = StallWatch(lambda f: None, "r", 0, 0)
    off.note()
    off.start()
    assert set(threading.enumerate()) == before
    on = StallWatch(lambda f: None, "r", 1, None)
    on.note()
    on.start()
    assert any(t.name == "rankboard-stallwatch-1" for t in threading.enumerate())
    t0 = time.monotonic()
    on.close()
    assert time.monotonic() - t0 < 1.0
    assert set(threading.enumerate()) == before
    on.start()  # closed stays closed
    assert set(threading.enumerate()) == before
    with pytest.raises(ValueError):
        StallWatch(lambda f: None, "r", 0, -1)


def test_automatic_stall_after() -> None:
    assert auto_stall_after([]) == 60.0
    assert auto_stall_after([0.1] * 100) == 60.0
    assert auto_stall_after([7.0] * 60 + [0.1] * 40) == 70.0  # 10 x the median
    assert auto_stall_after([1.0, 20.0, 30.0]) == 200.0


def test_automatic_stall_after_follows_the_calls_the_watcher_sees() -> None:
    """The watcher measures intervals itself (the caller only stores a timestamp)."""
    watch = StallWatch(lambda f: None, "r", 0, None)
    try:
        watch.start()
        # a whole number of seconds: base + 8 i is then exact in a float, so the intervals
        # the watcher takes as differences are exactly 8 (with base = monotonic() itself
        # they were 7.9999999999990905 at some uptimes: a flake in CI)
        base = float(int(time.monotonic()))
        for i in range(4):  # intervals of 8 s, as the watcher sees the timestamps change
            watch._last = base + 8.0 * i
            wait_for(lambda: watch._seen == watch._last, 3, "the watcher to see the call")
        assert list(watch._intervals) == [8.0, 8.0, 8.0]
        assert watch.current_stall_after() == 80.0
    finally:
        watch.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_child_gets_its_own_watcher(receiver: Receiver) -> None:
    """A child forked from a process whose watch runs gets a fresh watcher on start() and is
    dumped in its own hang; the parent's watch goes on in the parent."""
    script = textwrap.dedent(f"""
        import os, sys, time
        from tests.agent.diag_child import Push
        from rank_agent.stallwatch import StallWatch
        def parent_hangs_here(): sys.stdin.readline()
        def child_hangs_here(): time.sleep(30)
        push = Push({receiver.endpoint!r})
        watch = StallWatch(lambda f: push(f), "fork-run", 0, 0.5)
        watch.note(); watch.start()
        pid = os.fork()
        if pid == 0:
            push = Push({receiver.endpoint!r})  # the child's own socket
            watch.rank = 1
            watch.note(); watch.start()
            child_hangs_here()
            os._exit(0)
        print(pid, flush=True)
        parent_hangs_here()
        os.kill(pid, 9); os.waitpid(pid, 0)
        watch.close(); push.close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        proc.stdout.readline()

        def hung(rank: int, fn: str) -> bool:
            return any(f.rank == rank and any(fr.function == fn for fr in main_thread(f).frames)
                       for f in stalls(receiver.frames))
        receiver.wait_for(lambda fs: hung(1, "child_hangs_here") and hung(0, "parent_hangs_here"),
                          timeout=10)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(10) == 0
    finally:
        reap(proc)
