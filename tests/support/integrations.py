"""Helpers of the integration tests: a REAL broker with a tap on what it accepts, and the
way an examples/ script is run (its environment, torchrun's command line)."""
from __future__ import annotations

import csv
import http.client
import io
import json
import os
import re
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path
from typing import Any, Dict, List, Optional

import zmq

from broker import feed
from broker.server import BrokerServer
from tests.support import polling
from web.children import terminate

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

EPHEMERAL = "tcp://127.0.0.1:*"


class TappedBroker:
    """A BrokerServer in a thread; every accepted frame is also kept, decoded."""

    def __init__(self) -> None:
        self.server = BrokerServer(EPHEMERAL, EPHEMERAL, EPHEMERAL, heartbeat_interval=0.2,
                                   poll_interval=0.02)
        self._frames: List[Any] = []
        self._lock = threading.Lock()
        forward = self.server.runs.on_accept

        def tap(run: str, raw: bytes, frame: Any, now: float) -> None:
            with self._lock:
                self._frames.append(frame)
            if forward is not None:
                forward(run, raw, frame, now)

        self.server.runs.on_accept = tap
        self.endpoints = self.server.bind()
        self.thread = threading.Thread(target=self.server.serve_forever, name="broker",
                                       daemon=True)
        self.thread.start()
        self.ctx = zmq.Context()

    @property
    def ingest(self) -> str:
        return self.endpoints["ingest"]

    def frames(self, run: Optional[str] = None, kind: Optional[str] = None) -> List[Any]:
        """Accepted frames (of ``run``; of wire type ``kind`` such as ``"steps"``)."""
        with self._lock:
            out = list(self._frames)
        if run is not None:
            out = [f for f in out if f.run == run]
        if kind is not None:
            out = [f for f in out if type(f).__name__.lower() == kind]
        return out

    def runs(self) -> List[str]:
        """Run ids the broker accepted frames for, in first-frame order."""
        seen: Dict[str, None] = {}
        for frame in self.frames():
            seen.setdefault(frame.run, None)
        return list(seen)

    def snapshot(self, run: str, timeout: float = 10.0) -> Dict[str, Any]:
        """The run's snapshot (``header``, ``ranks``, ``records``, ``complete``...)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        try:
            sock.connect(self.endpoints["snapshot"])
            sock.send_multipart(feed.encode_snapshot_request(run))
            found: Dict[str, Any] = {}
            while True:
                if not sock.poll(int(timeout * 1000)):
                    raise AssertionError("no snapshot reply from the broker")
                kind, body = feed.decode_snapshot_reply(sock.recv_multipart())
                if kind == "END":
                    break
                if body.get("run") == run:
                    found = body
            if not found:
                raise AssertionError(f"the broker holds no run {run!r}; it has {self.runs()}")
            return found
        finally:
            sock.close(linger=0)

    def wait_ended(self, run: str, timeout: float = 30.0) -> Dict[str, Any]:
        """The run's snapshot once its status is ``complete`` or ``failed``."""
        def ended() -> Optional[Dict[str, Any]]:
            snap = self.snapshot(run)
            return snap if snap["header"]["status"] in ("complete", "failed") else None
        return polling.wait_for(ended, timeout, f"run {run!r} to end")

    def step_points(self, run: str) -> Dict[int, Dict[int, Dict[str, Any]]]:
        """rank -> step -> point, from the ``steps`` frames as the broker decoded them
        (per (rank, step) last write, as the broker applies them)."""
        out: Dict[int, Dict[int, Dict[str, Any]]] = {}
        for frame in self.frames(run, "steps"):
            mine = out.setdefault(frame.rank, {})
            for i, step in enumerate(frame.steps):
                mine[step] = {
                    "time": frame.times[i],
                    "step_ms": frame.step_ms[i],
                    "samples": frame.samples[i] if frame.samples else 0,
                    "tokens": frame.tokens[i] if frame.tokens else 0,
                    "metrics": {name: values[i] for name, values in frame.metrics.items()
                                if values[i] is not None},
                }
        return out

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(10)
        self.server.close()
        self.ctx.term()


class Web:
    """A real ``rankboard web`` process fed by a broker; ``get(path)`` reads its HTTP API.

    Its output is drained by a thread (a full pipe would stall it) and shown on failure."""

    _DASHBOARD = re.compile(r"dashboard: http://[^:]+:(\d+)")

    def __init__(self, broker: TappedBroker) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("RANKBOARD_TOKEN", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rankboard", "web", "--publish", broker.endpoints["publish"],
             "--snapshot", broker.endpoints["snapshot"], "--port", "0", "--log-level", "WARNING"],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.lines: List[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.port = 0
        try:
            polling.wait_for(self._ready, 30, "the web to serve /healthz", interval=0.05,
                             retry_on=(OSError, http.client.HTTPException))
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError("web exited:\n" + "\n".join(self.lines[-30:]))
        if not self.port:
            found = [m for m in map(self._DASHBOARD.search, list(self.lines)) if m]
            if not found:
                return False
            self.port = int(found[0].group(1))
        return self._request("/healthz")[0] == 200

    def _request(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def get(self, path: str) -> Any:
        """GET ``path`` and decode its JSON (asserting 200)."""
        status, body = self._request(path)
        assert status == 200, f"GET {path}: {status} {body[:300]!r}"
        return json.loads(body)

    def run(self, run: str) -> Dict[str, Any]:
        """``/api/runs/<run>``: the header plus ``ranks`` and ``records``."""
        return self.get(f"/api/runs/{urllib.parse.quote(run, safe='')}")

    def steps(self, run: str, metric: str, points: int = 10000) -> List[List[Any]]:
        """``/api/runs/<run>/steps?metric=...``: the buckets (one per step up to ``points``)."""
        query = urllib.parse.urlencode({"metric": metric, "points": points})
        return self.get(f"/api/runs/{urllib.parse.quote(run, safe='')}/steps?{query}")["buckets"]

    def steps_csv(self, run: str) -> List[Dict[str, str]]:
        """``/api/runs/<run>/steps.csv``: every closed step at full resolution, as dicts
        (``step``, ``n``, ``<metric>_mean``..., ``step_ms_mean``, ``samples``, ``tokens``...)."""
        status, body = self._request(f"/api/runs/{urllib.parse.quote(run, safe='')}/steps.csv")
        assert status == 200, f"steps.csv: {status}"
        return list(csv.DictReader(io.StringIO(body.decode("utf-8"))))

    def runs(self) -> List[str]:
        """``/api/runs``: the run ids, oldest first."""
        return [r["run"] for r in reversed(self.get("/api/runs"))]

    def wait_ended(self, run: str, timeout: float = 30.0) -> Dict[str, Any]:
        """``/api/runs/<run>`` once the run is ``complete`` or ``failed`` (the web is at most
        a second behind the broker)."""
        def ended() -> Optional[Dict[str, Any]]:
            status, _ = self._request(f"/api/runs/{urllib.parse.quote(run, safe='')}")
            if status != 200:
                return None
            state = self.run(run)
            return state if state["status"] in ("complete", "failed") else None
        return polling.wait_for(ended, timeout, f"the web to show run {run!r} ended")

    def stop(self) -> None:
        terminate(self.proc, 10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._reader.join(5)


def example_env(broker: Any, **extra: str) -> Dict[str, str]:
    """The environment an example runs in: the broker's ingest endpoint, no run id (the
    integrations must agree on one themselves), offline Hugging Face, a quiet torch."""
    env = dict(os.environ)
    for name in ("RANKBOARD_RUN", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "RANK", "WORLD_SIZE",
                 "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update({
        "RANKBOARD_BROKER": broker.ingest,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    })
    env.update(extra)
    return env


def run_script(cmd: List[str], env: Dict[str, str], cwd: Path,
               timeout: float = 240.0, expect_ok: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a training command to its end; its output is shown when the test fails."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-8000:]}")
    if not expect_ok and proc.returncode == 0:
        raise AssertionError(f"{cmd} was expected to fail\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def torchrun(nproc: int, run_id: Optional[str] = None) -> List[str]:
    """torchrun on one node with a rendezvous on a free port (so concurrent jobs on this
    machine cannot collide). Without ``run_id`` TORCHELASTIC_RUN_ID is torchrun's
    placeholder ``none``, as in a plain ``torchrun --nproc-per-node N`` job; with it, as
    ``--standalone`` (which sets a random one) or ``--rdzv-id`` does."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "127.0.0.1:0", *(["--rdzv-id", run_id] if run_id else [])]
