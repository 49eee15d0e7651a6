"""The web against hostile clients (extends tests/web): the token on every route including
SSE and exports, near-miss tokens, constant-time comparison, security headers on refusals,
the sandboxed SVG, and malformed HTTP (huge headers and URLs, bad run ids and Last-Event-ID
values): always a clear 4xx, never a traceback, and the web stays healthy."""
from __future__ import annotations

import base64
import socket
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from rank_agent import protocol
from tests.support.brokers import Pusher
from tests.support.http import SSEClient, fetch
from tests.support.polling import wait_for
from tests.support.procs import Proc, no_traceback, start_broker, start_web
from tests.support.spying import spy

TOKEN = "tok-\u00e9-0123456789abcdef"  # non-ASCII on purpose: compared as UTF-8 bytes
ASCII_TOKEN = "s3cr3t-0123456789abcdef"
EVIL_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" onload="alert(1)">'
            '<script>fetch("/api/runs")</script><rect width="1" height="1"/></svg>')
SVG_CSP = "default-src 'none'; style-src 'unsafe-inline'; sandbox"


@pytest.fixture
def stack(spawn: Callable[..., Proc], tmp_path: Path) -> Any:
    broker, eps = start_broker(spawn, tmp_path / "data")
    web = start_web(spawn, eps, "--token", ASCII_TOKEN, "--host", "0.0.0.0")
    pusher = Pusher(eps.ingest)
    pusher.register("r", 0, 1, host="h")
    pusher.send(protocol.Svg(run="r", rank=0, svg=EVIL_SVG))
    pusher.epoch("r", 0, 1)
    bearer = {"Authorization": f"Bearer {ASCII_TOKEN}"}
    wait_for(lambda: fetch(web.port, "/api/runs/r", bearer).status == 200
             and fetch(web.port, "/api/runs/r", bearer).json()["records"], what="the run")
    wait_for(lambda: fetch(web.port, "/api/runs/r/graph.svg", bearer).status == 200, what="svg")
    yield web, broker
    pusher.close()


ROUTES = [("/", 200), ("/api/runs", 200), ("/api/runs/r", 200), ("/api/runs/r/history", 200),
          ("/api/runs/r/history.csv", 200), ("/api/runs/r/graph.svg", 200), ("/metrics", 200),
          ("/static/dashboard.js", 200), ("/api/runs/nope", 404), ("/nope", 404)]


def test_every_route_with_the_token_answers_and_without_it_refuses(stack: Any) -> None:
    web, broker = stack
    good = [{"Authorization": f"Bearer {ASCII_TOKEN}"},
            {"Authorization": f"bearer  {ASCII_TOKEN} "}]  # scheme is case-insensitive
    near_misses = [
        {}, {"Authorization": "Bearer"}, {"Authorization": "Bearer "},
        {"Authorization": f"Bearer {ASCII_TOKEN[:-1]}"},
        {"Authorization": f"Bearer {ASCII_TOKEN}x"},
        {"Authorization": f"Bearer {ASCII_TOKEN.upper()}"},
        {"Authorization": f"Token {ASCII_TOKEN}"},
        {"Authorization": "Basic " + base64.b64encode(f"u:{ASCII_TOKEN}".encode()).decode()},
        {"Authorization": ASCII_TOKEN},
        {"Cookie": f"rankboard_session={ASCII_TOKEN}"},  # the cookie is not the token
    ]
    for path, status in ROUTES:
        for headers in good:
            r = fetch(web.port, path, headers)
            assert r.status == status, (path, headers, r.status)
        for headers in near_misses:
            r = fetch(web.port, path, headers)
            assert r.status == 401, (path, headers, r.status)
            assert ASCII_TOKEN.encode() not in r.body
            assert r.headers["X-Content-Type-Options"] == "nosniff"
            assert r.headers["X-Frame-Options"] == "DENY"
            assert r.headers["Referrer-Policy"] == "no-referrer"
            assert "script-src 'self'" in r.headers["Content-Security-Policy"]
        for method in ("HEAD", "OPTIONS", "POST"):
            assert fetch(web.port, path, method=method).status == 401, (method, path)
    assert fetch(web.port, "/healthz").status == 200
    # the exports carry their content only with the token
    r = fetch(web.port, "/api/runs/r/history.csv", good[0])
    assert r.text.startswith("epoch,duration_secs,loss")
    r = fetch(web.port, "/api/runs/r/graph.svg", good[0])
    assert r.text == EVIL_SVG  # served as-is, but sandboxed: no script runs
    assert r.headers["Content-Security-Policy"] == SVG_CSP
    assert r.headers["Content-Type"] == "image/svg+xml"
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    no_traceback(web)


def test_sse_needs_the_token_by_header_query_or_cookie(stack: Any) -> None:
    web, _ = stack
    path = "/api/runs/r/events"
    with SSEClient(web.port, path) as c:
        assert c.status == 401
    with SSEClient(web.port, path, {"Last-Event-ID": "0", "Authorization": "Bearer nope"}) as c:
        assert c.status == 401
    with SSEClient(web.port, path, {"Authorization": f"Bearer {ASCII_TOKEN}"}) as c:
        assert c.status == 200 and c.headers["content-type"] == "text/event-stream"
        assert c.events_until(lambda e: e["event"] == "epoch")[0]["event"] == "run"
    with SSEClient(web.port, f"{path}?token={ASCII_TOKEN}") as c:  # EventSource's only way
        assert c.status == 200
        cookie = c.headers["set-cookie"]
        assert ASCII_TOKEN not in cookie and "httponly" in cookie.lower()
        assert c.events_until(lambda e: e["event"] == "epoch")
    with SSEClient(web.port, path, {"Cookie": cookie.split(";")[0]}) as c:
        assert c.status == 200
    assert ASCII_TOKEN not in web.output("stderr") + web.output("stdout")  # never logged


def test_tokens_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from web import app as web_app
    from web.hub import Hub

    calls = spy(monkeypatch, web_app.hmac, "compare_digest")
    client = web_app.create_app(Hub(), {"token": TOKEN}).test_client()
    assert client.get("/api/runs", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert calls and all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in calls)
    calls.clear()
    assert client.get("/api/runs", headers={"Authorization": "Bearer x"}).status_code == 401
    assert client.get("/api/runs?token=x").status_code == 401
    assert len(calls) >= 2  # every candidate went through compare_digest, none through ==
    assert client.get("/api/runs?token=" + TOKEN).status_code == 200


def raw_request(port: int, data: bytes) -> bytes:
    """Send raw bytes; return the response's status line (b"" if the server just closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(data)
        except OSError:  # the server may close while we still write a huge request
            pass
        got = b""
        try:
            while b"\r\n" not in got:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        except ConnectionResetError:
            pass
    return got.split(b"\r\n", 1)[0]


def test_malformed_http_is_a_clean_4xx_and_the_web_stays_up(
        spawn: Callable[..., Proc], tmp_path: Path) -> None:
    broker, eps = start_broker(spawn, tmp_path / "data")
    web = start_web(spawn, eps)
    pusher = Pusher(eps.ingest)
    try:
        pusher.register("r", 0, 1)
        wait_for(lambda: fetch(web.port, "/api/runs/r").status == 200, what="run")
        host = b"Host: 127.0.0.1\r\n"
        requests = {
            "huge header value": b"GET /api/runs HTTP/1.1\r\n" + host + b"X-Big: "
                                 + b"a" * 200_000 + b"\r\n\r\n",
            "huge request line": b"GET /api/runs/" + b"r" * 100_000 + b" HTTP/1.1\r\n" + host
                                 + b"\r\n",
            "10 000 headers": b"GET /api/runs HTTP/1.1\r\n" + host
                              + b"".join(b"X-%d: v\r\n" % i for i in range(10_000)) + b"\r\n",
            "bad percent-encoding": b"GET /api/runs/%zz%ff%00/history HTTP/1.1\r\n" + host
                                    + b"\r\n",
            "NUL in path": b"GET /api/runs/a\x00b HTTP/1.1\r\n" + host + b"\r\n",
            "traversal": b"GET /static/../app.py HTTP/1.1\r\n" + host + b"\r\n",
            "encoded traversal": b"GET /api/runs/..%2f..%2fetc%2fpasswd/history HTTP/1.1\r\n"
                                 + host + b"\r\n",
            "garbage": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64
                       + b"\r\n\r\n",  # a TLS ClientHello
            "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            "bad method": b"BREW /api/runs HTTP/1.1\r\n" + host + b"\r\n",
            "bad content-length": b"POST /api/runs HTTP/1.1\r\n" + host
                                  + b"Content-Length: -5\r\n\r\n",
            "bad version": b"GET /api/runs HTTP/9.9\r\n" + host + b"\r\n",
        }
        for name, data in requests.items():
            status = raw_request(web.port, data)
            assert status.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")), (name, status)
        # bad Last-Event-ID values: a full replay (PROTOCOL 4), never an error
        for bad in ("a" * 10_000, "9" * 10_000, "-1", "1e3", "\uff11\uff12", " 0x10 ", ""):
            with SSEClient(web.port, "/api/runs/r/events",
                           {"Last-Event-ID": bad.encode("utf-8").decode("latin-1")}) as c:
                assert c.status == 200, bad
                head = c.next_event()
                assert head is not None and head["event"] == "run" and head["id"] == "0"
        # bad run ids on every run route: 404 with a JSON error
        for run in ("a%20b", "%2e%2e", "x" * 129, "%00", "%C3%A9", "a%2Fb"):
            for suffix in ("", "/history", "/history.csv", "/graph.svg", "/events"):
                r = fetch(web.port, f"/api/runs/{run}{suffix}")
                assert r.status == 404 and "error" in r.json(), (run, suffix, r.status)
        assert fetch(web.port, "/healthz").status == 200
        no_traceback(web, broker)
    finally:
        pusher.close()


# ----------------------------------------------------------- issue 19: request heads
def status_of(port: int, data: bytes, *, host: bytes = b"127.0.0.1") -> bytes:
    """The status line of one raw request sent with ``Host: <host>``."""
    first, _, rest = data.partition(b"\r\n")
    return raw_request(port, first + b"\r\nHost: " + host + b"\r\n" + rest)


def limited(port: int, reason: str, token: str | None = None) -> float:
    """``rankboard_web_limited_total{reason=...}`` of the web's /metrics (0 when absent)."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    for line in fetch(port, "/metrics", headers).text.splitlines():
        if line.startswith(f'rankboard_web_limited_total{{reason="{reason}"}} '):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def plain_web(spawn: Callable[..., Proc], tmp_path: Path) -> Any:
    """A tokenless web on 127.0.0.1 with one run, against a broker subprocess."""
    broker, eps = start_broker(spawn, tmp_path / "data")
    web = start_web(spawn, eps)
    pusher = Pusher(eps.ingest)
    pusher.register("r", 0, 1)
    wait_for(lambda: fetch(web.port, "/api/runs/r").status == 200, what="run")
    yield web, broker
    pusher.close()


def test_a_head_over_64_kib_is_431_before_any_token_check(
        spawn: Callable[..., Proc], tmp_path: Path) -> None:
    """Finding 8: complete and unfinished heads over MAX_HEAD_BYTES (in one header line, in
    many small ones) are 431 at once, on a web with a token too (before the check); a head
    just under the bound is served."""
    broker, eps = start_broker(spawn, tmp_path / "data")
    web = start_web(spawn, eps, "--token", ASCII_TOKEN)
    bearer = f"Authorization: Bearer {ASCII_TOKEN}\r\n".encode()
    line = b"GET /api/runs HTTP/1.1\r\n"
    heads = {
        "one big header": line + b"X-Big: " + b"a" * 70_000 + b"\r\n\r\n",
        "many small headers": line + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 90)
                                              for i in range(800)) + b"\r\n",
        "unfinished": line + b"X-Big: " + b"a" * 70_000,
        "unfinished, many lines": line + b"X-a: b\r\n" * 10_000,
    }
    for name, data in heads.items():
        assert status_of(web.port, data) == b"HTTP/1.1 431 Request Header Fields Too Large", name
    assert limited(web.port, "head_too_large", ASCII_TOKEN) == len(heads)
    under = line + bearer + b"X-Pad: " + b"p" * 60_000 + b"\r\n\r\n"
    assert status_of(web.port, under) == b"HTTP/1.1 200 OK"
    assert fetch(web.port, "/healthz").status == 200
    no_traceback(web, broker)


def test_a_head_not_complete_in_10_s_is_closed(plain_web: Any) -> None:
    """Finding 8: a half head, and a head trickled a byte at a time, are closed after
    HEAD_TIMEOUT however slowly they keep coming; an idle connection too. A full request
    on another connection meanwhile is answered."""
    web, _ = plain_web
    started = time.monotonic()
    socks = [socket.create_connection(("127.0.0.1", web.port), timeout=20) for _ in range(3)]
    try:
        socks[0].sendall(b"GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Half: ")
        # socks[1] sends nothing at all; socks[2] trickles
        trickled = 0
        closed: dict[int, float] = {}
        deadline = started + 20
        while len(closed) < 3 and time.monotonic() < deadline:
            if 2 not in closed:
                try:
                    socks[2].sendall(b"a")
                    trickled += 1
                except OSError:
                    closed[2] = time.monotonic() - started
            for i, s in enumerate(socks):
                if i in closed:
                    continue
                s.settimeout(0.25)
                try:
                    if s.recv(100) == b"":
                        closed[i] = time.monotonic() - started
                except socket.timeout:
                    pass
                except OSError:
                    closed[i] = time.monotonic() - started
            if time.monotonic() - started < 5:
                assert fetch(web.port, "/api/runs").status == 200
        assert sorted(closed) == [0, 1, 2], closed
        assert all(9.0 <= at <= 14.0 for at in closed.values()), closed
        assert trickled >= 5  # it kept sending all along
    finally:
        for s in socks:
            s.close()
    assert limited(web.port, "head_timeout") == 3
    assert fetch(web.port, "/healthz").status == 200


@pytest.mark.parametrize("name,head", [
    ("CL+TE", b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n"),
    ("duplicate Content-Length", b"Content-Length: 3\r\nContent-Length: 3\r\n"),
    ("+3", b"Content-Length: +3\r\n"),
    ("obs-fold", b"X-A: 1\r\n folded\r\n"),
    ("TE not chunked last", b"Transfer-Encoding: chunked, gzip\r\n"),
])
def test_ambiguous_framing_is_400(plain_web: Any, name: str, head: bytes) -> None:
    """The low finding: gevent's parser took each of these; a proxy and the web could then
    read different requests out of one stream."""
    web, _ = plain_web
    data = b"POST /api/runs HTTP/1.1\r\n" + head + b"\r\nabc"
    assert status_of(web.port, data) == b"HTTP/1.1 400 Bad Request", name
    assert limited(web.port, "bad_framing") == 1
    ok = b"GET /api/runs HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
    assert status_of(web.port, ok) == b"HTTP/1.1 200 OK"


def test_a_tokenless_web_answers_only_its_own_host_names(plain_web: Any) -> None:
    """Finding 9 over a real connection: a rebound name is 421 on every route but
    /healthz; the loopback names with any port are answered."""
    web, broker = plain_web
    get = b"GET /api/runs/r HTTP/1.1\r\n\r\n"
    for host in (b"evil.example", b"evil.example:%d" % web.port, b"127.0.0.1.nip.io"):
        assert status_of(web.port, get, host=host) == b"HTTP/1.1 421 MISDIRECTED REQUEST"
        assert status_of(web.port, b"GET /healthz HTTP/1.1\r\n\r\n", host=host) \
            == b"HTTP/1.1 200 OK"
    assert raw_request(web.port, b"GET /api/runs HTTP/1.0\r\n\r\n").startswith(
        b"HTTP/1.1 421")  # no Host at all
    for host in (b"localhost", b"127.0.0.1:1", b"[::1]:%d" % web.port):
        assert status_of(web.port, get, host=host) == b"HTTP/1.1 200 OK"
    assert limited(web.port, "host") == 4
    no_traceback(web, broker)


def test_allowed_host_adds_a_name(spawn: Callable[..., Proc], tmp_path: Path) -> None:
    broker, eps = start_broker(spawn, tmp_path / "data")
    web = start_web(spawn, eps, "--allowed-host", "dash.example.org")
    get = b"GET /api/runs HTTP/1.1\r\n\r\n"
    assert status_of(web.port, get, host=b"dash.example.org") == b"HTTP/1.1 200 OK"
    assert status_of(web.port, get, host=b"other.example.org").startswith(b"HTTP/1.1 421")


def test_a_non_reading_client_of_a_wide_run_is_dropped_by_bytes(
        spawn: Callable[..., Proc], tmp_path: Path) -> None:
    """Finding 7 against a real web: a 16,384-rank run (256-character hosts: ~12 MB
    ``ranks`` events, one a second while frames arrive) and one SSE client that never
    reads. The web drops it once its queue would pass 64 MiB (a handful of events), counted
    as ``sse_queue_bytes``, and its memory stays bounded; before, the client was kept until
    256 events (~3 GB) and the web grew by ~18 MiB a second."""
    import psutil

    ranks = 16_384
    broker, eps = start_broker(spawn, tmp_path / "data")
    web = start_web(spawn, eps)
    pusher = Pusher(eps.ingest)
    try:
        for rank in range(ranks):
            pusher.register("wide", rank, ranks, host=f"{rank:05d}" + "h" * 251)
        wait_for(lambda: fetch(web.port, "/api/runs/wide", timeout=60).status == 200
                 and len(fetch(web.port, "/api/runs/wide", timeout=60).json()["ranks"]) == ranks,
                 timeout=60, what="every rank registered", retry_on=(OSError,))
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", web.port))
        stalled.sendall(b"GET /api/runs/wide/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        rss = psutil.Process(web.proc.pid).memory_info
        start = peak = rss().rss
        deadline = time.monotonic() + 60
        i = 0
        try:
            while limited(web.port, "sse_queue_bytes") < 1:
                assert time.monotonic() < deadline, "the non-reading client was never dropped"
                pusher.send(protocol.Resources(run="wide", rank=i % ranks,
                                               sample=protocol.ResourceSample(cpu_percent=i % 100)))
                i += 1
                peak = max(peak, rss().rss)
                time.sleep(0.2)  # a rank's pace, not a synchronisation
        finally:
            stalled.close()
        assert (peak - start) < 400 * 2**20, f"web grew {(peak - start) / 2**20:.0f} MiB"
        assert fetch(web.port, "/healthz").status == 200
        no_traceback(web, broker)
    finally:
        pusher.close()
