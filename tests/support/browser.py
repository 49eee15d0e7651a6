"""The real stack for the browser tests: ``rankboard up`` as a child process on ephemeral
ports (ZeroMQ ``tcp://127.0.0.1:*`` endpoints and ``--port 0`` for the web), its addresses
learnt from its own output, and a ZeroMQ PUSH socket that sends wire frames exactly as a
training rank does.
"""
from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, List

import zmq

from rank_agent import protocol as wire
from tests.support import REPO
from tests.support.polling import wait_for
from tests.support.procs import CLI_MODULE
from web.children import terminate

#: where browser tests leave screenshots
ARTIFACTS = REPO / "artifacts"
START_TIMEOUT = 30.0

_DASHBOARD = re.compile(r"dashboard: (http://\S+)")
_INGEST = re.compile(r"broker ingest bound at (\S+)")


#: a run id / label / metric name that would run script if the page ever used it as HTML
HOSTILE = "<img src=x onerror=window.__pwned=1>"

# Counts strongly coloured pixels of a canvas: the grey background, grid and axis text do
# not count; a drawn series (every palette colour is saturated) does.
COLOURED_PIXELS = """(sel) => {
  const c = document.querySelector(sel);
  if (!c || !c.width || !c.height) return 0;
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) {
    const mx = Math.max(d[i], d[i + 1], d[i + 2]), mn = Math.min(d[i], d[i + 1], d[i + 2]);
    if (mx - mn > 80) n++;
  }
  return n;
}"""


def sample(rank: int, util: float = 90.0, vram_gb: float = 60.0) -> wire.ResourceSample:
    """A plausible resource sample of one rank on an 80 GB GPU."""
    gib = 2**30
    return wire.ResourceSample(
        cpu_percent=35.0 + rank, ram_used_bytes=180 * gib, ram_total_bytes=512 * gib,
        gpu_util_percent=util, vram_allocated_bytes=int(vram_gb * gib),
        vram_total_bytes=80 * gib,
        gpus=[wire.GpuSample(device_index=rank % 4, name="NVIDIA H100 80GB HBM3",
                             util_percent=util, vram_allocated_bytes=int(vram_gb * gib),
                             vram_total_bytes=80 * gib, temperature_c=61.0, power_w=520.0)],
    )


# -- senders of a whole run's frames (what a cluster of ranks would send) ----------------

def register(stack: Stack, run: str, world: int, total: int, hosts: List[str] | None = None,
             per_host: int = 4) -> None:
    for r in range(world):
        host = hosts[r // per_host] if hosts else "node-a"
        stack.send(wire.Register(run=run, rank=r, world_size=world, host=host,
                                 local_rank=r % per_host, total_epochs=total))


def epoch(stack: Stack, run: str, e: int, ranks: range, loss: float = 1.0,
          slow: int | None = None) -> None:
    for r in ranks:
        factor = 1.3 if r == slow else 1.0
        stack.send(wire.Metrics(
            run=run, rank=r, epoch=e, avg_loss=loss, batches=int(400 / factor),
            samples=int(102400 / factor), epoch_ms=42000.0 * factor,
            scalars={"acc": (min(0.95, 0.2 + 0.06 * e), 1), "lr": (3e-4 * 0.9**e, 1)},
            resources=sample(r, util=92.0 / factor, vram_gb=58.0 + r)))


def coloured(page: Any, selector: str) -> int:
    """How many strongly coloured pixels the canvas at ``selector`` has (0: nothing drawn)."""
    return int(page.evaluate(COLOURED_PIXELS, selector))


def wait_drawn(page: Any, selector: str) -> None:
    """Wait until the canvas shows at least one drawn series."""
    wait_for(lambda: coloured(page, selector) > 30, 10.0, f"a series drawn on {selector}")


def wait_js(page: Any, expression: str, timeout: float = 10.0) -> None:
    """Poll a JS expression (evaluated as a function, so CSP does not object)."""
    wait_for(lambda: page.evaluate(f"() => Boolean({expression})"), timeout, expression)


class Stack:
    """``rankboard up`` as a child process, plus a PUSH socket into its ingest."""

    def __init__(self, data_dir: Path, command: List[str] | None = None) -> None:
        """``command``: other ``rankboard`` arguments (e.g. ``demo ...``) instead of ``up``."""
        cmd = [sys.executable, "-m", CLI_MODULE]
        cmd += command if command is not None else [
            "up", "--port", "0", "--ingest", "tcp://127.0.0.1:*",
            "--publish", "tcp://127.0.0.1:*", "--snapshot", "tcp://127.0.0.1:*",
            "--stale-after", "60"]
        cmd += ["--data-dir", str(data_dir)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: List[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s,), daemon=True)
                         for s in (self.proc.stdout, self.proc.stderr)]
        for t in self._readers:
            t.start()
        self.url = ""
        self.ingest = ""
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.setsockopt(zmq.SNDTIMEO, 5000)

    def _read(self, stream: Any) -> None:
        for raw in stream:
            self.lines.put(raw.decode("utf-8", "replace").rstrip("\n"))

    def start(self) -> None:
        """Wait for the web URL and the ingest endpoint, then for /healthz to say ok."""
        deadline = time.monotonic() + START_TIMEOUT
        while not (self.url and self.ingest):
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise AssertionError("rankboard up did not start:\n" + "\n".join(self.log[-30:]))
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            self.log.append(line)
            m = _DASHBOARD.search(line)
            if m:
                self.url = m.group(1).rstrip("/")
            m = _INGEST.search(line)
            if m:
                self.ingest = m.group(1)
        self.push.connect(self.ingest)
        wait_for(lambda: self._healthy(), START_TIMEOUT, "/healthz")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def send(self, *frames: Any) -> None:
        """Send wire frames (``rank_agent.protocol`` Structs) as a rank would."""
        for frame in frames:
            self.push.send(wire.encoder.encode(frame))

    def get_json(self, path: str) -> Any:
        """GET a JSON route; an error answer raises HTTPError (a 404 of a run the web does
        not know yet is "not yet" to :func:`wait_for`), its connection closed first."""
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            exc.close()  # else the socket is left to the garbage collector: a ResourceWarning
            raise

    def wait_run(self, run: str, epochs: int = 0, timeout: float = 15.0) -> dict:
        """Poll /api/runs until ``run`` is listed with at least ``epochs`` records."""
        def ready() -> Any:
            for r in self.get_json("/api/runs"):
                if r["run"] == run and (r["epochs_done"] or 0) >= epochs:
                    return r
            return None
        return wait_for(ready, timeout, f"run {run} with {epochs} epochs")

    def close(self) -> None:
        self.push.close(linger=0)
        self.ctx.term()
        terminate(self.proc, 10)
        for t in self._readers:
            t.join(timeout=5)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()
