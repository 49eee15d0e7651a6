"""Diagnosis benchmarks (issue 20): grouping 1,024 ranks' dumps, and what the stall watch
costs the training thread.

* ``stacks_groups_1024_ms``: the grouping of ``GET /api/runs/<run>/stacks`` for a run whose
  1,024 ranks each have a 60-frame ``stall`` dump (3 distinct stacks: 1,021 ranks in
  ``all_reduce``, two stragglers elsewhere), dumps in the dict form the feed and journal
  carry, plus encoding the groups as JSON; the median of the rounds (target <= 50 ms for the
  whole GET). Extra figures: the same from decoded ``Stacks`` Structs, and encoding the full
  response body (every dump as well as the groups) with msgspec's JSON encoder, which is
  what dominates the GET.
* ``profile_overhead_pct``: a CPU-bound training loop's median step time (about 1 ms of
  pure-Python work a step) while its process answers a 100 Hz profile request over a real
  control channel (an XPUB on loopback standing in for the broker's publish socket), against
  the same loop unprofiled just before, in the same process (target <= 3 %). Rounds
  alternate so drift in the shared machine's load falls on both sides. On an overloaded
  machine (more runnable threads than cores) every GIL handoff to the sampling thread may
  wait for a core, and the figure is mostly that wait: ``sample_cpu_us``, the CPU time of
  one sample, says what the profile itself costs (x 100 a second).
* ``stall_note_ns``: :meth:`rank_agent.stallwatch.StallWatch.note`, the training thread's
  whole cost per ``log_step``/``log_epoch``, in ns per call (the best of several rounds of
  a million calls; an empty method call measured alongside is the baseline).

    python bench/stacks_bench.py [--quick]
"""
from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgspec  # noqa: E402
import zmq  # noqa: E402
from common import result  # noqa: E402

from broker.stacks.groups import stack_groups  # noqa: E402
from rank_agent.control import Control  # noqa: E402
from rank_agent.controlwire import ControlRequest, encode_request  # noqa: E402
from rank_agent.protocol import Stacks, decoder, encoder  # noqa: E402
from rank_agent.stacks import ProfileCounter  # noqa: E402
from rank_agent.stallwatch import StallWatch  # noqa: E402

RANKS = 1024
DEPTH = 60


def dumps(ranks: int = RANKS, depth: int = DEPTH) -> dict[int, dict[str, Any]]:
    """``rank -> stall dump`` as a dict; 3 distinct main-thread stacks."""
    base = [{"file": f"/opt/venv/lib/python3.11/site-packages/torch/module_{i}.py", "line": 100 + i,
             "function": f"fn_{i}", "code": f"return self.fn_{i + 1}(x)"} for i in range(depth - 1)]
    tails = [{"file": "/opt/venv/lib/python3.11/site-packages/torch/distributed/c10d.py",
              "line": 2050, "function": "all_reduce", "code": "work.wait()"},
             {"file": "/opt/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py",
              "line": 631, "function": "__next__", "code": "data = self._next_data()"},
             {"file": "/work/train.py", "line": 88, "function": "save_checkpoint",
              "code": "torch.save(state, path)"}]
    out = {}
    for rank in range(ranks):
        tail = tails[0] if rank not in (417, 1000) else tails[1 if rank == 417 else 2]
        worker = {"name": "pin_memory", "frames": base[:10]}
        out[rank] = {"type": "stacks", "run": "bench", "rank": rank, "reason": "stall",
                     "request_id": "", "taken_at": 1.0e9, "idle_s": 75.0,
                     "threads": [{"name": "MainThread", "main": True,
                                  "frames": [*base, tail]}, worker]}
    return out


def time_groups(stall: dict[int, Any], rounds: int) -> list[float]:
    stalled = set(stall)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        groups = stack_groups(stall, stalled, {}, None)
        json.dumps(groups)
        times.append((time.perf_counter() - t) * 1000)
    assert [len(g["ranks"]) for g in groups] == [RANKS - 2, 1, 1]
    return times


def note_ns(calls: int, rounds: int = 5) -> tuple[float, float]:
    watch = StallWatch(lambda frame: None, "bench", 0, 60)

    class Empty:
        def note(self) -> None:
            pass

    def best(note: Any) -> float:
        fastest = float("inf")
        for _ in range(rounds):
            t = time.perf_counter_ns()
            for _ in range(calls):
                note()
            fastest = min(fastest, (time.perf_counter_ns() - t) / calls)
        return fastest
    try:
        return best(watch.note), best(Empty().note)
    finally:
        watch.close()


def _step(n: int = 40_000) -> int:
    x = 0
    for i in range(n):
        x += i & 7
    return x


def _steps_for(seconds: float) -> list[float]:
    times = []
    end = time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        if t >= end:
            return times
        _step()
        times.append(time.perf_counter() - t)


def sample_cpu_us(depth: int = 30, calls: int = 1000) -> float:
    """CPU time of one profile sample (``ProfileCounter.sample``) of a thread ``depth``
    frames deep that spins meanwhile: what the training thread's GIL is lent for, 100 times
    a second, besides the handoff itself."""
    stop = threading.Event()

    def deep(n: int) -> None:
        if n:
            return deep(n - 1)
        while not stop.is_set():
            _step(10_000)

    thread = threading.Thread(target=deep, args=(depth,), daemon=True)
    thread.start()
    counter = ProfileCounter()
    best = float("inf")
    try:
        while len(counter.counts) == 0:
            counter.sample(thread.ident)
        for _ in range(5):
            t = time.thread_time_ns()
            for _ in range(calls):
                counter.sample(thread.ident)
            best = min(best, (time.thread_time_ns() - t) / calls / 1000)
    finally:
        stop.set()
        thread.join(5)
    return best


def profile_overhead(seconds: float, rounds: int) -> dict[str, Any]:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    answers: list[Stacks] = []
    control = Control(f"tcp://127.0.0.1:{port}", "bench", 0, answers.append,
                      socket_options=lambda: None)
    control.start()
    try:
        if not pub.poll(10_000):
            raise RuntimeError("the control socket did not subscribe")
        pub.recv()
        plain: list[float] = []
        profiled: list[float] = []
        for r in range(rounds):
            plain += _steps_for(seconds)
            pub.send_multipart(encode_request(ControlRequest(
                run="bench", request_id=f"p{r}", kind="profile", hz=100, seconds=seconds)))
            profiled += _steps_for(seconds)
            deadline = time.monotonic() + seconds + 5
            while len(answers) <= r and time.monotonic() < deadline:
                time.sleep(0.01)
        base, prof = statistics.median(plain), statistics.median(profiled)
        return result("profile_overhead_pct", round((prof / base - 1) * 100, 2), "%",
                      step_ms=round(base * 1000, 2), profiled_step_ms=round(prof * 1000, 2),
                      samples=sum(a.samples for a in answers), answers=len(answers), hz=100,
                      sample_cpu_us=round(sample_cpu_us(), 2))
    finally:
        control.close()
        pub.close(linger=0)
        ctx.term()


def run(quick: bool) -> list[dict[str, Any]]:
    rounds = 5 if quick else 30
    stall = dumps()
    as_dicts = time_groups(stall, rounds)
    structs = {r: decoder.decode(encoder.encode(msgspec.convert(d, Stacks)))
               for r, d in stall.items()}
    as_structs = time_groups(structs, rounds)
    body = {"dumps": list(stall.values()), "groups": stack_groups(stall, set(stall), {}, None)}
    enc = msgspec.json.Encoder()
    t = time.perf_counter()
    data = enc.encode(body)
    body_ms = (time.perf_counter() - t) * 1000
    note, empty = note_ns(200_000 if quick else 1_000_000)
    overhead = profile_overhead(1.0 if quick else 3.0, 2 if quick else 5)
    return [
        overhead,
        result("stacks_groups_1024_ms", round(statistics.median(as_dicts), 2), "ms",
               ranks=RANKS, frames=DEPTH, distinct=3, p_max_ms=round(max(as_dicts), 2),
               structs_ms=round(statistics.median(as_structs), 2),
               full_body_json_ms=round(body_ms, 2), full_body_mib=round(len(data) / 2**20, 2)),
        result("stall_note_ns", round(note, 1), "ns", baseline=round(empty, 1),
               ratio=round(note / empty, 2) if empty else None),
    ]


if __name__ == "__main__":
    for line in run("--quick" in sys.argv):
        print(json.dumps(line))
