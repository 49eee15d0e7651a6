"""Supervising web workers: ``--workers N`` runs N web processes on one port.

The supervisor (:class:`WorkerPool`) starts N children, each a complete web (``web/serve.py``,
its own feed subscription, snapshot and hub) listening on the same port with
``SO_REUSEPORT``, so the kernel spreads connections over them. Separate processes because
one gevent hub is one core; children started as fresh interpreters because
monkey-patching must happen before anything else in a process, which a fork of an already
patched (or not yet patched) process cannot promise. How a child is started (the
interpreter and the module that parses its ``web ...`` arguments) is the caller's: this
layer is below the command line and does not name it. The supervisor holds the port
(bound, not listening: it never gets a connection) so that a restarted worker finds it
free, restarts a worker that dies and stops them all on SIGINT/SIGTERM. ``--metrics-port
P`` gives worker K a listener of its own on P+K-1 serving only ``/metrics`` and
``/healthz``: through the shared port a scrape lands on whichever worker the kernel picks.
"""
from __future__ import annotations

import errno
import logging
import re
import signal
import socket
import sys
import time
from typing import Any, Callable, Sequence

from web.children import terminate_all
from web.config import WebConfig
from web.serve import (
    Stopper,
    bind_failure,
    bind_refusal,
    dashboard_lines,
    fail,
    patch,
    reuseport_socket,
    say,
)

log = logging.getLogger(__name__)

_WORKER_FAILURE = re.compile(r"^rankboard web: (.*)$")

#: How a worker is started: given its ``web ...`` arguments and its environment, the full
#: command line and environment. The caller's, because it knows the interpreter and the
#: module that parses those arguments (the command line lives above this layer).
Launcher = Callable[[Sequence[str], dict[str, str]], tuple[list[str], dict[str, str]]]


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

    def __init__(self, cfg: WebConfig, launcher: Launcher) -> None:
        #: the pool's web (``workers`` of them); each worker gets :meth:`WebConfig.worker`
        self.cfg = cfg
        self.launcher = launcher
        self.host: str = cfg.host
        self.workers = [Worker(k) for k in range(1, cfg.workers + 1)]
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
            say(line)

    # -- children -------------------------------------------------------------------
    def command(self, worker: Worker) -> tuple[list[str], dict[str, str]]:
        """The worker's command line and environment. The token travels in the
        environment (``RANKBOARD_TOKEN``), never on a command line anyone can read in ps."""
        assert self.port is not None
        cfg = self.cfg.worker(worker.slot, self.port)
        return self.launcher(cfg.argv(), cfg.env())

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

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM every worker at once, SIGKILL what is left after ``timeout``; release
        the port."""
        self._stopping = True
        terminate_all([w.proc for w in self.workers if w.proc is not None], timeout)
        for sock in (self._reservation, self._guard):
            if sock is not None:
                sock.close()
        self._reservation = self._guard = None


def pool_refusal(cfg: WebConfig) -> str | None:
    """The one-line reason ``--workers``/``--metrics-*`` cannot work here, or None."""
    if cfg.workers > 1 and not sys.platform.startswith("linux"):
        return ("--workers needs Linux: it relies on SO_REUSEPORT spreading connections "
                "over the workers")
    if cfg.metrics_port is not None and cfg.metrics_port + cfg.workers - 1 > 65535:
        return f"--metrics-port {cfg.metrics_port} + {cfg.workers} workers is past port 65535"
    if cfg.metrics_host is not None:
        return bind_refusal(cfg.metrics_host, cfg.token, cfg.insecure_no_auth)
    return None


def run_pool(cfg: WebConfig, launcher: Launcher, prog: str = "rankboard web") -> int:
    """``rankboard web --workers N``: hold the port, run the workers until stopped."""
    patch()
    assert cfg.port is not None, "a web on its own has a port (only up binds lazily)"
    stopper = Stopper()
    pool = WorkerPool(cfg, launcher)
    try:
        try:
            pool.bind(cfg.port)
        except OSError as exc:
            return fail(prog, bind_failure(exc))
        if pool.failure:
            return fail(prog, pool.failure)
        while not stopper.wait(0.5):
            pool.check(stopper)
    finally:
        pool.stop()
        stopper.close()
    log.info("web stopped (%d workers)", len(pool.workers))
    return 0
