"""``rankboard web``, ``rankboard up`` and ``rankboard demo`` (the flags live in broker/cli.py).

This is the only module that monkey-patches (gevent), and it does so at the start of each
command, never at import: ``broker.cli`` imports it lazily, and tests may import it safely.

* ``web``: the feed pump (SUB + snapshot) and the gevent WSGI server for the app (its
  connections have ``TCP_NODELAY``: see :func:`set_nodelay`).
* ``up``: the broker as a child process (``python -m broker.cli broker ...``) plus the web
  here; without ``--port`` the web binds lazily on the first port a rank registers.
* ``demo``: ``up`` with a private broker on ephemeral loopback ports and a temporary data
  dir, plus a simulated cluster of real agent processes (web/demo.py), run after run until
  Ctrl-C.
* ``--workers N`` (``web``, ``up``): this process becomes a supervisor (:class:`WorkerPool`)
  of N ``rankboard web --worker-id K`` children, each a complete web (its own feed
  subscription, snapshot and hub) listening on the same port with ``SO_REUSEPORT``, so the
  kernel spreads connections over them. Separate processes because one gevent hub is one
  core; children started with ``python -m`` because monkey-patching must happen before
  anything else in a process, which a fork of an already patched (or not yet patched)
  process cannot promise. The supervisor holds the port (bound, not listening: it never
  gets a connection) so that a restarted worker finds it free, restarts a worker that dies
  and stops them all on SIGINT/SIGTERM. ``--metrics-port P`` gives worker K a listener of
  its own on P+K-1 serving only ``/metrics`` and ``/healthz``: through the shared port a
  scrape lands on whichever worker the kernel picks.

Tuning knobs for tests and operators (environment, not flags): ``RANKBOARD_SSE_QUEUE``
(events a client may fall behind before it is dropped, default 256) and
``RANKBOARD_SSE_PING`` (seconds between ``: ping`` comments, default 15).
"""
from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

_BOUND = re.compile(r"broker (ingest|publish|snapshot) bound at (\S+)")
_CHILD_FAILURE = re.compile(r"^rankboard broker: (.*)$")
EPHEMERAL = "tcp://127.0.0.1:*"
BROKER_START_TIMEOUT = 20.0
#: listen backlog of a worker's SO_REUSEPORT socket (a page load opens several connections,
#: and a dashboard wall reconnecting after a restart opens thousands at once)
LISTEN_BACKLOG = 1024
#: the response header naming the worker that served a request (``--workers`` > 1 only)
WORKER_HEADER = "X-Rankboard-Worker"
#: what a ``--metrics-port`` listener serves; everything else there is 404
METRICS_PATHS = frozenset({"/metrics", "/healthz"})


def _patch() -> None:
    """gevent's monkey-patching, done once, first thing in a web command."""
    from gevent import monkey

    if not monkey.is_module_patched("socket"):
        monkey.patch_all()


def _say(line: str) -> None:
    print(line, flush=True)


def _fail(prog: str, message: str, code: int = 1) -> int:
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
    """What the user is told on bind (PROTOCOL 6)."""
    if is_loopback_host(host):
        return [f"dashboard: http://localhost:{port}",
                f"ssh -L {port}:localhost:{port} {socket.gethostname()}"]
    shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    if ":" in shown:
        shown = f"[{shown}]"
    return [f"dashboard: http://{shown}:{port}"]


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


def feed_curve(args: argparse.Namespace) -> dict[int, bytes] | None:
    """The web's CURVE client options from its flags, or None for a plain feed.

    ``up``/``demo`` start the broker themselves: their web's server key defaults to the
    public half of ``--curve-secret-key``. Raises ``ValueError`` (one line) for a bad file.
    """
    client = getattr(args, "curve_client_key", None)
    if client is None:
        return None
    server = getattr(args, "curve_server_key", None) or getattr(args, "curve_secret_key", None)
    if server is None:
        raise ValueError("--curve-client-key needs --curve-server-key (the broker's public key)")
    from broker.keys import client_options

    flag = "--curve-server-key" if getattr(args, "curve_server_key", None) else "--curve-secret-key"
    return client_options(Path(server), Path(client), server_flag=flag)


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


def pool_guard(host: str, port: int) -> socket.socket:
    """An abstract UNIX socket named after ``port``, held by one pool supervisor at a time.

    ``SO_REUSEPORT`` lets any process of the same user join a port, so without this a second
    ``rankboard web --workers N`` on the port of a running one would start fine and silently
    take half its connections. The name lives as long as the socket: a killed supervisor
    frees it at once, no stale lock file to clean up.
    """
    guard = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        guard.bind(f"\0rankboard-web-port-{port}")
    except OSError as exc:
        guard.close()
        if exc.errno != errno.EADDRINUSE:
            raise
        raise OSError(errno.EADDRINUSE, f"cannot bind the web to {host}:{port}: Address already "
                      "in use (another rankboard web --workers serves that port)") from None
    return guard


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


def open_browser(url: str) -> bool:
    """Open ``url`` in the user's browser when there is a screen to show it on.

    On a headless cluster node (no ``DISPLAY``/``WAYLAND_DISPLAY``) this does nothing: the
    printed URL and ssh hint are the way in. ``$BROWSER`` is honoured (``webbrowser``)."""
    graphical = (sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY"))
                 or bool(os.environ.get("WAYLAND_DISPLAY")) or bool(os.environ.get("BROWSER")))
    if not graphical:
        return False
    import webbrowser

    try:
        return bool(webbrowser.open(url, new=2))
    except Exception as exc:  # a broken browser setup must not stop the demo
        log.warning("could not open a browser: %s", exc)
        return False


def nodelay_handler_class() -> Any:
    """gevent pywsgi's ``WSGIHandler`` that sets ``TCP_NODELAY`` before serving a connection.

    Built on first use (importing gevent.pywsgi stays out of this module's import, see the
    module docstring) and cached, so every server of the process shares one class."""
    global _NODELAY_HANDLER
    if _NODELAY_HANDLER is None:
        from gevent.pywsgi import WSGIHandler

        class NoDelayHandler(WSGIHandler):  # type: ignore[misc]
            """A pywsgi handler whose connection sends each write at once (no Nagle)."""

            def handle(self) -> None:
                set_nodelay(self.socket)
                super().handle()

            def format_request(self) -> str:
                # The access log must not carry a ``?token=`` credential.
                return redact_token(super().format_request())

            def read_request(self, raw_requestline: str) -> Any:
                # A header line over 64 KiB or over 100 headers raises http.client's
                # LineTooLong/HTTPException, which pywsgi answers 400 but also prints a
                # traceback for; as a ValueError it is a one-line client error.
                import http.client

                try:
                    return super().read_request(raw_requestline)
                except http.client.HTTPException as exc:
                    raise ValueError(f"bad request headers: {type(exc).__name__}") from None

        _NODELAY_HANDLER = NoDelayHandler
    return _NODELAY_HANDLER


class Web:
    """The hub, its feed pump, the app and (once bound) the gevent WSGI server."""

    def __init__(self, args: argparse.Namespace, publish: str, snapshot: str, *,
                 curve: dict[int, bytes] | None = None) -> None:
        from web.app import create_app
        from web.hub import DEFAULT_QUEUE_SIZE, FeedPump, Hub

        self.host: str = args.host
        #: this process's slot in a ``--workers`` pool (None: a web on its own)
        self.worker_id: int | None = getattr(args, "worker_id", None)
        self.hub = Hub(queue_size=_env_number("RANKBOARD_SSE_QUEUE", DEFAULT_QUEUE_SIZE, int))
        self.pump = FeedPump(self.hub, publish, snapshot, curve=curve)
        self.app = create_app(self.hub, {
            "token": args.token,
            "ping_interval": _env_number("RANKBOARD_SSE_PING", 15.0, float),
        })
        if self.worker_id is not None:
            self.app.wsgi_app = worker_header(self.app.wsgi_app, self.worker_id)  # type: ignore[method-assign]
        self.server: Any = None
        self.metrics_server: Any = None
        self.port: int | None = None

    def start_feed(self) -> None:
        self.pump.start()

    def _server(self, listener: Any, app: Any) -> Any:
        from gevent.pywsgi import LoggingLogAdapter, WSGIServer

        return WSGIServer(
            listener, app, handler_class=nodelay_handler_class(),
            log=LoggingLogAdapter(logging.getLogger("web.access"), logging.DEBUG),
            error_log=LoggingLogAdapter(logging.getLogger("web.server"), logging.ERROR),
        )

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
                _say(line)

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
        self.pump.stop()


class LazyBinder:
    """``up`` without ``--port``: bind on the first registered port (PROTOCOL 6).

    First arrival wins; a later, different port is warned about once and ignored; after a
    failed bind the next registration naming a port (any) is tried.
    """

    def __init__(self, web: Web | WorkerPool) -> None:
        #: what binds: a web, or a pool that starts its workers there (``up --workers N``);
        #: either has ``port`` (None until bound) and ``bind(port)`` raising OSError
        self.web = web
        self.ignored: set[int] = set()
        self._binding = False

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


def terminate(proc: Any, timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; reaps the child."""
    if proc.poll() is None:
        try:
            proc.terminate()
            proc.wait(timeout=timeout)
        except Exception:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class BrokerChild:
    """``python -m broker.cli broker ...`` as a child; relays its log and learns its endpoints."""

    def __init__(self, args: argparse.Namespace, *, ingest: str, publish: str, snapshot: str,
                 data_dir: Path) -> None:
        cmd = [sys.executable, "-m", "broker.cli", "broker",
               "--ingest", ingest, "--publish", publish, "--snapshot", snapshot,
               "--data-dir", str(data_dir), "--stale-after", repr(float(args.stale_after)),
               "--step-close-after", repr(float(args.step_close_after))]
        if getattr(args, "max_runs", None) is not None:
            cmd += ["--max-runs", str(args.max_runs)]
        if getattr(args, "retention_days", None) is not None:
            cmd += ["--retention-days", repr(float(args.retention_days))]
        if getattr(args, "curve_secret_key", None) is not None:
            cmd += ["--curve-secret-key", str(args.curve_secret_key),
                    "--curve-authorized", str(args.curve_authorized)]
        level = getattr(args, "log_level", None) or ("DEBUG" if getattr(args, "verbose", 0) else "INFO")
        given = {"ingest": ingest, "publish": publish, "snapshot": snapshot}
        #: ephemeral endpoints are learnt from the child's "bound at" log lines (INFO)
        self.learn = any(ep.endswith(":*") for ep in given.values())
        if self.learn and level not in ("DEBUG", "INFO"):
            level = "INFO"
        self.wait_bound = level in ("DEBUG", "INFO")
        cmd += ["--log-level", level]
        self.cmd = cmd
        self.proc: Any = None
        self.endpoints: dict[str, str] = {} if self.learn else dict(given)
        self._seen: set[str] = set()
        #: the child's own one-line reason for exiting ("rankboard broker: <reason>")
        self.reason: str | None = None

    def start(self, stopper: Stopper) -> str | None:
        """Start the child and wait until it has bound all three sockets.

        Returns None when ready, else a one-line reason (the child's own error is relayed).
        """
        import gevent
        import gevent.event
        from gevent import subprocess

        ready = gevent.event.Event()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=env)

        def relay() -> None:
            assert self.proc is not None
            for raw in self.proc.stderr:
                line = raw.decode("utf-8", "replace")
                failure = _CHILD_FAILURE.match(line)
                if failure:  # becomes our own one-line reason instead of a second line
                    self.reason = failure.group(1).strip()
                    continue
                sys.stderr.write(line)
                sys.stderr.flush()
                m = _BOUND.search(line)
                if m:
                    self._seen.add(m.group(1))
                    if self.learn:
                        self.endpoints[m.group(1)] = m.group(2)
                    if len(self._seen) == 3:
                        ready.set()
            ready.set()  # the child exited

        gevent.spawn(relay)
        if not self.wait_bound:  # its log is quiet: a failed bind shows as its exit instead
            return None
        deadline = time.monotonic() + BROKER_START_TIMEOUT
        while not ready.is_set() and not stopper.stopping and time.monotonic() < deadline:
            ready.wait(0.2)
        if stopper.stopping:
            return None
        if len(self._seen) == 3:
            return None
        try:
            self.proc.wait(timeout=2.0)  # its stderr closed: it is exiting
        except subprocess.TimeoutExpired:
            return f"the broker did not bind within {BROKER_START_TIMEOUT:.0f} s"
        return self.failure()

    def failure(self) -> str:
        """Why the child exited, in one line."""
        code = None if self.proc is None else self.proc.poll()
        if self.reason:
            return f"broker: {self.reason}"
        return f"the broker exited with status {code}"

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)
            if self.proc.stderr is not None:
                self.proc.stderr.close()


# ------------------------------------------------------------------- worker pool
_WORKER_FAILURE = re.compile(r"^rankboard web: (.*)$")


def describe_exit(code: int | None) -> str:
    """``exited with status 1`` / ``was killed by SIGKILL``, for the supervisor's log."""
    if code is None:
        return "is running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


class Worker:
    """One ``rankboard web --worker-id K`` child and what the supervisor knows of it."""

    def __init__(self, slot: int) -> None:
        import gevent.event

        self.slot = slot
        self.proc: Any = None
        self.ready = gevent.event.Event()
        #: its own one-line reason for exiting ("rankboard web: <reason>" on its stderr)
        self.reason: str | None = None
        self.started_at = 0.0
        #: exits in a row that came soon after a start (backs restarts off)
        self.quick_exits = 0
        self.restarting = False


class WorkerPool:
    """``--workers N``: N web processes on one port, supervised (see the module docstring).

    Looks like a :class:`Web` to :class:`LazyBinder` (``port``, ``bind(port)``), so ``up``
    without ``--port`` starts the pool where the first rank's port says. ``failure`` is set
    when the pool cannot serve at all (a worker that fails on its first start); the command
    then exits with it. Later deaths are restarted at once; a worker that dies again soon
    after its restart waits 0.5, 1, 2 ... 30 s before the next, so a crash loop does not spin.
    """

    READY_TIMEOUT = 30.0
    #: a worker that dies sooner than this after starting counts as a quick exit
    QUICK_EXIT = 10.0
    MAX_BACKOFF = 30.0

    def __init__(self, args: argparse.Namespace, publish: str, snapshot: str, size: int) -> None:
        self.args = args
        self.publish = publish
        self.snapshot = snapshot
        self.host: str = args.host
        self.workers = [Worker(k) for k in range(1, size + 1)]
        self.port: int | None = None
        self.failure: str | None = None
        self._reservation: socket.socket | None = None
        self._guard: socket.socket | None = None
        self._stopping = False

    # -- the port -------------------------------------------------------------------
    def bind(self, port: int) -> None:
        """Hold ``port`` (OSError if taken), start every worker on it, announce it.

        A worker failing to start sets :attr:`failure` instead of raising: that is not
        about the port, so trying the next registered one would not help."""
        reservation = reuseport_socket(self.host, port, listen=False)
        port = reservation.getsockname()[1]
        try:
            guard = pool_guard(self.host, port)
        except OSError:
            reservation.close()
            raise
        self._reservation, self._guard, self.port = reservation, guard, port
        problem = self.start()
        if problem:
            self.failure = problem
            return
        log.info("web listening on http://%s:%d (%d workers)", self.host, port,
                 len(self.workers))
        for line in dashboard_lines(self.host, port):
            _say(line)

    # -- children -------------------------------------------------------------------
    def command(self, worker: Worker) -> tuple[list[str], dict[str, str]]:
        """The worker's command line and environment. The token travels in the
        environment (``RANKBOARD_TOKEN``), never on a command line anyone can read in ps."""
        args = self.args
        assert self.port is not None
        cmd = [sys.executable, "-m", "broker.cli", "web", "--publish", self.publish,
               "--snapshot", self.snapshot, "--host", self.host, "--port", str(self.port),
               "--worker-id", str(worker.slot)]
        if args.insecure_no_auth:
            cmd.append("--insecure-no-auth")
        client = getattr(args, "curve_client_key", None)
        if client is not None:
            server = getattr(args, "curve_server_key", None) or args.curve_secret_key
            cmd += ["--curve-server-key", str(server), "--curve-client-key", str(client)]
        if getattr(args, "metrics_port", None) is not None:  # 0: each its own ephemeral port
            port = args.metrics_port + worker.slot - 1 if args.metrics_port else 0
            cmd += ["--metrics-port", str(port), "--metrics-host", args.metrics_host or self.host]
        level = getattr(args, "log_level", None) or (
            "DEBUG" if getattr(args, "verbose", 0) else "INFO")
        cmd += ["--log-level", level]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("RANKBOARD_TOKEN", None)
        if args.token:
            env["RANKBOARD_TOKEN"] = args.token
        return cmd, env

    def spawn(self, worker: Worker) -> None:
        """Start ``worker``'s process; greenlets read its stdout (``ready``) and relay its
        stderr (its log) to ours.

        Its own session: a Ctrl-C in the terminal reaches the supervisor alone, which then
        stops every worker, instead of racing the workers' own exits against a restart."""
        import gevent
        from gevent import subprocess

        cmd, env = self.command(worker)
        worker.ready.clear()
        worker.reason = None
        worker.started_at = time.monotonic()
        proc = worker.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, start_new_session=True)

        def read_stdout() -> None:
            for raw in proc.stdout:
                if raw.strip() == b"ready":
                    worker.ready.set()

        def relay_stderr() -> None:
            for raw in proc.stderr:
                line = raw.decode("utf-8", "replace")
                failure = _WORKER_FAILURE.match(line)
                if failure:
                    worker.reason = failure.group(1).strip()
                    continue
                sys.stderr.write(line)
                sys.stderr.flush()

        gevent.spawn(read_stdout)
        gevent.spawn(relay_stderr)

    def _wait_ready(self, worker: Worker, deadline: float) -> str | None:
        """None once ``worker`` says ready, else why it never will."""
        while not worker.ready.wait(0.1):
            if self._stopping:
                return None
            if worker.proc.poll() is not None:
                worker.proc.wait()
                why = worker.reason or f"it {describe_exit(worker.proc.returncode)}"
                return f"web worker {worker.slot} failed to start: {why}"
            if time.monotonic() > deadline:
                return (f"web worker {worker.slot} did not start within "
                        f"{self.READY_TIMEOUT:.0f} s")
        return None

    def start(self) -> str | None:
        """Start every worker and wait until all serve; a one-line reason if one cannot."""
        for worker in self.workers:
            self.spawn(worker)
        deadline = time.monotonic() + self.READY_TIMEOUT
        for worker in self.workers:
            problem = self._wait_ready(worker, deadline)
            if problem:
                return problem
        return None

    def check(self, stopper: Stopper) -> None:
        """Restart every worker that has died (called from the supervisor's loop)."""
        import gevent

        for worker in self.workers:
            if (self._stopping or worker.restarting or worker.proc is None
                    or worker.proc.poll() is None):
                continue
            worker.restarting = True
            gevent.spawn(self._restart, worker, stopper)

    def _restart(self, worker: Worker, stopper: Stopper) -> None:
        try:
            pid, code = worker.proc.pid, worker.proc.wait()
            lived = time.monotonic() - worker.started_at
            worker.quick_exits = worker.quick_exits + 1 if lived < self.QUICK_EXIT else 0
            delay = (min(self.MAX_BACKOFF, 0.5 * 2 ** (worker.quick_exits - 2))
                     if worker.quick_exits > 1 else 0.0)
            # a short grace even so: under systemd or a terminal the signal that stops us
            # all may reach a worker first, and a stop must not look like a crash
            if stopper.wait(max(delay, 0.2)) or self._stopping:
                return
            reason = f" ({worker.reason})" if worker.reason else ""
            log.warning("web worker %d (pid %d) %s%s; restarting it%s", worker.slot, pid,
                        describe_exit(code), reason,
                        f" after {delay:g} s ({worker.quick_exits} exits in a row, each soon "
                        "after a start)" if delay else "")
            self.spawn(worker)
            problem = self._wait_ready(worker, time.monotonic() + self.READY_TIMEOUT)
            if problem:
                log.error("%s; trying again", problem)
            elif not self._stopping:
                log.info("web worker %d restarted (pid %d)", worker.slot, worker.proc.pid)
        finally:
            worker.restarting = False

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None]

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM every worker at once, SIGKILL what is left after ``timeout``; release
        the port."""
        self._stopping = True
        procs = [w.proc for w in self.workers if w.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.terminate()
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for sock in (self._reservation, self._guard):
            if sock is not None:
                sock.close()
        self._reservation = self._guard = None


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


def _pool_refusal(args: argparse.Namespace) -> str | None:
    workers = getattr(args, "workers", 1)
    if workers > 1 and not sys.platform.startswith("linux"):
        return ("--workers needs Linux: it relies on SO_REUSEPORT spreading connections "
                "over the workers")
    if getattr(args, "metrics_port", None) is not None and (
            args.metrics_port + workers - 1 > 65535):
        return f"--metrics-port {args.metrics_port} + {workers} workers is past port 65535"
    host = getattr(args, "metrics_host", None)
    if host is not None:
        return bind_refusal(host, args.token, args.insecure_no_auth)
    return None


# ------------------------------------------------------------------------ commands
def web_main(args: argparse.Namespace) -> int:
    """``rankboard web``: serve the dashboard of the broker at --publish/--snapshot.

    With ``--workers N`` (N > 1) this process supervises N workers instead
    (:class:`WorkerPool`); a worker (``--worker-id``) is this same command, told by its
    supervisor to share the port and to report ``ready`` on stdout rather than print the
    dashboard lines."""
    _patch()
    prog = "rankboard web"
    refusal = bind_refusal(args.host, args.token, args.insecure_no_auth) or _pool_refusal(args)
    if refusal:
        return _fail(prog, refusal, 2)
    try:
        curve = feed_curve(args)
    except ValueError as exc:
        return _fail(prog, str(exc), 2)
    worker_id = getattr(args, "worker_id", None)
    if worker_id is None and getattr(args, "workers", 1) > 1:
        return _serve_pool(args, prog)
    if worker_id is not None:
        _worker_logging(worker_id)
    stopper = Stopper()
    web = Web(args, args.publish, args.snapshot, curve=curve)
    try:
        try:
            web.bind(args.port, reuse_port=worker_id is not None, announce=worker_id is None)
            if getattr(args, "metrics_port", None) is not None:
                web.bind_metrics(getattr(args, "metrics_host", None) or args.host,
                                 args.metrics_port)
        except OSError as exc:
            return _fail(prog, str(exc.strerror or exc))
        web.start_feed()
        if worker_id is not None:
            import gevent

            gevent.spawn(_watch_parent, os.getppid(), stopper)
            _say("ready")
        stopper.wait()
    finally:
        web.close()
        stopper.close()
    log.info("web stopped")
    return 0


def _serve_pool(args: argparse.Namespace, prog: str) -> int:
    """``rankboard web --workers N``: hold the port, run the workers until stopped."""
    stopper = Stopper()
    pool = WorkerPool(args, args.publish, args.snapshot, args.workers)
    try:
        try:
            pool.bind(args.port)
        except OSError as exc:
            return _fail(prog, str(exc.strerror or exc))
        if pool.failure:
            return _fail(prog, pool.failure)
        while not stopper.wait(0.5):
            pool.check(stopper)
    finally:
        pool.stop()
        stopper.close()
    log.info("web stopped (%d workers)", len(pool.workers))
    return 0


def up_main(args: argparse.Namespace) -> int:
    """``rankboard up``: the broker (child process) and the web (here)."""
    return _up(args, "rankboard up", demo=False)


def demo_main(args: argparse.Namespace) -> int:
    """``rankboard demo``: ``up`` on private ports plus a simulated cluster, until Ctrl-C."""
    return _up(args, "rankboard demo", demo=True)


def _up(args: argparse.Namespace, prog: str, *, demo: bool) -> int:
    _patch()
    from broker import cli as broker_cli

    refusal = bind_refusal(args.host, args.token, args.insecure_no_auth) or _pool_refusal(args)
    if refusal:
        return _fail(prog, refusal, 2)
    try:
        curve = feed_curve(args)
    except ValueError as exc:
        return _fail(prog, str(exc), 2)
    endpoints = {"ingest": args.ingest, "publish": args.publish, "snapshot": args.snapshot}
    if demo:  # a private broker: never clash with one already running on the defaults
        defaults = {"ingest": broker_cli.DEFAULT_INGEST, "publish": broker_cli.DEFAULT_PUBLISH,
                    "snapshot": broker_cli.DEFAULT_SNAPSHOT}
        endpoints = {k: EPHEMERAL if v == defaults[k] else v for k, v in endpoints.items()}
    temp_dir: str | None = None
    if args.data_dir is not None:
        data_dir = Path(args.data_dir)
    elif demo:
        temp_dir = tempfile.mkdtemp(prefix="rankboard-demo-")
        data_dir = Path(temp_dir)
    else:
        data_dir = broker_cli.default_data_dir()

    stopper = Stopper()
    broker = BrokerChild(args, data_dir=data_dir, **endpoints)
    web: Web | None = None
    pool: WorkerPool | None = None
    cluster: Any = None
    try:
        problem = broker.start(stopper)
        if problem:
            return _fail(prog, problem)
        if stopper.stopping:
            return 0
        if getattr(args, "workers", 1) > 1:
            return _up_pool(args, prog, broker, stopper, curve)
        web = Web(args, broker.endpoints["publish"], broker.endpoints["snapshot"], curve=curve)
        if args.port is None:
            binder = LazyBinder(web)
            web.hub.port_listeners.append(binder.on_port)
            web.hub.snapshot_listeners.append(binder.on_snapshot)
            log.info("the web binds on the first port a rank registers (or pass --port)")
        else:
            try:
                web.bind(args.port)
            except OSError as exc:
                return _fail(prog, str(exc.strerror or exc))
        if getattr(args, "metrics_port", None) is not None:
            try:
                web.bind_metrics(args.metrics_host or args.host, args.metrics_port)
            except OSError as exc:
                return _fail(prog, str(exc.strerror or exc))
        web.start_feed()
        if demo:
            from web.demo import Cluster

            assert web.port is not None
            cluster = Cluster(
                broker.endpoints["ingest"], ranks=args.ranks, hosts=args.hosts,
                epochs=args.epochs, epoch_seconds=args.epoch_seconds, port=web.port,
            )
            cluster.start()
            if not args.no_browser:
                open_browser(f"http://localhost:{web.port}/")
        while not stopper.wait(0.5):
            if broker.exited() is not None:
                if stopper.wait(0.5):  # Ctrl-C reached the broker first
                    return 0
                return _fail(prog, broker.failure())
        return 0
    finally:
        if cluster is not None:
            cluster.stop()
        if web is not None:
            web.close()
        if pool is not None:
            pool.stop()
        broker.stop()
        stopper.close()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
        log.info("%s stopped", prog)


def _up_pool(args: argparse.Namespace, prog: str, broker: BrokerChild, stopper: Stopper,
             curve: dict[int, bytes] | None) -> int:
    """``up --workers N``: the pool instead of the in-process web, beside the broker child.

    Without ``--port`` the supervisor decides the port exactly as a single web would: a
    hub and feed pump of its own feed :class:`LazyBinder`, which starts the pool on the
    first registered port (and keeps warning about later, different ones). Deciding once,
    here, keeps N workers from ever picking N different ports. (That hub holds a copy of
    the runs, as a worker does: the price of reusing the one implementation of the rule.)
    """
    from web.hub import FeedPump, Hub

    pool = WorkerPool(args, broker.endpoints["publish"], broker.endpoints["snapshot"],
                      args.workers)
    pump: FeedPump | None = None
    try:
        if args.port is None:
            hub = Hub()
            pump = FeedPump(hub, broker.endpoints["publish"], broker.endpoints["snapshot"],
                            curve=curve)
            binder = LazyBinder(pool)
            hub.port_listeners.append(binder.on_port)
            hub.snapshot_listeners.append(binder.on_snapshot)
            pump.start()
            log.info("the web binds on the first port a rank registers (or pass --port)")
        else:
            try:
                pool.bind(args.port)
            except OSError as exc:
                return _fail(prog, str(exc.strerror or exc))
        while not stopper.wait(0.5):
            if pool.failure:
                return _fail(prog, pool.failure)
            if broker.exited() is not None:
                if stopper.wait(0.5):  # Ctrl-C reached the broker first
                    return 0
                return _fail(prog, broker.failure())
            pool.check(stopper)
        return 0
    finally:
        if pump is not None:
            pump.stop()
        pool.stop()
