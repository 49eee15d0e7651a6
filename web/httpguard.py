"""The web's hardened HTTP handler: gevent pywsgi's ``WSGIHandler`` with ``TCP_NODELAY``, a
request head bounded in bytes and time, and no ambiguous body framing.

Split from ``web/serve.py`` (which builds the servers and uses
:func:`nodelay_handler_class`) so that the rules a connection meets before the app (and so
before any token check) read in one place: :data:`MAX_HEAD_BYTES` (else 431),
:data:`HEAD_TIMEOUT` (else closed), :func:`framing_problem` (else 400), and the access log
without a ``?token=`` (:func:`redact_token`). SECURITY.md promises these limits; they are
constants, not knobs. Importing this module imports no gevent: the handler class is built
on first use.
"""
from __future__ import annotations

import logging
import re
import socket
from typing import Any

log = logging.getLogger(__name__)

def set_nodelay(sock: Any) -> None:
    """Turn Nagle's algorithm off on an accepted connection.

    An SSE event is one small write. With Nagle on, a write made while the previous small
    segment (say the 1/s ``ranks`` event) is still unacknowledged is held by the kernel until
    the client's delayed ACK, up to ~40 ms: that was the whole e2e p99. The web writes whole
    events (never byte by byte), so sending each write at once costs nothing. A socket that
    is not TCP (a UNIX socket) or is already closed is left alone.
    """
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        pass


_NODELAY_HANDLER: Any = None

_TOKEN_IN_QUERY = re.compile(r"([?&]token=)[^&\s]*", re.IGNORECASE)


def redact_token(line: str) -> str:
    """``line`` with every ``token=`` query value replaced, for logs."""
    return _TOKEN_IN_QUERY.sub(r"\1<redacted>", line)


#: The most bytes of a request's head (request line and headers) the web reads: a bigger
#: one is answered 431 and its connection closed (PROTOCOL 4; issue 19 finding 8: 150
#: unfinished ~5.7 MB heads pinned 918 MB before any token check).
MAX_HEAD_BYTES = 64 * 1024
#: Seconds a connection has to send a whole request head (counted from when the web starts
#: waiting for it, so an idle keep-alive connection is closed after it too); then the
#: connection is closed without an answer.
HEAD_TIMEOUT = 10.0
#: The read buffer of a connection's ``rfile``. pywsgi makes it ``io.DEFAULT_BUFFER_SIZE``
#: (8 KiB), allocated when the connection is accepted and held until it closes; an SSE
#: client reads one request head and then never again, so those 8 KiB were a quarter of what
#: the web holds per client (``fanout_kib_per_client``). A head bigger than this is still
#: read whole (a few more ``recv`` calls); :data:`MAX_HEAD_BYTES` is the head's bound.
RFILE_BUFFER_BYTES = 1024
#: The 431 answer, written by the handler itself (the app never sees such a request).
HEAD_TOO_LARGE_RESPONSE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                           b"Connection: close\r\nContent-Length: 0\r\n\r\n")
#: After a 431 the web still reads (and discards) up to this many bytes of the refused
#: head, for at most :data:`LINGER_SECONDS`, before closing: closing with unread bytes
#: makes the kernel send a reset, which can destroy the 431 before the client reads it.
LINGER_BYTES = 1024 * 1024
LINGER_SECONDS = 1.0
_DIGITS = re.compile(r"[0-9]{1,18}")


class HeadTooLarge(Exception):
    """A request head over :data:`MAX_HEAD_BYTES`."""


class HeadTimeout(Exception):
    """A request head not complete within :data:`HEAD_TIMEOUT`."""


def framing_problem(lines: list[str]) -> str | None:
    """Why a request's header lines (after the request line, without line ends) frame its
    body ambiguously, or None.

    gevent's parser takes ``Content-Length`` and ``Transfer-Encoding`` together (dropping the
    length), a repeated ``Content-Length`` (one of them), ``+3`` (``int()`` does), an unknown
    transfer coding (then it reads by the length) and obs-fold continuation lines: each is a
    way for a proxy in front of the web and the web to see different requests (smuggling),
    so each is a 400 here (RFC 9112 sections 5.2, 6.1, 6.3)."""
    lengths: list[str] = []
    codings: list[str] = []
    for line in lines:
        if line[:1] in (" ", "\t"):
            return "obsolete header line folding"
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            return "malformed header line"
        key = name.lower()
        if key == "content-length":
            lengths.append(value.strip())
        elif key == "transfer-encoding":
            codings.append(value.strip().lower())
    if codings and lengths:
        return "both Content-Length and Transfer-Encoding"
    if len(lengths) > 1:
        return "more than one Content-Length"
    if lengths and not _DIGITS.fullmatch(lengths[0]):
        return "Content-Length is not a decimal number"
    if len(codings) > 1 or (codings and codings[0] != "chunked"):
        return "Transfer-Encoding other than one 'chunked'"
    return None


def nodelay_handler_class() -> Any:
    """gevent pywsgi's ``WSGIHandler``, hardened: ``TCP_NODELAY``, a bounded request head.

    pywsgi reads the request line with ``rfile.readline(8192)`` and the headers with
    ``http.client.parse_headers`` (100 lines of up to 64 KiB each, so ~6.5 MB a head) with
    no time limit. This handler reads the whole head itself first, at most
    :data:`MAX_HEAD_BYTES` (else 431) within :data:`HEAD_TIMEOUT` (else the connection is
    closed), rejects ambiguous body framing (:func:`framing_problem`, 400), and then lets
    pywsgi parse the head from memory. All of it happens before the app, so before any
    token check. Each refusal is counted on the server's ``limit_counter`` (the hub's
    :meth:`~web.hub.Hub.count_limit`, set by :class:`Web`) when it has one.

    Built on first use (importing gevent.pywsgi stays out of this module's import, see the
    module docstring) and cached, so every server of the process shares one class."""
    global _NODELAY_HANDLER
    if _NODELAY_HANDLER is None:
        import io

        import gevent
        from gevent.pywsgi import WSGIHandler

        class NoDelayHandler(WSGIHandler):  # type: ignore[misc]
            """A pywsgi handler whose connection sends each write at once (no Nagle) and
            whose request heads are bounded in bytes and time."""

            _head: list[bytes] | None = None
            rfile: Any

            def __init__(self, sock: Any, address: Any, server: Any) -> None:
                super().__init__(sock, address, server)
                # pywsgi's own rfile has an 8 KiB buffer: swapped for a small one before a
                # byte is read (closing it leaves the socket open: it only drops its ref)
                self.rfile.close()
                self.rfile = sock.makefile("rb", RFILE_BUFFER_BYTES)

            def handle(self) -> None:
                set_nodelay(self.socket)
                super().handle()

            def _count(self, reason: str) -> None:
                counter = getattr(self.server, "limit_counter", None)
                if counter is not None:
                    counter(reason)

            def _read_head(self) -> list[bytes]:
                """The head's lines (ends kept) up to the blank line; [] at EOF before any
                byte. Raises :class:`HeadTooLarge` or :class:`HeadTimeout`."""
                lines: list[bytes] = []
                total = 0
                with gevent.Timeout(HEAD_TIMEOUT, HeadTimeout):
                    while True:
                        line = self.rfile.readline(MAX_HEAD_BYTES + 1 - total)
                        total += len(line)
                        if total > MAX_HEAD_BYTES:
                            raise HeadTooLarge
                        if not line:  # EOF: a half head is no request
                            return []
                        lines.append(line)
                        if len(lines) > 1 and line in (b"\r\n", b"\n"):
                            return lines

            def handle_one_request(self) -> Any:
                if self.rfile.closed:
                    return None
                try:
                    head = self._read_head()
                except HeadTooLarge:
                    self._count("head_too_large")
                    log.info("request head from %s over %d bytes: 431",
                             self.client_address, MAX_HEAD_BYTES)
                    self._refuse(HEAD_TOO_LARGE_RESPONSE)
                    return None
                except HeadTimeout:
                    self._count("head_timeout")
                    log.debug("request head from %s not complete within %.0f s: closed",
                              self.client_address, HEAD_TIMEOUT)
                    return None
                except OSError:
                    return None
                if not head:
                    return None
                self._head = head
                return super().handle_one_request()

            def _refuse(self, response: bytes) -> None:
                """Send ``response``, end our side, and read out (a bounded amount of) what
                the client is still sending so that it gets to read the answer."""
                self.status = response.split(b" ", 2)[1]
                try:
                    self.socket.sendall(response)
                    self.socket.shutdown(socket.SHUT_WR)
                    drained = 0
                    with gevent.Timeout(LINGER_SECONDS, False):
                        while drained < LINGER_BYTES:
                            chunk = self.socket.recv(65536)
                            if not chunk:
                                break
                            drained += len(chunk)
                except OSError:
                    pass

            def read_requestline(self) -> str:
                head = self._head or [b""]
                return head[0].decode("latin-1")

            def format_request(self) -> str:
                # The access log must not carry a ``?token=`` credential.
                return redact_token(super().format_request())

            def read_request(self, raw_requestline: str) -> Any:
                # A header line over 100 headers raises http.client's HTTPException, which
                # pywsgi answers 400 but also prints a traceback for; as a ValueError it is a
                # one-line client error.
                import http.client

                head, self._head = self._head or [], None
                lines = [raw.decode("latin-1").rstrip("\r\n") for raw in head[1:-1]]
                problem = framing_problem(lines)
                if problem is not None:
                    self._count("bad_framing")
                    raise ValueError(f"bad request framing: {problem}")
                rfile = self.rfile
                self.rfile = io.BytesIO(b"".join(head[1:]))
                try:
                    return super().read_request(raw_requestline)
                except http.client.HTTPException as exc:
                    raise ValueError(f"bad request headers: {type(exc).__name__}") from None
                finally:
                    self.rfile = rfile

        _NODELAY_HANDLER = NoDelayHandler
    return _NODELAY_HANDLER
