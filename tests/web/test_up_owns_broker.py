"""``rankboard up`` owns its broker: SIGKILL ``up`` and the broker ends too, its ports and
data dir free (issue 19: an orphaned broker held the ports and the data-dir lock, so the
next ``up`` could not start). Real processes, a real SIGKILL."""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import psutil
import zmq

from tests.support.polling import wait_for


def _where(pid: int) -> str:
    """The process's state, signal masks and each thread's kernel wait channel."""
    lines = []
    try:
        with open(f"/proc/{pid}/status") as fh:
            lines += [ln.rstrip() for ln in fh if ln.startswith(("State", "Sig", "Shd"))]
        for tid in sorted(os.listdir(f"/proc/{pid}/task")):
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                comm = fh.read().strip()
            with open(f"/proc/{pid}/task/{tid}/wchan") as fh:
                lines.append(f"thread {tid} {comm}: {fh.read().strip()}")
    except OSError as exc:
        lines.append(f"({exc})")
    return "\n".join(lines)


def test_a_sigkilled_up_takes_its_broker_with_it(spawn: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    up = spawn("up", "--port", "0", "--ingest", "tcp://127.0.0.1:*", "--publish",
               "tcp://127.0.0.1:*", "--snapshot", "tcp://127.0.0.1:*", "--data-dir", str(data))
    endpoints = {name: up.wait_line(rf"broker {name} bound at (\S+)", stream="stderr").group(1)
                 for name in ("ingest", "publish", "snapshot")}
    up.wait_dashboard()
    children = psutil.Process(up.proc.pid).children()
    assert len(children) == 1, children
    broker = children[0]
    assert "broker" in broker.cmdline()

    os.kill(up.proc.pid, signal.SIGKILL)
    up.proc.wait(10)

    def broker_gone() -> bool:
        try:
            return broker.status() == psutil.STATUS_ZOMBIE or not broker.is_running()
        except psutil.NoSuchProcess:
            return True

    try:
        try:
            wait_for(broker_gone, timeout=15, what="the broker to end with up")
        except AssertionError as exc:  # say where it is stuck, and what it last logged
            raise AssertionError(f"{exc}\n{_where(broker.pid)}\nup's stderr (the broker's "
                                 f"log relayed):\n{up.output('stderr')[-4000:]}") from None
    finally:
        if not broker_gone():  # the failure must not leave the orphan behind
            broker.kill()
    ctx = zmq.Context()
    try:
        def ports_free() -> bool:
            for endpoint in endpoints.values():
                sock = ctx.socket(zmq.PULL)
                sock.linger = 0
                try:
                    sock.bind(endpoint)
                except zmq.ZMQError:
                    return False
                finally:
                    sock.close()
            return True

        wait_for(ports_free, timeout=10, what="the broker's ports to be free")
    finally:
        ctx.term()
    # and the data dir is free: a new up starts on it
    again = spawn("up", "--port", "0", "--ingest", "tcp://127.0.0.1:*", "--publish",
                  "tcp://127.0.0.1:*", "--snapshot", "tcp://127.0.0.1:*", "--data-dir",
                  str(data))
    again.wait_dashboard()
    assert again.stop(signal.SIGTERM) == 0


def test_a_sigkilled_demo_takes_its_ranks_with_it(spawn: Any) -> None:
    """The demo's simulated ranks end with it too, however it ends: SIGKILLed, they went on
    training into nothing (and, under a test runner, held its output pipes open)."""
    demo = spawn("demo", "--port", "0", "--ranks", "2", "--hosts", "1", "--epochs", "50",
                 "--no-browser")
    demo.wait_dashboard(timeout=30)
    parent = psutil.Process(demo.proc.pid)

    def ranks() -> list[psutil.Process]:
        return [p for p in parent.children() if "rankboard.demo" in " ".join(p.cmdline())]

    found = wait_for(lambda: len(ranks()) >= 2 and ranks(), timeout=30, what="the demo's ranks")
    os.kill(demo.proc.pid, signal.SIGKILL)
    demo.proc.wait(10)

    def gone(p: psutil.Process) -> bool:
        try:
            return p.status() == psutil.STATUS_ZOMBIE or not p.is_running()
        except psutil.NoSuchProcess:
            return True

    wait_for(lambda: all(gone(p) for p in found), timeout=15, what="every rank to end with the demo")
