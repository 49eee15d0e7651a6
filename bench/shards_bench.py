"""Shards (PROTOCOL 7.3, issue 30): what N brokers cost and buy, with real processes.

* **shards_cpu_per_frame_ratio**: broker CPU seconds per frame with 2 shards (summed over
  both processes) over 1 broker, the same frames (``RUNS`` runs of ``RANKS`` ranks: per rank
  and epoch a ``resources`` and a ``metrics`` frame, registers first) spread over the runs of
  both shards. Sharding should cost nothing per frame: target ≤ 1.1.
* **shards_web_cpu_per_event_ratio**: the web's CPU per epoch record served with 3 shards
  (one web subscribed to three brokers) over 1 broker, the same runs and epochs; target ≤ 1.1.
* **shard_return_s**: one shard SIGKILLed and restarted on its ports and data dir: seconds
  from the restart until the web serves its run's next epoch (the broker's start-up included);
  target ≤ 5.
* **shards_capacity**: frames/s taken by N = 1, 2, ... brokers (up to the cores, at most 4)
  from one sender process per shard; reported with the machine's cores (on 2 shared cores
  the figure says little about a head node's 32).

The brokers' ``accepted`` counters come from their own heartbeats (SUB on each feed); the
web's progress from ``/api/runs``. Run: ``python bench/shards_bench.py [--quick]``.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from common import EPHEMERAL, Proc, http_json, machine, result, wait_for

from broker import feed
from rank_agent import protocol
from rank_agent.protocol import Metrics, Register, Resources, ResourceSample
from rank_agent.shards import shard_of

_BOUND = re.compile(r"broker (ingest|publish|snapshot) bound at (\S+)")
_DASHBOARD = re.compile(r"dashboard: http://localhost:(\d+)")
RANKS = 4


class Broker:
    """A ``rankboard broker [--shard K/N]`` process and a SUB reading its heartbeats."""

    def __init__(self, data_dir: Path, shard: tuple[int, int],
                 endpoints: Optional[dict[str, str]] = None) -> None:
        import zmq

        eps = endpoints or {"ingest": EPHEMERAL, "publish": EPHEMERAL, "snapshot": EPHEMERAL}
        args = ["broker", "--ingest", eps["ingest"], "--publish", eps["publish"],
                "--snapshot", eps["snapshot"], "--data-dir", str(data_dir), "--log-level", "INFO"]
        if shard[1] > 1:
            args += ["--shard", f"{shard[0]}/{shard[1]}"]
        self.started = time.perf_counter()
        self.proc = Proc(args)
        self.endpoints: dict[str, str] = {}

        def bound() -> bool:
            if self.proc.proc.poll() is not None:
                raise RuntimeError("broker exited:\n" + self.proc.tail())
            self.endpoints = {m.group(1): m.group(2) for m in self.proc.find(_BOUND)}
            return len(self.endpoints) == 3
        wait_for(bound, 30, "a broker to bind")
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.linger = 0
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.endpoints["publish"])
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.linger = 0
        self.push.sndhwm = 0
        self.push.connect(self.endpoints["ingest"])
        self.accepted = 0

    def poll_accepted(self) -> int:
        import zmq

        while True:
            try:
                parts = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self.accepted
            try:
                update = feed.decode_update(parts)
            except feed.FeedError:
                continue
            if isinstance(update, feed.Heartbeat):
                self.accepted = update.accepted

    def kill(self) -> None:
        self.proc.proc.send_signal(signal.SIGKILL)
        self.proc.stop()
        self.close_sockets()

    def close_sockets(self) -> None:
        self.sub.close(0)
        self.push.close(0)
        self.ctx.term()

    def stop(self) -> None:
        self.proc.stop()
        self.close_sockets()


def _runs(n: int, prefix: str) -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


def _registers(runs: list[str]) -> list[tuple[str, bytes]]:
    enc = protocol.encoder.encode
    return [(run, enc(Register(run=run, rank=r, world_size=RANKS, host=f"node-{r // 4}")))
            for run in runs for r in range(RANKS)]


def _epochs(runs: list[str], first: int, epochs: int) -> list[tuple[str, bytes]]:
    enc = protocol.encoder.encode
    out = []
    for e in range(first, first + epochs):
        for run in runs:
            for r in range(RANKS):
                sample = ResourceSample(cpu_percent=10.0 + r, ram_used_bytes=1 << 30,
                                        ram_total_bytes=1 << 34)
                out.append((run, enc(Resources(run=run, rank=r, sample=sample))))
                out.append((run, enc(Metrics(run=run, rank=r, epoch=e, avg_loss=1.0 / (e + 1),
                                             batches=10, samples=640, epoch_ms=100.0))))
    return out


def _send(brokers: list[Broker], frames: list[tuple[str, bytes]]) -> list[int]:
    """Push each frame to its run's shard; returns the frames sent to each shard."""
    n = len(brokers)
    sent = [0] * n
    for run, raw in frames:
        k = shard_of(run, n)
        brokers[k].push.send(raw)
        sent[k] += 1
    return sent


def _wait_accepted(brokers: list[Broker], want: list[int], timeout: float = 120.0) -> None:
    wait_for(lambda: all(b.poll_accepted() >= w for b, w in zip(brokers, want)), timeout,
             "the brokers to accept every frame", interval=0.02)


def _start(n: int, root: Path, tag: str) -> list[Broker]:
    return [Broker(root / f"{tag}-{n}-{k}", (k, n)) for k in range(n)]


def cpu_seconds(proc: Proc) -> float:
    """CPU seconds of every thread of ``proc`` (its ZeroMQ I/O threads included), from
    ``/proc/<pid>/task/*/schedstat`` in nanoseconds: the 10 ms tick of ``/proc/<pid>/stat``
    would make a few hundred milliseconds of work a figure to ±5 %."""
    total = 0
    base = f"/proc/{proc.pid}/task"
    for task in os.listdir(base):
        try:
            with open(f"{base}/{task}/schedstat", encoding="ascii") as fh:
                total += int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that just ended
            continue
    return total / 1e9


def idle_cpu_rate(procs: list[Proc], seconds: float = 2.0) -> float:
    """CPU seconds per second the processes spend idle (their timers, heartbeats and polls):
    subtracted from a measurement, so that N processes' idle loops are not counted as
    per-frame cost (the clock's tick is 10 ms: the frames make the figure, not the loops)."""
    c0, t0 = sum(cpu_seconds(p) for p in procs), time.perf_counter()
    time.sleep(seconds)  # measuring idleness itself, not waiting for anything
    return (sum(cpu_seconds(p) for p in procs) - c0) / (time.perf_counter() - t0)


def broker_cpu_per_frame(n: int, root: Path, runs: int, epochs: int) -> float:
    brokers = _start(n, root, "cpu")
    try:
        names = _runs(runs, f"cpu{n}")
        base = _send(brokers, _registers(names))
        _wait_accepted(brokers, base)
        frames = _epochs(names, 0, epochs)
        idle = idle_cpu_rate([b.proc for b in brokers])
        c0, t0 = sum(cpu_seconds(b.proc) for b in brokers), time.perf_counter()
        sent = _send(brokers, frames)
        _wait_accepted(brokers, [a + b for a, b in zip(base, sent)])
        used = sum(cpu_seconds(b.proc) for b in brokers) - c0
        return (used - idle * (time.perf_counter() - t0)) / len(frames)
    finally:
        for b in brokers:
            b.stop()


class WebOver:
    """A ``rankboard web`` subscribed to ``brokers`` (their lists, shard order)."""

    def __init__(self, brokers: list[Broker]) -> None:
        self.proc = Proc(["web", "--publish", ",".join(b.endpoints["publish"] for b in brokers),
                          "--snapshot", ",".join(b.endpoints["snapshot"] for b in brokers),
                          "--port", "0", "--log-level", "WARNING"])
        self.port = 0

        def ready() -> bool:
            found = self.proc.find(_DASHBOARD)
            if not found:
                if self.proc.proc.poll() is not None:
                    raise RuntimeError("web exited:\n" + self.proc.tail())
                return False
            self.port = int(found[0].group(1))
            return bool(http_json(self.port, "/healthz")["ok"])
        wait_for(ready, 30, "the web to be healthy", retry_on=(OSError, ValueError, KeyError))

    def epochs_done(self) -> dict[str, int]:
        return {r["run"]: r["epochs_done"] for r in http_json(self.port, "/api/runs")}


def web_cpu_per_event(n: int, root: Path, runs: int, epochs: int,
                      keep: Optional[dict[str, Any]] = None) -> float:
    brokers = _start(n, root, "web")
    web = WebOver(brokers)
    try:
        names = _runs(runs, f"web{n}")
        base = _send(brokers, _registers(names))
        _wait_accepted(brokers, base)
        wait_for(lambda: len(web.epochs_done()) == runs, 60, "every run on the web")
        frames = _epochs(names, 0, epochs)
        idle = idle_cpu_rate([web.proc])
        c0, t0 = cpu_seconds(web.proc), time.perf_counter()
        _send(brokers, frames)
        # the last epoch closes when the next one's frames arrive: epochs - 1 records
        wait_for(lambda: all(v >= epochs - 1 for v in web.epochs_done().values()), 120,
                 "every epoch served", interval=0.2)
        used = cpu_seconds(web.proc) - c0 - idle * (time.perf_counter() - t0)
        per_event = used / (runs * (epochs - 1))
        if keep is not None:
            keep.update(brokers=brokers, web=web, names=names, epochs=epochs, root=root)
            brokers, web = [], None  # type: ignore[assignment]
        return per_event
    finally:
        if web is not None:
            web.proc.stop()
        for b in brokers:
            b.stop()


def shard_return(kept: dict[str, Any]) -> float:
    """SIGKILL shard 1 of the kept web bench, restart it; seconds until the web serves its
    run's next epoch."""
    brokers: list[Broker] = kept["brokers"]
    web: WebOver = kept["web"]
    try:
        n = len(brokers)
        run = next(r for r in kept["names"] if shard_of(r, n) == 1)
        done = web.epochs_done()[run]
        eps = dict(brokers[1].endpoints)
        brokers[1].kill()
        wait_for(lambda: not http_json(web.port, "/healthz")["shards"][1]["connected"], 30,
                 "the web to see the shard gone", interval=0.05)
        t0 = time.perf_counter()
        brokers[1] = Broker(kept["root"] / f"web-{n}-1", (1, n), endpoints=eps)
        frames = [raw for r, raw in _epochs([run], kept["epochs"], 2)]
        for raw in frames:
            brokers[1].push.send(raw)
        wait_for(lambda: web.epochs_done()[run] > done, 30, "the run's next epoch",
                 interval=0.02)
        return time.perf_counter() - t0
    finally:
        web.proc.stop()
        for b in brokers:
            b.stop()


def capacity(n: int, root: Path, runs: int, epochs: int) -> float:
    """Frames/s N brokers take from one sender process per shard (spawned, pre-encoded)."""
    import multiprocessing as mp

    brokers = _start(n, root, "cap")
    try:
        names = _runs(runs, f"cap{n}")
        base = _send(brokers, _registers(names))
        _wait_accepted(brokers, base)
        frames = _epochs(names, 0, epochs)
        per_shard: list[list[bytes]] = [[] for _ in range(n)]
        for run, raw in frames:
            per_shard[shard_of(run, n)].append(raw)
        ctx = mp.get_context("spawn")
        go, ready = ctx.Event(), ctx.Semaphore(0)
        procs = [ctx.Process(target=_sender, args=(b.endpoints["ingest"], part, ready, go),
                             daemon=True) for b, part in zip(brokers, per_shard)]
        for p in procs:
            p.start()
        for _ in procs:
            if not ready.acquire(timeout=120):
                raise RuntimeError("a sender did not start")
        t0 = time.perf_counter()
        go.set()
        _wait_accepted(brokers, [a + len(p) for a, p in zip(base, per_shard)])
        dt = time.perf_counter() - t0
        for p in procs:
            p.join(30)
        return len(frames) / dt
    finally:
        for b in brokers:
            b.stop()


def _sender(endpoint: str, frames: list[bytes], ready: Any, go: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.sndhwm = 0
    sock.connect(endpoint)
    ready.release()
    go.wait()
    for raw in frames:
        sock.send(raw)
    sock.close(linger=-1)
    ctx.term()


def run(quick: bool) -> list[dict[str, Any]]:
    runs, epochs = (32, 12) if quick else (64, 80)
    out = []
    with tempfile.TemporaryDirectory(prefix="rankboard-shards-") as tmp:
        root = Path(tmp)
        one = broker_cpu_per_frame(1, root, runs, epochs)
        two = broker_cpu_per_frame(2, root, runs, epochs)
        out.append(result("shards_cpu_per_frame_ratio", round(two / one, 3), "x",
                          baseline=round(one * 1e6, 2), ratio=round(two / one, 3),
                          us_per_frame_1=round(one * 1e6, 2), us_per_frame_2=round(two * 1e6, 2)))
        w1 = web_cpu_per_event(1, root, runs, epochs)
        kept: dict[str, Any] = {}
        w3 = web_cpu_per_event(3, root, runs, epochs, keep=kept)
        out.append(result("shards_web_cpu_per_event_ratio", round(w3 / w1, 3), "x",
                          baseline=round(w1 * 1e6, 1), ratio=round(w3 / w1, 3),
                          us_per_event_1=round(w1 * 1e6, 1), us_per_event_3=round(w3 * 1e6, 1)))
        out.append(result("shard_return_s", round(shard_return(kept), 2), "s"))
        cores = os.cpu_count() or 1
        rates = {}
        for n in range(1, max(2, min(cores, 4)) + 1):
            rates[n] = round(capacity(n, root, runs, epochs))
        out.append(result("shards_capacity", rates[max(rates)], "frames/s",
                          baseline=rates[1], ratio=round(rates[max(rates)] / rates[1], 2),
                          cores=cores, by_shards=rates))
    return out


def main() -> int:
    quick = "--quick" in sys.argv
    print(json.dumps({"machine": machine()}))
    for line in run(quick):
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
