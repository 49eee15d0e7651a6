"""Nobody let in: ``rankboard keys``, a CURVE broker that accepts only authorized client keys
(real ``rankboard broker`` process, ZAP through pyzmq's ThreadAuthenticator), the agent's
CURVE configuration from the environment, and the warning for an open plain ingest.
(The feed side, webs with and without keys, is tests/scaleout/test_feed_curve.py.)"""
from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from broker import feed
from rank_agent import RankAgent, curve
from rank_agent.curve import client_options
from rank_agent.protocol import Register, encoder
from tests.support import REPO
from tests.support.brokers import FeedClient
from tests.support.procs import Proc, start_broker


def keys(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rankboard", "keys", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class CurveFeedClient(FeedClient):
    """The tests' FeedClient as a CURVE client: a CURVE broker's feed demands it too."""

    def __init__(self, ctx: zmq.Context, publish: str, snapshot: str,
                 options: dict[int, bytes]) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.dealer = ctx.socket(zmq.DEALER)
        for sock in (self.sub, self.dealer):
            sock.linger = 0
            for option, value in options.items():
                sock.setsockopt(option, value)
        self.sub.rcvhwm = 0
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(publish)
        self.dealer.connect(snapshot)


@pytest.fixture
def keydir(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    result = keys(str(d), "--clients", "2")
    assert result.returncode == 0, result.stderr
    return d


def test_keys_command_writes_private_secrets_and_an_authorized_dir(keydir: Path) -> None:
    assert mode(keydir) == 0o700
    assert mode(keydir / "server.key_secret") == 0o600
    assert mode(keydir / "clients") == 0o700
    assert mode(keydir / "webs") == 0o700
    for n in (1, 2):
        assert mode(keydir / "clients" / f"client-{n}.key_secret") == 0o600
    assert mode(keydir / "webs" / "web-1.key_secret") == 0o600
    authorized = sorted(p.name for p in (keydir / "authorized").iterdir())
    assert authorized == ["client-1.key", "client-2.key", "web-1.key"]  # public keys only
    # the webs' public keys apart too: only they may make ranks dump (--curve-web-authorized)
    assert sorted(p.name for p in (keydir / "authorized-webs").iterdir()) == ["web-1.key"]
    for path in [*(keydir / "authorized").iterdir(), *(keydir / "authorized-webs").iterdir()]:
        assert "secret-key" not in path.read_text()
    pub, sec = zmq.auth.load_certificate(str(keydir / "server.key_secret"))
    assert sec is not None and zmq.auth.load_certificate(str(keydir / "server.key"))[0] == pub

    # again, with more clients: nothing handed out before changes
    before = {p: p.read_bytes() for p in keydir.rglob("*") if p.is_file()}
    result = keys(str(keydir), "--clients", "3")
    assert result.returncode == 0, result.stderr
    assert all(p.read_bytes() == data for p, data in before.items())
    assert (keydir / "authorized" / "client-3.key").exists()


def test_keys_command_one_line_error_for_an_unusable_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = keys(str(blocker))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def _handshake_fails(ctx: zmq.Context, endpoint: str, options: dict[int, bytes],
                     expected_event: int) -> None:
    """A PUSH with ``options`` connects, sends a frame, and is refused at the handshake."""
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    for opt, value in options.items():
        sock.setsockopt(opt, value)
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(endpoint)
        sock.send(encoder.encode(Register(run="intruder", rank=0, world_size=1, host="evil")))
        seen = []
        while True:
            assert monitor.poll(10_000), f"no handshake failure; events {seen}"
            event = recv_monitor_message(monitor)["event"]
            seen.append(event)
            assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED
            if event == expected_event:
                return
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


def test_curve_broker_accepts_known_client_keys_only(
        spawn: Callable[..., Proc], keydir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    broker, eps = start_broker(
        spawn, tmp_path / "data", "--curve-secret-key", str(keydir / "server.key_secret"),
        "--curve-authorized", str(keydir / "authorized"))
    assert "without CURVE" not in broker.output()
    server_public = zmq.auth.load_certificate(str(keydir / "server.key"))[0]
    ctx = zmq.Context()
    client = CurveFeedClient(ctx, eps.publish, eps.snapshot, client_options(
        keydir / "server.key", keydir / "webs" / "web-1.key_secret"))
    try:
        # a plain client: mechanism mismatch; an unknown key: ZAP says no
        _handshake_fails(ctx, eps.ingest, {}, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        public, secret = zmq.curve_keypair()
        _handshake_fails(ctx, eps.ingest, {zmq.CURVE_SERVERKEY: server_public,
                                           zmq.CURVE_PUBLICKEY: public,
                                           zmq.CURVE_SECRETKEY: secret},
                         zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        # a known key, through the agent's own configuration
        monkeypatch.setenv(curve.SERVER_KEY_ENV, str(keydir / "server.key"))
        monkeypatch.setenv(curve.CLIENT_KEY_ENV, str(keydir / "clients" / "client-2.key_secret"))
        with RankAgent(eps.ingest, "trusted", 0, 1, host="good") as agent:
            agent.register()
            agent.log_epoch(0, 0.5, batches=1)
        hb = client.until(lambda u: isinstance(u, feed.Heartbeat) and u.accepted >= 3,
                          what="the trusted frames", timeout=15)[0]
        snaps, _ = client.snapshot()
        assert [s["run"] for s in snaps] == ["trusted"]  # the intruders' frames never arrived
        assert hb.accepted == 3 and hb.rejected == {}  # register, metrics, finish
        assert [rec["epoch"] for _, rec in snaps[0]["records"]] == [0]
    finally:
        client.close()
        ctx.term()


def test_agent_with_unusable_keys_sends_nothing_and_never_raises(
        tmp_path: Path, keydir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        for server, client in [
            (str(keydir / "server.key"), str(tmp_path / "missing.key_secret")),  # no file
            (str(keydir / "server.key"), str(keydir / "clients" / "client-1.key")),  # public only
            (str(keydir / "server.key"), ""),  # half configured
        ]:
            monkeypatch.setenv(curve.SERVER_KEY_ENV, server)
            monkeypatch.setenv(curve.CLIENT_KEY_ENV, client)
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="rank_agent"):
                agent = RankAgent(endpoint, "r", 0, 1, host="h", linger_ms=0)
                results = [agent.register(), agent.log_epoch(0, 1.0), agent.log_epoch(1, 1.0)]
                agent.close()
            assert results == [False, False, False]
            assert agent.sent == 0 and agent.dropped == 3 and agent.errors == 3
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            # one line from the PUSH socket and one from the control channel (which uses
            # the same keys), each naming the variable: not one line per frame
            assert sorted(r.name for r in errors) == ["rank_agent.control", "rank_agent.pusher"]
            assert all("RANKBOARD_CURVE" in r.getMessage() for r in errors)
        assert not pull.poll(200)  # nothing in plain, ever
    finally:
        pull.close(linger=0)
        ctx.term()


def test_socket_options_from_env(keydir: Path) -> None:
    assert curve.socket_options({}) is None
    opts = curve.socket_options({
        curve.SERVER_KEY_ENV: str(keydir / "server.key"),
        curve.CLIENT_KEY_ENV: str(keydir / "clients" / "client-1.key_secret")})
    assert opts is not None
    server_public = zmq.auth.load_certificate(str(keydir / "server.key"))[0]
    public, secret = zmq.auth.load_certificate(str(keydir / "clients" / "client-1.key_secret"))
    assert opts == {zmq.CURVE_SERVERKEY: server_public, zmq.CURVE_PUBLICKEY: public,
                    zmq.CURVE_SECRETKEY: secret}
    with pytest.raises(curve.CurveError, match="CLIENT_KEY"):
        curve.socket_options({curve.SERVER_KEY_ENV: str(keydir / "server.key")})
    with pytest.raises(curve.CurveError, match="no CURVE public key|cannot read"):
        curve.socket_options({curve.SERVER_KEY_ENV: os.devnull,
                              curve.CLIENT_KEY_ENV: str(keydir / "clients" / "client-1.key_secret")})


@pytest.mark.parametrize("ingest, warned", [("tcp://0.0.0.0:*", True), ("tcp://127.0.0.1:*", False)])
def test_plain_ingest_off_loopback_is_warned_about(
        spawn: Callable[..., Proc], tmp_path: Path, ingest: str, warned: bool) -> None:
    proc = spawn("broker", "--ingest", ingest, "--publish", "tcp://127.0.0.1:*",
                 "--snapshot", "tcp://127.0.0.1:*", "--data-dir", str(tmp_path / "d"))
    proc.wait_line(r"runs restored", stream="stderr")  # logged after the warning
    assert ("reachable from other hosts without CURVE" in proc.output()) is warned
    proc.close()
