"""agent_send_p99_us and sampler_sample_us: what rankboard costs inside a training process.

agent_send_p99_us: the wall time of one ``RankAgent.log_epoch`` call (4 scalars, the
sampler's latest sample riding along, as ``start_sampling`` makes it) in the calling thread,
with a real receiver draining the PULL end in another process so the send queue never fills
(a full queue would measure the drop path instead). The calls are paced (one every 200 µs)
rather than back to back: training calls it once per epoch, and pacing keeps the figure from
measuring ZeroMQ's queue under a burst. p99 over all calls.

Placement, as a training job has it: the calling thread ("the training thread") runs on a
CPU of its own and the agent's background threads (ZeroMQ's I/O thread, the sampler) and
the receiver ("the broker") on the others, so the figure is what the agent costs the
training thread rather than how often this benchmark's own helpers preempt it. The I/O and
sampler threads are created while the process is on the background CPUs (threads inherit
the creator's affinity), then only the calling thread moves. Nothing is pinned when fewer
than 2 CPUs are usable (``pinned`` in the details says which). Other processes on the
machine can still preempt the calling thread: that stays in the figure. The garbage
collector stays on; ``gc_collections`` counts the collections during the timed calls.

log_step_p99_us: the wall time of one ``RankAgent.log_step`` call (4 metrics, samples and
tokens, as a training loop logs an optimizer step) in the calling thread, placed and paced
exactly as agent_send_p99_us (one call every 200 µs, a real receiver draining the PULL end).
The call only appends to the agent's buffer; the agent's flusher thread, started by the
warm-up calls while the process is still on the background CPUs, sends ``steps`` frames every
``step_flush`` (0.25 s) from there, so its work (and its share of the GIL) stays in the
figure just as the sampler's does in agent_send_p99_us. p99 over all calls. ``noop_p99_us``
in the details is the same loop calling a function that does nothing, right after: the
floor that this machine's own noise (other processes, interrupts) puts under the figure.

sampler_sample_us: the median wall time of one ``Sampler.sample()`` (psutil CPU times and
virtual memory, plus NVML when a GPU and driver are present; the figure says which).
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import statistics
import time
from contextlib import contextmanager
from typing import Any, Iterator

import zmq
from common import percentile, result

from rank_agent import RankAgent
from rank_agent.sampler import Sampler


def _placement() -> tuple[set[int] | None, set[int] | None]:
    """(background CPUs, the calling thread's CPU), or (None, None) where pinning is not
    possible (fewer than 2 usable CPUs, or no sched_setaffinity)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None, None
    if len(cpus) < 2:
        return None, None
    return set(cpus[:-1]), {cpus[-1]}


def _pin(cpus: set[int] | None) -> None:
    """Move the calling thread (only it: pid 0) to ``cpus``; None leaves it where it is."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def _drain(endpoint_q: Any, stop: Any, cpus: set[int] | None = None) -> None:
    _pin(cpus)  # before the context: its I/O thread inherits this
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    endpoint_q.put(f"tcp://127.0.0.1:{port}")
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(100):
            while True:
                try:
                    sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
    sock.close(0)
    ctx.term()


@contextmanager
def _draining(background: set[int] | None) -> Iterator[str]:
    """A receiver process ("the broker") on the background CPUs; yields its endpoint, and
    on the way out gives the calling thread its original CPUs back."""
    original = os.sched_getaffinity(0) if background is not None else None
    mpc = mp.get_context("spawn")
    q = mpc.Queue()
    stop = mpc.Event()
    proc = mpc.Process(target=_drain, args=(q, stop, background), daemon=True)
    proc.start()
    try:
        yield q.get(timeout=30)
    finally:
        _pin(original)
        stop.set()
        proc.join(10)


def _paced(call: Any, n: int, *args: Any, before: Any = None,
           **kwargs: Any) -> tuple[list[float], int]:
    """Time ``call(i, *args, **kwargs)`` for i in range(n), one call every 200 µs
    (busy-waiting in between, so the thread keeps its CPU); returns (seconds per call, gc
    collections meanwhile). ``call`` is the bound method itself: no wrapper in the timing.
    ``before``: called, untimed, before each timed call (``batch_ready``: 7.1)."""
    times: list[float] = []
    clock = time.perf_counter
    collections = sum(st["collections"] for st in gc.get_stats())
    next_at = clock()
    for i in range(n):
        while clock() < next_at:
            pass
        if before is not None:
            before()
        t0 = clock()
        call(i, *args, **kwargs)
        times.append(clock() - t0)
        next_at = t0 + 200e-6
    return times, sum(st["collections"] for st in gc.get_stats()) - collections


def agent_send(quick: bool) -> dict[str, Any]:
    background, caller = _placement()
    with _draining(background) as endpoint:
        _pin(background)  # the agent's I/O thread (first send) and sampler thread start here
        agent = RankAgent(endpoint, run="bench-agent", rank=3, world_size=8, local_rank=3, host="node-a")
        try:
            agent.register(total_epochs=100)
            agent.start_sampling(interval=0.5)
            deadline = time.monotonic() + 10
            while agent.latest_sample is None and time.monotonic() < deadline:
                time.sleep(0.01)
            _pin(caller)  # then only the calling thread moves to its own CPU
            scalars: dict[str, Any] = {"acc": 0.91, "grad_norm": (3.0, 2), "lr": 1e-3, "tokens_per_s": 12345.0}
            n = 5000 if quick else 50000
            for i in range(200):  # warm-up: the socket is created on the first send
                agent.log_epoch(i, 0.5, batches=100, samples=6400, epoch_ms=1000.0, scalars=scalars)
            times, collections = _paced(agent.log_epoch, n, 0.5, batches=100, samples=6400,
                                        epoch_ms=1000.0, scalars=scalars)
            dropped = agent.dropped
        finally:
            agent.close()
    us = [t * 1e6 for t in times]
    return result("agent_send_p99_us", round(percentile(us, 99), 2), "us",
                  p50_us=round(percentile(us, 50), 2), max_us=round(max(us), 1), calls=n,
                  dropped=dropped, pinned=caller is not None, gc_collections=collections)


def _noop(step: int, metrics: Any, samples: int = 0, tokens: int = 0) -> bool:
    return True


def _log_step_run(quick: bool, ready: bool = False,
                  **diag: Any) -> tuple[list[float], int, int, int, list[float]]:
    """One log_step measurement with the agent's diagnosis keywords ``diag``: the timed
    calls (seconds), gc collections, dropped, frames sent, and the no-op floor."""
    background, caller = _placement()
    with _draining(background) as endpoint:
        _pin(background)  # the agent's I/O thread, step flusher and stall watch start here
        agent = RankAgent(endpoint, run="bench-steps", rank=3, world_size=8, local_rank=3,
                          host="node-a", step_flush=0.25, **diag)
        try:
            agent.register(total_epochs=100)
            metrics = {"loss": 0.5, "lr": 3e-4, "grad_norm": 1.25, "tokens_per_s": 12345.0}
            for i in range(200):  # warm-up: the first call starts the flusher thread
                # (the timed calls count from step 0 again: a restart, as log_step allows)
                agent.log_step(i, metrics, samples=64, tokens=65536)
            _pin(caller)  # then only the calling thread moves to its own CPU
            n = 5000 if quick else 50000
            times, collections = _paced(agent.log_step, n, metrics, samples=64, tokens=65536,
                                        before=agent.batch_ready if ready else None)
            dropped = agent.dropped
            floor, _ = _paced(_noop, n // 5, metrics, samples=64, tokens=65536)
        finally:
            agent.close()
            _pin(background)  # the next measurement starts where this one did
        sent = agent.sent
    return times, collections, dropped, sent, floor


def log_step(quick: bool) -> dict[str, Any]:
    """The figure with the agent's defaults (stall watch on, automatic ``stall_after``;
    control channel on); in the details, the same run's figure with ``stall_after=0``
    (``stall_off_p99_us``) and with diagnosis off altogether (``stall_after=0,
    control=False``: no timestamp at all, ``diag_off_p99_us``), measured right after, so the
    watch's cost (a timestamp per call, a thread waking twice a second) shows as the gap."""
    times, collections, dropped, sent, floor = _log_step_run(quick)
    off, _, _, _, _ = _log_step_run(quick, stall_after=0)
    bare, _, _, _, _ = _log_step_run(quick, stall_after=0, control=False)
    # 7.1: batch_ready before each call (untimed), so every log_step derives a data_ms
    data, _, _, _, _ = _log_step_run(quick, ready=True)
    us = [t * 1e6 for t in times]
    return result("log_step_p99_us", round(percentile(us, 99), 2), "us",
                  p50_us=round(percentile(us, 50), 2), max_us=round(max(us), 1),
                  calls=len(times), dropped=dropped, frames_sent=sent,
                  pinned=_placement()[1] is not None, gc_collections=collections,
                  noop_p99_us=round(percentile([t * 1e6 for t in floor], 99), 2),
                  stall_off_p99_us=round(percentile([t * 1e6 for t in off], 99), 2),
                  diag_off_p99_us=round(percentile([t * 1e6 for t in bare], 99), 2),
                  data_ms_p99_us=round(percentile([t * 1e6 for t in data], 99), 2),
                  data_ms_p50_us=round(percentile([t * 1e6 for t in data], 50), 2))


def batch_ready_ns(calls: int, rounds: int = 5) -> dict[str, Any]:
    """``batch_ready_ns`` (7.1): the training thread's cost of one ``agent.batch_ready()``
    (the bound method as a loop calls it), ns per call, the best of ``rounds`` rounds of
    ``calls`` calls; an empty method call measured alongside is the baseline."""
    agent = RankAgent("tcp://127.0.0.1:9", run="bench-ready", rank=0, world_size=1,
                      stall_after=0, control=False)

    class Empty:
        def batch_ready(self) -> None:
            pass

    def best(call: Any) -> float:
        fastest = float("inf")
        for _ in range(rounds):
            t = time.perf_counter_ns()
            for _ in range(calls):
                call()
            fastest = min(fastest, (time.perf_counter_ns() - t) / calls)
        return fastest
    try:
        ready, empty = best(agent.batch_ready), best(Empty().batch_ready)
    finally:
        agent.close()
    return result("batch_ready_ns", round(ready, 1), "ns", baseline=round(empty, 1),
                  ratio=round(ready / empty, 2) if empty else None, calls=calls)


def sampler_sample(quick: bool) -> dict[str, Any]:
    sampler = Sampler(0)
    try:
        sampler.sample()
        n = 500 if quick else 5000
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            sampler.sample()
            times.append(time.perf_counter() - t0)
        gpu = sampler.gpu_name is not None
    finally:
        sampler.close()
    us = [t * 1e6 for t in times]
    return result("sampler_sample_us", round(statistics.median(us), 2), "us",
                  p99_us=round(percentile(us, 99), 1), gpu=gpu, samples=n)


def run(quick: bool) -> list[dict[str, Any]]:
    # sampler_sample_us is bench/sampler_bench.py's in run_all (with the GPU health reads,
    # through a fake NVML); sampler_sample() here is the same figure on this machine's own
    # NVML, if any, and stays callable.
    return [agent_send(quick), log_step(quick),
            batch_ready_ns(100_000 if quick else 1_000_000)]


if __name__ == "__main__":
    import json
    import sys

    if "--log-step" in sys.argv[1:]:  # just the log_step comparison, quick mode
        print(json.dumps(log_step(True)))
        raise SystemExit(0)
    for line in run(True):
        print(json.dumps(line))
