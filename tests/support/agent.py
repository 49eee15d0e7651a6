"""Helpers of the agent tests: a stand-in broker ingest (a real PULL socket on loopback) and
the diagnosis test child (``tests/agent/diag_child.py``) as a subprocess. Only rank_agent,
zmq, msgspec and the stdlib: these run in the tox ``agent`` env (no gevent, Flask, torch)."""
from __future__ import annotations

import subprocess
import sys
import time
from typing import Any, Callable, List, Optional

import zmq

from rank_agent.controlwire import ControlRequest, encode_request
from rank_agent.protocol import Register, decode
from tests.support import REPO


class Receiver:
    """A stand-in broker ingest: a PULL socket bound to a random loopback port."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.frames: List[Any] = []
        #: every frame, the agents' implicit registers included (``frames`` leaves those out)
        self.all_frames: List[Any] = []
        self._heard: set[tuple[str, int]] = set()

    def _pump(self, deadline: float) -> bool:
        left_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if not self.sock.poll(left_ms):
            return False
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            self._keep(decode(data))

    def _keep(self, frame: Any) -> None:
        """An agent's first frame is a ``register`` (its own, or the implicit one it sends
        ahead of any other first frame, PROTOCOL.md section 5): it is kept in ``all_frames``
        and ``registers``, and left out of ``frames``, so that each test sees the frames its
        own calls produced. ``test_implicit_register`` checks the implicit one itself."""
        self.all_frames.append(frame)
        who = (frame.run, frame.rank)
        first = who not in self._heard
        self._heard.add(who)
        if first and isinstance(frame, Register) and frame.port == 0 and frame.total_epochs == 0:
            return
        self.frames.append(frame)

    def wait_for(self, pred: Callable[[List[Any]], bool], timeout: float = 10.0) -> List[Any]:
        """Receive until ``pred(all frames so far)`` holds; fail the test at the deadline."""
        deadline = time.monotonic() + timeout
        while not pred(self.frames):
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out; got {len(self.frames)} frames: {self.frames[-5:]!r}")
            self._pump(deadline)
        return self.frames

    def wait_count(self, n: int, timeout: float = 10.0) -> List[Any]:
        return self.wait_for(lambda fs: len(fs) >= n, timeout)

    def of_type(self, cls: type) -> List[Any]:
        return [f for f in self.frames if isinstance(f, cls)]

    def close(self) -> None:
        """Idempotent, so a test can kill "the broker" early and the fixture still cleans up."""
        self.sock.close(linger=0)
        self.ctx.term()


def control_connected(control: Any, timeout: float) -> bool:
    """True once ``control`` (a :class:`rank_agent.control.Control`) has made its socket and
    subscribed (the broker may still take a moment to learn it, as with any ZeroMQ SUB).
    Only tests wait for this: the agent itself never does (issue 44: a dead name there)."""
    return bool(control._subscribed.wait(timeout))


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.agent.diag_child", *args], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def reap(proc: subprocess.Popen[str]) -> None:
    """Kill a child still running and close its pipes (an open pipe is an error here)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:  # stdin of a killed child: broken pipe on flush
                pass


def expect_line(proc: subprocess.Popen[str], word: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the child prints promptly; pytest-timeout bounds a hang
    assert line.startswith(word), f"expected {word!r}, child said {line!r}"
    return line


class Publisher:
    """The broker's publish socket, as an XPUB so the test sees each subscription arrive
    (a SUB joining late would miss a request: the test waits for the subscriptions)."""

    def __init__(self, curve_secret: Optional[bytes] = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        if curve_secret is not None:
            self.sock.setsockopt(zmq.CURVE_SERVER, 1)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, curve_secret)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.subscriptions: List[bytes] = []

    def wait_subscriptions(self, topics: List[bytes], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        want = sorted(topics)
        while sorted(self.subscriptions) != want:
            left = deadline - time.monotonic()
            assert left > 0, f"subscriptions {self.subscriptions!r}, wanted {want!r}"
            if self.sock.poll(int(left * 1000)):
                msg = self.sock.recv()
                if msg[:1] == b"\x01":
                    self.subscriptions.append(msg[1:])

    def request(self, run: str, request_id: str, kind: str = "stacks",
                ranks: Optional[List[int]] = None, **kw: Any) -> float:
        self.sock.send_multipart(encode_request(
            ControlRequest(run=run, request_id=request_id, kind=kind, ranks=ranks, **kw)))
        return time.monotonic()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
