"""Whether a broker ever took this agent's connection, so that training with no broker says
once, at the end, where its frames went.

A PUSH socket queues frames whether or not anything listens (that is what keeps ``send``
from ever blocking), so a run whose broker was never started looks like a quiet success: no
error, no dashboard. ZeroMQ's socket monitor reports each TCP connection made; the agent
reads those events once, when it closes. Never raises: a monitor that cannot be made just
means nothing is said.
"""
from __future__ import annotations

import logging
from typing import Any

import zmq

log = logging.getLogger("rank_agent")

_CONNECTED = zmq.EVENT_CONNECTED


class Reach:
    """The socket monitor of one PUSH socket (inproc PAIR, read only at close)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._monitor: Any = None
        try:
            # an address of its own: pyzmq's default (``monitor.s-<fd>``) is the one any other
            # monitor of this socket (a test's, a user's) would bind too
            self._monitor = sock.get_monitor_socket(
                _CONNECTED, addr=f"inproc://rankboard-reach-{id(self):x}")
        except Exception:  # an old libzmq, an odd transport: just nothing said at the end
            self._monitor = None

    def reached(self, wait_ms: int = 100) -> bool | None:
        """True if a connection was ever made, False if none, None when unknown. Waits up to
        ``wait_ms`` for a first event (a process that ends right after its first frame may
        close before ZeroMQ's connection is up; close() may wait longer still, ``linger``)."""
        mon = self._monitor
        if mon is None:
            return None
        try:
            timeout = wait_ms
            while mon.poll(timeout):
                timeout = 0
                frames = mon.recv_multipart(zmq.NOBLOCK)
                event = int.from_bytes(frames[0][:2], "little") if frames and frames[0] else 0
                if event & _CONNECTED:
                    return True
        except Exception:
            return None
        return False

    def close(self) -> None:
        """Stop the monitor and close its socket (before the context terminates)."""
        mon, self._monitor = self._monitor, None
        if mon is None:
            return
        try:
            self._sock.disable_monitor()
        except Exception:
            pass
        try:
            mon.close(linger=0)
        except Exception:
            pass

    def forget(self) -> Any:
        """In a forked child: the parent's monitor socket, to be left alone (never closed here)."""
        mon, self._monitor = self._monitor, None
        return mon


def say_where_frames_went(broker: str, sent: int) -> None:
    """The one line for a process whose frames no broker took."""
    log.warning("rankboard: no broker answered at %s, so this process's %d frames went "
                "nowhere (training was not affected); start one with `rankboard up`, or set "
                "RANKBOARD_BROKER to yours", broker, sent)
