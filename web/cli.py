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

Tuning knobs for tests and operators (environment, not flags): ``RANKBOARD_SSE_QUEUE``
(events a client may fall behind before it is dropped, default 256) and
``RANKBOARD_SSE_PING`` (seconds between ``: ping`` comments, default 15).
"""
from __future__ import annotations

import argparse
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

    def __init__(self, args: argparse.Namespace, publish: str, snapshot: str) -> None:
        from web.app import create_app
        from web.hub import DEFAULT_QUEUE_SIZE, FeedPump, Hub

        self.host: str = args.host
        self.hub = Hub(queue_size=_env_number("RANKBOARD_SSE_QUEUE", DEFAULT_QUEUE_SIZE, int))
        self.pump = FeedPump(self.hub, publish, snapshot)
        self.app = create_app(self.hub, {
            "token": args.token,
            "ping_interval": _env_number("RANKBOARD_SSE_PING", 15.0, float),
        })
        self.server: Any = None
        self.port: int | None = None

    def start_feed(self) -> None:
        self.pump.start()

    def bind(self, port: int) -> None:
        """Bind and start serving; raises OSError (e.g. the address in use)."""
        from gevent.pywsgi import LoggingLogAdapter, WSGIServer

        server = WSGIServer(
            (self.host, port), self.app, handler_class=nodelay_handler_class(),
            log=LoggingLogAdapter(logging.getLogger("web.access"), logging.DEBUG),
            error_log=LoggingLogAdapter(logging.getLogger("web.server"), logging.ERROR),
        )
        try:
            server.start()
        except OSError as exc:
            server.close()
            reason = exc.strerror or str(exc)
            raise OSError(exc.errno, f"cannot bind the web to {self.host}:{port}: {reason}") from None
        self.server = server
        self.port = server.server_port
        log.info("web listening on http://%s:%d", self.host, self.port)
        for line in dashboard_lines(self.host, self.port):
            _say(line)

    def close(self) -> None:
        self.hub.close_all()
        if self.server is not None:
            self.server.stop(timeout=1.0)
            self.server = None
        self.pump.stop()


class LazyBinder:
    """``up`` without ``--port``: bind on the first registered port (PROTOCOL 6).

    First arrival wins; a later, different port is warned about once and ignored; after a
    failed bind the next registration naming a port (any) is tried.
    """

    def __init__(self, web: Web) -> None:
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


# ------------------------------------------------------------------------ commands
def web_main(args: argparse.Namespace) -> int:
    """``rankboard web``: serve the dashboard of the broker at --publish/--snapshot."""
    _patch()
    prog = "rankboard web"
    refusal = bind_refusal(args.host, args.token, args.insecure_no_auth)
    if refusal:
        return _fail(prog, refusal, 2)
    stopper = Stopper()
    web = Web(args, args.publish, args.snapshot)
    try:
        try:
            web.bind(args.port)
        except OSError as exc:
            return _fail(prog, str(exc.strerror or exc))
        web.start_feed()
        stopper.wait()
    finally:
        web.close()
        stopper.close()
    log.info("web stopped")
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

    refusal = bind_refusal(args.host, args.token, args.insecure_no_auth)
    if refusal:
        return _fail(prog, refusal, 2)
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
    cluster: Any = None
    try:
        problem = broker.start(stopper)
        if problem:
            return _fail(prog, problem)
        if stopper.stopping:
            return 0
        web = Web(args, broker.endpoints["publish"], broker.endpoints["snapshot"])
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
        broker.stop()
        stopper.close()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
        log.info("%s stopped", prog)
