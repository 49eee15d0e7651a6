"""A training process for the diagnosis tests, run as ``python -m tests.agent.diag_child``.

It owns a :class:`StallWatch` and (with ``--control``) a :class:`Control` the way the agent
does, sending through a non-blocking PUSH socket to ``--push``, and its training loop stops
in functions with recognisable names so a test can find them in the dumps:

* ``--work wait``: the loop calls ``note()`` a few times, prints ``hanging``, then blocks
  in ``hang_in_collective`` until a line arrives on stdin; then it runs again (``note()``
  every 20 ms) for ``--recover`` seconds, prints ``recovered``, and blocks in
  ``second_hang`` until stdin closes;
* ``--work spin``: the loop spins in ``spin_in_named_function`` (CPU-bound, one ``note()``
  per 10 ms) until stdin closes.

``--thread`` runs the loop on a thread named ``trainer`` instead of the main thread. It
prints ``ready`` once the watch runs (and the control socket is subscribed) and
``closed <threads>`` at the end, after closing everything, with the names of the Python
threads still alive.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import zmq

from rank_agent.control import Control
from rank_agent.protocol import encoder
from rank_agent.stallwatch import StallWatch
from tests.support.agent import control_connected


class Push:
    """The agent's send, reduced: non-blocking, thread-safe, drops when it cannot queue."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(endpoint)
        self.lock = threading.Lock()

    def __call__(self, frame: Any) -> bool:
        data = encoder.encode(frame)
        with self.lock:
            try:
                self.sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                return False
        return True

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def hang_in_collective() -> None:
    print("hanging", flush=True)  # from here, so a dump taken after it finds this function
    sys.stdin.readline()  # blocks, releasing the GIL, as a collective waiting on a peer does


def second_hang() -> None:
    sys.stdin.read()


def spin_in_named_function(watch: StallWatch, stop: threading.Event) -> None:
    x = 0
    next_note = time.monotonic()
    while not stop.is_set():
        for _ in range(2000):
            x += 1
        now = time.monotonic()
        if now >= next_note:
            watch.note()
            next_note = now + 0.01


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--push", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--stall-after", type=float, default=0.0)
    ap.add_argument("--control", default="")
    ap.add_argument("--work", choices=("wait", "spin"), default="wait")
    ap.add_argument("--recover", type=float, default=1.0)
    ap.add_argument("--thread", action="store_true")
    args = ap.parse_args()

    push = Push(args.push)
    watch = StallWatch(push, args.run, args.rank, args.stall_after)
    control = None
    if args.control:
        control = Control(args.control, args.run, args.rank, push,
                          training_thread=watch.training_thread, idle_s=watch.idle_s)
        control.start()
        if not control_connected(control, 10):
            raise SystemExit("control socket did not connect")

    def loop() -> None:
        if args.work == "spin":
            watch.note()
            watch.start()
            print("ready", flush=True)
            stop = threading.Event()
            threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
            spin_in_named_function(watch, stop)
            return
        for _ in range(5):
            watch.note()
            watch.start()
            time.sleep(0.01)
        print("ready", flush=True)
        hang_in_collective()
        end = time.monotonic() + args.recover
        while time.monotonic() < end:
            watch.note()
            time.sleep(0.02)
        watch.note()
        print("recovered", flush=True)
        second_hang()

    if args.thread:
        trainer = threading.Thread(target=loop, name="trainer")
        trainer.start()
        trainer.join()
    else:
        loop()
    watch.close()
    if control is not None:
        control.close()
    push.close()
    alive = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    print("closed " + ",".join(alive), flush=True)


if __name__ == "__main__":
    main()
