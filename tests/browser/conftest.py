"""Fixtures for the browser tests: the real stack and a real headless Chromium.

``stack`` runs ``python -m rankboard up`` as a subprocess on ephemeral ports (ZeroMQ
``tcp://127.0.0.1:*`` endpoints and ``--port 0`` for the web), learns the addresses it bound
from its own output, and hands out a ZeroMQ PUSH socket that sends wire frames exactly as a
training rank does. ``page`` is a fresh Chromium page that records page errors and console
errors, so every test can assert the dashboard stayed clean.
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
from typing import Any, Callable, Iterator, List

import pytest
import zmq

from rank_agent import protocol as wire
from tests import polling

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update"]
START_TIMEOUT = 30.0

_DASHBOARD = re.compile(r"dashboard: (http://\S+)")
_INGEST = re.compile(r"broker ingest bound at (\S+)")


def wait_until(pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """:func:`tests.polling.wait_for` (the name the browser tests use)."""
    return polling.wait_for(pred, timeout, what)


class Stack:
    """``rankboard up`` as a child process, plus a PUSH socket into its ingest."""

    def __init__(self, data_dir: Path, command: List[str] | None = None) -> None:
        """``command``: other ``rankboard`` arguments (e.g. ``demo ...``) instead of ``up``."""
        cmd = [sys.executable, "-m", "rankboard"]
        cmd += command if command is not None else [
            "up", "--port", "0", "--ingest", "tcp://127.0.0.1:*",
            "--publish", "tcp://127.0.0.1:*", "--snapshot", "tcp://127.0.0.1:*",
            "--stale-after", "60"]
        cmd += ["--data-dir", str(data_dir)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
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
        wait_until(lambda: self._healthy(), START_TIMEOUT, "/healthz")

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
        with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as resp:
            return json.loads(resp.read())

    def wait_run(self, run: str, epochs: int = 0, timeout: float = 15.0) -> dict:
        """Poll /api/runs until ``run`` is listed with at least ``epochs`` records."""
        def ready() -> Any:
            for r in self.get_json("/api/runs"):
                if r["run"] == run and (r["epochs_done"] or 0) >= epochs:
                    return r
            return None
        return wait_until(ready, timeout, f"run {run} with {epochs} epochs")

    def close(self) -> None:
        self.push.close(linger=0)
        self.ctx.term()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for t in self._readers:
            t.join(timeout=5)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("rankboard-data"))
    try:
        s.start()
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = None
    try:
        from playwright import sync_api
    except ImportError:
        missing = "the playwright package (pip install playwright)"
    if not Path(CHROMIUM).exists():
        missing = f"Debian's chromium at {CHROMIUM} (apt-get install chromium)"
    if missing:
        if os.environ.get("CI"):  # CI installs both: a skip there would hide lost coverage
            pytest.fail(f"browser tests need {missing}")
        pytest.skip(f"browser tests need {missing}")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class PageErrors(list):
    """Page errors and console errors seen by one page."""

    def check(self) -> None:
        assert list(self) == [], f"the page logged errors: {list(self)!r}"


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh 1440x900 page; ``page.errors`` collects page and console errors."""
    context = browser.new_context(viewport={"width": 1440, "height": 900}, device_scale_factor=1,
                                  accept_downloads=True)
    pg = context.new_page()
    errors = PageErrors()
    pg.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    pg.on("console", lambda msg: errors.append(f"console.{msg.type}: {msg.text}")
          if msg.type == "error" else None)
    pg.errors = errors
    try:
        yield pg
    finally:
        context.close()
