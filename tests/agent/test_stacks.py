"""The ``stacks`` frame's limits on the wire and the agent's truncation to fit them
(PROTOCOL.md sections 2 and 2.5), with real threads in real frames."""
from __future__ import annotations

import re
import sys
import threading
from typing import Any, Callable, Iterator, List

import msgspec
import pytest

from rank_agent.protocol import (
    MAX_FRAME_BYTES,
    ProfileEntry,
    StackFrame,
    Stacks,
    ThreadStack,
    decode,
    encoder,
)
from rank_agent.stacks import (
    FRAME_BUDGET,
    ProfileCounter,
    dump_threads,
    fit_profile,
    fit_threads,
    stacks_frame,
)
from tests.support.polling import wait_for


def frame_bytes(**fields: Any) -> bytes:
    body = {"type": "stacks", "run": "r", "rank": 0, "reason": "stall", "taken_at": 1.0}
    body.update(fields)
    return msgspec.msgpack.encode(body)


def fr(n: int = 1, text: str = "x") -> List[dict]:
    return [{"file": text, "line": 1, "function": text, "code": text}] * n


@pytest.mark.parametrize("fields", [
    {"threads": [{"name": "t", "frames": fr()}] * 128},
    {"threads": [{"name": "t" * 512, "frames": fr(256, "y" * 512)}]},
    {"profile": [{"stack": ["f (a.py:1)"] * 256, "count": 1}] * 2000},
    {"reason": "request", "request_id": "q" * 64, "samples": 5, "seconds": 0.5},
])
def test_a_frame_at_every_limit_is_accepted(fields: dict) -> None:
    frame = decode(frame_bytes(**fields))
    assert isinstance(frame, Stacks)


@pytest.mark.parametrize("fields", [
    {"threads": [{"name": "t", "frames": fr()}] * 129},
    {"threads": [{"name": "t", "frames": fr(257)}]},
    {"threads": [{"name": "t" * 513, "frames": fr()}]},
    {"threads": [{"name": "t", "frames": fr(1, "y" * 513)}]},
    {"threads": [{"name": "t", "frames": [{"file": "a", "line": 1, "function": "f",
                                           "code": "c" * 513}]}]},
    {"profile": [{"stack": ["f"], "count": 1}] * 2001},
    {"profile": [{"stack": ["f"] * 257, "count": 1}]},
    {"profile": [{"stack": ["f"], "count": 0}]},
    {"request_id": "q" * 65},
    {"reason": "curious"},
    {"samples": -1},
    {"threads": [{"name": "t"}]},  # frames is required
], ids=["threads", "frames", "name", "file-function", "code", "profile", "depth", "count",
        "request_id", "reason", "samples", "no-frames"])
def test_a_frame_over_any_limit_is_rejected(fields: dict) -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(frame_bytes(**fields))


def test_taken_at_is_required_and_unknown_keys_are_ignored() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({"type": "stacks", "run": "r", "rank": 0, "reason": "stall"}))
    assert isinstance(decode(frame_bytes(future_field=[1, 2])), Stacks)


@pytest.fixture
def parked() -> Iterator[Callable[[Callable[[threading.Event], None], str], threading.Thread]]:
    """Start threads that run a function until released, and always release them."""
    stop = threading.Event()
    threads: List[threading.Thread] = []

    def start(body: Callable[[threading.Event], None], name: str) -> threading.Thread:
        ready = threading.Event()

        def run() -> None:
            ready.set()
            body(stop)
        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        threads.append(t)
        ready.wait(5)
        return t

    yield start
    stop.set()
    for t in threads:
        t.join(5)


def recurse_then_wait(depth: int) -> Callable[[threading.Event], None]:
    def deep(n: int, stop: threading.Event) -> None:
        if n:
            deep(n - 1, stop)
        else:
            stop.wait()
    return lambda stop: deep(depth, stop)


def in_frames(thread: threading.Thread, fn: str) -> Callable[[], bool]:
    def check() -> bool:
        frame = sys._current_frames().get(thread.ident or 0)
        while frame is not None:
            if frame.f_code.co_name == fn:
                return True
            frame = frame.f_back
        return False
    return check


def depth(thread: threading.Thread) -> int:
    frame = sys._current_frames().get(thread.ident or 0)
    n = 0
    while frame is not None:
        n += 1
        frame = frame.f_back
    return n


def test_a_deep_thread_keeps_its_innermost_256_frames_outermost_first(parked: Any) -> None:
    t = parked(recurse_then_wait(400), "deep")
    wait_for(lambda: len([f for f in dump_threads(None) if f.name == "deep"][0].frames) == 256,
             5, "the recursion to reach its bottom")
    dump = [ts for ts in dump_threads(t.ident) if ts.name == "deep"][0]
    assert dump.main
    assert len(dump.frames) == 256
    assert dump.frames[-1].function == "wait"  # innermost last: Event.wait, Condition.wait
    assert dump.frames[-1].file == threading.__file__
    bottom = [f for f in dump.frames if f.function == "deep"][-1]
    assert bottom.code == "stop.wait()"  # the source line, stripped
    assert dump.frames[0].function == "deep"  # the outer ones (run, _bootstrap) were cut


def test_the_training_thread_comes_first_and_at_most_128_threads(parked: Any) -> None:
    threads = [parked(lambda stop: stop.wait(), f"worker-{i}") for i in range(140)]
    trainer = threads[77]
    dump = dump_threads(trainer.ident)
    assert len(dump) == 128
    assert dump[0].name == "worker-77" and dump[0].main
    assert sum(t.main for t in dump) == 1
    current = threading.current_thread().ident
    assert dump_threads(current)[0].name == threading.current_thread().name


def test_long_names_are_cut_to_512_characters(parked: Any) -> None:
    name = "f" * 600
    namespace: dict = {}
    exec(compile(f"def {name}(stop):\n    stop.wait()\n", "/" + "d" * 700 + ".py", "exec"),
         namespace)
    t = parked(namespace[name], "n" * 600)
    wait_for(in_frames(t, name), 5, "the long-named function to run")
    dump = [ts for ts in dump_threads(None) if ts.name.startswith("nnn")][0]
    assert len(dump.name) == 512
    inner = [f for f in dump.frames if f.function.startswith("fff")][0]
    assert inner.function == "f" * 512 and inner.file == "/" + "d" * 511
    assert inner.code == ""  # no such file: no source line, and no error
    decode(encoder.encode(Stacks(run="r", rank=0, reason="stall", taken_at=0.0, threads=[dump])))


def test_threads_past_4_mib_are_left_out_the_training_thread_kept(parked: Any) -> None:
    """20 threads of 256 frames with 512-character names and files are about 5.5 MB: the
    dump keeps the training thread and as many others as fit under 4 MiB, and decodes."""
    name = "g" * 512
    namespace: dict = {}
    exec(compile(f"def {name}(n, stop):\n    return {name}(n - 1, stop) if n else stop.wait()\n",
                 "/" + "e" * 511, "exec"), namespace)
    fn = namespace[name]
    threads = [parked(lambda stop: fn(300, stop), f"heavy-{i}") for i in range(20)]
    for t in threads:
        wait_for(lambda t=t: depth(t) > 300, 10, "deep stacks")
    trainer = threads[13]
    frame = stacks_frame("r", 0, "stall", main_ident=trainer.ident, idle_s=61.0)
    data = encoder.encode(frame)
    assert FRAME_BUDGET < len(data) + 256 * 1100 and len(data) <= MAX_FRAME_BYTES
    back = decode(data)
    assert isinstance(back, Stacks)
    assert back.threads[0].name == "heavy-13" and back.threads[0].main
    heavy = [t for t in back.threads if t.name.startswith("heavy-")]
    assert 10 <= len(heavy) < 20
    assert back.idle_s == 61.0 and back.reason == "stall"


def test_fit_threads_keeps_the_leading_threads_that_fit() -> None:
    big = ThreadStack(name="b", frames=[StackFrame(file="f" * 500, line=i, function="g" * 500,
                                                   code="c" * 500) for i in range(256)])
    size = len(encoder.encode(big))
    assert len(fit_threads([big] * 10, budget=3 * size)) == 3
    assert len(fit_threads([big] * 10, budget=3 * size - 1)) == 2
    assert fit_threads([big], budget=size - 1) == []


def spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def test_profile_counts_the_sampled_threads_stacks(parked: Any) -> None:
    t = parked(spin, "spinner")
    wait_for(in_frames(t, "spin"), 5, "the spinner")
    counter = ProfileCounter()
    for _ in range(50):
        counter.sample(t.ident)
    counter.sample(None)  # a thread that is gone: counted as a sample, no stack
    assert counter.samples == 51
    entries = counter.entries()
    assert sum(e.count for e in entries) == 50
    assert entries == sorted(entries, key=lambda e: -e.count)
    assert all(any(s.startswith("spin (") for s in e.stack) for e in entries)
    inner = [e.stack[-1] for e in entries if e.stack[-1].startswith("spin (")]
    assert inner, entries  # most samples find it spinning in spin itself
    assert re.fullmatch(rf"spin \({re.escape(__file__)}:\d+\)", inner[0])
    assert all(e.stack[0].startswith("_bootstrap (") for e in entries)  # outermost first


def test_profile_stacks_are_cut_to_their_innermost_256_entries(parked: Any) -> None:
    t = parked(recurse_then_wait(300), "deep")
    wait_for(lambda: len([s for s in dump_threads(None, source=False)
                          if s.name == "deep"][0].frames) == 256, 5, "the recursion")
    counter = ProfileCounter()
    counter.sample(t.ident)
    (entry,) = counter.entries()
    assert len(entry.stack) == 256
    assert entry.stack[0].startswith("deep (") and entry.stack[-1].startswith("wait (")


def test_profile_holds_at_most_2000_distinct_stacks_and_keeps_the_heaviest() -> None:
    counter = ProfileCounter()
    heavy = (("train.py", "all_reduce", 10),)
    counter.add(heavy, 1000)
    for i in range(10_000):
        counter.add((("x.py", "f", i),))
        assert len(counter.counts) <= 2000
    entries = counter.entries()
    assert len(entries) <= 2000
    assert entries[0] == ProfileEntry(stack=["all_reduce (train.py:10)"], count=1000)


def test_fit_profile_keeps_the_heaviest_entries_under_4_mib() -> None:
    entries = [ProfileEntry(stack=["f" * 512 + " (" + "p" * 512 + ":1)"] * 256, count=2000 - i)
               for i in range(2000)]
    kept = fit_profile(entries)
    assert 0 < len(kept) < 2000 and kept == entries[:len(kept)]
    frame = Stacks(run="r", rank=0, reason="request", taken_at=0.0, profile=kept, samples=10**6)
    assert len(encoder.encode(frame)) <= MAX_FRAME_BYTES
