"""The agent's socket: one ZeroMQ PUSH per process, non-blocking sends into a bounded queue,
drop and error counters, and fork safety (PROTOCOL.md section 5, "No call ever blocks").

* **Never block, never raise.** A frame goes out with ``zmq.NOBLOCK`` into a queue bounded by
  the send high-water mark (``sndhwm``); a frame that does not fit (broker slow or gone) is
  dropped and counted. Any other failure (encoding, a closed socket, a frame over the wire
  limit) is counted, logged rate-limited and swallowed.
* **No I/O before the first send.** The context and socket are created by the first frame,
  so an agent can be built (and ``fork()``-ed) cheaply. An unusable endpoint (or a CURVE key
  that does not load) latches the pusher as broken: one failed attempt, not one per frame.
* **Fork safety.** ZeroMQ contexts must not be used across ``fork()``. The pusher records
  the pid that made its context; in a forked child (the agent's ``os.register_at_fork``
  hook, plus a pid check on the slow path for forks that bypass it) it lets go of the
  inherited context and socket *without touching them* (parked in :data:`FORK_ORPHANS` so
  that their finalisers never run in the child) and makes a fresh pair if the child sends.
* **Bounded shutdown.** Every socket gets ``LINGER`` = ``linger_ms`` at creation, so
  :meth:`Pusher.close` waits at most that long for unsent frames, broker or no broker.
* **Thread safety.** The training thread, the step flusher and the sampler all send; a lock
  guards the socket, held only for a non-blocking send (a microsecond or so).
* **Introduced first.** ``introduce`` (the agent's implicit ``register``, section 5) is
  sent ahead of the first frame that is not itself a ``register``; the check sits on the
  slow path that the first send takes anyway, so the hot path pays nothing for it.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, List

import zmq

from . import curve
from .protocol import MAX_FRAME_BYTES, Register, encoder
from .ratelimit import RateLimitedLog
from .reach import Reach, say_where_frames_went

log = logging.getLogger(__name__)

# hot-path bindings (log_epoch sends from the training thread): one global lookup each
_encode = encoder.encode
_getpid = os.getpid
_NOBLOCK = zmq.NOBLOCK
_Again = zmq.Again

#: zmq objects inherited across fork(): kept referenced forever in the child so that their
#: finalisers (which would warn, or destroy the parent's context state) never run there.
FORK_ORPHANS: List[Any] = []


class Pusher:
    """One agent's PUSH socket to ``broker`` (see the module docstring).

    ``on_fork`` is called when a send notices a fork that the at-fork hook missed (the
    agent resets all of its per-process state, this pusher's included, through it);
    ``introduce`` returns the encoded ``register`` frame to send ahead of the first other
    frame (``None``: nothing to send). Both are called with the pusher's lock held."""

    def __init__(self, broker: str, *, sndhwm: int, linger_ms: int, warn: RateLimitedLog,
                 on_fork: Callable[[], None] | None = None,
                 introduce: Callable[[], bytes | None] | None = None) -> None:
        self.broker = broker
        self.sndhwm = sndhwm
        self.linger_ms = linger_ms
        self._warn = warn
        self._on_fork = on_fork or self.reset_after_fork
        self._introduce = introduce
        #: whether a ``register`` went out (or the introduction was tried): once per agent,
        #: not again in a forked child, whose rank the broker already knows
        self.introduced = introduce is None
        self.closed = False
        self.sent = 0
        self.dropped = 0
        self.errors = 0
        self._broken: Exception | None = None  # set when the endpoint proved unusable
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._reach: Reach | None = None  # whether a broker ever took the connection
        #: ``self._sock.send`` while the socket is usable (None: not created yet, closed,
        #: broken or forked): the send fast path is "``_push`` set and same pid"
        self._push: Any = None
        self._pid = os.getpid()  # the process whose context self._ctx is
        self.lock = threading.Lock()

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's zmq objects without touching them."""
        if self._ctx is not None or self._sock is not None:
            FORK_ORPHANS.append((self._ctx, self._sock))
        if self._reach is not None:
            FORK_ORPHANS.append((None, self._reach.forget()))
            self._reach = None
        self._ctx = None
        self._sock = None
        self._push = None
        self._pid = os.getpid()
        self.lock = threading.Lock()  # the parent's may have been held by a thread at fork

    def _socket(self) -> zmq.Socket:
        """The PUSH socket of this process, created on first use. Call with the lock held.

        Raises what ZeroMQ raises for an unusable endpoint; the caller latches that in
        ``self._broken`` so that a bad endpoint costs one failed attempt, not one per frame."""
        if self._pid != os.getpid():  # a fork the at-fork hook did not see (e.g. a raw syscall)
            self._on_fork()
        if self._sock is None:
            ctx = zmq.Context(io_threads=1)
            sock = None
            reach = None
            try:
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, self.linger_ms)
                sock.setsockopt(zmq.SNDHWM, self.sndhwm)
                # CURVE from RANKBOARD_CURVE_*; a configured but unusable key raises here,
                # which latches the agent as broken: it sends nothing rather than plain.
                for option, value in (curve.socket_options() or {}).items():
                    sock.setsockopt(option, value)
                # the monitor before the connect: ZeroMQ connects in its I/O thread at once,
                # and a monitor attached after a connection is made never hears of it (on a
                # busy machine the rank then said, wrongly, that its frames went nowhere)
                reach = Reach(sock)
                sock.connect(self.broker)
            except BaseException:
                if reach is not None:
                    reach.close()
                if sock is not None:
                    sock.close(linger=0)
                ctx.term()
                raise
            self._ctx, self._sock = ctx, sock
            self._push = sock.send
            self._reach = reach
        return self._sock

    def send(self, frame: Any) -> bool:
        """Encode ``frame`` and queue it without blocking; ``True`` when queued."""
        try:
            data = _encode(frame)
        except Exception as exc:
            return self.lose("encode", "rankboard: could not encode a %s frame: %r", type(frame).__name__, exc)
        if len(data) > MAX_FRAME_BYTES:
            return self.lose("oversize", "rankboard: %s frame of %d bytes is over the 4 MiB limit; not sent",
                             type(frame).__name__, len(data))
        return self.send_bytes(data, type(frame))

    def send_bytes(self, data: bytes, frame_type: type) -> bool:
        """Queue one encoded frame without blocking; count it as sent or dropped.

        The fast path (the socket exists, in this process) is one lock, one pid check and one
        non-blocking send; the first send, a closed or broken pusher and a fork the at-fork
        hook did not see go through :meth:`_send_other`, under the same lock."""
        with self.lock:
            push = self._push
            if push is not None and self._pid == _getpid():
                try:
                    push(data, _NOBLOCK)
                except _Again:
                    self.dropped += 1
                    return False
                except Exception as exc:
                    self.dropped += 1
                    self.errors += 1
                    failure, fatal = exc, False
                else:
                    self.sent += 1
                    return True
            else:
                outcome = self._send_other(data, frame_type)
                if isinstance(outcome, bool):
                    return outcome
                failure, fatal = outcome
        # logging happens outside the lock: a slow log handler must not stall the other sender
        if fatal:
            log.error("rankboard: cannot use broker endpoint %r (%r); this agent will send nothing",
                      self.broker, failure)
        else:
            self._warn("send", "rankboard: could not send a %s frame to %s: %r",
                       frame_type.__name__, self.broker, failure)
        return False

    def _send_other(self, data: bytes, frame_type: type) -> bool | tuple[Exception, bool]:
        """Every send but the fast path; call with the lock held. Counts the frame and returns
        whether it was queued, or ``(failure, fatal)`` for the caller to log once unlocked."""
        if self.closed or self._broken is not None:
            self.dropped += 1
            if self._broken is not None:
                self.errors += 1
            return False
        try:
            sock = self._socket()
        except Exception as exc:
            self._broken = exc
            self.dropped += 1
            self.errors += 1
            return exc, True
        if not self.introduced:
            self._introduce_first(sock, frame_type)
        try:
            sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return False
        except Exception as exc:
            self.dropped += 1
            self.errors += 1
            return exc, False
        self.sent += 1
        return True

    def _introduce_first(self, sock: zmq.Socket, frame_type: type) -> None:
        """Send the implicit ``register`` ahead of a first frame that is not one (once)."""
        self.introduced = True
        if frame_type is Register or self._introduce is None:
            return
        try:
            register = self._introduce()
            if register is not None:
                sock.send(register, zmq.NOBLOCK)
                self.sent += 1
        except zmq.Again:
            self.dropped += 1
        except Exception as exc:  # counted; the frame behind it still goes
            self.dropped += 1
            self.errors += 1
            self._warn("register", "rankboard: could not send the implicit register: %r", exc)

    def lose(self, kind: str, msg: str, *args: Any) -> bool:
        """Count a frame that could not even be built, log it rate-limited; return False."""
        with self.lock:
            self.dropped += 1
            self.errors += 1
        self._warn(kind, msg, *args)
        return False

    def close(self) -> None:
        """Stop sending and release ZeroMQ, giving queued frames up to ``linger_ms``.

        The socket is taken under the lock and closed outside it: a thread still sending
        gets an immediate drop, not a wait of up to ``linger_ms``. In a forked child it
        closes only what the child itself created. Idempotent."""
        with self.lock:
            self.closed = True
            if self._pid != os.getpid():
                self._on_fork()
            sock, ctx = self._sock, self._ctx
            self._sock = self._ctx = self._push = None
            reach, self._reach = self._reach, None
        reached = reach.reached() if reach is not None else None
        if reach is not None:
            reach.close()
        if reached is False and self.sent:
            say_where_frames_went(self.broker, self.sent)
        try:
            if sock is not None:
                sock.close(linger=self.linger_ms)
            if ctx is not None:
                ctx.term()  # bounded: the only socket had LINGER = linger_ms
        except Exception as exc:
            self._warn("close", "rankboard: error closing the socket: %r", exc)
