"""The agent's per-step buffer: :meth:`StepBuffer.log_step` (the per-step hot path) and the
flusher thread that turns buffered points into ``steps`` frames (PROTOCOL.md section 5).

``log_step`` runs once per optimizer step in the training thread, so it only appends a tuple
to a deque (lock-free: ``append``/``popleft`` are atomic) and never touches the socket; a
daemon thread, started by the first call (and again in a forked child), sends the buffer
every flush interval in force (:func:`~rank_agent.stepframes.flush_interval`: ``step_flush``,
or ``world_size / 16384`` seconds when that is longer, so a big run does not flood the
broker with steps frames) through the pusher's ``send``. The frames themselves are built
by the pure :func:`rank_agent.stepframes.step_frames`. At most :data:`MAX_PENDING_STEPS`
points wait; beyond that the oldest are dropped and counted.
"""
from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Mapping

from .protocol import MAX_STEP_METRICS
from .ratelimit import RateLimitedLog
from .stepframes import StepPoint, flush_interval, step_frames

#: Most step points waiting in one agent's buffer (PROTOCOL.md section 5); beyond it the
#: oldest are dropped and counted in ``RankAgent.dropped``.
MAX_PENDING_STEPS = 8192

_getpid = os.getpid
_monotonic = time.monotonic
_get_ident = threading.get_ident


def _int_arg(value: Any, what: str) -> int:
    """An ``int`` subclass as ``int``; refuse ``bool`` and every other type (no conversion:
    ``int()`` of a GPU tensor would synchronise the device)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    raise TypeError(f"{what} must be an int, got {type(value).__name__}")


def checked_step_flush(value: Any) -> float:
    """``value`` as seconds between two flushes; ``ValueError`` unless a positive finite
    number. The one check, for the agent's constructor and its ``step_flush`` setter alike
    (0 would wake the flusher every few microseconds)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"step_flush must be a positive number of seconds, got {value}")
    return seconds


class StepBuffer:
    """One agent's ``log_step`` points and their flusher (see the module docstring).

    ``send(frame)`` queues a frame (the pusher's, never blocking); ``lose(kind, msg, *args)``
    counts and logs a call that could not be recorded; ``on_fork()`` resets the owning
    agent's per-process state (this buffer's included) when a fork the at-fork hook missed
    is noticed. ``step_flush`` is read by the flusher on each wait, so it may be changed;
    ``world_size`` (the run's) sets the floor of the interval in force (:attr:`interval`)."""

    def __init__(self, run: str, rank: int, step_flush: float, *, send: Callable[[Any], bool],
                 lose: Callable[..., bool], warn: RateLimitedLog,
                 on_fork: Callable[[], None] | None = None, watch: Any = None,
                 on_start: Callable[[], None] | None = None, world_size: int = 1) -> None:
        self.run = run
        #: the agent's :class:`~rank_agent.stallwatch.StallWatch` (None: none): each call
        #: stores its two fields inline (its ``note()``, without the call)
        self.watch = watch
        #: called when the flusher starts (once per process): the agent starts its
        #: diagnosis threads there, off the per-step path
        self._on_start = on_start
        self.rank = rank
        self._step_flush = checked_step_flush(step_flush)
        self.world_size = world_size
        self._send = send
        self._lose = lose
        self._warn = warn
        self._on_fork = on_fork or self.reset
        self.closed = False
        #: points lost: pushed out of the full buffer, logged after close (only the appending
        #: thread writes it: no lock on the hot path)
        self.dropped = 0
        self._retry_at = 0.0  # monotonic time before which a dead flusher is not restarted
        self.reset()

    def reset(self) -> None:
        """Fresh state: at construction, and in a forked child (whose copy of the parent's
        buffer belongs to the parent, whose flusher thread did not survive, and whose locks
        may have been held at the fork)."""
        self._pid = os.getpid()
        self._buf: Deque[StepPoint] = deque()
        self._prev: int | None = None
        self._t = 0.0
        #: (7.1) the time of the previous log_step call (None: none yet) and of the latest
        #: batch_ready since it (None: not called since)
        self._tlast: float | None = None
        self._ready: float | None = None
        self._last: StepPoint | None = None  # last point of the last flush (merging)
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()
        self._flush_lock = threading.Lock()
        self._start_lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Step points buffered and not yet handed to a ``steps`` frame."""
        return len(self._buf)

    def batch_ready(self) -> None:
        """:meth:`rank_agent.RankAgent.batch_ready`: one timestamp, nothing else."""
        self._ready = time.time()

    def log_step(self, step: int, metrics: Mapping[str, Any] | None = None,
                 samples: int = 0, tokens: int = 0, *, data_ms: float | None = None) -> bool:
        """:meth:`rank_agent.RankAgent.log_step` (its docstring says what it does)."""
        t = time.time()  # through the module, so a test may patch time.time
        # the data wait (7.1): explicit, or the latest batch_ready since the previous call
        ready = self._ready
        if data_ms is None:
            if ready is not None:
                self._ready = None
                last = self._tlast
                if last is not None:
                    data_ms = (ready - last) * 1000.0 if ready > last else 0.0
        else:
            self._ready = None
            if type(data_ms) is not float or not data_ms >= 0.0:  # (NaN: not >= 0)
                data_ms = self._data_arg(data_ms)
        self._tlast = t
        watch = self.watch
        if watch is not None:  # StallWatch.note(), inlined: the only cost of the watch here
            watch._last = _monotonic()
            watch._tid = _get_ident()
        try:
            if type(step) is not int:
                step = _int_arg(step, "step")
            if step < 0:
                raise ValueError(f"step must be >= 0, got {step}")
            if type(samples) is not int or samples < 0:
                samples = self._count_arg(samples, "samples")
            if type(tokens) is not int or tokens < 0:
                tokens = self._count_arg(tokens, "tokens")
            m: Dict[Any, Any] | None = None
            if metrics:
                # the common case, a small dict of plain numbers: a C-level copy (the caller
                # may reuse its dict) checked in one pass; anything else takes the slow path
                if type(metrics) is dict and len(metrics) <= MAX_STEP_METRICS:
                    m = metrics.copy()
                    for value in m.values():
                        kind = type(value)
                        if kind is not float and kind is not int:
                            m = self._metrics_slow(metrics)
                            break
                else:
                    m = self._metrics_slow(metrics)
        except Exception as exc:
            return self._lose("step", "rankboard: bad log_step call; point not recorded: %r", exc)
        if self.closed:
            self.dropped += 1
            return False
        prev = self._prev
        if prev is None or step < prev:
            step_ms = None
            self._prev, self._t = step, t
        elif step > prev:
            step_ms = (t - self._t) / (step - prev) * 1000.0
            self._prev, self._t = step, t
        else:
            step_ms = None
        buf = self._buf
        if len(buf) >= MAX_PENDING_STEPS:
            self._full(buf)
            buf = self._buf  # a fork the hook missed replaces it
        buf.append((step, t, step_ms, m, samples, tokens, data_ms))
        if self.thread is None:
            self._start_thread()
        return True

    def _count_arg(self, value: Any, what: str) -> int:
        """``samples``/``tokens`` that are not a plain non-negative ``int``: an ``int``
        subclass is converted, anything else (a tensor, a negative count) counts as 0."""
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return int(value)
        self._warn("step_" + what, "rankboard: log_step %s=%r is not an int >= 0; sent as 0",
                   what, type(value).__name__ if not isinstance(value, int) else value)
        return 0

    def _data_arg(self, value: Any) -> float | None:
        """An explicit ``data_ms`` that is not a ``float`` >= 0: an ``int`` (or a ``float``
        subclass) as ``float``, anything else (a tensor, a ``bool``) not sent, logged; a
        negative or NaN wait is not sent either (the broker rejects a frame holding one, and
        with it the step's other values)."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                wait = float(value)
            except OverflowError:
                wait = math.nan
            if wait >= 0.0:
                return wait
            self._warn("step_data_ms", "rankboard: log_step data_ms=%r is not a wait >= 0 ms; "
                       "not sent", wait)
            return None
        self._warn("step_data_ms", "rankboard: log_step data_ms=%r is not a number; not sent",
                   type(value).__name__)
        return None

    def _odd_metric(self, m: Dict[Any, Any], name: Any, value: Any) -> None:
        """A metric value that is not exactly ``int``/``float``: keep a subclass (as the base
        type msgspec encodes), skip everything else without ever calling into it."""
        if isinstance(value, float):
            m[name] = float(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            m[name] = int(value)
        else:
            self._warn("step_metric", "rankboard: log_step metric %r is a %s, not an int or "
                       "float; skipped (it is never converted: .item() on a GPU tensor "
                       "synchronises the device)", name, type(value).__name__)

    def _metrics_slow(self, metrics: Mapping[Any, Any]) -> Dict[Any, Any] | None:
        """``log_step`` metrics that are not a small ``dict`` of plain numbers: any mapping,
        odd values kept or skipped by :meth:`_odd_metric`, at most 64 kept (the wire limit
        per point, so a huge dict cannot fill memory 8192 times over); None if none is left."""
        m: Dict[Any, Any] = {}
        for name, value in metrics.items():
            if len(m) >= MAX_STEP_METRICS:
                self._warn("step_names", "rankboard: more than %d step metrics in one point; "
                           "the rest are not sent", MAX_STEP_METRICS)
                break
            kind = type(value)
            if kind is float or kind is int:
                m[name] = value
            else:
                self._odd_metric(m, name, value)
        return m or None

    def _full(self, buf: Deque[StepPoint]) -> None:
        """The buffer holds 8192 points: drop the oldest (counted), and make sure a flusher
        exists, since a full buffer means nothing drains it (a dead thread, or a fork that
        the at-fork hook did not see) or the loop outruns ``step_flush``."""
        try:
            buf.popleft()
            self.dropped += 1
        except IndexError:  # the flusher emptied it meanwhile
            pass
        if self._pid != _getpid():  # a fork the at-fork hook did not see: fresh state
            self._on_fork()
            return
        thread = self.thread
        if thread is not None and not thread.is_alive():
            now = time.monotonic()
            if now >= self._retry_at:  # at most one restart a second
                self._retry_at = now + 1.0
                self.thread = None  # log_step starts a new one

    def _start_thread(self) -> None:
        """Start the flusher (a daemon thread), once per process; a failure is logged and
        leaves points waiting for finish()/close() (or a retry when the buffer fills)."""
        with self._start_lock:
            if self.thread is not None or self.closed:
                return
            stop = self.stop
            thread = threading.Thread(target=self._loop, args=(stop,),
                                      name=f"rankboard-steps-{self.rank}", daemon=True)
            self.thread = thread
        try:
            thread.start()
        except Exception as exc:
            self._warn("steps_thread", "rankboard: could not start the step flusher: %r", exc)
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception as exc:  # pragma: no cover - the owner's starts never raise
                self._warn("diag_start", "rankboard: could not start diagnosis: %r", exc)

    @property
    def step_flush(self) -> float:
        """Seconds between two flushes asked for (read by the flusher on each wait)."""
        return self._step_flush

    @step_flush.setter
    def step_flush(self, value: float) -> None:
        self._step_flush = checked_step_flush(value)

    @property
    def interval(self) -> float:
        """Seconds between two flushes in force: ``max(step_flush, world_size / 16384)``."""
        return flush_interval(self.step_flush, self.world_size)

    def _loop(self, stop: threading.Event) -> None:
        """The flusher: every :attr:`interval` seconds, send the buffer; never dies on an
        error."""
        while not stop.wait(self.interval):
            try:
                self.flush()
            except Exception as exc:  # pragma: no cover - send already swallows send trouble
                self._warn("steps_flush", "rankboard: step flush failed: %r", exc)

    def flush(self) -> None:
        """Send the points buffered now as ``steps`` frames (see :func:`step_frames`).

        Serialised by a lock of its own (never the socket lock, never taken by log_step), so
        frames leave in call order and a finish() cannot overtake points that the flusher
        thread has taken but not yet sent."""
        if self._pid != _getpid():  # a fork the hook missed: the parent's locks and points
            self._on_fork()
        with self._flush_lock:
            buf = self._buf
            n = len(buf)
            if not n:
                return
            pop = buf.popleft
            points: List[StepPoint] = []
            for _ in range(n):  # only what is there now: a fast loop cannot keep us here
                try:
                    points.append(pop())
                except IndexError:  # log_step's overflow dropped one meanwhile
                    break
            frames, self._last = step_frames(self.run, self.rank, points, self._last, self._warn)
            for frame in frames:
                self._send(frame)

    def safe_flush(self) -> None:
        """:meth:`flush` for finish() and close(): never raises."""
        try:
            self.flush()
        except Exception as exc:  # pragma: no cover - send already swallows send trouble
            self._warn("steps_flush", "rankboard: step flush failed: %r", exc)

    def close(self) -> None:
        """Stop the flusher (bounded: a flush is non-blocking sends), send what is pending,
        refuse further points. Points a concurrent ``log_step`` adds after the last flush are
        lost and counted."""
        if self._pid != _getpid():  # a fork the hook missed: not the parent's flusher or locks
            self._on_fork()
        current = threading.current_thread()
        thread = self.thread
        self.stop.set()
        if thread is not None and thread is not current and thread.ident:
            thread.join(timeout=2.0)
        self.safe_flush()
        self.closed = True

    def discard_pending(self) -> None:
        """Count and drop what a concurrent ``log_step`` added after :meth:`close`'s flush."""
        left = len(self._buf)
        if left:
            self._buf.clear()
            self.dropped += left
