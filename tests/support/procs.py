"""Real ``rankboard`` child processes: the command, a process handle that collects its output
lines, and starters for a web and a broker on ephemeral loopback ports that learn what the
child bound from its own log lines.

Nothing here sleeps to synchronise: every wait polls a condition against a deadline.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from tests.support import REPO
from tests.support.http import fetch
from tests.support.polling import wait_for

#: The module children run as (``python -m CLI_MODULE ...``): the ``rankboard`` entry point.
CLI_MODULE = "rankboard"
#: Any free port on loopback, for a ZeroMQ endpoint.
ANY = "tcp://127.0.0.1:*"


class Proc:
    """A ``python -m <CLI_MODULE> ...`` subprocess whose stdout/stderr lines are collected."""

    def __init__(self, args: list[str], env: Optional[dict[str, str]] = None) -> None:
        """The process leads a process group of its own, as a command started from a shell
        does: :meth:`interrupt` is a terminal's Ctrl-C, and :meth:`close` ends the group."""
        full_env = dict(os.environ, PYTHONUNBUFFERED="1")
        full_env.pop("RANKBOARD_TOKEN", None)
        full_env.update(env or {})
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", CLI_MODULE, *args], cwd=REPO, env=full_env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        self.lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._cond = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(name, stream), daemon=True)
            for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr))
        ]
        for t in self._readers:
            t.start()
        self.port: Optional[int] = None

    def _read(self, name: str, stream: Any) -> None:
        for line in stream:
            with self._cond:
                self.lines[name].append(line.rstrip("\n"))
                self._cond.notify_all()

    def output(self, name: str = "stderr") -> str:
        with self._cond:
            return "\n".join(self.lines[name])

    def wait_line(self, pattern: str, stream: str = "stdout", timeout: float = 20.0,
                  start: int = 0) -> re.Match[str]:
        """The first line (from index ``start``) of ``stream`` matching ``pattern``."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[stream][start:]:
                    m = rx.search(line)
                    if m:
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and all(
                        not t.is_alive() for t in self._readers)):
                    raise AssertionError(
                        f"no line matching {pattern!r} on {stream} of {self.args}; "
                        f"exit={self.proc.poll()}\nstdout:\n{self.output('stdout')}\n"
                        f"stderr:\n{self.output('stderr')[-4000:]}")
                self._cond.wait(min(left, 0.2))

    def wait_dashboard(self, timeout: float = 20.0) -> int:
        self.port = int(self.wait_line(r"^dashboard: http://[^:]+:(\d+)$", timeout=timeout).group(1))
        return self.port

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.close()

    def interrupt(self) -> None:
        """Ctrl-C at a terminal: SIGINT to every process of the foreground group (the
        process and the children it did not move to a group of their own)."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def close(self) -> None:
        """Kill the process and whatever is left of its group: a child that outlived it
        (``demo``'s ranks, a broker of ``up``'s in its own session ends by itself) would hold
        the output pipes open, and the readers would wait for it, then run on beside later
        tests."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is empty: nothing outlived the process
        for t in self._readers:
            t.join(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def start_web(spawn: Callable[..., Proc], broker: Any, *extra: str,
              env: Optional[dict[str, str]] = None, healthy: bool = True) -> Proc:
    """``rankboard web`` on an ephemeral loopback port against ``broker``; waits for /healthz."""
    proc = spawn("web", "--publish", broker.publish, "--snapshot", broker.snapshot,
                 "--host", "127.0.0.1", "--port", "0", *extra, env=env)
    port = proc.wait_dashboard()
    if healthy:
        wait_for(lambda: fetch(port, "/healthz").status == 200, what="web /healthz 200")
    return proc


class Endpoints:
    """A broker's bound endpoints, shaped like the web tests' ``broker`` (``start_web`` reads
    ``.publish`` and ``.snapshot``)."""

    def __init__(self, ingest: str, publish: str, snapshot: str) -> None:
        self.ingest, self.publish, self.snapshot = ingest, publish, snapshot

    def as_dict(self) -> dict[str, str]:
        return {"ingest": self.ingest, "publish": self.publish, "snapshot": self.snapshot}


def start_broker(spawner: Callable[..., Proc], data_dir: Path, *extra: str,
                 endpoints: Endpoints | None = None) -> tuple[Proc, Endpoints]:
    """``rankboard broker`` on ``endpoints`` (default: ephemeral loopback ports); waits until
    all three sockets are bound and returns the process and the bound endpoints."""
    eps = endpoints.as_dict() if endpoints else {"ingest": ANY, "publish": ANY, "snapshot": ANY}
    proc = spawner("broker", "--ingest", eps["ingest"], "--publish", eps["publish"],
                 "--snapshot", eps["snapshot"], "--data-dir", str(data_dir), *extra)
    found = {name: proc.wait_line(rf"broker {name} bound at (\S+)", stream="stderr").group(1)
             for name in ("ingest", "publish", "snapshot")}
    return proc, Endpoints(**found)


def no_traceback(*procs: Any) -> None:
    for proc in procs:
        err = proc.output("stderr")
        assert "Traceback" not in err, err[-3000:]
