"""Serving the web: the hub, its feed pump, the Flask app and the gevent WSGI server.

This is the only module that monkey-patches (gevent), and it does so in :func:`patch`, called
first thing by each command that serves a web (:func:`run_web` here, ``rankboard up`` and
``demo``), never at import: importing this module (tests do) changes nothing.

* :class:`Web`: one web process's parts; its connections have ``TCP_NODELAY``
  (:func:`web.httpguard.set_nodelay`); ``--worker-id`` (a worker of a ``--workers N`` pool, see
  ``web/workers.py``) listens on a ``SO_REUSEPORT`` socket shared with its siblings and tags
  its responses ``X-Rankboard-Worker``; ``--metrics-port`` adds a listener serving only
  ``/metrics`` and ``/healthz``. Its handler (:func:`web.httpguard.nodelay_handler_class`)
  bounds each request head in bytes and time and refuses ambiguous body framing before the
  app runs.
* :class:`LazyBinder`: ``up`` without ``--port`` binds on the first port a rank registers.
* :class:`Stopper`: SIGINT/SIGTERM as an event the main greenlet waits on.
* :func:`run_web`: ``rankboard web`` (one web, or one worker of a pool) until stopped.

Tuning knobs for tests and operators (environment, not flags): ``RANKBOARD_SSE_QUEUE``
(events a client may fall behind before it is dropped, default 256) and
``RANKBOARD_SSE_PING`` (seconds between ``: ping`` comments, default 15). The hardening
limits (``web.httpguard.MAX_HEAD_BYTES``, ``HEAD_TIMEOUT``, ``web.runstate.MAX_QUEUED_BYTES``) are
constants, not knobs: SECURITY.md promises them.
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Protocol

from web.config import WebConfig
from web.httpguard import nodelay_handler_class

log = logging.getLogger(__name__)

#: listen backlog of a worker's SO_REUSEPORT socket (a page load opens several connections,
#: and a dashboard wall reconnecting after a restart opens thousands at once)
LISTEN_BACKLOG = 1024
#: the response header naming the worker that served a request (``--workers`` > 1 only)
WORKER_HEADER = "X-Rankboard-Worker"
#: what a ``--metrics-port`` listener serves; everything else there is 404
METRICS_PATHS = frozenset({"/metrics", "/healthz"})


def patch() -> None:
    """gevent's monkey-patching, done once, first thing in a command that serves a web."""
    from gevent import monkey

    if not monkey.is_module_patched("socket"):
        monkey.patch_all()


def say(line: str) -> None:
    """A line on stdout, flushed: what a user (or a supervisor, ``ready``) reads."""
    print(line, flush=True)


def fail(prog: str, message: str, code: int = 1) -> int:
    """Print ``<prog>: <message>`` on stderr and return ``code``: a user's mistake is one
    line, never a traceback."""
    print(f"{prog}: {message}", file=sys.stderr, flush=True)
    return code


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback literals (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_refusal(host: str, token: str | None, insecure: bool) -> str | None:
    """The one-line reason to refuse binding ``host``, or None when it is allowed."""
    if token or insecure or is_loopback_host(host):
        return None
    return (f"refusing to serve the dashboard on non-loopback host {host!r} without a token: "
            "pass --token (or set RANKBOARD_TOKEN), or --insecure-no-auth")


def dashboard_lines(host: str, port: int) -> list[str]:
    """What the user is told on bind (PROTOCOL 6): a URL that reaches the bound address.

    ``localhost`` only for 127.0.0.1 (and ``localhost`` itself): another loopback address
    such as 127.0.0.2 is not where ``localhost`` goes, so it is printed as it is."""
    bare = host.strip().strip("[]")
    if bare.lower() in ("127.0.0.1", "localhost"):
        return [f"dashboard: http://localhost:{port}",
                f"ssh -L {port}:localhost:{port} {socket.gethostname()}"]
    shown = socket.gethostname() if bare in ("0.0.0.0", "::", "") else bare
    if ":" in shown:
        shown = f"[{shown}]"
    lines = [f"dashboard: http://{shown}:{port}"]
    if is_loopback_host(bare):
        lines.append(f"ssh -L {port}:{shown}:{port} {socket.gethostname()}")
    return lines


def dashboard_url(host: str, port: int) -> str:
    """The dashboard's URL as :func:`dashboard_lines` prints it, with a trailing slash."""
    return dashboard_lines(host, port)[0].split(" ", 1)[1] + "/"


def allowed_hosts(bound: str, extra: tuple[str, ...] | list[str] = ()) -> frozenset[str]:
    """The ``Host`` names (without port, lower case, IPv6 in brackets) a web without a token
    answers (PROTOCOL 4 "Hardening"): ``localhost``, ``127.0.0.1``, ``[::1]``, the address
    it bound and each ``--allowed-host``."""
    names = {"localhost", "127.0.0.1", "[::1]"}
    for name in (bound, *extra):
        name = name.strip().lower()
        if not name:
            continue
        bare = name.strip("[]")
        names.add(f"[{bare}]" if ":" in bare else bare)
    return frozenset(names)


def _env_number(name: str, default: float, kind: Callable[[str], Any]) -> Any:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        log.warning("ignoring %s=%r: not a number", name, text)
        return default
    return value if value > 0 else default


def feed_curve(cfg: WebConfig) -> dict[int, bytes] | None:
    """The web's CURVE client options from its config, or None for a plain feed.

    ``up``/``demo`` start the broker themselves: their web's server key defaults to the
    public half of ``--curve-secret-key`` (:attr:`WebConfig.curve_server_flag` says which
    flag named the file). Raises ``ValueError`` (one line) for a bad file.
    """
    if cfg.curve_client_key is None:
        return None
    if cfg.curve_server_key is None:
        raise ValueError("--curve-client-key needs --curve-server-key (the broker's public key)")
    from rank_agent.curve import client_options

    return client_options(Path(cfg.curve_server_key), Path(cfg.curve_client_key),
                          server_label=cfg.curve_server_flag)


def reuseport_socket(host: str, port: int, *, listen: bool) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (and listening if asked).

    Every worker of a pool binds its own such socket and the kernel spreads incoming
    connections over the listening ones; the supervisor's copy is bound but never listens,
    so it holds the port without taking connections. Raises ``OSError`` whose ``strerror``
    is the one-line reason the CLI prints (it names the address, as :meth:`Web.bind` does).
    """
    where = f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(errno.EINVAL, f"cannot bind the web to {where}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        if listen:
            sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        reason = "Address already in use" if exc.errno == errno.EADDRINUSE else (
            exc.strerror or str(exc))
        raise OSError(exc.errno, f"cannot bind the web to {where}: {reason}") from None
    return sock


def bind_failure(exc: OSError) -> str:
    """The one line a failed web bind prints: the reason naming the address, and for a port
    in use how to pick another (PROTOCOL 8.5: a newcomer's second ``rankboard up`` must not
    stop at "Address already in use")."""
    reason = str(exc.strerror or exc)
    if exc.errno == errno.EADDRINUSE:
        reason += "; pick another port with --port N"
    return reason


def port_taken(host: str, port: int) -> OSError | None:
    """Whether ``host:port`` is taken now, as the web's own bind would find it (the same
    ``SO_REUSEADDR``), probed before ``up`` starts its brokers so that a port in use is one
    line and no broker log; the OSError names the address as :meth:`Web.bind`'s does. None
    when free (or for port 0: any free port)."""
    if not port:
        return None
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return None  # the real bind says what is wrong with the host
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return OSError(exc.errno, f"cannot bind the web to {host}:{port}: "
                           f"{exc.strerror or exc}")
    return None


def worker_header(app: Callable[..., Any], worker_id: int) -> Callable[..., Any]:
    """WSGI middleware adding ``X-Rankboard-Worker: <K>`` to every response.

    With several workers behind one port this is how an operator (or a test) tells which
    process answered; it names a slot (1..N), not a pid, so it reveals nothing about the
    host."""
    value = str(worker_id)

    def app_with_header(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            headers.append((WORKER_HEADER, value))
            return start_response(status, headers, exc_info)

        return app(environ, start)

    return app_with_header


def only_paths(app: Callable[..., Any], paths: frozenset[str]) -> Callable[..., Any]:
    """WSGI middleware serving ``paths`` through ``app`` (with its auth) and 404 otherwise:
    a per-worker metrics listener is for scrapers and health checks, not a second dashboard."""
    body = b'{"error": "not found"}'

    def filtered(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO") in paths:
            return app(environ, start_response)
        start_response("404 NOT FOUND", [("Content-Type", "application/json"),
                                         ("Content-Length", str(len(body)))])
        return [body]

    return filtered


# --------------------------------------------------------------------------- the web

class Bindable(Protocol):
    """What :class:`LazyBinder` binds: a :class:`Web`, or a pool of workers
    (``web/workers.py``) that starts them on the port."""

    port: int | None

    def bind(self, port: int) -> None: ...


class Web:
    """The hub, its feed pump, the app and (once bound) the gevent WSGI server."""

    def __init__(self, cfg: WebConfig, *, curve: dict[int, bytes] | None = None) -> None:
        from web.app import create_app
        from web.hub import DEFAULT_QUEUE_SIZE, Hub
        from web.pump import FeedPump
        from web.shards import ShardedHub, ShardHub, feed_pairs, run_live

        self.host: str = cfg.host
        #: this process's slot in a ``--workers`` pool (None: a web on its own)
        self.worker_id: int | None = cfg.worker_id
        queue_size = _env_number("RANKBOARD_SSE_QUEUE", DEFAULT_QUEUE_SIZE, int)
        # one hub and pump per shard (PROTOCOL 7.3, web/shards.py); one broker: a plain hub
        feeds = feed_pairs(cfg.publish, cfg.snapshot)
        hubs = [Hub(queue_size=queue_size)] if len(feeds) == 1 else [
            ShardHub(queue_size=queue_size) for _ in feeds]
        self.pumps = [FeedPump(h, p, s, curve=curve) for h, (p, s) in zip(hubs, feeds)]
        self.pump = self.pumps[0]
        self.hub: Hub | ShardedHub = hubs[0] if len(hubs) == 1 else ShardedHub(hubs)
        request_stacks = (self.hub.stacks_router(self.pumps) if isinstance(self.hub, ShardedHub)
                          else self.pump.request_stacks)
        hosts = [*cfg.allowed_hosts]
        if cfg.metrics_host:
            hosts.append(cfg.metrics_host)
        self.app = create_app(self.hub, {
            "token": cfg.token,
            "allowed_hosts": allowed_hosts(cfg.host, hosts),
            "ping_interval": _env_number("RANKBOARD_SSE_PING", 15.0, float),
            "read_only": cfg.read_only,
            "request_stacks": request_stacks,
            "run_live": run_live(self.hub),
        })
        if self.worker_id is not None:
            self.app.wsgi_app = worker_header(self.app.wsgi_app, self.worker_id)  # type: ignore[method-assign]
        self.server: Any = None
        self.metrics_server: Any = None
        self.port: int | None = None

    def start_feed(self) -> None:
        for pump in self.pumps:
            pump.start()

    def _server(self, listener: Any, app: Any) -> Any:
        from gevent.pywsgi import LoggingLogAdapter, WSGIServer

        server = WSGIServer(
            listener, app, handler_class=nodelay_handler_class(),
            log=LoggingLogAdapter(logging.getLogger("web.access"), logging.DEBUG),
            error_log=LoggingLogAdapter(logging.getLogger("web.server"), logging.ERROR),
        )
        server.limit_counter = self.hub.count_limit  # the handler counts refused heads
        return server

    def bind(self, port: int, *, reuse_port: bool = False, announce: bool = True) -> None:
        """Bind and start serving; raises OSError (e.g. the address in use).

        ``reuse_port``: listen on a ``SO_REUSEPORT`` socket, as a pool's worker does.
        ``announce``: print the ``dashboard:`` lines (a worker leaves that to its supervisor).
        """
        listener: Any = (self.host, port)
        if reuse_port:
            listener = reuseport_socket(self.host, port, listen=True)
        server = self._server(listener, self.app)
        try:
            server.start()
        except OSError as exc:
            server.close()
            reason = exc.strerror or str(exc)
            raise OSError(exc.errno, f"cannot bind the web to {self.host}:{port}: {reason}") from None
        self.server = server
        self.port = server.server_port
        log.info("web listening on http://%s:%d", self.host, self.port)
        if announce:
            for line in dashboard_lines(self.host, self.port):
                say(line)

    def bind_metrics(self, host: str, port: int) -> None:
        """Serve ``/metrics`` and ``/healthz`` alone on ``host:port`` (``--metrics-port``)."""
        server = self._server((host, port), only_paths(self.app, METRICS_PATHS))
        try:
            server.start()
        except OSError as exc:
            server.close()
            reason = exc.strerror or str(exc)
            raise OSError(exc.errno, f"cannot bind the metrics listener to {host}:{port}: "
                          f"{reason}") from None
        self.metrics_server = server
        log.info("web metrics on http://%s:%d/metrics", host, server.server_port)

    def close(self) -> None:
        self.hub.close_all()
        for server in (self.server, self.metrics_server):
            if server is not None:
                server.stop(timeout=1.0)
        self.server = self.metrics_server = None
        for pump in self.pumps:
            pump.stop()


class LazyBinder:
    """``up`` without ``--port``: bind on the first registered port (PROTOCOL 6).

    First arrival wins; a later, different port is warned about once and ignored; after a
    failed bind the next registration naming a port (any) is tried.
    """

    def __init__(self, web: Bindable) -> None:
        #: what binds: a web, or a pool that starts its workers there (``up --workers N``);
        #: either has ``port`` (None until bound) and ``bind(port)`` raising OSError
        self.web = web
        self.ignored: set[int] = set()
        self._binding = False

    def listen(self, hub: Any) -> LazyBinder:
        """Hear ``hub``'s port registrations and snapshots (both may name the port)."""
        hub.port_listeners.append(self.on_port)
        hub.snapshot_listeners.append(self.on_snapshot)
        log.info("the web binds on the first port a rank registers (or pass --port)")
        return self

    def on_snapshot(self, hub: Any) -> None:
        """A rank may have registered before the web subscribed: take the port of the newest
        unfinished run in the snapshot, as if its registration had just arrived."""
        if self.web.port is not None:
            return
        for state in hub.runs_newest_first():
            port = state.header.get("port")
            if isinstance(port, int) and port > 0 and state.header.get("status") not in (
                    "complete", "failed"):
                self.on_port(state.run, -1, port)
                return

    def on_port(self, run: str, rank: int, port: int) -> None:
        import gevent

        if self.web.port is not None:
            if port != self.web.port and port not in self.ignored:
                self.ignored.add(port)
                log.warning("run %s registered port %d; the web is already on %d (ignored)",
                            run, port, self.web.port)
            return
        if self._binding:
            return
        self._binding = True
        gevent.spawn(self._bind, run, rank, port)

    def _bind(self, run: str, rank: int, port: int) -> None:
        try:
            log.info("run %s registered port %d: binding the web there", run, port)
            self.web.bind(port)
        except OSError as exc:
            log.warning("%s; waiting for the next registered port", exc.strerror or exc)
        finally:
            self._binding = False


# ----------------------------------------------------------------- signals, children
class Stopper:
    """SIGINT/SIGTERM set an event the main greenlet waits on (no KeyboardInterrupt traces)."""

    def __init__(self) -> None:
        import gevent
        import gevent.event

        self.event = gevent.event.Event()
        self.signum: int | None = None
        self._handlers = [gevent.signal_handler(sig, self._stop, sig)
                          for sig in (signal.SIGINT, signal.SIGTERM)]

    def _stop(self, signum: int) -> None:
        if self.signum is None:
            log.info("signal %d: stopping", signum)
        self.signum = signum
        self.event.set()

    def wait(self, timeout: float | None = None) -> bool:
        return bool(self.event.wait(timeout))

    @property
    def stopping(self) -> bool:
        return self.event.is_set()

    def close(self) -> None:
        for handler in self._handlers:
            handler.cancel()


def _watch_parent(parent: int, stopper: Stopper) -> None:
    """A worker stops when its supervisor is gone (SIGKILLed, say): an orphan would keep
    serving from a stale process and keep the port's share the next supervisor expects."""
    while not stopper.wait(1.0):
        if os.getppid() != parent:
            log.warning("the supervisor (pid %d) is gone: stopping", parent)
            stopper.event.set()
            return


def _worker_logging(slot: int) -> None:
    """Tag a worker's log lines ``web[K]``: the supervisor relays N workers' logs as one."""
    fmt = logging.Formatter(f"%(asctime)s %(levelname)s web[{slot}] %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.setFormatter(fmt)


def run_web(cfg: WebConfig, curve: dict[int, bytes] | None,
            prog: str = "rankboard web") -> int:
    """Serve the dashboard of the broker at ``cfg.publish``/``cfg.snapshot`` until stopped.

    A worker (``cfg.worker_id`` set) is this same web, told by its supervisor to share the
    port and to report ``ready`` on stdout rather than print the dashboard lines. The
    caller has checked the config (:func:`bind_refusal`) and read its CURVE keys
    (:func:`feed_curve`)."""
    patch()
    worker_id = cfg.worker_id
    if worker_id is not None:
        _worker_logging(worker_id)
    assert cfg.port is not None, "a web on its own has a port (only up binds lazily)"
    stopper = Stopper()
    web = Web(cfg, curve=curve)
    try:
        try:
            web.bind(cfg.port, reuse_port=worker_id is not None, announce=worker_id is None)
            if cfg.metrics_port is not None:
                web.bind_metrics(cfg.metrics_host or cfg.host, cfg.metrics_port)
        except OSError as exc:
            return fail(prog, bind_failure(exc))
        web.start_feed()
        if worker_id is not None:
            import gevent

            gevent.spawn(_watch_parent, os.getppid(), stopper)
            say("ready")
        stopper.wait()
    finally:
        web.close()
        stopper.close()
    log.info("web stopped")
    return 0
