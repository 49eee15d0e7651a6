"""The broker's I/O shell: PULL -> Runs -> PUB, the snapshot ROUTER, timers and the journal.

Everything with meaning lives in :mod:`broker.runs` and :mod:`broker.run.sink`; this module only
moves bytes, in one thread, around one ``zmq.Poller``:

* PULL (ingest) is drained in batches by :mod:`broker.ingest` (``NOBLOCK`` until ``Again``
  or ``batch_limit``), the
  batch is journaled and flushed once, then its events are PUBlished, each encoded once.
  Flushing before publishing means no event leaves the broker before the frame that caused
  it is handed to the OS, and sequence reservations are written before their ids are used.
* The ROUTER answers snapshot requests between batches (Clone pattern), at most
  ``SNAPSHOT_SLICE_S`` of them a turn, from a cache of encoded snapshots
  (:mod:`broker.snapshots`; the requests themselves: :mod:`broker.router`): since every event is
  published as soon as it exists, a snapshot is always exactly "everything published so far".
* The poll timeout (``poll_interval``) drives ``Runs.tick`` and the 1 s heartbeat.
* Alert webhooks (PROTOCOL 3.1) run in a thread of their own (:mod:`broker.webhooks.notifier`): the
  loop only hands each live alert and run end to the notifier, which takes a lock for
  microseconds, so a receiver that hangs never slows ingest. Its counters, and the
  journal's, ride in the heartbeat.

The constructor does no I/O (pyzmq ``Device.bind_in`` style): :meth:`bind` creates and
binds the sockets, then opens the journal; :meth:`run` serves until stopped.
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence, Union

import zmq

from broker import feed
from broker.ingest import IngestLoop
from broker.retention.loop import DataDirBound
from broker.router import RouterRequests
from broker.run.events import Event
from broker.run.sink import RunSink
from broker.runs import Runs
from broker.shardgate import ShardGate
from broker.snapshots import SnapshotCache
from broker.stacks.requests import ForwardGate
from broker.webhooks.notifier import DEFAULT_REPEAT, WebhookNotifier
from rank_agent import protocol
from rank_agent.curve import CurveError, load_key, load_public_keys
from rank_agent.protocol import Register
from rank_agent.ratelimit import RateLimitedLog

__all__ = [
    "BrokerServer",
    "BindError",
    "DataDirError",
    "StartError",
    "is_loopback_endpoint",
    "tune_gc",
    "GC_YOUNG_THRESHOLD",
]

log = logging.getLogger(__name__)

#: The transport-level cap on an ingest message: the protocol's 4 MiB frame limit plus 64 KiB.
#: A message just over the protocol limit still reaches :class:`Runs` and is rejected *and
#: counted* as ``oversize`` (PROTOCOL 2); beyond this ZeroMQ drops it before allocating it and
#: disconnects the peer (nobody can count that, but it bounds what one message can pin).
DEFAULT_MAX_MESSAGE_BYTES = protocol.MAX_FRAME_BYTES + 64 * 1024
#: Messages the ingest socket queues per connected sender before back-pressure (the sender
#: waits; an agent drops by its own bounded-queue rule). ZeroMQ counts messages, not bytes,
#: so this is what bounds the bytes waiting in the broker: at most INGEST_RCVHWM x
#: DEFAULT_MAX_MESSAGE_BYTES (~130 MiB) per connection, plus the one being read. It was
#: 100,000 (x 8 MiB): 600 valid 4 MiB frames took the broker from 42 MB to 5.3 GB (issue 19
#: finding 2). 32 small frames still keep a raw PULL far faster than the broker decodes.
INGEST_RCVHWM = 32
#: Snapshot work (seconds) the loop does before it turns back to the ingest: requests left
#: over wait in the ROUTER for the next turn, so a storm of snapshot requests delays a new
#: run's first frame by about this much plus one encoding, not by the whole storm (issue 19
#: finding 10: 60 requests for a wide run held the ingest 12.7 s).
SNAPSHOT_SLICE_S = 0.02


#: The broker process's first-generation collection threshold (CPython 3.11's default: 700).
GC_YOUNG_THRESHOLD = 20_000


def tune_gc() -> tuple[int, int, int]:
    """Collect the young generation every :data:`GC_YOUNG_THRESHOLD` allocations, not 700
    (CPython 3.11's default):
    process-wide, so only a broker's entry point calls it (``rankboard broker``, and the
    benchmarks that host a :class:`BrokerServer`), never an import.

    Why: a ``steps`` frame decodes into a dozen lists and a dict that the pending columns
    hold until their step closes, so a flood triggers a collection every ~60 frames, each
    walking survivors that are still young; 4 % of the broker's instructions per 3-point
    frame went there (issue 17, measured with callgrind). The broker's own state is almost
    all acyclic (freed by reference counting) or numpy, so the rarer collections free the
    same garbage, a few MiB later at most. Returns the thresholds it replaced."""
    import gc

    before = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, before[1], before[2])
    return before


class StartError(OSError):
    """The broker cannot start; ``str()`` is a one-line reason naming the problem."""

    def __str__(self) -> str:
        return str(self.strerror)


class BindError(StartError):
    """A socket could not be bound (address in use, bad endpoint, CURVE key files)."""


class DataDirError(StartError):
    """The data dir cannot be used (not a directory, no permission, held by another broker)."""


def is_loopback_endpoint(endpoint: str) -> bool:
    """True when ``endpoint`` can only be reached from this host (ipc, inproc, loopback tcp)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme not in ("tcp", "ws", "wss"):
        return False
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    host = host.split(";")[-1].strip("[]")  # "src;dst" form: the bound address is last
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a host name: assume reachable from outside


class BrokerServer:
    """One broker: binds ingest (PULL), publish (PUB) and snapshot (ROUTER) endpoints.

    ``ingest``/``publish``/``snapshot`` may end in ``:*`` (``tcp://127.0.0.1:*``) for an
    ephemeral port; :meth:`bind` returns the endpoints actually bound. ``clock`` gives the
    unix time stamped on frames; timers use ``time.monotonic``.
    """

    def __init__(
        self,
        ingest: str = protocol.DEFAULT_INGEST,
        publish: str = protocol.DEFAULT_PUBLISH,
        snapshot: str = protocol.DEFAULT_SNAPSHOT,
        *,
        stale_after: float = 30.0,
        step_close_after: float = 10.0,
        data_dir: Union[str, Path, None] = None,
        curve_secret_key: Union[str, Path, None] = None,
        curve_authorized: Union[str, Path, None] = None,
        curve_web_authorized: Union[str, Path, None] = None,
        max_runs: int = 1000,
        retention_days: float | None = None,
        clock: Callable[[], float] = time.time,
        heartbeat_interval: float = 1.0,
        poll_interval: float = 0.1,
        batch_limit: int = 1000,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        context: zmq.Context | None = None,
        alert_webhooks: Sequence[str] = (),
        alert_repeat: float = DEFAULT_REPEAT,
        public_url: str | None = None,
        webhooks: WebhookNotifier | None = None,
        shard: tuple[int, int] = (0, 1),
        retain_bytes: int | None = None,
        retention_interval: float | None = None,
        control_secret_file: Union[str, Path, None] = None,
    ) -> None:
        if (curve_secret_key is None) != (curve_authorized is None):
            raise ValueError("CURVE needs both a secret key file and an authorized-keys directory")
        if stale_after <= 0:
            raise ValueError("stale_after must be > 0")
        if alert_repeat <= 0:
            raise ValueError("alert_repeat must be > 0")
        self.ingest_endpoint = ingest
        self.publish_endpoint = publish
        self.snapshot_endpoint = snapshot
        self.stale_after = stale_after
        if step_close_after <= 0:
            raise ValueError("step_close_after must be > 0")
        self.step_close_after = step_close_after
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.curve_secret_key = curve_secret_key
        self.curve_authorized = curve_authorized
        #: (CURVE) the webs' public keys (a directory, or one key file): the only clients
        #: whose requests for dumps reach ranks (broker/stacks/requests.py)
        self.curve_web_authorized = curve_web_authorized
        self.max_runs = max_runs
        #: finished runs older than this are deleted from the journal at start (None: kept)
        self.retention_days = retention_days
        self.clock = clock
        self.heartbeat_interval = heartbeat_interval
        self.poll_interval = poll_interval
        self.batch_limit = batch_limit
        self.max_message_bytes = max_message_bytes
        #: Random per start: a new one tells the web the broker restarted.
        self.instance = uuid.uuid4().hex
        # Runs checks max_runs (ValueError when < 1).
        #: Alert webhooks (``webhooks``: a notifier built by the caller, for tests and
        #: benchmarks; else one for ``alert_webhooks``, doing nothing without URLs). Started
        #: by :meth:`bind`, closed by :meth:`close`.
        self.webhooks = webhooks if webhooks is not None else WebhookNotifier(
            alert_webhooks, repeat=alert_repeat, public_url=public_url)
        self.runs = Runs(stale_after=stale_after, max_runs=max_runs, on_register=self._on_register,
                         step_close_after=step_close_after, on_alert=self.webhooks.alert,
                         on_run_end=self.webhooks.run_ended, on_evict=self.webhooks.forget_run,
                         hold_samples=True)
        #: ``--shard K/N`` (PROTOCOL 7.3): (K, N); a run not K's is ``wrong_shard``
        self.shard = shard
        self.runs.shard = shard[0]
        if shard[1] > 1:
            self.runs.owns = ShardGate(*shard)
        #: the control secret's file (rank_agent/controlauth.py): None = ``<data_dir>/
        #: control.secret`` when there is a data dir, else requests for dumps go unsigned
        self.control_secret_file = (Path(control_secret_file) if control_secret_file is not None
                                    else None)
        self.endpoints: dict[str, str] = {}
        self._context = context
        self._own_context = context is None
        self._ctx: zmq.Context | None = None
        self._pull: zmq.Socket | None = None
        self._pub: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self._auth: Any = None
        self._journal: Any = None
        #: set by :meth:`stop`: a plain attribute the loop reads each turn, not an Event,
        #: because a signal handler calls stop() and a lock there can deadlock (below)
        self._stop_requested = False
        self._closed = False
        self._rlog = RateLimitedLog(log)
        #: which requests for dumps reach ranks, and the counts of those refused
        self.stacks_gate = ForwardGate()
        #: encoded run snapshots, reused while their run's seq has not moved
        self.snapshots = SnapshotCache(self._rlog)
        #: the ROUTER's requests: snapshots, and requests for dumps to forward (broker/router.py)
        self._requests = RouterRequests(self.runs, self.snapshots, self.stacks_gate, self._rlog,
                                        self.instance)
        #: the receive loop and its state across batches (broker/ingest.py)
        self._ingest = IngestLoop(self.runs, batch_limit, self._rlog, flood_after=INGEST_RCVHWM)
        #: PROTOCOL 8.4: ``--retain-bytes`` (None: no bound) and the pass interval (None:
        #: $RANKBOARD_RETENTION_INTERVAL or broker.retention.plan.DEFAULT_INTERVAL)
        if retain_bytes is not None and retain_bytes <= 0:
            raise ValueError("retain_bytes must be > 0")
        self.retain_bytes = retain_bytes
        self.retention_interval = retention_interval
        self._retention = DataDirBound(self)

    # -- setup ---------------------------------------------------------------------------

    def bind(self) -> dict[str, str]:
        """Create and bind the sockets, then open the journal; returns the bound endpoints.

        Raises :class:`BindError` (address in use, bad endpoint) or :class:`DataDirError`
        with everything already created closed again.
        """
        if self._pull is not None:
            return dict(self.endpoints)
        try:
            self._bind_sockets()
        except BaseException:
            self._close_sockets()
            raise
        for name in ("ingest", "publish", "snapshot"):
            log.info("broker %s bound at %s", name, self.endpoints[name])
        if not is_loopback_endpoint(self.endpoints["ingest"]) and self._auth is None:
            log.warning(
                "ingest %s is reachable from other hosts without CURVE: anyone who can reach "
                "it can inject frames (see `rankboard keys`)", self.endpoints["ingest"]
            )
        if self.data_dir is not None:
            try:
                self._open_journal()
            except BaseException:
                self._close_sockets()
                raise
        try:
            self._load_control_secret()
        except BaseException:
            self.close()
            raise
        self.webhooks.start()  # after the replay: nothing replayed is handed to it
        return dict(self.endpoints)

    def _load_control_secret(self) -> None:
        """Read (or create, at a data dir's first start) the secret that signs requests for
        dumps (issue 38 finding 6, :mod:`rank_agent.controlauth`), and say the control
        channel's trust model in one line. :class:`StartError` for a file that cannot be
        used: the agents may already read it, so it is never replaced."""
        from rank_agent.controlauth import SecretError, broker_secret, trust_summary

        path = self.control_secret_file
        if path is None and self.data_dir is not None:
            path = self.data_dir / "control.secret"
        publish = self.endpoints.get("publish", self.publish_endpoint)
        if path is None:
            log.info("control channel: requests for dumps go unsigned: any process on this "
                     "host that binds %s can ask ranks for stacks (give the broker a data dir "
                     "or a control secret file to sign them)", publish)
            return
        try:
            key, created = broker_secret(path)
        except SecretError as exc:
            raise StartError(errno.EINVAL, str(exc)) from None
        self._requests.control_key = key
        log.info("control channel: requests for dumps signed with %s%s: %s", path,
                 " (created)" if created else "", trust_summary(path, publish))

    def _bind_sockets(self) -> None:
        if self._own_context:
            self._ctx = zmq.Context()
        else:
            self._ctx = self._context
        ctx = self._ctx
        assert ctx is not None
        pull = self._pull = ctx.socket(zmq.PULL)
        pull.linger = 0
        pull.rcvhwm = INGEST_RCVHWM
        pull.maxmsgsize = self.max_message_bytes
        pub = self._pub = ctx.socket(zmq.PUB)
        pub.linger = 0
        pub.sndhwm = 100_000  # a slow web loses events (gap -> re-snapshot) only under real overload
        router = self._router = ctx.socket(zmq.ROUTER)
        router.linger = 0
        router.sndhwm = 100_000
        router.router_mandatory = True  # a full or gone peer raises instead of silently dropping
        if self.curve_secret_key is not None:
            self._setup_curve(pull, pub, router)
        self.endpoints = {
            "ingest": self._bind_named(pull, "ingest", self.ingest_endpoint),
            "publish": self._bind_named(pub, "publish", self.publish_endpoint),
            "snapshot": self._bind_named(router, "snapshot", self.snapshot_endpoint),
        }
        if self._auth is None:
            for name in ("publish", "snapshot"):
                if not is_loopback_endpoint(self.endpoints[name]):
                    log.warning(
                        "%s %s is reachable from other hosts without CURVE: anyone who can "
                        "reach it reads every run (see `rankboard keys`)", name,
                        self.endpoints[name])

    @classmethod
    def _bind_named(cls, sock: zmq.Socket, name: str, endpoint: str) -> str:
        """:meth:`_bind_one`, and a port in use said as such, naming the port (issue 38
        finding 6: a process that took the publish port during a restart may be what the
        ranks without the control secret now obey)."""
        try:
            return cls._bind_one(sock, endpoint)
        except BindError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            port = endpoint.rpartition(":")[2]
            who = ("another broker, or a local process squatting it (ranks without the control "
                   "secret obey whatever holds it)" if name == "publish" else "another broker?")
            raise BindError(exc.errno, f"cannot bind {endpoint}: the {name} port {port} is "
                                       f"already in use ({who}); see `ss -ltnp 'sport = "
                                       f":{port}'`, or pick other ports with --ingest/--publish/"
                                       "--snapshot") from None

    @staticmethod
    def _bind_one(sock: zmq.Socket, endpoint: str) -> str:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            reason = re.sub(r"\s*\(addr=.*\)$", "", str(exc.strerror))  # pyzmq appends it
            if exc.errno == errno.EADDRINUSE:
                reason = "Address already in use"
            raise BindError(exc.errno, f"cannot bind {endpoint}: {reason}") from None
        last = sock.last_endpoint
        return last.decode() if isinstance(last, bytes) else str(last)

    def _setup_curve(self, *socks: zmq.Socket) -> None:
        """CURVE server on ingest, publish and snapshot alike, with one ZAP handler.

        Why all three: the feed carries every run's data (metadata included) and the snapshot
        hands out all of it on request, so a web on another host must prove who it is exactly
        as a rank does. One authorized-keys directory lets ranks and webs connect; one verb
        tells them apart: a request for dumps reaches ranks only from a key in
        ``curve_web_authorized`` (a rank's key would otherwise make other jobs' ranks dump).
        """
        from zmq.auth.thread import ThreadAuthenticator

        authorized = Path(str(self.curve_authorized))
        if not authorized.is_dir():
            raise BindError(errno.ENOENT, f"--curve-authorized {authorized}: no such directory")
        try:
            public, secret = load_key(str(self.curve_secret_key), "--curve-secret-key",
                                      secret=True)
        except CurveError as exc:
            raise BindError(errno.EINVAL, str(exc)) from None
        assert self._ctx is not None
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(authorized))
        for sock in socks:
            sock.curve_publickey = public
            sock.curve_secretkey = secret
            sock.curve_server = True
        log.info("ingest, publish and snapshot require CURVE; authorized client keys from %s",
                 authorized)
        self.stacks_gate.web_keys = self._web_keys()

    def _web_keys(self) -> frozenset[str]:
        """The z85 public keys whose requests for dumps reach ranks (CURVE): the key files
        in ``curve_web_authorized`` (a directory, or one file). None given: no one's."""
        where = self.curve_web_authorized
        if where is None:
            log.warning("no --curve-web-authorized: requests for dumps are refused from every "
                        "client (name the directory of the webs' public keys)")
            return frozenset()
        try:
            keys = load_public_keys(where, "--curve-web-authorized")
        except CurveError as exc:
            raise BindError(errno.EINVAL, str(exc)) from None
        log.info("requests for dumps accepted from the %d web keys in %s", len(keys), where)
        return keys

    def _open_journal(self) -> None:
        from broker.journal.journal import RETRY_S, Journal, JournalError

        assert self.data_dir is not None
        journal = self._journal = Journal(self.data_dir, retention_days=self.retention_days)
        try:
            sinks: dict[str, RunSink] = journal.load(stale_after=self.stale_after,
                                                     step_close_after=self.step_close_after,
                                                     max_runs=self.max_runs)
        except (OSError, JournalError) as exc:
            self._journal = None
            journal.close()
            if isinstance(exc, JournalError):  # its message already names the dir
                message = " ".join(str(exc).split())
            else:
                where = exc.filename or self.data_dir
                message = f"cannot use data dir {where}: {exc.strerror or exc}"
            raise DataDirError(getattr(exc, "errno", None) or errno.EIO, message) from None
        self._retention.start_pass(journal, sinks)  # PROTOCOL 8.4, before any is served
        journal.retry_interval = RETRY_S
        self.runs.restore(sinks)
        # record + note_seq per frame, not per batch: the journal reserves ids in blocks and
        # a batch may issue more events for one run than half a block.
        self.runs.recorder = journal.accept
        self.runs.sample_recorder = journal.accept_samples
        self.runs.on_settle = journal.note_seq  # an evicted run's last steps, before forget
        self.runs.loader = lambda run: journal.load_run(
            run, stale_after=self.stale_after, step_close_after=self.step_close_after)
        forget_webhooks = self.webhooks.forget_run

        def on_evict(run: str) -> None:
            journal.forget(run)
            forget_webhooks(run)

        self.runs.on_evict = on_evict
        if isinstance(self.runs.owns, ShardGate):  # the journal's runs are this shard's too
            self.runs.owns.held = lambda run: os.path.exists(
                os.path.join(journal.runs_dir, run + ".journal"))  # (a decoded id: no "/")
        log.info("journal %s: %d runs restored", self.data_dir, len(sinks))

    # -- serving -------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` is called (from any thread or a signal handler)."""
        self.run(None)

    def run(self, stop_event: threading.Event | None = None) -> None:
        """Bind if needed, then serve until ``stop_event`` is set or :meth:`stop` is called."""
        self.bind()
        pull, router = self._pull, self._router
        assert pull is not None and router is not None
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        poller.register(router, zmq.POLLIN)
        timeout_ms = max(1, int(self.poll_interval * 1000))
        next_heartbeat = started = time.monotonic()
        next_tick = next_heartbeat + self.poll_interval

        def stopping() -> bool:
            return self._stop_requested or (stop_event is not None and stop_event.is_set())

        while not stopping():
            ready = dict(poller.poll(timeout_ms))
            if pull in ready:
                self._drain_ingest()
            if router in ready:
                self._serve_snapshots()
            mono = time.monotonic()
            if mono >= next_tick:
                next_tick = mono + self.poll_interval
                self._publish_events(self.runs.tick(self.clock()))
                self._publish_events(self._retention.turn(mono))
            if mono >= next_heartbeat:
                # Webs learn of a (re)started broker from its heartbeat. The first ones go
                # out before a web's SUB has reconnected (ZeroMQ's slow joiner) and are lost,
                # so for its first two intervals the broker beats every poll interval: a web
                # sees a returning broker within ~0.1 s, not one whole interval later.
                early = mono - started < 2 * self.heartbeat_interval
                next_heartbeat = mono + (min(self.heartbeat_interval, self.poll_interval)
                                         if early else self.heartbeat_interval)
                self._send_heartbeat()

    def stop(self) -> None:
        """Ask :meth:`run` to return within one poll interval; safe from any thread and from
        a signal handler. It only sets an attribute: ``threading.Event.set`` takes a lock,
        and a second SIGTERM landing while the main thread is inside that same ``set``
        would re-enter the lock and hang the broker until SIGKILL (issue 27)."""
        self._stop_requested = True

    def close(self) -> None:
        """Close the journal, the sockets (linger 0) and the context if we made it."""
        if self._closed:
            return
        self._closed = True
        try:
            self.webhooks.close()
        except Exception:
            log.exception("closing the alert webhooks failed")
        self._retention.close()
        if self._journal is not None:
            try:
                self._journal.close()
            except Exception:
                log.exception("closing the journal failed")
            self._journal = None
            self.runs.recorder = None
            self.runs.sample_recorder = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pull, self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pull = self._pub = self._router = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None and self._own_context:
            self._ctx.term()
        self._ctx = None

    def __enter__(self) -> BrokerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop's parts ------------------------------------------------------------------

    def _on_register(self, frame: Register) -> None:
        # (The journal records the frame before this, as ``runs.recorder``.)
        if frame.port:
            self._ingest.pending_ports.append((frame.run, frame.rank, frame.port))

    def _drain_ingest(self) -> None:
        """One ingest batch (:class:`~broker.ingest.IngestLoop`), journaled and flushed,
        then published: no event leaves before the frame that caused it is written."""
        assert self._pull is not None
        out = self._ingest.drain(self._pull, self.clock())
        if self._journal is not None:
            try:
                self._journal.flush()
            except Exception:
                self._rlog.error("journal", "journal write failed", exc_info=True)
        self._send_all(out)

    def _send_all(self, messages: list[list[bytes]]) -> None:
        """PUBlish encoded messages (two parts each; ``send`` twice beats ``send_multipart``)."""
        pub = self._pub
        assert pub is not None
        send = pub.send
        more = zmq.SNDMORE
        for msg in messages:
            if len(msg) == 2:
                send(msg[0], more)
                send(msg[1])
            else:
                pub.send_multipart(msg)

    def _publish_events(self, events: list[tuple[str, Event]]) -> None:
        if not events:
            if self._journal is not None and self._journal.state_due:
                try:  # a run's alerts or figures waited for their interval (PROTOCOL 8.5)
                    self._journal.flush()
                except Exception:
                    self._rlog.error("journal", "journal write failed", exc_info=True)
            return
        if self._journal is not None:
            try:
                seen: set[str] = set()
                for run, _ in events:
                    sink = self.runs.get(run)
                    if sink is not None and run not in seen:
                        seen.add(run)
                        self._journal.note_seq(sink)
                self._journal.flush()
            except Exception:
                self._rlog.error("journal", "journal write failed", exc_info=True)
        out: list[list[bytes]] = []
        self._ingest.queue_events(events, out)
        self._send_all(out)

    def _send_heartbeat(self) -> None:
        pub = self._pub
        assert pub is not None
        c = self.runs.counters()
        hooks = self.webhooks.counters()
        journal: dict[str, int] = {}
        if self._journal is not None:
            jc = self._journal.counters()
            journal = {k: int(jc[k]) for k in feed.JOURNAL_COUNTERS if k in jc}
            journal.update(self._retention.counters())
        pub.send_multipart(feed.encode_heartbeat(
            self.instance, self.clock(), c["accepted"], c["rejected"], c["runs"], c["late_metrics"],
            c["late_steps"], c["steps_closed"], webhooks_sent=hooks["sent"],
            webhooks_failed=hooks["failed"], webhooks_dropped=hooks["dropped"], journal=journal,
        ))

    def _serve_snapshots(self) -> None:
        """The ROUTER's pending requests (:class:`~broker.router.RouterRequests`), for at
        most SNAPSHOT_SLICE_S; the rest wait for the loop's next turn, after the ingest's."""
        assert self._router is not None and self._pub is not None
        self._requests.serve(self._router, self._pub, self._auth is not None,
                             time.monotonic() + SNAPSHOT_SLICE_S)
