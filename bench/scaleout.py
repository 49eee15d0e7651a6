"""fanout_4000_workers2_p99_ms and nginx_e2e_p99_ms: the web scaled out, with real processes.

Both run a real broker process and a real ``rankboard web --workers 2`` (a supervisor and two
worker processes sharing one port with SO_REUSEPORT), started as ``bench/common.py`` starts
its stack, and measure exactly as ``bench/web_bench.py`` does (its ``fanout`` and ``e2e``
are called here), so the figures compare with ``fanout_1000_p99_ms`` and
``e2e_latency_p99_ms``:

* **fanout_4000_workers2_p99_ms**: a 64-rank run, 4,000 SSE clients (``bench/sse_clients.py``,
  two gevent processes of raw-socket clients; the kernel spreads the connections over the
  two workers). Per epoch, the latency of every client from the last rank's send to its
  receipt of the ``epoch`` event; p99 over clients and epochs. The web's CPU and memory
  are summed over its processes (the supervisor and both workers). A full run also
  measures one web process (``--workers 1``) with the same 4,000 clients, in the details
  (``workers1_p99_ms``): on a machine whose cores the clients share, that says what the
  second worker buys there.
* **nginx_e2e_p99_ms**: 64 ranks on 8 hosts; Debian's nginx with
  ``deploy/nginx/rankboard-proxy.conf`` in front of the pool; one SSE client reads through
  nginx. Per epoch the clock starts when the last rank's metrics go out and stops when the
  client has parsed the ``epoch`` event; p99 over the epochs (p50 in the details). nginx
  gets its listening socket from this process (``NGINX`` environment variable, as on a
  binary upgrade), so it runs on an ephemeral port.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import psutil
import web_bench
from common import _DASHBOARD, REPO, Proc, Stack, raise_nofile, result, wait_for

WORKERS = 2


class PoolProc:
    """The web's processes as one: ``rss_kib`` and ``cpu_seconds`` summed over the
    supervisor and its workers (what ``web_bench.fanout`` reads off ``stack.web``)."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc

    def _all(self) -> list[psutil.Process]:
        top = psutil.Process(self.proc.pid)
        return [top, *top.children(recursive=True)]

    def rss_kib(self) -> int:
        return sum(p.memory_info().rss for p in self._all()) // 1024

    def cpu_seconds(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self._all())

    def stop(self) -> None:
        self.proc.stop()


class PoolStack(Stack):
    """``common.Stack`` whose web is ``rankboard web --workers N``."""

    def __init__(self, data_dir: Path, workers: int = WORKERS) -> None:
        self.workers = workers
        super().__init__(data_dir, web=False)
        self.start_pool()

    def start_pool(self) -> None:
        proc = Proc(["web", "--publish", self.endpoints["publish"],
                     "--snapshot", self.endpoints["snapshot"], "--port", "0",
                     "--workers", str(self.workers), "--log-level", "WARNING"])
        self.web = PoolProc(proc)  # type: ignore[assignment]
        seen: set[str] = set()

        def ready() -> bool:
            if proc.proc.poll() is not None:
                raise RuntimeError("web exited:\n" + proc.tail())
            found = proc.find(_DASHBOARD)
            if not found:
                return False
            self.port = int(found[0].group(1))
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            try:
                conn.request("GET", "/healthz")
                resp = conn.getresponse()
                resp.read()
                if resp.status == 200:
                    seen.add(resp.getheader("X-Rankboard-Worker") or "")
            finally:
                conn.close()
            return len(seen) == self.workers
        try:
            wait_for(ready, 60, "every worker healthy", interval=0.02)
        except BaseException:
            self.close()
            raise


class Nginx:
    """Debian's nginx in front of ``upstream_port`` with the deploy snippet, on a port this
    process binds (handed over as an inherited socket: nginx cannot listen on port 0)."""

    def __init__(self, root: Path, upstream_port: int) -> None:
        binary = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")
        if binary is None:
            raise RuntimeError("nginx_e2e needs nginx (apt-get install nginx)")
        (root / "logs").mkdir(parents=True)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1024)
        self.port = self.listener.getsockname()[1]
        conf = root / "nginx.conf"
        conf.write_text(f"""
daemon off;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/logs/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    proxy_max_temp_file_size 0;
    upstream rankboard_web {{ server 127.0.0.1:{upstream_port}; keepalive 32; }}
    server {{
        listen 127.0.0.1:{self.port};
        include {REPO / "deploy" / "nginx" / "rankboard-proxy.conf"};
    }}
}}
""")
        fd = self.listener.fileno()
        self.proc = subprocess.Popen(
            [binary, "-e", str(root / "logs" / "error.log"), "-p", f"{root}/", "-c", str(conf)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=[fd], env=dict(os.environ, NGINX=f"{fd};"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.listener.close()


class Front:
    """What ``web_bench.e2e`` reads off a stack (``ingest``, ``port``), with the port
    nginx's."""

    def __init__(self, stack: Stack, port: int) -> None:
        self.ingest = stack.ingest
        self.port = port


def fanout(stack: PoolStack, clients: int, epochs: int) -> list[dict[str, Any]]:
    """``web_bench.fanout`` against the pool; its p99 line renamed (``--quick`` runs fewer
    clients under the same name, as web_bench does), its memory line kept in the details:
    ``fanout_kib_per_client`` itself stays the one-process web's figure."""
    p99, kib = web_bench.fanout(stack, clients, epochs)
    extra = dict(p99["_extra"], workers=stack.workers, kib_per_client=kib["value"],
                 rss_before_kib=kib["_extra"]["rss_before_kib"],
                 rss_after_kib=kib["_extra"]["rss_after_kib"])
    return [result("fanout_4000_workers2_p99_ms", p99["value"], "ms", **extra)]


def nginx_e2e(stack: PoolStack, tmp: Path, epochs: int) -> list[dict[str, Any]]:
    proxy = Nginx(tmp / "nginx", stack.port)
    try:
        front = Front(stack, proxy.port)
        wait_for(lambda: _status(proxy.port, "/healthz") == 200, 30, "the web through nginx")
        p50, p99 = web_bench.e2e(front, epochs)  # type: ignore[arg-type]
    finally:
        proxy.stop()
    return [result("nginx_e2e_p99_ms", p99["value"], "ms", p50_ms=p50["value"],
                   max_ms=p99["_extra"]["max_ms"], epochs=epochs, ranks=64,
                   workers=stack.workers)]


def _status(port: int, path: str) -> Optional[int]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def run(quick: bool) -> list[dict[str, Any]]:
    raise_nofile(20_000)
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rankboard-bench-") as tmp:
        stack = PoolStack(Path(tmp) / "data")
        try:
            out += nginx_e2e(stack, Path(tmp), 30 if quick else 300)
        finally:
            stack.close()
        # a fresh stack: the fan-out's memory and CPU figures start from a clean web
        stack = PoolStack(Path(tmp) / "data2")
        try:
            out += fanout(stack, 200 if quick else 4000, 3 if quick else 10)
        finally:
            stack.close()
        if not quick:
            stack = PoolStack(Path(tmp) / "data3", workers=1)
            try:
                one = fanout(stack, 4000, 10)[0]
            finally:
                stack.close()
            out[-1]["_extra"].update(workers1_p99_ms=one["value"],
                                     workers1_p50_ms=one["_extra"]["p50_ms"],
                                     workers1_web_cpu_ms_per_event=one["_extra"][
                                         "web_cpu_ms_per_event"])
    return out


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    for line in run(quick):
        print(json.dumps(line))
