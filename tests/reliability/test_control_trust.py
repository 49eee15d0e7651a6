"""Issue 38 finding 6, with real processes: a local process that binds the broker's publish
port while the broker is down is not obeyed by a rank that has the broker's control secret.

A real ``rankboard broker`` (its data dir's ``control.secret`` created at start), a real rank
(``tests/support/trustrank.py``: a :class:`~rank_agent.RankAgent` in a process of its own,
given the secret by ``RANKBOARD_CONTROL_SECRET_FILE``): a request through the broker is
answered. Then the broker is SIGKILLed and a rogue binds its publish port (a real XPUB) and
its ingest port (a PULL, to see any answer): a well-formed request without a MAC, one signed
with another key and a replay of a request the broker signed (captured from the feed, as any
local process can) are refused and counted, and nothing answers them; a request signed with
the real secret still is (the channel is alive, so the refusals are the secret's doing).
Without a secret the old behaviour stays: the same rogue is obeyed, and a signed request
(a broker with a secret) is answered by a rank without one (the wire stayed compatible).
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import zmq

from broker import feed
from rank_agent.controlauth import SECRET_FILE_ENV, sign_request
from rank_agent.controlwire import (
    CONTROL_PREFIX,
    ControlRequest,
    decode_request,
    encode_request,
)
from rank_agent.protocol import Stacks, decode
from tests.support import REPO
from tests.support.polling import wait_for
from tests.support.procs import Proc, start_broker

RUN = "trust-run"


class Rank:
    """The rank process; :meth:`state` asks it for its control channel's counters."""

    def __init__(self, ingest: str, control: str, env: dict[str, str]) -> None:
        full = {k: v for k, v in os.environ.items() if not k.startswith("RANKBOARD_CONTROL")}
        full.update(env, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.trustrank", ingest, control, RUN], cwd=REPO,
            env=full, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(self._line()) == {"ready": True}

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the child answers at once; pytest-timeout bounds it
        assert line, f"the rank exited ({self.proc.poll()})"
        return line

    def state(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return dict(json.loads(self._line()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def ranks() -> Iterator[Callable[..., Rank]]:
    started: list[Rank] = []

    def start(ingest: str, control: str, env: dict[str, str]) -> Rank:
        rank = Rank(ingest, control, env)
        started.append(rank)
        return rank

    yield start
    for rank in started:
        rank.close()


class Rogue:
    """A local process squatting the publish port (an XPUB, so it sees the rank subscribe)
    and the ingest port (a PULL, to see whether anything answers)."""

    def __init__(self, ctx: zmq.Context, publish: str, ingest: str) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.linger = 0
        self.pull = ctx.socket(zmq.PULL)
        self.pull.linger = 0
        self.answers: dict[str, int] = {}
        try:
            for sock, endpoint in ((self.pub, publish), (self.pull, ingest)):
                # the port was just freed by the broker's death: bind once the OS lets go
                wait_for(lambda s=sock, e=endpoint: _try_bind(s, e), timeout=20.0,
                         what=f"binding {endpoint}")
        except BaseException:
            self.close()
            raise

    def wait_subscribed(self, timeout: float = 30.0) -> None:
        def heard() -> bool:
            if self.pub.poll(200):
                return self.pub.recv().startswith(b"\x01" + CONTROL_PREFIX)
            return False

        wait_for(heard, timeout=timeout, what="the rank subscribing to the squatter")

    def drain(self) -> dict[str, int]:
        while self.pull.poll(0):
            frame = decode(self.pull.recv())
            if isinstance(frame, Stacks) and frame.request_id:
                self.answers[frame.request_id] = self.answers.get(frame.request_id, 0) + 1
        return self.answers

    def close(self) -> None:
        self.pub.close(linger=0)
        self.pull.close(linger=0)


def _try_bind(sock: zmq.Socket, endpoint: str) -> bool:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:
        return False
    return True


def ask_broker(ctx: zmq.Context, snapshot: str, rank: Rank, sub: zmq.Socket) -> list[bytes]:
    """Requests through the broker (a DEALER on its snapshot socket, as a web sends them),
    one at a time, until the rank answers one; returns that request as the feed carried it
    (what any local process can capture). One at a time, each given seconds to be answered,
    so the answer counted is that request's and nothing is still in flight afterwards."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(snapshot)
    try:
        deadline = time.monotonic() + 60.0
        n = 0
        while time.monotonic() < deadline:
            n += 1
            request_id = f"ok-{n}"
            base = rank.state()["answered"]
            dealer.send_multipart(feed.encode_stacks_request(ControlRequest(
                run=RUN, request_id=request_id, kind="stacks")))
            seen: Optional[list[bytes]] = None
            wait_until = time.monotonic() + 5.0  # the broker's gate: one a second a run
            while time.monotonic() < wait_until:
                if sub.poll(100):
                    parts = sub.recv_multipart()
                    if decode_request(parts).request_id == request_id:
                        seen = parts
                if seen is not None and rank.state()["answered"] > base:
                    return seen
        raise AssertionError("no request through the broker was answered within 60 s")
    finally:
        dealer.close(linger=0)


def test_a_squatter_of_the_publish_port_is_not_obeyed_by_a_rank_with_the_secret(
        spawn: Callable[..., Proc], ranks: Callable[..., Rank], ctx: zmq.Context,
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    broker, eps = start_broker(spawn, data)
    line = broker.wait_line(r"control channel: requests for dumps signed with (\S+)",
                            stream="stderr")
    secret = data / "control.secret"
    assert line.group(1) == str(secret)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    key = secret.read_text().strip().encode()

    rank = ranks(eps.ingest, eps.publish, {SECRET_FILE_ENV: str(secret),
                                           "XDG_STATE_HOME": str(tmp_path / "xdg")})
    sub = ctx.socket(zmq.SUB)  # any local process may read the feed: it captures requests
    sub.linger = 0
    try:
        sub.setsockopt(zmq.SUBSCRIBE, CONTROL_PREFIX)
        sub.connect(eps.publish)
        captured = ask_broker(ctx, eps.snapshot, rank, sub)
    finally:
        sub.close(linger=0)
    before = rank.state()
    assert before["refused"] == {"unsigned": 0, "bad_mac": 0, "stale": 0, "replayed": 0}

    broker.stop(signal.SIGKILL)  # a restart's gap, and a local process takes the ports
    rogue = Rogue(ctx, eps.publish, eps.ingest)
    try:
        rogue.wait_subscribed()
        rogue.pub.send_multipart(encode_request(ControlRequest(
            run=RUN, request_id="rogue-plain", kind="profile", seconds=0.5)))
        rogue.pub.send_multipart(sign_request(b"not-the-secret-at-all", ControlRequest(
            run=RUN, request_id="rogue-wrong-key", kind="stacks"), time.time()))
        rogue.pub.send_multipart(captured)  # the broker's own bytes, replayed

        def refused_all() -> Optional[dict[str, int]]:
            refused: dict[str, int] = rank.state()["refused"]
            return refused if sum(refused.values()) >= 3 else None

        refused = wait_for(refused_all, timeout=30.0, what="the rank refusing three messages")
        assert refused["unsigned"] == 1 and refused["bad_mac"] == 1
        # within 10 s of the broker signing it the replay is caught as one; past it, as late
        assert refused["replayed"] + refused["stale"] == 1

        # the channel is alive: a request signed with the real secret is obeyed
        rogue.pub.send_multipart(sign_request(key, ControlRequest(
            run=RUN, request_id="signed-now", kind="stacks"), time.time()))
        wait_for(lambda: rogue.drain().get("signed-now"), timeout=30.0,
                 what="the signed request's answer")
        after = rank.state()
        assert after["answered"] == before["answered"] + 1
        assert sum(after["refused"].values()) == 3
        assert not any(rid.startswith("rogue-") for rid in rogue.drain())
    finally:
        rogue.close()


def test_without_a_secret_the_old_behaviour_stays(ranks: Callable[..., Rank],
                                                   ctx: zmq.Context, tmp_path: Path) -> None:
    pub = ctx.socket(zmq.XPUB)
    pub.linger = 0
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    ingest = pull.bind_to_random_port("tcp://127.0.0.1")
    rogue = Rogue.__new__(Rogue)
    rogue.pub, rogue.pull, rogue.answers = pub, pull, {}
    try:
        # no variable, and no file at the default path: an agent as before this change
        rank = ranks(f"tcp://127.0.0.1:{ingest}", f"tcp://127.0.0.1:{port}",
                     {"XDG_STATE_HOME": str(tmp_path / "empty")})
        rogue.wait_subscribed()
        pub.send_multipart(encode_request(ControlRequest(run=RUN, request_id="plain",
                                                         kind="stacks")))
        wait_for(lambda: rogue.drain().get("plain"), timeout=30.0, what="the plain request obeyed")
        # a broker with a secret signs: a rank without one reads the request as before
        pub.send_multipart(sign_request(b"s" * 64, ControlRequest(
            run=RUN, request_id="signed", kind="stacks"), time.time()))
        wait_for(lambda: rogue.drain().get("signed"), timeout=30.0,
                 what="the signed request answered by a rank without the secret")
        assert rank.state() == {"answered": 2, "refused": {"unsigned": 0, "bad_mac": 0,
                                                           "stale": 0, "replayed": 0}}
    finally:
        rogue.close()
