"""The control channel (PROTOCOL.md section 2.5): dumps and profiles on request.

A :class:`Control` owns one ZeroMQ context, one SUB socket and one daemon thread. The SUB
socket connects to the broker's publish socket (:func:`control_endpoint`: the explicit
endpoint, ``RANKBOARD_CONTROL``, or the ingest endpoint's host with its port + 1), with
CURVE when the agent's ingest uses CURVE (same server key, same client key pair), and
subscribes to its own run's topic only (framing: :mod:`rank_agent.controlwire`). The thread
makes, uses and closes the socket itself (a ZeroMQ socket belongs to one thread) and does
all the work of an answer, so the training thread never pays for a request:

* ``stacks``: a dump of every thread (``main`` = the training thread), sent at once as a
  ``stacks`` frame of reason ``request`` (well within the contract's 1 s);
* ``profile``: the training thread's stack sampled ``hz`` times a second for ``seconds``
  (:class:`rank_agent.stacks.ProfileCounter`, bounded to 2,000 distinct stacks), sent when
  done (within ``seconds`` + 1 s). While a profile runs, the socket is still read between
  samples: a ``stacks`` request is answered at once, up to 4 further profiles wait their
  turn (more are dropped and logged).

Answers go through the ``send`` callable (the agent's non-blocking, counting send). The
thread wakes every :data:`POLL_S` to see whether :meth:`Control.close` was called, so
``close()`` returns within about that (plus a dump in progress) and leaves no thread, socket
or context behind. A failure to connect (a bad endpoint, unusable CURVE keys) is logged
once and the channel stays closed; training never sees it. Fork-safe: a forked child parks
the parent's context untouched and the owner's next :meth:`Control.start` makes a new one.

Hardening (issue 32, finding 8): the thread's warnings are rate-limited
(:class:`~rank_agent.ratelimit.RateLimitedLog`, one line per kind per
:data:`WARN_INTERVAL_S`, then how many were suppressed): 20,000 malformed messages were
20,000 lines on the training job's stderr. A read drains at most :data:`MAX_READ` messages
and stops when :meth:`Control.close` is called, so a flood cannot keep the thread past
``close()``. Without CURVE nothing proves who publishes at the endpoint: when it is not the
broker's own (ingest port + 1), anyone who binds it first (a local squatter) is obeyed, so
that is said once per endpoint (:func:`squatter_warning`).

Trust (issue 38, finding 6; :mod:`rank_agent.controlauth`): when the agent has the broker's
control secret (``RANKBOARD_CONTROL_SECRET``, ``RANKBOARD_CONTROL_SECRET_FILE``, or the
default data dir's ``control.secret`` that ``rankboard up`` creates), the thread obeys only
requests the broker signed with it, each once and within 10 s of this host's clock; the rest
are dropped, counted by reason in :attr:`Control.refused` and logged once a minute per
reason. The secret is read by the thread (the constructor does no I/O); a secret configured
but unusable leaves the channel closed. Without a secret nor CURVE the thread says once, at
start, that anyone on this host who binds the endpoint is obeyed.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from functools import partial
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Tuple, Union

import zmq

from . import controlauth, curve
from .controlwire import ControlError, ControlRequest, control_topic, decode_request
from .digits import is_ascii_digits
from .flightrec import send_collectives
from .protocol import Stacks
from .ratelimit import RateLimitedLog
from .shards import pick_control
from .stacks import ProfileCounter, dump_threads, fit_profile, main_thread_ident

__all__ = ["Control", "control_endpoint", "CONTROL_ENV", "POLL_S", "MAX_QUEUED_PROFILES"]

log = logging.getLogger(__name__)

CONTROL_ENV = "RANKBOARD_CONTROL"
#: How often the thread checks for close() while idle, seconds.
POLL_S = 0.1
#: Profiles that may wait while one runs.
MAX_QUEUED_PROFILES = 4
#: Seconds between two warning lines of one kind from the control thread.
WARN_INTERVAL_S = 60.0
#: Messages one read of the socket takes at most before the loop looks at ``stop`` again.
MAX_READ = 256

_rlog = RateLimitedLog(log, WARN_INTERVAL_S)
#: endpoints already warned about (a process says it once per endpoint)
_WARNED: set[str] = set()
#: endpoints whose trust model was already said (once per process and endpoint)
_TRUST_SAID: set[str] = set()

_CONTROLS: weakref.WeakSet[Control] = weakref.WeakSet()
#: zmq contexts inherited across fork(): referenced forever in the child, never touched.
_FORK_ORPHANS: List[Any] = []


def _after_fork_in_child() -> None:
    for control in list(_CONTROLS):
        control._reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def control_endpoint(control: Union[bool, str, None], broker: str,
                     env: Optional[Mapping[str, str]] = None, *, shard: int = 0,
                     shards: int = 1) -> Optional[str]:
    """The endpoint the control channel connects to, or None for none.

    ``control`` is the ``RankAgent(control=...)`` argument: ``False``/``None`` none, a
    string that endpoint, ``True`` ``RANKBOARD_CONTROL`` or else ``broker``'s host with its
    port + 1 (``tcp://h:5585`` -> ``tcp://h:5586``). A broker endpoint with no TCP port
    (``ipc://``...) has no default: None, and the caller logs that it has no control.
    ``broker`` is the run's own shard's endpoint, number ``shard`` of ``shards`` in the
    agent's list (PROTOCOL 7.3): an explicit endpoint may then be a comma-separated list of
    the same length, read at that position; a list of another length gives no control
    channel and one warning (a misconfiguration the ranks must not guess around)."""
    if control is False or control is None:
        return None
    env = os.environ if env is None else env
    explicit = control if isinstance(control, str) else env.get(CONTROL_ENV, "")
    if explicit.strip():
        picked = pick_control(explicit, shard, shards)
        if picked is None:
            log.warning("rankboard: %s %r does not list %d endpoint(s), one per broker: no "
                        "control channel", CONTROL_ENV, explicit, shards)
        return picked
    if isinstance(control, str):
        return None
    if not broker.startswith("tcp://"):
        return None
    host, sep, port = broker.rpartition(":")
    if not sep or not is_ascii_digits(port) or host == "tcp":
        return None
    number = int(port) + 1
    if number > 65535:
        return None
    return f"{host}:{number}"


def trust_line(endpoint: str, plain: bool, where: Optional[str], why: str) -> str:
    """The one line an agent says at start about who it obeys on ``endpoint``: ``where``
    names the secret it checks (None: it has none, ``why``), ``plain``: no CURVE."""
    if where is not None:
        return (f"rankboard: control channel {endpoint}: only requests signed with the "
                f"broker's secret ({where}) are obeyed")
    if not plain:
        return f"rankboard: control channel {endpoint}: CURVE authenticates the broker"
    return (f"rankboard: control channel {endpoint} is not authenticated ({why}): any process "
            "on this host that binds it can ask this rank for stacks and profiles; set "
            f"{controlauth.SECRET_FILE_ENV} to the broker's {controlauth.SECRET_FILE_NAME}, "
            "or use CURVE")


def squatter_warning(endpoint: str, broker: str, plain: bool) -> Optional[str]:
    """The warning for a control ``endpoint`` obeyed without CURVE (``plain``) that is not
    ``broker``'s publish socket (its ingest port + 1), or None."""
    if not plain or endpoint == control_endpoint(True, broker, {}):
        return None
    return (f"rankboard: control channel {endpoint} is not the broker's publish socket "
            f"({broker} port + 1) and has no CURVE: whatever listens there first can ask this "
            "rank for dumps and profiles; use CURVE or the default endpoint")


class Control:
    """One rank's end of the control channel (module docstring).

    ``training_thread()`` names the thread to mark ``main`` and to profile, ``idle_s()`` the
    seconds since the loop's last call (both from the agent's
    :class:`~rank_agent.stallwatch.StallWatch`); ``socket_options()`` gives the CURVE
    options (None for plain) and may raise :class:`rank_agent.curve.CurveError`, which
    leaves the channel closed rather than open in plain. The constructor does no I/O.
    """

    def __init__(self, endpoint: str, run: str, rank: int, send: Callable[[Any], Any], *,
                 training_thread: Callable[[], Optional[int]] = main_thread_ident,
                 idle_s: Callable[[], float] = lambda: 0.0,
                 socket_options: Callable[[], Optional[Dict[int, bytes]]] = curve.socket_options,
                 broker: Optional[str] = None,
                 secret: Optional[Callable[[], Tuple[Optional[bytes], str]]] = None,
                 ) -> None:
        self.endpoint = endpoint
        #: the ingest endpoint (for :func:`squatter_warning`; None: not checked)
        self.broker = broker
        self.run = run
        self.rank = rank
        self.send = send
        self.training_thread = training_thread
        self.idle_s = idle_s
        self.socket_options = socket_options
        #: requests this rank answered (for tests and the owner's counters)
        self.answered = 0
        #: (the control secret, where it came from) or (None, why none); read by the thread
        self.secret = secret if secret is not None else partial(
            controlauth.agent_secret, endpoint=endpoint)
        self._verifier: Optional[controlauth.Verifier] = None
        _CONTROLS.add(self)
        self._init_state()

    def _init_state(self) -> None:
        self._pid = os.getpid()
        self._ctx: Optional[zmq.Context] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._closed = False
        self._subscribed = threading.Event()

    @property
    def refused(self) -> Dict[str, int]:
        """Control messages refused under the secret, by reason (``unsigned``, ``bad_mac``,
        ``stale``, ``replayed``); all 0 without a secret (a copy)."""
        verifier = self._verifier
        if verifier is None:
            return dict.fromkeys(controlauth.REFUSALS, 0)
        return dict(verifier.refused)

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Open the channel (a context and a daemon thread that makes the socket); once.
        Idempotent; after :meth:`close` it does nothing."""
        if self._pid != os.getpid():  # a fork the at-fork hook did not see
            self._reset_after_fork()
        if self._thread is not None or self._closed:
            return
        try:
            ctx = zmq.Context(io_threads=1)
        except Exception as exc:
            log.warning("rankboard: control channel unavailable: %r", exc)
            self._closed = True
            return
        thread = threading.Thread(target=self._loop, args=(ctx, self._stop),
                                  name=f"rankboard-control-{self.rank}", daemon=True)
        self._ctx, self._thread = ctx, thread
        try:
            thread.start()
        except Exception as exc:
            log.warning("rankboard: could not start the control channel: %r", exc)
            self._thread = None
            self._ctx = None
            ctx.term()

    def close(self, timeout: float = 3.0) -> None:
        """Stop the thread, which closes its socket; terminate the context. Idempotent."""
        self._closed = True
        if self._pid != os.getpid():
            self._reset_after_fork()
            self._closed = True
        self._stop.set()
        thread, self._thread = self._thread, None
        ctx, self._ctx = self._ctx, None
        if thread is not None and thread is not threading.current_thread() and thread.ident:
            thread.join(timeout)
            if thread.is_alive():  # cannot happen short of a hung dump; never block on term
                log.warning("rankboard: control thread did not stop; leaving its context")
                _FORK_ORPHANS.append(ctx)
                ctx = None
        if ctx is not None:
            ctx.term()  # the thread closed the only socket (linger 0): immediate
        _CONTROLS.discard(self)

    def _reset_after_fork(self) -> None:
        """In a forked child: forget the parent's context and thread without touching them."""
        if self._ctx is not None:
            _FORK_ORPHANS.append(self._ctx)
        closed = self._closed
        self._init_state()
        self._closed = closed

    # -- the thread ----------------------------------------------------------------------

    def _open(self, ctx: zmq.Context) -> Optional[zmq.Socket]:
        sock = None
        try:
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 64)
            options = self.socket_options()
            for option, value in (options or {}).items():
                sock.setsockopt(option, value)
            key, where = self.secret()
            if key is not None:  # a squatter is then harmless: not warned about
                self._verifier = controlauth.Verifier(key)
            elif self.broker is not None and self.endpoint not in _WARNED:
                warning = squatter_warning(self.endpoint, self.broker, not options)
                if warning is not None:
                    _WARNED.add(self.endpoint)
                    log.warning("%s", warning)
            if self.endpoint not in _TRUST_SAID:
                _TRUST_SAID.add(self.endpoint)
                line = trust_line(self.endpoint, not options, where if key else None, where)
                # at INFO: the broker and `rankboard up` say the trust model where a user
                # reads it; a WARNING from every rank of every job (1,024 lines for 1,024
                # ranks, on every run's stderr) would be noise, not news
                log.info("%s", line)
            sock.setsockopt(zmq.SUBSCRIBE, control_topic(self.run))
            sock.connect(self.endpoint)
        except controlauth.SecretError as exc:  # configured but unusable: closed, not open
            log.error("rankboard: %s; this rank will not answer requests for stacks", exc)
            if sock is not None:
                sock.close(linger=0)
            return None
        except Exception as exc:
            log.error("rankboard: control channel %r unusable (%r); this rank will not "
                      "answer requests for stacks", self.endpoint, exc)
            if sock is not None:
                sock.close(linger=0)
            return None
        self._subscribed.set()
        return sock

    def _loop(self, ctx: zmq.Context, stop: threading.Event) -> None:
        sock = self._open(ctx)
        if sock is None:
            return
        profiles: Deque[ControlRequest] = deque()
        try:
            while not stop.is_set():
                if profiles:
                    self._profile(profiles.popleft(), sock, profiles, stop)
                elif sock.poll(int(POLL_S * 1000)):
                    self._read(sock, profiles, stop)
        except Exception as exc:  # a bug: log, never take the process down
            log.exception("rankboard: control channel stopped: %r", exc)
        finally:
            sock.close(linger=0)

    def _read(self, sock: zmq.Socket, profiles: Deque[ControlRequest],
              stop: threading.Event) -> None:
        """What waits on the socket (at most :data:`MAX_READ` messages, not past ``stop``):
        answer ``stacks`` now, queue ``profile``."""
        for _ in range(MAX_READ):
            if stop.is_set():
                return
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            verifier = self._verifier
            if verifier is not None:
                refused = verifier.check(parts, time.time())
                if refused is not None:
                    _rlog.warning(("refused", refused), "rankboard: control message refused "
                                  "(%s): not signed by the broker with this rank's control "
                                  "secret, or replayed; %d refused so far", refused,
                                  sum(verifier.refused.values()))
                    continue
            try:
                req = decode_request(parts)
            except ControlError as exc:
                _rlog.warning("bad", "rankboard: ignoring a control message: %s", exc)
                continue
            if req.run != self.run or not req.asks(self.rank):
                continue
            if req.kind == "stacks":
                self._answer_stacks(req)
            elif len(profiles) < MAX_QUEUED_PROFILES:
                profiles.append(req)
            else:
                _rlog.warning("profiles", "rankboard: profile request %s dropped: %d already "
                              "waiting", req.request_id, MAX_QUEUED_PROFILES)

    def _answer(self, frame: Stacks) -> None:
        try:
            self.send(frame)
            self.answered += 1
        except Exception as exc:
            _rlog.warning("send", "rankboard: could not send an answer to a control request: "
                          "%r", exc)
            return
        send_collectives(self.send, frame)  # the Flight Recorder's view (7.2); never raises

    def _answer_stacks(self, req: ControlRequest) -> None:
        self._answer(Stacks(run=self.run, rank=self.rank, reason="request",
                            request_id=req.request_id, taken_at=time.time(),
                            idle_s=self.idle_s(), threads=dump_threads(self.training_thread())))

    def _profile(self, req: ControlRequest, sock: zmq.Socket,
                 profiles: Deque[ControlRequest], stop: threading.Event) -> None:
        """Sample the training thread at ``hz`` for ``seconds``; between samples, read the
        socket (a ``stacks`` request is answered at once). The schedule is anchored at the
        start, so waiting for the GIL does not slow the rate; a sample later than a whole
        interval is taken at once and the schedule moves on (never a burst to catch up)."""
        counter = ProfileCounter()
        interval = 1.0 / req.hz
        start = time.monotonic()
        end = start + req.seconds
        next_t = start
        while not stop.is_set():
            now = time.monotonic()
            if now >= end:
                break
            if now < next_t:
                # one wait per sample: poll rounds its timeout up to whole ms, and a timeout
                # means the sample is due (re-checking the clock would cost one more GIL
                # round trip with the training thread, and that is the profile's cost)
                if sock.poll(math.ceil((min(next_t, end) - now) * 1000)):
                    self._read(sock, profiles, stop)
                    continue
                if next_t >= end:
                    break
            counter.sample(self.training_thread())
            next_t += interval
            if next_t < now:  # late (the GIL was busy): one sample now, then on time
                next_t = now
        if stop.is_set():
            return
        seconds = time.monotonic() - start
        self._answer(Stacks(run=self.run, rank=self.rank, reason="request",
                            request_id=req.request_id, taken_at=time.time(),
                            idle_s=self.idle_s(), profile=fit_profile(counter.entries()),
                            samples=counter.samples, seconds=seconds))
