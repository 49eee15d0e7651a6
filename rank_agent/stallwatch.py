"""The stall watch (PROTOCOL.md section 2.5): a dump of every thread when the loop goes silent.

The training thread pays :meth:`StallWatch.note`, two attribute stores (the monotonic time
and the calling thread's id) per ``log_step``/``log_epoch``; everything else happens on the
watcher thread, which wakes at most every :data:`TICK` seconds (and at the moment a dump is
due):

* it notices a new call by the changed timestamp; the interval since the previous one it saw
  goes into a ring of the last 100, whose median makes the automatic ``stall_after`` =
  max(60 s, 10 x median) (:func:`auto_stall_after`). The watcher sees the calls at its own
  tick, so intervals shorter than the tick merge; only medians above 6 s change the value,
  and those it sees exactly;
* when the loop has been silent for ``stall_after`` it sends a ``stacks`` frame of reason
  ``stall`` through the ``send`` callable it was given (the agent's non-blocking send), then
  again every ``stall_after`` while the silence lasts, at most :data:`MAX_DUMPS` per stall;
  the next call ends the stall (the broker learns it from the next ``steps``/``metrics``).
  The first dump leaves within ``stall_after`` + :data:`TICK` of the last call.

``main`` marks the thread that made the last call (before any call, the process's main
thread). ``stall_after=0`` is off: :meth:`start` starts nothing. Fork-safe like the agent:
in a forked child (``os.register_at_fork``, plus a pid check in :meth:`start`) the watch
forgets the parent's thread and state without touching them; the owner's next
:meth:`start` makes a fresh thread in the child.

A thread that holds the GIL and never releases it starves this thread too: no dump is sent
(the limit section 2.5 documents).
"""
from __future__ import annotations

import logging
import os
import statistics
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Deque, Optional

from .flightrec import send_collectives
from .stacks import main_thread_ident, stacks_frame

__all__ = ["StallWatch", "auto_stall_after", "MAX_DUMPS", "TICK", "MIN_AUTO", "INTERVALS"]

log = logging.getLogger(__name__)

#: Most dumps of one stall.
MAX_DUMPS = 10
#: The watcher's longest sleep, seconds (the first dump's lateness is at most this).
TICK = 0.5
#: The automatic ``stall_after``'s floor, seconds, and the number of intervals it looks at.
MIN_AUTO = 60.0
INTERVALS = 100

_monotonic = time.monotonic
_get_ident = threading.get_ident

_WATCHES: weakref.WeakSet[StallWatch] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for watch in list(_WATCHES):
        watch._reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def auto_stall_after(intervals: Deque[float] | list[float]) -> float:
    """max(60 s, 10 x the median of ``intervals``) (section 2.5); 60 s with none."""
    if not intervals:
        return MIN_AUTO
    return max(MIN_AUTO, 10.0 * statistics.median(intervals))


class StallWatch:
    """Watch a training loop for silence and dump every thread's stack when it stalls.

    ``send(frame)`` receives each ``stacks`` frame; it must not block (the agent's send
    queues without blocking and counts what it drops) and its exceptions are logged and
    swallowed. ``stall_after``: ``None`` automatic, ``0`` off, else seconds. ``clock`` is
    injectable for tests; the hot path always uses :func:`time.monotonic`.
    """

    def __init__(self, send: Callable[[Any], Any], run: str, rank: int,
                 stall_after: Optional[float] = None) -> None:
        if stall_after is not None and (stall_after < 0 or stall_after != stall_after):
            raise ValueError(f"stall_after must be None, 0 or a positive number of seconds, "
                             f"got {stall_after!r}")
        self.send = send
        self.run = run
        self.rank = rank
        self.stall_after = stall_after
        #: the last call's monotonic time and thread (None before the first call)
        self._last: Optional[float] = None
        self._tid: Optional[int] = None
        self.dumps_sent = 0
        _WATCHES.add(self)
        self._init_thread_state()

    def _init_thread_state(self) -> None:
        self._pid = os.getpid()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._closed = False
        self._intervals: Deque[float] = deque(maxlen=INTERVALS)
        self._auto = MIN_AUTO
        #: the last call time the watcher has seen (read by tests)
        self._seen: Optional[float] = None

    @property
    def enabled(self) -> bool:
        return self.stall_after != 0

    # -- the training thread's side -------------------------------------------------------

    def note(self) -> None:
        """One ``log_step``/``log_epoch`` call: the time and the calling thread, nothing else."""
        self._last = _monotonic()
        self._tid = _get_ident()

    # -- what other agent threads read ----------------------------------------------------

    def training_thread(self) -> Optional[int]:
        """The thread that last called :meth:`note` (the process's main thread before)."""
        tid = self._tid
        return tid if tid is not None else main_thread_ident()

    def idle_s(self) -> float:
        """Seconds since the last :meth:`note` (0 before the first)."""
        last = self._last
        return 0.0 if last is None else max(0.0, _monotonic() - last)

    def current_stall_after(self) -> float:
        """The ``stall_after`` in force (the automatic one as the watcher last computed it)."""
        return self._auto if self.stall_after is None else float(self.stall_after)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the watcher thread (a daemon) unless it runs, the watch is off or stopped.
        Cheap when it already runs (the owner may call it on every ``log_epoch``)."""
        if self._pid != os.getpid():  # a fork the at-fork hook did not see
            self._reset_after_fork()
        if self._thread is not None or self._closed or not self.enabled:
            return
        thread = threading.Thread(target=self._loop, args=(self._stop,),
                                  name=f"rankboard-stallwatch-{self.rank}", daemon=True)
        self._thread = thread
        try:
            thread.start()
        except Exception as exc:  # e.g. no more threads: the watch is lost, training is not
            log.warning("rankboard: could not start the stall watch: %r", exc)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the watcher (``finish``/``close``); idempotent; no thread is left running
        (the loop wakes at once, and a dump in progress is bounded)."""
        self._closed = True
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread() and thread.ident:
            thread.join(timeout)
        _WATCHES.discard(self)

    def _reset_after_fork(self) -> None:
        """In a forked child: the parent's thread does not exist here; start afresh (the
        last call's time and thread carry over: the child's loop is the same loop)."""
        closed = self._closed
        self._init_thread_state()
        self._closed = closed
        self.dumps_sent = 0

    # -- the watcher thread ---------------------------------------------------------------

    def _loop(self, stop: threading.Event) -> None:
        stall_of: Optional[float] = None  # the call whose silence is being dumped
        dumps = 0
        next_at = 0.0
        wait = TICK
        while not stop.wait(wait):
            wait = TICK
            last = self._last
            if last is None:
                continue
            seen = self._seen
            if last != seen:
                if seen is not None and last > seen:
                    self._intervals.append(last - seen)
                    if self.stall_after is None:
                        self._auto = auto_stall_after(self._intervals)
                self._seen = last
            after = self.current_stall_after()
            if stall_of != last:  # a call since the stall (or no stall yet): a fresh count
                stall_of, dumps, next_at = last, 0, last + after
            now = _monotonic()
            if dumps >= MAX_DUMPS:
                continue
            if now >= next_at:
                self._dump(now - last)
                dumps += 1
                next_at = max(next_at + after, now + after * 0.5)
                now = _monotonic()
            wait = min(TICK, max(0.001, next_at - now))

    def _dump(self, idle: float) -> None:
        try:
            frame = stacks_frame(self.run, self.rank, "stall", main_ident=self.training_thread(),
                                 idle_s=idle)
            self.send(frame)
            self.dumps_sent += 1
        except Exception as exc:
            log.warning("rankboard: stall dump failed: %r", exc)
            return
        send_collectives(self.send, frame)  # the Flight Recorder's view (7.2); never raises
