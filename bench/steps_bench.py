"""Per-step streaming figures (issue 8): ingest, memory, /steps queries, restart, e2e.

* ``steps_ingest_frames_per_s``: ``steps`` frames of 3 points x 4 metrics from 1,024 ranks
  (4 sender processes, pre-encoded), flooded into the real :class:`BrokerServer` (journal
  on, steps closing by the watermark, ``steps`` events published). ``baseline`` is the floor
  of any validating broker measured in the same run: a bare PULL loop that also runs
  ``protocol.decode`` on each frame, same senders, same frames.
* ``steps_bytes_per_step_series``: bytes a :class:`StepStore` allocates for 1,000,000
  closed steps x 4 metrics, per step and per series served by ``/steps`` (the 4 metrics,
  ``step_ms``, ``samples_per_s``, ``tokens_per_s``); the per-step total and the figure per
  *stored* series (metrics + step_ms) are in the details. The same store class holds the
  steps in the broker and in the web.
* ``steps_query_1m_p99_ms``: a real broker + web holding a 1,000,000-step run (its journal
  written by the real :class:`Journal` code path); ``/steps?metric=loss&points=1000`` over
  random ranges through one keep-alive HTTP connection; p99 of the wall time per answer.
* ``steps_restart_1m_s``: that broker SIGKILLed and started again on the same data dir and
  endpoints: seconds from the new broker's spawn until the web (which re-snapshots the new
  instance) answers ``/steps`` with the whole range again. ``web_start_1m_s`` in the
  details: a fresh web against the broker holding the run, spawn to full answer.
* ``steps_floor_ratio`` (issue 17): the same frames, broker frames/s over the floor's; the
  details also compare CPU per frame of the two receiving threads (``cpu_ratio``).
* ``steps_close_per_s`` (issue 17): one rank sends 200,000 steps x 4 metrics in frames of
  1,000 points to a real broker and web (processes); steps/s from the first frame sent to
  ``/steps`` serving the last; the broker process's CPU per closed step in the details.
* ``steps_close_1024_ms`` (issue 17): the CPU time of closing one step reported by 1,024
  ranks x 4 metrics (:class:`RunSteps`, in process: the close, the store append and the
  ``steps`` event's wire block),
  median over rounds; in the details the adds' CPU per frame, and the adds and the close
  together (``with_adds_ms``), so that work moved from the close into the adds shows.
* ``step_e2e_p99_ms``: ``log_step`` in a real agent process (2 ranks, ``step_flush`` 0.25,
  ~20 steps/s) to the ``steps`` event on an SSE client, from the record's ``time`` (the
  ``log_step`` wall time) to the event's arrival.
"""
from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import zmq
from common import (
    EPHEMERAL,
    Proc,
    Senders,
    SseReader,
    broker_gc,
    http_get,
    percentile,
    pull_rate,
    result,
    wait_for,
)

from broker.journal.journal import Journal
from broker.run.sink import RunSink
from broker.run.steps.store import StepStore
from broker.server import BrokerServer
from rank_agent import protocol

SENDERS = 4
RANKS = 1024
RUN = "bench-steps"
METRICS = ("loss", "lr", "grad_norm", "acc")


# ----------------------------------------------------------------- ingest


def frames_for(sender: int, rounds: int) -> list[bytes]:
    enc = protocol.encoder.encode
    out = []
    t = 1.7e9
    for k in range(rounds):
        steps = [3 * k, 3 * k + 1, 3 * k + 2]
        for rank in range(sender, RANKS, SENDERS):
            out.append(enc(protocol.Steps(
                run=RUN, rank=rank, steps=steps, times=[t + s for s in steps],
                step_ms=[100.0 + rank % 7] * 3, samples=[32] * 3, tokens=[4096] * 3,
                metrics={m: [1.0 / (s + 1) + rank * 1e-6 for s in steps] for m in METRICS})))
    return out


def registers() -> list[bytes]:
    enc = protocol.encoder.encode
    return [enc(protocol.Register(run=RUN, rank=r, world_size=RANKS, host=f"node-{r // 8:03d}",
                                  local_rank=r % 8)) for r in range(RANKS)]


def floor_rate(rounds: int) -> tuple[float, float]:
    """(frames/s, CPU seconds per frame) of a bare PULL loop that decodes every frame (no
    sink, no journal)."""
    cpu: dict[str, float] = {}
    rate = pull_rate(lambda ep: Senders(ep, frames_for, SENDERS, rounds), RANKS * rounds,
                     decode=True, cpu=cpu)
    return rate, cpu["per_frame"]


def broker_rate(rounds: int) -> tuple[float, int, float]:
    """(frames/s, closed steps, CPU seconds of the broker's thread per frame)."""
    cpu: dict[str, float] = {}
    with broker_gc(), tempfile.TemporaryDirectory(prefix="rankboard-bench-") as tmp:
        server = BrokerServer(EPHEMERAL, EPHEMERAL, EPHEMERAL, data_dir=Path(tmp) / "data")
        endpoints = server.bind()

        def serve() -> None:
            server.serve_forever()
            cpu["end"] = time.thread_time()

        def mark() -> None:  # the broker thread's CPU clock when the flood starts
            cpu["start"] = time.thread_time()
        server.runs.on_register = lambda frame: mark() if frame.rank == RANKS - 1 else None
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            ctx = zmq.Context()
            push = ctx.socket(zmq.PUSH)
            push.connect(endpoints["ingest"])
            for f in registers():
                push.send(f)
            push.close(linger=-1)
            ctx.term()
            wait_for(lambda: server.runs.accepted >= RANKS, 30, "registers")
            base = server.runs.accepted
            total = RANKS * rounds
            senders = Senders(endpoints["ingest"], frames_for, SENDERS, rounds)
            t0 = senders.start()
            wait_for(lambda: server.runs.accepted - base >= total, 300, "every steps frame",
                     interval=0.002)
            dt = time.perf_counter() - t0
            senders.join()
            if server.runs.rejected_total:
                raise RuntimeError(f"rejected: {dict(server.runs.rejected)}")
            sink = server.runs.get(RUN)
            closed = (len(sink.steps) + sink._steps.waiting) if sink is not None else 0
        finally:
            server.stop()
            thread.join(10)
            server.close()
    return total / dt, closed, (cpu["end"] - cpu["start"]) / total


# ----------------------------------------------------------------- a million steps


def _block(base: int, k: int, spike: Optional[int]) -> dict[str, Any]:
    """Rows ``base..base+k`` of a synthetic run in StepStore's wire form (4 metrics, all
    present, rank spread around each mean)."""
    steps = np.arange(base, base + k, dtype=np.int64)
    rows = steps.astype(np.uint32)
    out: dict[str, Any] = {
        "base": base, "rows": k, "step": steps.tobytes(),
        "time": (1.7e9 + steps * 0.1).astype(np.float64).tobytes(),
        "n": np.full(k, 64, np.int32).tobytes(), "slowest": (steps % 64).astype(np.int32).tobytes(),
        "samples": np.full(k, 2048, np.int64).tobytes(),
        "tokens": np.full(k, 2048 * 1024, np.int64).tobytes(),
    }
    ms = 100.0 + (steps % 13).astype(np.float64)
    out["step_ms"] = [rows.tobytes(), ms.tobytes(), (ms - 5).tobytes(), (ms + 5).tobytes()]
    out["metrics"] = {}
    for i, name in enumerate(METRICS):
        mean = 2.0 / np.sqrt(steps + 1.0) + i
        if name == "loss" and spike is not None and base <= spike < base + k:
            mean = mean.copy()
            mean[spike - base] = 50.0
        out["metrics"][name] = [rows.tobytes(), mean.tobytes(), (mean - 0.1).tobytes(),
                                (mean + 0.1).tobytes()]
    return out


def build_store(n: int, spike: int, chunk: int = 4096) -> StepStore:
    store = StepStore()
    for base in range(0, n, chunk):
        store.extend_wire(_block(base, min(chunk, n - base), spike))
    return store


def write_run(data_dir: Path, n: int, spike: int) -> None:
    """A finished-looking journal of a 1M-step run, written by the real Journal code path
    (frames recorded as the broker records them, closed steps noted as STEPS blocks)."""
    journal = Journal(data_dir)
    journal.load()
    sink = RunSink(RUN)
    t = time.time()
    for rank in range(64):
        frame = protocol.Register(run=RUN, rank=rank, world_size=64, host=f"node-{rank // 8}",
                                  local_rank=rank % 8)
        sink.apply(frame, t)
        journal.accept(sink, protocol.encoder.encode(frame), frame, t)
    for base in range(0, n, 65536):
        sink.restore_steps(_block(base, min(65536, n - base), spike))
        sink.seq += 1  # as a steps event would
        journal.note_seq(sink)
        journal.flush()
    journal.close()


class Server:
    """A broker process (fixed endpoints after the first start) and a web process."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.endpoints = {"ingest": EPHEMERAL, "publish": EPHEMERAL, "snapshot": EPHEMERAL}
        self.broker: Optional[Proc] = None
        self.web: Optional[Proc] = None
        self.port = 0

    def start_broker(self) -> float:
        t0 = time.monotonic()
        self.broker = Proc(["broker", "--ingest", self.endpoints["ingest"],
                            "--publish", self.endpoints["publish"],
                            "--snapshot", self.endpoints["snapshot"],
                            "--data-dir", str(self.data_dir), "--log-level", "INFO"])
        import re
        bound = re.compile(r"broker (ingest|publish|snapshot) bound at (\S+)")
        broker = self.broker

        def ready() -> bool:
            if broker.proc.poll() is not None:
                raise RuntimeError("broker exited:\n" + broker.tail())
            found = {m.group(1): m.group(2) for m in broker.find(bound)}
            if len(found) == 3:
                self.endpoints = found
                return True
            return False
        wait_for(ready, 60, "the broker to bind")
        return t0

    def start_web(self) -> float:
        t0 = time.monotonic()
        self.web = Proc(["web", "--publish", self.endpoints["publish"],
                         "--snapshot", self.endpoints["snapshot"], "--port", "0",
                         "--log-level", "WARNING"])
        import re
        dash = re.compile(r"dashboard: http://localhost:(\d+)")
        web = self.web

        def ready() -> bool:
            if web.proc.poll() is not None:
                raise RuntimeError("web exited:\n" + web.tail())
            found = web.find(dash)
            if found:
                self.port = int(found[0].group(1))
                return True
            return False
        wait_for(ready, 60, "the web to bind")
        return t0

    def serving(self, last: int) -> bool:
        status, _ = http_get(self.port, "/healthz")
        if status != 200:
            return False
        status, body = http_get(self.port, f"/api/runs/{RUN}/steps?metric=loss&points=1000")
        if status != 200:
            return False
        buckets = json.loads(body)["buckets"]
        return bool(buckets) and buckets[-1][1] == last

    def close(self) -> None:
        for p in (self.web, self.broker):
            if p is not None:
                p.stop()


def million(n: int, queries: int) -> list[dict[str, Any]]:
    spike = n // 3 + 7
    out = []
    store = build_store(n, spike)
    served = len(METRICS) + 3
    stored = len(METRICS) + 1
    total = store.nbytes()
    out.append(result("steps_bytes_per_step_series", round(total / n / served, 2), "B",
                      steps=n, metrics=len(METRICS), bytes_per_step=round(total / n, 1),
                      per_stored_series=round(total / n / stored, 2),
                      total_mib=round(total / 2**20, 1)))
    del store
    with tempfile.TemporaryDirectory(prefix="rankboard-bench-") as tmp:
        data = Path(tmp) / "data"
        write_run(data, n, spike)
        journal_mib = sum(f.stat().st_size for f in (data / "runs").iterdir()) / 2**20
        srv = Server(data)
        try:
            t_broker = srv.start_broker()
            t_web = srv.start_web()
            wait_for(lambda: srv.serving(n - 1), 120, "the web to serve the run", interval=0.02)
            web_start = time.monotonic() - t_web
            first_start = time.monotonic() - t_broker
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
            rng = random.Random(1)
            times = []
            spike_seen = False
            for i in range(queries):
                if i == 0:
                    a, b = 0, n - 1
                else:
                    a = rng.randrange(0, n)
                    b = rng.randrange(a, n)
                t0 = time.perf_counter()
                conn.request("GET", f"/api/runs/{RUN}/steps?metric=loss&start={a}&end={b}"
                                    "&points=1000")
                body = conn.getresponse().read()
                times.append((time.perf_counter() - t0) * 1000)
                if i == 0:
                    spike_seen = any(bk[4] == 50.0 for bk in json.loads(body)["buckets"])
            conn.close()
            out.append(result("steps_query_1m_p99_ms", round(percentile(times, 99), 2), "ms",
                              p50_ms=round(percentile(times, 50), 2),
                              max_ms=round(max(times), 2), queries=queries, points=1000,
                              steps=n, spike_at_full_range=spike_seen))
            # SIGKILL the broker; restart it on the same dir and endpoints.
            assert srv.broker is not None
            os.kill(srv.broker.pid, signal.SIGKILL)
            srv.broker.proc.wait(10)
            wait_for(lambda: http_get(srv.port, "/healthz")[0] == 503, 30,
                     "the web to notice the broker is gone", interval=0.05)
            t0 = srv.start_broker()
            wait_for(lambda: srv.serving(n - 1), 120, "the web to serve it again",
                     interval=0.02)
            restart = time.monotonic() - t0
            rss = srv.web.rss_kib() if srv.web is not None else 0
            out.append(result("steps_restart_1m_s", round(restart, 2), "s", steps=n,
                              web_start_1m_s=round(web_start, 2),
                              first_start_s=round(first_start, 2),
                              journal_mib=round(journal_mib, 1), web_rss_mib=round(rss / 1024, 1)))
        finally:
            srv.close()
    return out


# ----------------------------------------------------------------- end to end

_AGENT = r"""
import sys, time
from rank_agent import RankAgent
broker, run, rank, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with RankAgent(broker=broker, run=run, rank=rank, world_size=2, step_flush=0.25) as agent:
    agent.register()
    for step in range(steps):
        agent.log_step(step, {"loss": 1.0 / (step + 1)}, samples=32)
        time.sleep(0.05)
"""


def e2e(steps: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="rankboard-bench-") as tmp:
        srv = Server(Path(tmp) / "data")
        try:
            srv.start_broker()
            srv.start_web()
            wait_for(lambda: http_get(srv.port, "/healthz")[0] == 200, 30, "healthz")
            run = "bench-e2e"
            env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
            agents = [subprocess.Popen([sys.executable, "-c", _AGENT, srv.endpoints["ingest"], run,
                                        str(rank), str(steps)], env=env) for rank in range(2)]
            wait_for(lambda: http_get(srv.port, f"/api/runs/{run}")[0] == 200, 30, "the run")
            reader = SseReader(srv.port, run)
            lat: list[float] = []
            try:
                for kind, _, data, _t in reader.events():
                    if kind != "steps":
                        continue
                    arrived = time.time()
                    for rec in json.loads(data)["steps"]:
                        lat.append((arrived - rec["time"]) * 1000)
                        if rec["step"] >= steps - 1:
                            raise StopIteration
            except StopIteration:
                pass
            finally:
                reader.close()
            for a in agents:
                a.wait(30)
        finally:
            srv.close()
    return [result("step_e2e_p99_ms", round(percentile(lat, 99), 1), "ms",
                   p50_ms=round(percentile(lat, 50), 1), max_ms=round(max(lat), 1),
                   steps=len(lat), ranks=2, step_flush_s=0.25)]


# ----------------------------------------------------------------- closing (issue 17)


def close_1024(rounds: int) -> dict[str, Any]:
    """One step closed for 1,024 ranks x 4 metrics: each round every rank's frame of one
    point is added to a run's :class:`RunSteps` closer (its last add moves the watermark),
    then the close and its publication, as the sink does them (``close``: the batch;
    ``take``: into the store and the ``steps`` event's wire block). CPU seconds
    (``thread_time``) of that per step, median over the rounds (``close_only_ms``: the
    batch alone), and of the adds per frame; ``with_adds_ms``: the 1,024 adds and the
    close together, so that work moved from the close into the adds shows (issue 17)."""
    from broker.run.steps.closer import RunSteps

    enc, dec = protocol.encoder.encode, protocol.decode
    frames = [[dec(enc(protocol.Steps(
        run=RUN, rank=r, steps=[s], times=[1.7e9 + s], step_ms=[100.0 + r % 7],
        samples=[32], tokens=[4096], metrics={m: [1.0 / (s + 1) + r * 1e-6] for m in METRICS})))
        for r in range(RANKS)] for s in range(rounds)]
    steps = RunSteps(close_after=1e9, interval=0.0)
    steps.closer.grace = 0.0
    closes, only, adds, whole = [], [], [], []
    for s in range(rounds):
        t0 = time.thread_time()
        for f in frames[s]:
            steps.closer.add(f, 1.0, True)
        t1 = time.thread_time()
        steps.close(1.0, RANKS)
        t2 = time.thread_time()
        block = steps.take(1.0)
        t3 = time.thread_time()
        n = np.frombuffer(block["n"], np.int32)
        if block["rows"] != 1 or n[0] != RANKS or len(block["metrics"]) != len(METRICS):
            raise RuntimeError(f"round {s}: {block['rows']} steps closed")
        adds.append((t1 - t0) / RANKS)
        whole.append(t3 - t0)
        closes.append(t3 - t1)
        only.append(t2 - t1)
    return {"close_ms": float(np.median(closes)) * 1e3, "best_ms": min(closes) * 1e3,
            "close_only_ms": float(np.median(only)) * 1e3,
            "add_us_per_frame": float(np.median(adds)) * 1e6,
            "with_adds_ms": float(np.median(whole)) * 1e3}


def _close_frames(n: int, per: int) -> list[bytes]:
    enc = protocol.encoder.encode
    out = []
    for s0 in range(0, n, per):
        st = list(range(s0, min(n, s0 + per)))
        out.append(enc(protocol.Steps(
            run=RUN, rank=0, steps=st, times=[1.7e9 + s * 0.01 for s in st],
            step_ms=[10.0] * len(st), samples=[32] * len(st), tokens=[4096] * len(st),
            metrics={m: [1.0 / (s + 1) for s in st] for m in METRICS})))
    return out


def close_rate(n: int, per: int = 1000) -> dict[str, Any]:
    """One rank sends ``n`` steps x 4 metrics in frames of ``per`` points to a real broker
    and web (processes), as a new user would: steps closed a second, from the first frame
    sent until ``/steps`` serves the last; the broker process's CPU per closed step."""
    import psutil

    raws = _close_frames(n, per)
    reg = protocol.encoder.encode(protocol.Register(run=RUN, rank=0, world_size=1, host="h"))
    with tempfile.TemporaryDirectory(prefix="rankboard-bench-") as tmp:
        srv = Server(Path(tmp) / "data")
        try:
            srv.start_broker()
            srv.start_web()
            wait_for(lambda: http_get(srv.port, "/healthz")[0] == 200, 30, "healthz")
            assert srv.broker is not None
            proc = psutil.Process(srv.broker.pid)
            assert srv.web is not None
            web = psutil.Process(srv.web.pid)
            ctx = zmq.Context()
            push = ctx.socket(zmq.PUSH)
            push.sndhwm = 100_000
            push.connect(srv.endpoints["ingest"])
            push.send(reg)
            wait_for(lambda: http_get(srv.port, f"/api/runs/{RUN}")[0] == 200, 30, "the run")
            c0 = sum(proc.cpu_times()[:2])
            w0 = sum(web.cpu_times()[:2])
            t0 = time.perf_counter()
            for raw in raws:
                push.send(raw)
            wait_for(lambda: srv.serving(n - 1), 300, "the last step served", interval=0.01)
            dt = time.perf_counter() - t0
            cpu = sum(proc.cpu_times()[:2]) - c0
            web_cpu = sum(web.cpu_times()[:2]) - w0
            push.close(linger=0)
            ctx.term()
        finally:
            srv.close()
    return {"per_s": n / dt, "seconds": dt, "broker_cpu_us_per_step": cpu / n * 1e6,
            "web_cpu_us_per_step": web_cpu / n * 1e6}


def run(quick: bool) -> list[dict[str, Any]]:
    rounds = 5 if quick else 100
    floor, floor_cpu = floor_rate(rounds)
    rate, closed, cpu = broker_rate(rounds)
    out = [result("steps_ingest_frames_per_s", round(rate), "frames/s", baseline=round(floor),
                  ratio=round(rate / floor, 3), frames=RANKS * rounds, ranks=RANKS,
                  points_per_frame=3, metrics=len(METRICS), closed_steps=closed,
                  broker_cpu_us_per_frame=round(cpu * 1e6, 2),
                  one_core_frames_per_s=round(1 / cpu) if cpu else None)]
    # the same frames: broker / floor, by wall clock (value) and by the CPU of each one's
    # receiving thread (robust to what else the machine runs)
    out.append(result("steps_floor_ratio", round(rate / floor, 3), "ratio",
                      cpu_ratio=round(floor_cpu / cpu, 3) if cpu else None,
                      floor_cpu_us_per_frame=round(floor_cpu * 1e6, 2),
                      broker_cpu_us_per_frame=round(cpu * 1e6, 2)))
    n = 20_000 if quick else 200_000
    cr = close_rate(n)
    out.append(result("steps_close_per_s", round(cr["per_s"]), "steps/s", steps=n,
                      points_per_frame=1000, metrics=len(METRICS), seconds=round(cr["seconds"], 2),
                      broker_cpu_us_per_step=round(cr["broker_cpu_us_per_step"], 2),
                      web_cpu_us_per_step=round(cr["web_cpu_us_per_step"], 2),
                      one_core_steps_per_s=round(1e6 / cr["broker_cpu_us_per_step"])
                      if cr["broker_cpu_us_per_step"] else None))
    c1 = close_1024(10 if quick else 50)
    out.append(result("steps_close_1024_ms", round(c1["close_ms"], 3), "ms", ranks=RANKS,
                      metrics=len(METRICS), best_ms=round(c1["best_ms"], 3),
                      close_only_ms=round(c1["close_only_ms"], 3),
                      add_us_per_frame=round(c1["add_us_per_frame"], 2),
                      with_adds_ms=round(c1["with_adds_ms"], 3)))
    out += million(20_000 if quick else 1_000_000, 20 if quick else 300)
    out += e2e(20 if quick else 200)
    return out


if __name__ == "__main__":
    for line in run("--quick" in sys.argv):
        print(json.dumps(line))
