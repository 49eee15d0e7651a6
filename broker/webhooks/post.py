"""One webhook POST with a deadline for the whole attempt, and no redirects (issue 32).

``urllib``'s timeout is per socket operation: a receiver that trickles a header byte every
4 s kept a 5 s timeout from ever firing and held delivery for 62 s. Here the attempt has one
deadline (connect, send, status line, headers and the first 64 KiB of the answer): a timer
shuts the socket down when it passes, which ends whatever read is blocked. Redirects are
not followed: a 3xx is an answer like a 4xx (refused, never counted as sent), so a receiver
cannot bounce the alert, and its secret-bearing body, elsewhere.

Only the standard library (``http.client``); :func:`post` takes the same
``(urllib.request.Request, timeout)`` as the notifier's injectable opener. Like ``urlopen``
it goes through the proxy of ``http_proxy``/``https_proxy`` unless ``no_proxy`` names the
host (an HTTPS URL through a ``CONNECT`` tunnel).
"""
from __future__ import annotations

import http.client
import socket
import threading
import urllib.parse
import urllib.request

__all__ = ["post", "DeadlineExceeded"]


class DeadlineExceeded(TimeoutError):
    """The attempt did not finish within its deadline."""


def _shut(conn: http.client.HTTPConnection, fired: threading.Event) -> None:
    fired.set()
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _connection(parts: urllib.parse.SplitResult, deadline: float
                ) -> tuple[http.client.HTTPConnection, str]:
    """The connection for a URL (through the environment's proxy, as ``urlopen`` would)
    and the request target to send on it."""
    https = parts.scheme == "https"
    host = parts.hostname or ""
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        via = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
        if https:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                via.hostname or "", via.port or 8080, timeout=deadline)
            conn.set_tunnel(host, parts.port or 443)
            return conn, path
        conn = http.client.HTTPConnection(via.hostname or "", via.port or 8080, timeout=deadline)
        return conn, urllib.parse.urlunsplit(parts._replace(fragment=""))  # absolute form
    cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
    return cls(host, parts.port, timeout=deadline), path


def post(request: urllib.request.Request, deadline: float) -> int:
    """POST ``request`` and return the answer's status; the whole attempt ends within
    ``deadline`` seconds (:class:`DeadlineExceeded`). Raises ``OSError``/``HTTPException``
    like ``urlopen`` for a receiver that cannot be reached or does not speak HTTP."""
    conn, path = _connection(urllib.parse.urlsplit(request.full_url), deadline)
    fired = threading.Event()
    timer = threading.Timer(deadline, _shut, (conn, fired))
    timer.daemon = True
    timer.start()
    try:
        body = request.data if isinstance(request.data, bytes) else b""
        conn.request("POST", path, body=body, headers=dict(request.header_items()))
        response = conn.getresponse()
        response.read(65536)  # a little, so keep-alive servers see a complete exchange
        if fired.is_set():
            raise DeadlineExceeded(f"attempt past its {deadline:g} s deadline")
        return int(response.status)
    except (OSError, http.client.HTTPException) as exc:
        if fired.is_set():
            raise DeadlineExceeded(f"attempt past its {deadline:g} s deadline") from exc
        raise
    finally:
        timer.cancel()
        conn.close()
