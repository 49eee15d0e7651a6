"""Debian's nginx, started by the test with deploy/nginx/rankboard-proxy.conf (the very
locations the site file includes), in front of a real ``rankboard web --workers 2`` with a
token: the page, the API, auth and the SSE streams (live latency, pings, ``Last-Event-ID``
resume) all work through it; and the site file itself passes ``nginx -t``.

nginx cannot listen on port 0, so the test binds an ephemeral port itself and hands the
listening socket to nginx the way nginx hands sockets to a new binary on upgrade (the
``NGINX`` environment variable): no port is ever closed and bound again.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.support.brokers import Pusher
from tests.support.deploy import DEPLOY, tool
from tests.support.http import SSEClient, fetch
from tests.support.polling import wait_for
from tests.support.pool import start_pool
from tests.support.procs import Proc

TOKEN = "nginx-t0ken"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
RUN = "proxied"


class Nginx:
    """nginx in the foreground (``daemon off``), its prefix, logs and pid in ``root``."""

    def __init__(self, root: Path, upstream_port: int) -> None:
        self.root = root
        for sub in ("logs", "temp"):
            (root / sub).mkdir(parents=True)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self.error_log = root / "logs" / "error.log"
        conf = root / "nginx.conf"
        conf.write_text(f"""
daemon off;
worker_processes 1;
pid {root}/nginx.pid;
error_log {self.error_log} info;
events {{ worker_connections 512; }}
http {{
    access_log {root}/logs/access.log;
    client_body_temp_path {root}/temp/body;
    proxy_temp_path {root}/temp/proxy;
    fastcgi_temp_path {root}/temp/fastcgi;
    uwsgi_temp_path {root}/temp/uwsgi;
    scgi_temp_path {root}/temp/scgi;
    # (workers may run as nobody, who cannot enter pytest's tmp dir: no temp files)
    proxy_max_temp_file_size 0;
    upstream rankboard_web {{
        server 127.0.0.1:{upstream_port};
        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{self.port};
        include {DEPLOY / "nginx" / "rankboard-proxy.conf"};
    }}
}}
""")
        fd = self.listener.fileno()
        try:
            self.proc = subprocess.Popen(
                [tool("nginx", "nginx"), "-e", str(self.error_log), "-p", f"{root}/",
                 "-c", str(conf)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                pass_fds=[fd], env=dict(os.environ, NGINX=f"{fd};"))
        except BaseException:
            self.listener.close()
            raise

    def logs(self) -> str:
        return self.error_log.read_text() if self.error_log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: finish requests, then exit
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        self.listener.close()


@pytest.fixture
def web(spawn: Callable[..., Proc], broker: Any) -> Proc:
    return start_pool(spawn, broker, "--token", TOKEN, env={"RANKBOARD_SSE_PING": "0.5"})


@pytest.fixture
def nginx(tmp_path: Path, web: Proc) -> Iterator[Nginx]:
    assert web.port is not None
    proxy = Nginx(tmp_path / "nginx", web.port)
    try:
        wait_for(lambda: fetch(proxy.port, "/healthz").status == 200 or (
            proxy.proc.poll() is not None and pytest.fail(f"nginx exited:\n{proxy.logs()}")),
            what="the web through nginx")
        assert "using inherited sockets" in proxy.logs()
        yield proxy
    finally:
        proxy.stop()
    assert "[emerg]" not in proxy.logs() and "[alert]" not in proxy.logs(), proxy.logs()


def _run_with_records(pusher: Pusher, port: int, n: int) -> None:
    pusher.register(RUN, 0, 1)
    for epoch in range(n):
        pusher.epoch(RUN, epoch, 1)
    wait_for(lambda: (r := fetch(port, f"/api/runs/{RUN}/history", BEARER)).status == 200
             and len(r.json()) == n, what=f"{n} records through nginx")


def test_page_api_and_auth_through_nginx(nginx: Nginx, pusher: Pusher) -> None:
    _run_with_records(pusher, nginx.port, 1)
    page = fetch(nginx.port, "/", BEARER)
    assert page.status == 200 and "text/html" in page.headers["Content-Type"]
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert page.headers["X-Rankboard-Worker"] in ("1", "2")  # a pool's worker answered
    assert fetch(nginx.port, "/static/dashboard.js", BEARER).status == 200
    runs = fetch(nginx.port, "/api/runs", BEARER).json()
    assert [r["run"] for r in runs] == [RUN]
    assert fetch(nginx.port, f"/api/runs/{RUN}", BEARER).json()["records"][0]["epoch"] == 0
    assert fetch(nginx.port, f"/api/runs/{RUN}/history.csv", BEARER).text.startswith("epoch,")
    assert fetch(nginx.port, "/metrics", BEARER).status == 200
    # the token still guards everything: nginx forwards credentials, adds none
    assert fetch(nginx.port, "/api/runs").status == 401
    assert fetch(nginx.port, f"/api/runs/{RUN}/events").status == 401
    login = fetch(nginx.port, f"/?token={TOKEN}")
    cookie = login.headers["Set-Cookie"].split(";")[0]
    assert fetch(nginx.port, "/api/runs", {"Cookie": cookie}).status == 200


def test_sse_through_nginx_is_live_and_resumes(nginx: Nginx, pusher: Pusher) -> None:
    _run_with_records(pusher, nginx.port, 2)
    path = f"/api/runs/{RUN}/events"
    stream = SSEClient(nginx.port, path, BEARER)
    try:
        assert stream.status == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert stream.headers["cache-control"] == "no-store"
        first = stream.events_until(lambda ev: ev["event"] == "epoch" and ev["data"]["epoch"] == 1)
        assert first[0]["event"] == "run"
        latencies = []
        for epoch in range(2, 7):
            started = time.monotonic()
            pusher.epoch(RUN, epoch, 1)
            got = stream.events_until(lambda ev: ev["event"] == "epoch")[-1]
            latencies.append(time.monotonic() - started)
            assert got["data"]["epoch"] == epoch
        # each event crosses nginx as it is written (a buffering proxy holds it until a
        # buffer fills or the stream ends, i.e. forever here)
        assert max(latencies) < 1.0, latencies
        # pings pass too (the web pings every 0.5 s here): a comment block comes through
        def ping() -> bool:
            block = stream.next_block()
            assert block is not None, "the stream ended"
            return block.startswith(":")

        wait_for(ping, timeout=10, what="a ': ping' through nginx")
        resume_at = [int(e["id"]) for e in first if e["event"] == "epoch"][-1]  # epoch 1's id
    finally:
        stream.close()

    # the browser's reconnect: Last-Event-ID through nginx, exactly what was missed
    with SSEClient(nginx.port, path, {**BEARER, "Last-Event-ID": str(resume_at)}) as again:
        events = again.events_until(lambda ev: ev["event"] == "epoch" and ev["data"]["epoch"] == 6)
    assert events[0]["event"] == "run" and int(events[0]["id"]) == resume_at
    epochs = [e["data"]["epoch"] for e in events if e["event"] == "epoch"]
    assert epochs == [2, 3, 4, 5, 6]
    ids = [int(e["id"]) for e in events]
    assert ids == sorted(set(ids))


def test_the_site_file_passes_nginx_t(tmp_path: Path) -> None:
    """deploy/nginx/rankboard.conf as installed (TLS, HTTP/2, the snippet included), with
    a throwaway certificate and the snippet's path pointing into the repo."""
    nginx = tool("nginx", "nginx")
    openssl = tool("openssl", "openssl")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=rankboard.test", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    site = (DEPLOY / "nginx" / "rankboard.conf").read_text()
    for old, new in [("/etc/nginx/snippets/rankboard-proxy.conf",
                      str(DEPLOY / "nginx" / "rankboard-proxy.conf")),
                     ("/etc/ssl/certs/rankboard.pem", str(cert)),
                     ("/etc/ssl/private/rankboard.key", str(key))]:
        assert old in site
        site = site.replace(old, new)
    (tmp_path / "site.conf").write_text(site)
    (tmp_path / "logs").mkdir()
    (tmp_path / "nginx.conf").write_text(f"""
pid {tmp_path}/nginx.pid;
error_log {tmp_path}/logs/error.log;
events {{ }}
http {{ access_log off; include {tmp_path}/site.conf; }}
""")
    done = subprocess.run([nginx, "-t", "-e", str(tmp_path / "logs" / "error.log"),
                           "-p", f"{tmp_path}/", "-c", str(tmp_path / "nginx.conf")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "syntax is ok" in done.stderr and "test is successful" in done.stderr
