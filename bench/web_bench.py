"""e2e_latency_*, fanout_* and late_join_*: the whole pipe, with real processes.

Every figure here runs a real broker process and a real web process (``python -m rankboard
broker|web``, ephemeral loopback ports, tmp data dir) and sends real wire frames from this
process over one PUSH socket, playing the ranks.

* **e2e**: 64 ranks on 8 hosts. Per epoch, 63 ranks' metrics go out, then (after a 5 ms
  pause so they are in) the clock starts and the last rank's metrics go out; it stops when
  an SSE client (raw socket, in a thread here) has read and JSON-parsed the ``epoch`` event
  of that epoch. p50 and p99 over the epochs.
* **fanout**: the same 64-rank run, 1,000 SSE clients (``bench/sse_clients.py``: two
  gevent processes of raw-socket clients) on one web process. Per epoch, the latency of
  every client from the last rank's send to its receipt of the ``epoch`` event; p99 over
  clients and epochs. Memory: the web's RSS once warm (one client has come and gone) and
  again with every client connected and streaming; growth / clients, KiB.
* **late_join**: a run of 1,024 ranks (128 hosts, a GPU sample each) with 100 closed epochs
  is built through the broker and the web; then a new client GETs ``/api/runs/<run>``
  (the page's snapshot) and opens the SSE stream, and the clock stops when it has parsed
  all 100 records from the replay (JSON parsed with the stdlib, as a client would).
"""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import (
    REPO,
    SseReader,
    Stack,
    http_get,
    percentile,
    push_socket,
    raise_nofile,
    result,
    wait_for,
)

from rank_agent import protocol
from rank_agent.protocol import GpuSample, Metrics, Register, Resources, ResourceSample

SCALARS = {"acc": (90.0, 100), "grad_norm": (1.5, 1), "lr": (1e-3, 1), "tokens_per_s": (12345.0, 1)}


class Ranks:
    """Frames of one simulated run, sent over one PUSH socket."""

    def __init__(self, ingest: str, run: str, world: int, per_host: int = 8) -> None:
        self.run, self.world, self.per_host = run, world, per_host
        self.ctx, self.sock = push_socket(ingest)
        self.enc = protocol.encoder.encode

    def start(self, total_epochs: int) -> None:
        for r in range(self.world):
            self.sock.send(self.enc(Register(run=self.run, rank=r, world_size=self.world,
                                             host=f"node-{r // self.per_host:03d}",
                                             local_rank=r % self.per_host, total_epochs=total_epochs)))
        for r in range(self.world):
            gpu = GpuSample(device_index=r % self.per_host, name="NVIDIA H100 80GB HBM3",
                            util_percent=97.0, vram_allocated_bytes=60 << 30,
                            vram_total_bytes=80 << 30, temperature_c=61.0, power_w=650.5)
            self.sock.send(self.enc(Resources(run=self.run, rank=r, sample=ResourceSample(
                cpu_percent=42.5, ram_used_bytes=500 << 30, ram_total_bytes=1 << 40,
                gpu_util_percent=97.0, vram_allocated_bytes=60 << 30, vram_total_bytes=80 << 30,
                gpus=[gpu]))))

    def metrics(self, epoch: int, ranks: range) -> list[bytes]:
        return [self.enc(Metrics(run=self.run, rank=r, epoch=epoch, avg_loss=1.0 / (epoch + 1),
                                 batches=100, samples=6400, epoch_ms=1000.0 + r,
                                 scalars=SCALARS)) for r in ranks]

    def send(self, frames: list[bytes]) -> None:
        for f in frames:
            self.sock.send(f)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _records(port: int, run: str) -> int:
    status, body = http_get(port, f"/api/runs/{run}/history")
    return len(json.loads(body)) if status == 200 else 0


# ------------------------------------------------------------------------------ e2e
def e2e(stack: Stack, epochs: int) -> list[dict[str, Any]]:
    run, world = "bench-e2e", 64
    ranks = Ranks(stack.ingest, run, world)
    try:
        ranks.start(total_epochs=100_000)
        ranks.send(ranks.metrics(0, range(world)))
        wait_for(lambda: _records(stack.port, run) >= 1, 30, "the first record")
        got: queue.Queue[tuple[int, float]] = queue.Queue()
        reader = SseReader(stack.port, run)

        def read() -> None:
            try:
                for kind, _, data, _t in reader.events():
                    if kind == "epoch":
                        rec = json.loads(data)
                        got.put((rec["epoch"], time.monotonic()))
            except OSError:
                pass

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        while got.get(timeout=30)[0] < 0:
            pass
        lat: list[float] = []
        for e in range(1, epochs + 1):
            frames = ranks.metrics(e, range(world))
            last = frames.pop()
            ranks.send(frames)
            time.sleep(0.005)
            t0 = time.monotonic()
            ranks.sock.send(last)
            while True:
                epoch, t = got.get(timeout=30)
                if epoch == e:
                    break
            lat.append((t - t0) * 1000.0)
            time.sleep(0.005)
        reader.close()
        thread.join(5)
    finally:
        ranks.close()
    return [
        result("e2e_latency_p50_ms", round(percentile(lat, 50), 3), "ms", epochs=len(lat), ranks=world),
        result("e2e_latency_p99_ms", round(percentile(lat, 99), 3), "ms", epochs=len(lat), ranks=world,
               max_ms=round(max(lat), 3)),
    ]


# --------------------------------------------------------------------------- fanout
def fanout(stack: Stack, clients: int, epochs: int) -> list[dict[str, Any]]:
    assert stack.web is not None
    run, world = "bench-fanout", 64
    ranks = Ranks(stack.ingest, run, world)
    procs: list[subprocess.Popen[str]] = []
    try:
        ranks.start(total_epochs=100_000)
        ranks.send(ranks.metrics(0, range(world)))
        wait_for(lambda: _records(stack.port, run) >= 1, 30, "the first record")
        # warm the web: one stream comes and goes, so per-client growth is not first-use cost
        warm = SseReader(stack.port, run)
        next(warm.events())
        warm.close()
        time.sleep(0.5)
        rss0 = stack.web.rss_kib()
        nproc = 2 if clients > 1 else 1
        shares = [clients // nproc + (1 if i < clients % nproc else 0) for i in range(nproc)]
        for share in shares:
            procs.append(subprocess.Popen(
                [sys.executable, str(REPO / "bench" / "sse_clients.py"), str(stack.port), run, str(share), "1"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=raise_nofile))
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"SSE client process failed: {line!r}")
        time.sleep(0.5)
        rss1 = stack.web.rss_kib()
        web_cpu0 = stack.web.cpu_seconds()
        t0s: dict[int, float] = {}
        for e in range(1, epochs + 1):
            frames = ranks.metrics(e, range(world))
            last = frames.pop()
            ranks.send(frames)
            time.sleep(0.01)
            t0 = time.monotonic()
            ranks.sock.send(last)
            seq = None
            for p in procs:
                assert p.stdout is not None
                line = p.stdout.readline().split()
                if not line or line[0] != "got":
                    raise RuntimeError(f"SSE client process: {line!r}")
                seq = int(line[1])
            assert seq is not None
            t0s[seq] = t0
            time.sleep(0.05)
        web_cpu = stack.web.cpu_seconds() - web_cpu0
        lat: list[float] = []
        client_cpu = 0.0
        errors = 0
        for p in procs:
            out, _ = p.communicate(timeout=60)
            data = json.loads(out.strip().splitlines()[-1])
            client_cpu += data["cpu"]
            errors += data["errors"]
            for seq, times in data["times"].items():
                t0 = t0s.get(int(seq))
                if t0 is not None:
                    lat.extend((t - t0) * 1000.0 for t in times)
        procs = []
    finally:
        for p in procs:
            p.kill()
            p.wait()
        ranks.close()
    return [
        result("fanout_1000_p99_ms", round(percentile(lat, 99), 2), "ms", clients=clients, epochs=epochs,
               p50_ms=round(percentile(lat, 50), 2), max_ms=round(max(lat), 2), errors=errors,
               web_cpu_ms_per_event=round(web_cpu / epochs * 1000, 1),
               clients_cpu_ms_per_event=round(client_cpu / epochs * 1000, 1)),
        result("fanout_kib_per_client", round((rss1 - rss0) / clients, 2), "KiB", clients=clients,
               rss_before_kib=rss0, rss_after_kib=rss1),
    ]


# ------------------------------------------------------------------------ late join
def late_join(stack: Stack, world: int, epochs: int) -> list[dict[str, Any]]:
    run = "bench-late"
    ranks = Ranks(stack.ingest, run, world)
    try:
        ranks.start(total_epochs=epochs)
        for e in range(epochs):
            ranks.send(ranks.metrics(e, range(world)))
        wait_for(lambda: _records(stack.port, run) >= epochs, 300, "every record at the web",
                 interval=0.2)
    finally:
        ranks.close()
    times = []
    for _ in range(3):
        t0 = time.monotonic()
        status, body = http_get(stack.port, f"/api/runs/{run}")
        assert status == 200
        snap = json.loads(body)
        reader = SseReader(stack.port, run)
        got = 0
        for kind, _, data, _t in reader.events():
            if kind == "epoch":
                json.loads(data)
                got += 1
                if got == epochs:
                    break
        dt = time.monotonic() - t0
        reader.close()
        assert len(snap["records"]) == epochs
        times.append(dt)
    return [result(f"late_join_{1024}x{100}_s", round(min(times), 3), "s", ranks=world, epochs=epochs,
                   tries=[round(t, 3) for t in times], snapshot_bytes=len(body))]


def run(quick: bool) -> list[dict[str, Any]]:
    raise_nofile()
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rankboard-bench-") as tmp:
        stack = Stack(Path(tmp) / "data")
        try:
            out += e2e(stack, 40 if quick else 300)
            out += fanout(stack, 200 if quick else 1000, 3 if quick else 10)
            out += late_join(stack, 1024, 100)
        finally:
            stack.close()
    return out


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    for line in run(quick):
        print(json.dumps(line))
