"""The web's I/O shell on the broker feed: one greenlet with a ``zmq.green`` SUB and DEALER.

:class:`FeedPump` only moves messages between the sockets and a :class:`web.hub.Hub`, which
holds every rule (docs/DESIGN.md "The feed"); keeping the loop apart from the handler lets
the hub's rules be unit-tested without sockets. It also watches the SUB's handshakes, so a
CURVE key the broker refuses is a log line rather than a silent 503.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import gevent

from broker import feed
from rank_agent.controlwire import ControlRequest

if TYPE_CHECKING:
    from web.hub import Hub

log = logging.getLogger(__name__)


class StacksRequestError(RuntimeError):
    """A request for dumps could not be handed to the broker (no connection to it)."""


class FeedPump:
    """One greenlet per broker connection: SUB + DEALER (``zmq.green``) <-> :class:`Hub`.

    Constructing it does no I/O; :meth:`start` spawns the greenlet, :meth:`stop` ends it and
    closes the sockets with ``linger=0`` (a green context with pending messages can otherwise
    freeze every greenlet, pyzmq#809).

    ``curve``: ZeroMQ options that make both sockets CURVE clients
    (:func:`rank_agent.curve.client_options`), for a broker started with ``--curve-secret-key``.
    A broker that refuses the handshake (a key it does not authorize, or CURVE on one side
    only) lets nothing through, so the hub never connects and ``/healthz`` stays 503; a
    monitor on the SUB turns refusals into a log line (the first at once, then at most one
    per ``REFUSAL_LOG_INTERVAL``), since otherwise nothing would say why.
    """

    #: seconds between two log lines about refused handshakes
    REFUSAL_LOG_INTERVAL = 60.0
    #: seconds of feed work after which the pump lets the loop's other greenlets run (issue
    #: 38, item 2: it yielded only every 100 messages, and 100 big ones held ``/healthz``
    #: for seconds); one message's big work runs off the loop (:meth:`offload`)
    TURN_S = 0.02
    #: messages after which the pump yields even within :attr:`TURN_S` (as it always did)
    TURN_MESSAGES = 100
    #: seconds after start with no heartbeat before the pump says so, once (libzmq does not
    #: retry a connection whose handshake failed, so a refusal it reported while the
    #: monitor's event was lost, or none it reported at all, would otherwise leave the web
    #: at 503 with nothing in its log)
    SILENCE_LOG_AFTER = 10.0

    def __init__(self, hub: Hub, publish: str, snapshot: str, *, poll_ms: int = 250,
                 curve: dict[int, bytes] | None = None) -> None:
        self.hub = hub
        self.publish = publish
        self.snapshot = snapshot
        self.poll_ms = poll_ms
        self.curve = dict(curve) if curve else None
        #: handshakes the broker refused (or that failed) on the SUB since start
        self.handshake_failures = 0
        # a connection is up whose handshake has not succeeded yet: if it drops, that was a
        # failed handshake too (a plain client meeting a CURVE server often sees only the
        # server hanging up, not a protocol event, depending on who reads the greeting first)
        self._handshaking = False
        self._unlogged_failures = 0
        self._failure_logged_at: float | None = None
        self._greenlet: gevent.Greenlet | None = None
        self._stopping = False
        self._silence_logged = False
        self._dealer: Any = None  # the snapshot socket in use (requests for dumps go on it)
        #: requests for dumps handed to the broker
        self.stacks_requests = 0
        #: work the hub handed to :meth:`offload` (tests and the bench read it)
        self.offloaded = 0
        hub.offload = self.offload

    def offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in gevent's thread pool (a native thread), this greenlet waiting:
        the loop serves every other greenlet meanwhile, the GIL switching between the two
        threads every few milliseconds (``/metrics`` is built the same way,
        ``web/scrape.py``). Only the pump's greenlet calls it (through the hub), so one
        message's work at a time, in order."""
        self.offloaded += 1
        return gevent.get_hub().threadpool.apply(fn, args)

    def request_stacks(self, req: ControlRequest) -> str:
        """Hand ``req`` (checked by ``web/stacksapi.py``) to the broker, which forwards it to
        the run's ranks (PROTOCOL.md section 2.5); returns its ``request_id``. The answers
        arrive as ``stacks`` feed events (:meth:`web.hub.Hub.stacks_view`), and the hub
        groups this request's answers from now on.

        Raises :class:`StacksRequestError` when the broker cannot be reached now (nothing
        sent). Never blocks: one non-blocking send on the pump's snapshot socket, from the
        caller's greenlet."""
        dealer = self._dealer
        if dealer is None or self._stopping:
            raise StacksRequestError("not connected to the broker")
        import zmq

        try:
            dealer.send_multipart(feed.encode_stacks_request(req), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # Again: no broker connected
            raise StacksRequestError(f"cannot reach the broker: {exc.strerror}") from None
        self.stacks_requests += 1
        self.hub.note_stacks_request(req.run, req.request_id)
        return req.request_id

    def start(self) -> None:
        self._greenlet = gevent.spawn(self._run)

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping = True
        if self._greenlet is not None:
            self._greenlet.join(timeout)
            if not self._greenlet.dead:
                self._greenlet.kill(block=True, timeout=timeout)

    def _run(self) -> None:
        import zmq.green as zmq

        ctx = zmq.Context()

        def client(kind: int) -> Any:
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            for option, value in (self.curve or {}).items():  # before connect, or it is plain
                sock.setsockopt(option, value)
            return sock

        sub = client(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.publish)

        def new_dealer() -> Any:
            dealer = client(zmq.DEALER)
            dealer.connect(self.snapshot)
            self._dealer = dealer
            return dealer

        dealer = new_dealer()
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        log.info("web feed: SUB %s, snapshot %s%s", self.publish, self.snapshot,
                 " (CURVE)" if self.curve else "")
        started = time.monotonic()
        try:
            while not self._stopping:
                if self.hub.take_socket_reset():
                    poller.unregister(dealer)
                    dealer.close(linger=0)
                    dealer = new_dealer()
                    poller.register(dealer, zmq.POLLIN)
                request = self.hub.next_request()
                if request is not None:
                    try:
                        # never a blocking send: a DEALER whose connection failed its
                        # handshake has no pipe, libzmq does not retry it, and a blocking
                        # send would stop this loop (and so the monitor's log) for good;
                        # unsent, the request is "unanswered" and asked again on a new
                        # socket after SNAPSHOT_TIMEOUT
                        dealer.send_multipart(request, zmq.NOBLOCK)
                    except zmq.Again:
                        log.debug("snapshot request not sent: no broker connection yet")
                ready = dict(poller.poll(self.poll_ms))
                if sub in ready:
                    self._drain(sub, self.hub.handle_pub, zmq)
                if dealer in ready:
                    self._drain(dealer, self.hub.handle_snapshot, zmq)
                if monitor in ready:
                    self._drain(monitor, self._on_monitor_event, zmq)
                if not self._silence_logged and self.hub.heartbeat is None:
                    self._check_silence(started)
        finally:
            self._dealer = None
            for sock in (sub, dealer, monitor):
                poller.unregister(sock)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            dealer.close(linger=0)
            ctx.term()

    def _check_silence(self, started: float) -> None:
        """Log once when no heartbeat came within ``SILENCE_LOG_AFTER`` of start and no
        refusal was logged: the broker is not there, or its handshake failed unseen."""
        if time.monotonic() - started < self.SILENCE_LOG_AFTER:
            return
        self._silence_logged = True
        if self._failure_logged_at is not None:
            return  # the refusal was logged already, with its reason
        if self.curve:
            log.error("no heartbeat from the broker at %s after %.0f s: is it running, started "
                      "with --curve-secret-key, and is --curve-server-key its public key?",
                      self.publish, self.SILENCE_LOG_AFTER)
        else:
            log.error("no heartbeat from the broker at %s after %.0f s: is it running? (or the "
                      "handshake with the broker at %s failed unseen: a broker started with "
                      "--curve-secret-key needs --curve-server-key and --curve-client-key)",
                      self.publish, self.SILENCE_LOG_AFTER, self.publish)

    def _on_monitor_event(self, parts: list[bytes]) -> None:
        """Log handshake refusals: the first at once, then at most one per interval."""
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        event = parse_monitor_message(parts)
        kind = event["event"]
        value = int(event["value"])  # pyzmq hands it over as an Event flag; it is a number
        if kind == zmq.EVENT_CONNECTED:
            self._handshaking = True
            return
        if kind == zmq.EVENT_DISCONNECTED:
            if not self._handshaking:
                return  # a connection that had worked went away (a broker restart, say)
            kind, value = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0
        self._handshaking = False
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if self.handshake_failures:
                log.info("web feed: handshake with the broker at %s succeeded", self.publish)
                self.handshake_failures = self._unlogged_failures = 0
                self._failure_logged_at = None
            return
        self.handshake_failures += 1
        now = time.monotonic()
        if (self._failure_logged_at is not None
                and now - self._failure_logged_at < self.REFUSAL_LOG_INTERVAL):
            self._unlogged_failures += 1
            return
        self._failure_logged_at = now
        more = (f" ({self._unlogged_failures} more since the last report)"
                if self._unlogged_failures else "")
        self._unlogged_failures = 0
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            log.error("the broker at %s refused this web's CURVE key (ZAP status %s): is its "
                      "public key in the broker's --curve-authorized directory?%s",
                      self.publish, value, more)
        elif self.curve:
            log.error("CURVE handshake with the broker at %s failed (error %#x): is the "
                      "broker started with --curve-secret-key, and is --curve-server-key "
                      "its public key?%s", self.publish, value, more)
        else:
            log.error("handshake with the broker at %s failed (error %#x): a broker started "
                      "with --curve-secret-key needs --curve-server-key and "
                      "--curve-client-key%s", self.publish, value, more)

    def _drain(self, sock: Any, handler: Callable[[list[bytes]], None], zmq: Any) -> None:
        """Handle what is queued on ``sock`` now, yielding to other greenlets whenever
        :attr:`TURN_S` of work has passed since the last yield (messages vary from bytes
        to megabytes, so a count alone bounds nothing) or :attr:`TURN_MESSAGES` messages
        were handled (so SSE writers drain their queues, bounded in events, between turns
        of small messages as before)."""
        turn = time.monotonic()
        for n in range(1, 100_000):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handler(parts)
            except Exception:  # one bad message never kills the pump
                log.exception("feed message handling failed")
            if n % self.TURN_MESSAGES == 0 or time.monotonic() - turn >= self.TURN_S:
                gevent.sleep(0)
                turn = time.monotonic()
