"""A training-like rank and a flooder of the broker's snapshot socket, each a real process
(issue 32 finding 1): used by ``tests/reliability/test_stacks_flood.py`` (a short flood) and
``bench/stacks_flood_bench.py`` (the step-time figure).

* the rank (``python -m tests.support.stacksflood --rank INGEST CONTROL RUN BUSY_MS``): a
  loop with a real :class:`~rank_agent.RankAgent` (control channel on, at ``CONTROL``) doing
  a fixed amount of Python work (calibrated to about ``BUSY_MS``) then ``log_step``; it says
  ``{"ready": ...}`` once started, ``{"answered": n, "t": ...}`` whenever its count of
  answered requests changes, and, once its stdin closes, every step's end
  (``time.monotonic``: one clock for every process on Linux), duration and process CPU time;
* the flooder (``--flood SNAPSHOT RUN SECONDS KIND``): a DEALER sending ``STACKS`` requests
  for ``RUN`` as fast as the broker takes them (blocking at the HWM), alternating a dump of
  every rank (identical but for its id: the gate's ``coalesced``) with another shape (a dump
  of rank 0, or with ``KIND`` ``profile`` a profile at 250 Hz for 60 s, the most a request
  may ask: ``rate_limited``); prints ``{"sent": n}``.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
#: Seconds between two warm-up requests (longer than the broker's one-a-second gate).
WARMUP_GAP_S = 1.2

#: (monotonic end, seconds, process CPU seconds at the end, seconds the loop's thread has
#: waited for a CPU so far: the scheduler's run delay)
Step = tuple[float, float, float, float]


# ------------------------------------------------------------------ the rank's process
def _work(n: int) -> int:
    acc = 0
    for i in range(n):
        acc = (acc + i * i) % 1_000_003
    return acc


def _calibrate(busy_ms: float) -> int:
    """Iterations of :func:`_work` that take about ``busy_ms`` (the fastest of a few tries,
    so a busy machine at start does not make the work smaller)."""
    n = 20_000
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        _work(n)
        best = min(best, time.perf_counter() - t0)
    return max(1, int(n * busy_ms / 1000.0 / best))


def _run_delay(path: str) -> float:
    """Seconds this thread has waited on a run queue (``/proc/thread-self/schedstat``'s
    second field; 0 where the kernel has none)."""
    try:
        with open(path, "rb") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def rank_main(ingest: str, control: str, run: str, busy_ms: float) -> None:
    """The rank (module docstring), until stdin closes."""
    from rank_agent import RankAgent

    n = _calibrate(busy_ms)
    agent = RankAgent(ingest, run, 0, 1, control=control)
    agent.register()
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    ctl = agent._control  # the control channel: its count of requests answered
    print(json.dumps({"ready": True, "iterations": n}), flush=True)
    steps: list[Step] = []
    schedstat = "/proc/thread-self/schedstat"
    answered = 0
    step = 0
    while not done.is_set():
        t0 = time.perf_counter()
        loss = _work(n)
        agent.log_step(step, {"loss": float(loss)})
        end = time.perf_counter()
        steps.append((time.monotonic(), end - t0, time.process_time(), _run_delay(schedstat)))
        step += 1
        now = ctl.answered if ctl is not None else 0
        if now != answered:
            answered = now
            print(json.dumps({"answered": answered, "t": time.monotonic()}), flush=True)
    agent.close()
    print(json.dumps({"steps": steps}), flush=True)


# ------------------------------------------------------------------ the flooder's process
def flood_main(snapshot: str, run: str, seconds: float, kind: str) -> None:
    """The flooder (module docstring)."""
    import zmq

    from broker import feed
    from rank_agent.controlwire import ControlRequest

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(snapshot)
    sent = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for i in range(100):
            if i % 2 == 0:
                req = ControlRequest(run=run, request_id=f"f{sent}", kind="stacks")
            elif kind == "profile":
                req = ControlRequest(run=run, request_id=f"f{sent}", kind="profile", hz=250,
                                     seconds=60.0)
            else:
                req = ControlRequest(run=run, request_id=f"f{sent}", kind="stacks", ranks=[0])
            dealer.send_multipart(feed.encode_stacks_request(req))
            sent += 1
    # linger: what is still queued (up to the HWM, on a broker slower than this loop) goes
    # out before the count is printed, so ``sent`` is what the broker will read; closed at
    # once, those requests were dropped and the parent waited for requests never sent
    dealer.close(linger=60_000)
    ctx.term()
    print(json.dumps({"sent": sent}), flush=True)


# ------------------------------------------------------------------ the parent's side
def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.pop("RANKBOARD_CONTROL", None)
    return env


def pin(pid: int, cpus: Optional[set[int]]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads started later inherit it); None:
    nothing."""
    if cpus is None:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


class Rank:
    """The rank's process and what it said (read by a thread)."""

    def __init__(self, ingest: str, control: str, run: str, busy_ms: float,
                 cpus: Optional[set[int]] = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.stacksflood", "--rank", ingest, control, run,
             str(busy_ms)], cwd=str(REPO), env=_env(), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        pin(self.proc.pid, cpus)
        self.ready = threading.Event()
        self.answers: list[tuple[float, int]] = []
        self.steps: list[Step] = []
        self.finished = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            obj = json.loads(line)
            if "ready" in obj:
                self.ready.set()
            elif "answered" in obj:
                self.answers.append((obj["t"], obj["answered"]))
            elif "steps" in obj:
                self.steps = [(s[0], s[1], s[2], s[3]) for s in obj["steps"]]
        self.finished.set()

    @property
    def answered(self) -> int:
        return self.answers[-1][1] if self.answers else 0

    def stop(self, timeout: float = 30.0) -> None:
        """Close its stdin (it ends its loop and reports its steps); kill it if it hangs."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def warm_up(snapshot: str, rank: Rank, run: str, timeout: float = 60.0) -> None:
    """One request at a time until the rank answers one (its SUB is then connected)."""
    import zmq

    from broker import feed
    from rank_agent.controlwire import ControlRequest

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(snapshot)
    try:
        deadline = time.monotonic() + timeout
        n = 0
        while rank.answered == 0:
            if time.monotonic() > deadline or rank.proc.poll() is not None:
                raise RuntimeError("the rank never answered a request")
            dealer.send_multipart(feed.encode_stacks_request(
                ControlRequest(run=run, request_id=f"warm{n}", kind="stacks")))
            n += 1
            until = time.monotonic() + WARMUP_GAP_S
            while rank.answered == 0 and time.monotonic() < until:
                time.sleep(0.02)  # a poll's interval, bounded by the deadline above
    finally:
        dealer.close(linger=0)
        ctx.term()


def flood(snapshot: str, run: str, seconds: float, kind: str = "stacks",
          cpus: Optional[set[int]] = None) -> int:
    """A flooder process for ``seconds``; how many requests it sent."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.stacksflood", "--flood", snapshot, run,
         str(seconds), kind], cwd=str(REPO), env=_env(), stdout=subprocess.PIPE, text=True)
    pin(proc.pid, cpus)
    out, _ = proc.communicate(timeout=seconds + 120)
    if proc.returncode != 0:
        raise RuntimeError(f"the flooder exited {proc.returncode}")
    return int(json.loads(out.strip().splitlines()[-1])["sent"])


def phase(steps: list[Step], start: float, end: float) -> dict[str, float]:
    """Figures of the steps that ended in [start, end): how many, mean and p99 ms, the
    process's CPU ms a step and the loop thread's wait for a CPU in ms a step (NaN with fewer
    than two steps)."""
    inside = [s for s in steps if start <= s[0] < end]
    if len(inside) < 2:
        nan = float("nan")
        return {"steps": len(inside), "mean_ms": nan, "p99_ms": nan, "cpu_ms": nan,
                "wait_ms": nan}
    ms = sorted(s[1] * 1000.0 for s in inside)
    per_step = 1000.0 / (len(inside) - 1)
    return {"steps": len(inside), "mean_ms": statistics.fmean(ms),
            "p99_ms": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))],
            "cpu_ms": (inside[-1][2] - inside[0][2]) * per_step,
            "wait_ms": (inside[-1][3] - inside[0][3]) * per_step}


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank_main(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
    elif sys.argv[1] == "--flood":
        flood_main(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} --rank ... | --flood ...")
