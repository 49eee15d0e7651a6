"""What the web holds per connection: the handler's read buffer is small (``RFILE_BUFFER_BYTES``).

pywsgi gives every connection an 8 KiB ``rfile`` buffer for as long as it lives; an SSE client
reads one request head and never again, so that buffer was a quarter of the web's memory per
client. This runs the real ``Web.bind`` server in-process (as ``test_nodelay.py`` does) and
reads the buffer's size off the handler serving a request (``sys.getsizeof`` of a
``BufferedReader`` counts its buffer), with a head several times the buffer, which must still
be read whole.
"""
from __future__ import annotations

import io
import sys

import gevent
from gevent import socket as gsocket

from web.config import WebConfig
from web.httpguard import RFILE_BUFFER_BYTES
from web.serve import Web


def raw_get(port: int, head: bytes) -> bytes:
    """Send ``head`` on a gevent socket to the in-process web and read the whole reply."""
    client = gsocket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        client.sendall(head)
        reply = b""
        with gevent.Timeout(10):
            while True:
                data = client.recv(65536)
                if not data:
                    break
                reply += data
        return reply
    finally:
        client.close()


def test_a_connection_holds_a_small_read_buffer_and_big_heads_still_arrive() -> None:
    cfg = WebConfig(publish="tcp://127.0.0.1:9", snapshot="tcp://127.0.0.1:9", host="127.0.0.1")
    web = Web(cfg)  # feed never started: no I/O
    seen: list[tuple[int, str]] = []
    try:
        web.bind(0)
        assert web.port is not None
        served = web.server.handler_class

        class Probe(served):  # type: ignore[misc, valid-type]
            """Observes only: the rfile's size and a header from the end of the head."""

            def get_environ(self) -> dict[str, object]:
                env = super().get_environ()
                seen.append((sys.getsizeof(self.rfile), str(env.get("HTTP_X_LAST", ""))))
                return env

        web.server.handler_class = Probe
        filler = b"".join(b"X-Fill-%d: %s\r\n" % (i, b"f" * 100) for i in range(60))  # ~7 KiB
        reply = raw_get(web.port, b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n" + filler
                     + b"X-Last: end\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 503"), reply[:100]  # no broker: not healthy
    finally:
        web.close()
    pywsgi_default = sys.getsizeof(io.BufferedReader(io.BytesIO(), io.DEFAULT_BUFFER_SIZE))
    assert seen and seen[0][1] == "end"  # the whole head was read
    assert seen[0][0] <= pywsgi_default - io.DEFAULT_BUFFER_SIZE + RFILE_BUFFER_BYTES, seen
