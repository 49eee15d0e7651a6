"""CURVE on the feed: with ``--curve-secret-key`` the broker's publish and snapshot sockets
demand CURVE with the ingest's key and authorized directory. A web with an authorized key
(``--curve-server-key``/``--curve-client-key``, here a ``--workers 2`` pool) serves the runs;
a web with an unknown key, or none, gets nothing: ``/healthz`` stays 503, no run, and its
log says why. Real ``rankboard keys``, broker and web processes."""
from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from rank_agent import RankAgent, curve
from tests.support import REPO
from tests.support.http import fetch, get_json
from tests.support.polling import wait_for
from tests.support.pool import start_pool
from tests.support.procs import Endpoints, Proc, start_broker, start_web


@pytest.fixture
def keydir(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    done = subprocess.run([sys.executable, "-m", "rankboard", "keys", str(d), "--webs", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--curve-client-key" in done.stdout  # it says how a web uses its key
    (d / "authorized" / "web-2.key").unlink()  # web-2: a well-formed key the broker refuses
    return d


@pytest.fixture
def curve_broker(spawn: Callable[..., Proc], keydir: Path, tmp_path: Path) -> Endpoints:
    proc, eps = start_broker(spawn, tmp_path / "data",
                             "--curve-secret-key", str(keydir / "server.key_secret"),
                             "--curve-authorized", str(keydir / "authorized"))
    proc.wait_line(r"ingest, publish and snapshot require CURVE", stream="stderr")
    return eps


def _web_keys(keydir: Path, web: str) -> list[str]:
    return ["--curve-server-key", str(keydir / "server.key"),
            "--curve-client-key", str(keydir / "webs" / f"{web}.key_secret")]


def test_only_a_web_with_an_authorized_key_gets_the_feed(
        spawn: Callable[..., Proc], curve_broker: Endpoints, keydir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    good = start_pool(spawn, curve_broker, *_web_keys(keydir, "web-1"))
    stranger = start_web(spawn, curve_broker, *_web_keys(keydir, "web-2"), healthy=False)
    plain = start_web(spawn, curve_broker, healthy=False)

    monkeypatch.setenv(curve.SERVER_KEY_ENV, str(keydir / "server.key"))
    monkeypatch.setenv(curve.CLIENT_KEY_ENV, str(keydir / "clients" / "client-1.key_secret"))
    with RankAgent(curve_broker.ingest, "secret-run", 0, 1, host="good") as agent:
        agent.register()
        agent.log_epoch(0, 0.5, batches=1)
    assert good.port is not None
    wait_for(lambda: (r := fetch(good.port, "/api/runs/secret-run/history")).status == 200
             and len(r.json()) == 1, what="the run on the authorized web")

    # Each refused web has tried (its log says so) and has nothing, however long it waits:
    # the broker let no byte of the feed through.
    stranger.wait_line(r"refused this web's CURVE key \(ZAP status 400\)", stream="stderr")
    plain.wait_line(r"handshake with the broker at \S+ failed .* needs --curve-server-key",
                    stream="stderr")
    for web in (stranger, plain):
        assert web.port is not None
        r = fetch(web.port, "/healthz")
        assert (r.status, r.json()) == (503, {"ok": False, "journal": "ok", "shards": [
            {"shard": 0, "connected": False, "journal": "ok"}]})
        assert get_json(web.port, "/api/runs") == []
        assert fetch(web.port, "/api/runs/secret-run").status == 404
        assert "Traceback" not in web.output()
    assert fetch(good.port, "/healthz").status == 200


def test_up_connects_its_web_with_curve(spawn: Callable[..., Proc], keydir: Path,
                                        tmp_path: Path) -> None:
    # --curve-server-key defaults to the public half of the broker's own secret key file
    up = spawn("up", "--port", "0", "--ingest", "tcp://127.0.0.1:*",
               "--publish", "tcp://127.0.0.1:*", "--snapshot", "tcp://127.0.0.1:*",
               "--data-dir", str(tmp_path / "data"),
               "--curve-secret-key", str(keydir / "server.key_secret"),
               "--curve-authorized", str(keydir / "authorized"),
               "--curve-client-key", str(keydir / "webs" / "web-1.key_secret"))
    try:
        port = up.wait_dashboard()
        wait_for(lambda: fetch(port, "/healthz").status == 200, what="up's web connected")
    finally:  # SIGINT, so that up stops its broker child (a SIGKILL would orphan it)
        assert up.stop(signal.SIGINT, timeout=20) == 0
    assert "Traceback" not in up.output()


@pytest.mark.parametrize("args, message", [
    (["web", "--curve-server-key", "k"], "--curve-server-key and --curve-client-key go together"),
    (["web", "--curve-client-key", "k"], "--curve-server-key and --curve-client-key go together"),
    (["up", "--curve-secret-key", "s", "--curve-authorized", "a"], "pass --curve-client-key"),
    (["up", "--curve-client-key", "k"], "need --curve-secret-key"),
])
def test_inconsistent_curve_flags_are_one_line_usage_errors(
        spawn: Callable[..., Proc], args: list[str], message: str) -> None:
    proc = spawn(*args)
    assert proc.proc.wait(30) == 2
    proc.close()
    err = [line for line in proc.lines["stderr"] if line.strip()]
    assert len(err) == 1 and message in err[0], err


def test_an_unusable_key_file_stops_the_web_with_one_line(
        spawn: Callable[..., Proc], keydir: Path, tmp_path: Path) -> None:
    public_only = tmp_path / "web-1.key"
    shutil.copy(keydir / "webs" / "web-1.key", public_only)
    for client, expected in [(public_only, "no CURVE secret key"),
                             (tmp_path / "missing", "cannot read a CURVE key file")]:
        proc = spawn("web", "--port", "0", "--curve-server-key", str(keydir / "server.key"),
                     "--curve-client-key", str(client))
        assert proc.proc.wait(30) == 2
        proc.close()
        err = [line for line in proc.lines["stderr"] if line.strip()]
        assert len(err) == 1 and expected in err[0] and "--curve-client-key" in err[0], err


def test_keys_for_webs_are_private_and_authorized(tmp_path: Path) -> None:
    from rankboard.keys import create_keys

    written = create_keys(tmp_path / "k", clients=1, webs=2)
    names = {p.relative_to(tmp_path / "k").as_posix() for p in written}
    assert {"webs/web-1.key_secret", "webs/web-2.key", "authorized/web-2.key"} <= names
    assert (tmp_path / "k" / "webs").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "k" / "webs" / "web-2.key_secret").stat().st_mode & 0o777 == 0o600
    assert create_keys(tmp_path / "k", clients=1, webs=2) == []  # nothing handed out changes
    assert create_keys(tmp_path / "k", clients=1, webs=0) == []


def test_a_plain_feed_off_loopback_is_warned_about(
        spawn: Callable[..., Proc], tmp_path: Path) -> None:
    proc = spawn("broker", "--ingest", "tcp://127.0.0.1:*", "--publish", "tcp://0.0.0.0:*",
                 "--snapshot", "tcp://127.0.0.1:*", "--data-dir", str(tmp_path / "d"))
    proc.wait_line(r"runs restored", stream="stderr")
    warnings = [line for line in proc.lines["stderr"] if "reads every run" in line]
    assert len(warnings) == 1 and "publish tcp://0.0.0.0:" in warnings[0], warnings
    proc.close()


def test_refused_handshakes_are_logged_at_most_once_a_minute(
        caplog: pytest.LogCaptureFixture) -> None:
    """FeedPump's monitor handler alone (real monitor-event bytes, no sockets)."""
    import struct

    import zmq

    from web.hub import Hub
    from web.pump import FeedPump

    pump = FeedPump(Hub(), "tcp://broker:5586", "tcp://broker:5587", curve={1: b"x"})

    def event(kind: int, value: int) -> list[bytes]:
        return [struct.pack("=hi", kind, value), b"tcp://broker:5586"]

    with caplog.at_level(logging.INFO, logger="web.pump"):
        for _ in range(3):
            pump._on_monitor_event(event(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400))
        assert pump.handshake_failures == 3
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "refused this web's CURVE key (ZAP status 400)" in errors[0]
        assert pump._failure_logged_at is not None
        pump._failure_logged_at -= pump.REFUSAL_LOG_INTERVAL + 1  # a minute later
        pump._on_monitor_event(event(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, 0x11000003))
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2 and "(2 more since the last report)" in errors[1]
        assert "is the broker started with --curve-secret-key" in errors[1]
        pump._on_monitor_event(event(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0))
        assert pump.handshake_failures == 0
        assert "handshake with the broker at tcp://broker:5586 succeeded" in caplog.text
