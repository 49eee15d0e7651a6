"""The web against hostile clients (extends tests/web): the token on every route including
SSE and exports, near-miss tokens, constant-time comparison, security headers on refusals,
the sandboxed SVG, and malformed HTTP (huge headers and URLs, bad run ids and Last-Event-ID
values): always a clear 4xx, never a traceback, and the web stays healthy."""
from __future__ import annotations

import base64
import hmac
import socket
from pathlib import Path
from typing import Any, Callable

import pytest

from rank_agent import protocol
from tests.support.brokers import Pusher
from tests.support.http import SSEClient, fetch
from tests.support.polling import wait_for
from tests.support.procs import Proc, no_traceback, start_broker, start_web

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

    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(web_app.hmac, "compare_digest", spy)
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
