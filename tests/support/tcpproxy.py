"""A TCP forwarder between the browser and the web whose connections a test can cut, refuse
or (in a subclass, through :meth:`Proxy._pipe`) delay: Chromium's offline emulation leaves
an open EventSource alone, so an SSE cut has to happen on the wire."""
from __future__ import annotations

import socket
import threading
from typing import Any, List

__all__ = ["Proxy"]


class Proxy:
    """A TCP forwarder between the browser and the web whose connections the test can cut
    (Chromium's offline emulation leaves an open EventSource alone)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit("//", 1)[1].split(":")
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.conns: List[socket.socket] = []
        self.lock = threading.Lock()
        self.refusing = False
        self.closed = False
        self.pumps: List[threading.Thread] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.refusing:
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self.lock:
                self.conns += [client, server]
            self._pipe(client, server)

    def _pipe(self, client: socket.socket, server: socket.socket) -> None:
        """Carry one connection both ways (a subclass may delay or cut what it carries)."""
        for a, b in ((client, server), (server, client)):
            self._start_pump(self._pump, a, b)

    def _start_pump(self, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self.pumps.append(t)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            Proxy.close_pair(src, dst)

    @staticmethod
    def close_pair(src: socket.socket, dst: socket.socket) -> None:
        """End one carried connection: both of its sockets, each shut down first."""
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def drop(self, refuse: bool = False) -> None:
        """Cut every open connection; with ``refuse``, close new ones at once until resume()."""
        self.refusing = refuse
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def resume(self) -> None:
        self.refusing = False

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.closed = True
        self.listener.close()
        self.drop()
        self.thread.join(timeout=5)
        for t in self.pumps:
            t.join(timeout=5)
