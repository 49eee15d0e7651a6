"""The web's WSGI server sends each SSE write at once: ``TCP_NODELAY`` on accepted sockets.

Without it Nagle's algorithm holds a small event written while the previous one is still
unacknowledged until the client's delayed ACK (~40 ms), which was the whole e2e p99. The
option is only visible on the server's side of the connection, so this runs the real
``Web.bind`` server in-process (gevent, unpatched: the client is a gevent socket in the same
hub) and reads the option off the accepted socket while a request is being served.
"""
from __future__ import annotations

import socket

from tests.web.test_handler_buffers import raw_get
from web.config import WebConfig
from web.httpguard import nodelay_handler_class
from web.serve import Web


def test_accepted_connections_have_tcp_nodelay() -> None:
    cfg = WebConfig(publish="tcp://127.0.0.1:9", snapshot="tcp://127.0.0.1:9", host="127.0.0.1")
    web = Web(cfg)  # feed never started: no I/O
    seen: list[int] = []
    try:
        web.bind(0)
        assert web.port is not None
        served = web.server.handler_class
        assert issubclass(served, nodelay_handler_class())

        class Probe(served):  # type: ignore[misc, valid-type]
            """Observes only: records the option of the socket it is serving."""

            def get_environ(self) -> dict[str, object]:
                seen.append(self.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                return super().get_environ()

        web.server.handler_class = Probe
        reply = raw_get(web.port, b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 503"), reply[:100]  # no broker: not healthy
    finally:
        web.close()
    assert seen and all(v != 0 for v in seen), seen


def test_a_plain_pywsgi_connection_has_nagle_on() -> None:
    """The control: the kernel's default on an accepted loopback socket is Nagle on, so the
    test above fails without our handler."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        client = socket.create_connection(listener.getsockname(), timeout=10)
        try:
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        finally:
            client.close()
    finally:
        listener.close()
