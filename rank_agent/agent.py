"""RankAgent: the piece of rankboard that lives inside every training rank (PROTOCOL.md section 5).

It is a guest in someone else's training loop, and every design choice follows from that:

* **Never block, never raise.** Frames go out through a ZeroMQ PUSH socket with a bounded
  send high-water mark (``sndhwm``, default 1000 frames) and ``zmq.NOBLOCK``; a frame that
  does not fit (broker slow or gone) is dropped and counted in :attr:`RankAgent.dropped`.
  Any other failure (encoding, a closed socket, a value that would break the wire schema) is
  counted, logged rate-limited and swallowed. The only exceptions the agent raises are
  ``ValueError``/``TypeError`` from the constructor for arguments that could never produce a
  valid frame (a negative rank, a rank outside the world), i.e. set-up bugs, before training.
* **No I/O in the constructor.** The ZeroMQ context and socket are created on the first send,
  so an agent can be built (and ``fork()``-ed) cheaply.
* **Fork safety.** ZeroMQ contexts must not be used across ``fork()``. The agent records the
  pid that created its context; in a forked child (``os.register_at_fork`` hook, plus a pid
  check on every use for forks that bypass the hook) it drops the inherited context and
  socket *without touching them* (they are parked in a module list so that their finalisers
  never run in the child) and creates a fresh pair lazily if the child sends. ``close()`` in
  a child therefore never terminates, or waits on, the parent's context.
* **Bounded everything.** The queue is the socket's HWM; the sampler keeps one latest
  sample; logs are rate-limited per kind; strings are clamped to the wire limits and the run
  id is sanitised to the wire pattern, so the agent never produces a frame the broker rejects.
* **Bounded shutdown.** Every socket gets ``LINGER`` = ``linger_ms`` (default 500 ms) when it
  is created, so ``close()`` waits at most that long for unsent frames, broker or no broker.
  An agent a script never closed is closed by an ``atexit`` hook (same bound), so its last
  frames (``finish``) still go out.
* **Thread safety.** The training thread and the sampler thread both send; a lock guards the
  socket (held only for a non-blocking send, a microsecond or so).
* **Per-step points are buffered, not sent.** :meth:`RankAgent.log_step` runs once per
  optimizer step, so it only appends a tuple to a deque (lock-free: ``append``/``popleft``
  are atomic) and a daemon thread, started on the first call, turns the buffer into
  ``steps`` frames every ``step_flush`` seconds (details in :meth:`RankAgent.log_step`).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import math
import os
import re
import secrets
import socket as _socket
import threading
import time
import weakref
from collections import deque
from typing import Any, Deque, Dict, List, Mapping, Tuple, Union

import zmq

from . import curve
from .protocol import (
    MAX_FRAME_BYTES,
    MAX_METADATA_BYTES,
    MAX_RUN_ID,
    MAX_SCALAR_NAME,
    MAX_SCALARS,
    MAX_SHORT,
    MAX_STEP_METRICS,
    MAX_SUMMARY,
    MAX_SVG_BYTES,
    MAX_WORLD_SIZE,
    Finish,
    Hardware,
    Metadata,
    Metrics,
    Register,
    Resources,
    ResourceSample,
    Svg,
    encoder,
    utf8_over,
)
from .stepframes import StepPoint, step_frames

log = logging.getLogger(__name__)

DEFAULT_BROKER = "tcp://127.0.0.1:5585"
_RUN_BAD = re.compile(r"[^A-Za-z0-9._:\-]+")

ScalarArg = Union[float, Tuple[float, int]]

#: Most step points waiting in one agent's buffer (PROTOCOL.md section 5); beyond it the
#: oldest are dropped and counted in ``RankAgent.dropped``.
MAX_PENDING_STEPS = 8192

# hot-path bindings (log_epoch runs once per epoch in the training thread): one global
# lookup each instead of an attribute chain
_encode = encoder.encode
_getpid = os.getpid
_NOBLOCK = zmq.NOBLOCK
_Again = zmq.Again

# -- process-wide bookkeeping: live agents (for fork and exit hooks), parked zmq objects -------

_AGENTS: weakref.WeakSet[RankAgent] = weakref.WeakSet()
#: zmq objects inherited across fork(): kept referenced forever in the child so that their
#: finalisers (which would warn, or destroy the parent's context state) never run there.
_FORK_ORPHANS: List[Any] = []


def _after_fork_in_child() -> None:
    for agent in list(_AGENTS):
        agent._reset_after_fork()


def _close_all_at_exit() -> None:
    """Flush and close the agents a script forgot to close (bounded by each one's linger)."""
    for agent in list(_AGENTS):
        try:
            agent.close()
        except Exception:  # pragma: no cover - interpreter teardown
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
# registered after ``import zmq``, so it runs before pyzmq's own exit hook (atexit is LIFO)
atexit.register(_close_all_at_exit)


class _RateLimitedLog:
    """Logs each kind of trouble at most once per ``every`` seconds, counting what it skipped.

    The set of kinds is a fixed, small set of strings chosen by the agent, so memory is bounded.
    """

    def __init__(self, every: float = 60.0) -> None:
        self.every = every
        self._last: Dict[str, float] = {}
        self._skipped: Dict[str, int] = {}

    def __call__(self, kind: str, msg: str, *args: Any, level: int = logging.WARNING) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.every:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        self._last[kind] = now
        skipped = self._skipped.pop(kind, 0)
        log.log(level, msg, *args)
        if skipped:
            log.log(level, "rankboard: %d similar messages suppressed before this one", skipped)


def sanitize_run_id(run: str) -> str:
    """Make ``run`` a valid wire run id (1-128 of ``A-Z a-z 0-9 . _ : -``), deterministically.

    Runs of other characters become ``_`` (``"my run/1"`` -> ``"my_run_1"``). An id longer than
    128 characters keeps its first 119 and gains ``-`` plus 8 hex digits of a hash of the whole
    id, so long ids that differ only at the end stay distinct. Every rank computes the same
    result from the same input, so they all land in the same run. Empty input gives ``"run"``.
    """
    text = _RUN_BAD.sub("_", str(run))
    if len(text) > MAX_RUN_ID:
        digest = hashlib.sha1(str(run).encode("utf-8", "surrogatepass")).hexdigest()[:8]
        text = f"{text[:MAX_RUN_ID - 9]}-{digest}"
    return text or "run"


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or not value.strip():
        return None
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _clamp(text: str | None, limit: int) -> str | None:
    if text is None:
        return None
    text = str(text)
    return text if len(text) <= limit else text[:limit]


def _int_arg(value: Any, what: str) -> int:
    """An ``int`` subclass as ``int``; refuse ``bool`` and every other type (no conversion:
    ``int()`` of a GPU tensor would synchronise the device)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    raise TypeError(f"{what} must be an int, got {type(value).__name__}")


def _finite_or_none(obj: Any) -> Any:
    """A copy of JSON-like ``obj`` with NaN/Infinity replaced by ``None`` (strict JSON has neither)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


class RankAgent:
    """One training rank's connection to the rankboard broker.

    ``broker`` is the broker's ingest endpoint (e.g. ``tcp://head-node:5585``); ``run`` the
    run id shared by every rank of the job (sanitised with :func:`sanitize_run_id`); ``rank``
    the global rank (0 <= rank < world_size); ``world_size`` the number of ranks (1-65536);
    ``local_rank`` the rank on its host (it picks the GPU the sampler reads); ``host`` the
    host name shown in the dashboard (default: this machine's hostname; clamped to 256
    characters).

    Keyword-only tuning: ``sndhwm`` (frames queued while the broker is slow or gone before
    new ones are dropped), ``linger_ms`` (how long ``close()`` may wait to deliver what is
    queued), ``step_flush`` (seconds between two sends of the :meth:`log_step` buffer; a
    point leaves the process within about that long, and at most 2 x ``step_flush``).

    Every sending method returns ``True`` when the frame was queued and ``False`` when it was
    dropped; none of them blocks or raises.
    """

    def __init__(
        self,
        broker: str,
        run: str,
        rank: int,
        world_size: int,
        local_rank: int = 0,
        host: str | None = None,
        *,
        sndhwm: int = 1000,
        linger_ms: int = 500,
        step_flush: float = 0.25,
    ) -> None:
        rank, world_size, local_rank = int(rank), int(world_size), int(local_rank)
        step_flush = float(step_flush)
        if not (math.isfinite(step_flush) and step_flush > 0):
            raise ValueError(f"step_flush must be a positive number of seconds, got {step_flush}")
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be 1..{MAX_WORLD_SIZE}, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be 0..world_size-1 ({world_size - 1}), got {rank}")
        if local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {local_rank}")
        self.broker = str(broker)
        self.run = sanitize_run_id(run)
        if self.run != str(run):
            log.info("run id %r sent as %r (wire pattern)", run, self.run)
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.host = _clamp(host if host is not None else _socket.gethostname(), MAX_SHORT) or "unknown"
        self.sndhwm = max(1, int(sndhwm))
        self.linger_ms = max(0, int(linger_ms))
        #: seconds between two flushes of the step buffer (read by the flusher on each wait)
        self.step_flush = step_flush

        self._lock = threading.Lock()
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        #: ``self._sock.send`` while the socket is usable (None: not created yet, closed,
        #: broken or forked): the send fast path is "``_push`` set and same pid"
        self._push: Any = None
        self._pid = os.getpid()  # the process whose context self._ctx is
        self._closed = False
        self._broken: Exception | None = None  # set when the endpoint proved unusable
        self._finished = False
        self._sent = 0
        self._dropped = 0
        self._errors = 0
        self._warn = _RateLimitedLog()

        self._sampler: Any = None  # rank_agent.sampler.Sampler, created on first need
        self._sampler_thread: threading.Thread | None = None
        self._sampler_stop = threading.Event()
        self._latest: ResourceSample | None = None

        # log_step: the buffer (appended by the training thread, drained by the flusher
        # thread), the previous step and its time (for step_ms), points dropped from the
        # buffer (only the appending thread writes it: no lock on the hot path)
        self._steps_dropped = 0
        self._steps_retry_at = 0.0  # monotonic time before which a dead flusher is not restarted
        self._init_steps()
        _AGENTS.add(self)

    def _init_steps(self) -> None:
        """Fresh step-buffer state: at construction, and in a forked child (whose copy of
        the parent's buffer belongs to the parent, whose flusher thread did not survive, and
        whose locks may have been held at the fork)."""
        self._steps_buf: Deque[StepPoint] = deque()
        self._steps_prev: int | None = None
        self._steps_t = 0.0
        self._steps_last: StepPoint | None = None  # last point of the last flush (merging)
        self._steps_thread: threading.Thread | None = None
        self._steps_stop = threading.Event()
        self._steps_flush_lock = threading.Lock()

    # -- construction from the launcher's environment ----------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> RankAgent:
        """Build an agent from the environment a launcher (torchrun, Slurm, or none) set up.

        * broker: ``RANKBOARD_BROKER``, default ``tcp://127.0.0.1:5585``.
        * rank, world size, local rank: torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` when
          ``RANK`` is set, else Slurm's ``SLURM_PROCID``/``SLURM_NTASKS`` (or
          ``SLURM_NPROCS``)/``SLURM_LOCALID``, else a single process: rank 0 of 1, local 0.
          A missing world size defaults to rank + 1 and a missing local rank to 0.
        * run: ``RANKBOARD_RUN``; else torchrun's ``TORCHELASTIC_RUN_ID`` (unless it is
          torchrun's placeholder ``none``); else ``SLURM_JOB_ID``, with ``.<SLURM_STEP_ID>``
          when set (``12345.0``, as ``sacct`` names a step, so two ``srun`` steps of one
          allocation are two runs); else, for several ranks, ``MASTER_ADDR:MASTER_PORT`` (the
          one value all ranks share; warned about, since it repeats across jobs); else a
          generated ``run-<YYYYmmdd-HHMMSS>-<6 hex>``, which is fine for a single process.
        * host: ``RANKBOARD_HOST``, else the hostname.

        ``env`` defaults to ``os.environ``; ``kwargs`` (``sndhwm``, ``linger_ms``,
        ``step_flush``, or any constructor argument) override what the environment says.
        Unparseable integers and an inconsistent rank/world size raise ``ValueError`` naming
        the variable.
        """
        env = os.environ if env is None else env
        if env.get("RANK", "").strip():
            rank = _env_int(env, "RANK")
            world = _env_int(env, "WORLD_SIZE")
            local = _env_int(env, "LOCAL_RANK")
        elif env.get("SLURM_PROCID", "").strip():
            rank = _env_int(env, "SLURM_PROCID")
            world = _env_int(env, "SLURM_NTASKS")
            if world is None:
                world = _env_int(env, "SLURM_NPROCS")
            local = _env_int(env, "SLURM_LOCALID")
        else:
            rank, world, local = 0, 1, 0
        rank = 0 if rank is None else rank
        world = rank + 1 if world is None else world
        local = 0 if local is None else local

        run = env.get("RANKBOARD_RUN", "").strip()
        if not run:
            elastic = env.get("TORCHELASTIC_RUN_ID", "").strip()
            if elastic and elastic.lower() != "none":
                run = elastic
        if not run:
            job = env.get("SLURM_JOB_ID", "").strip()
            if job:
                step = env.get("SLURM_STEP_ID", "").strip()
                run = f"{job}.{step}" if step else job
        if not run and world > 1:
            addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
            if addr and port:
                run = f"{addr}:{port}"
                log.warning(
                    "no RANKBOARD_RUN, TORCHELASTIC_RUN_ID or SLURM_JOB_ID: run id %r from "
                    "MASTER_ADDR:MASTER_PORT; set RANKBOARD_RUN to name the run", run)
            else:
                log.warning(
                    "rank %d of %d has no shared run id (set RANKBOARD_RUN): each rank will "
                    "appear as its own run", rank, world)
        if not run:
            run = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"

        args: Dict[str, Any] = {
            "broker": env.get("RANKBOARD_BROKER", "").strip() or DEFAULT_BROKER,
            "run": run,
            "rank": rank,
            "world_size": world,
            "local_rank": local,
            "host": env.get("RANKBOARD_HOST", "").strip() or None,
        }
        args.update(kwargs)
        return cls(**args)

    # -- counters ----------------------------------------------------------------------------

    @property
    def sent(self) -> int:
        """Frames handed to ZeroMQ (queued; delivery is ZeroMQ's job from there)."""
        return self._sent

    @property
    def dropped(self) -> int:
        """Frames lost for any reason (queue full because the broker is slow or gone, after
        ``close()``, or an error, also counted in :attr:`errors`) plus step points lost: pushed
        out of the full :meth:`log_step` buffer, logged after ``close()``, or a bad call.
        A ``steps`` frame lost in the queue counts once, as a frame."""
        return self._dropped + self._steps_dropped

    @property
    def errors(self) -> int:
        """Frames lost to something other than a full queue (bad value, encode or socket error)."""
        return self._errors

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the socket --------------------------------------------------------------------------

    def _reset_after_fork(self) -> None:
        """In a forked child: forget the parent's zmq objects and threads without touching them."""
        if self._ctx is not None or self._sock is not None:
            _FORK_ORPHANS.append((self._ctx, self._sock))
        self._ctx = None
        self._sock = None
        self._push = None
        self._pid = os.getpid()
        self._lock = threading.Lock()  # the parent's may have been held by a thread at fork
        self._sampler_thread = None  # threads do not survive fork
        self._sampler_stop = threading.Event()
        self._sampler = None  # its NVML handles belong to the parent
        self._init_steps()  # the parent sends its own pending points; the flusher comes back lazily

    def _socket(self) -> zmq.Socket:
        """The PUSH socket of this process, created on first use. Call with the lock held.

        Raises what ZeroMQ raises for an unusable endpoint; the caller latches that in
        ``self._broken`` so that a bad endpoint costs one failed attempt, not one per frame."""
        if self._pid != os.getpid():  # a fork the at-fork hook did not see (e.g. a raw syscall)
            self._reset_after_fork()
        if self._sock is None:
            ctx = zmq.Context(io_threads=1)
            sock = None
            try:
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, self.linger_ms)
                sock.setsockopt(zmq.SNDHWM, self.sndhwm)
                # CURVE from RANKBOARD_CURVE_*; a configured but unusable key raises here,
                # which latches the agent as broken: it sends nothing rather than plain.
                for option, value in (curve.socket_options() or {}).items():
                    sock.setsockopt(option, value)
                sock.connect(self.broker)
            except BaseException:
                if sock is not None:
                    sock.close(linger=0)
                ctx.term()
                raise
            self._ctx, self._sock = ctx, sock
            self._push = sock.send
        return self._sock

    def _send_bytes(self, data: bytes, frame_type: type) -> bool:
        """Queue one encoded frame without blocking; count it as sent or dropped.

        The fast path (the socket exists, in this process) is one lock, one pid check and one
        non-blocking send; the first send, a closed or broken agent and a fork the at-fork
        hook did not see go through :meth:`_send_other`, under the same lock."""
        with self._lock:
            push = self._push
            if push is not None and self._pid == _getpid():
                try:
                    push(data, _NOBLOCK)
                except _Again:
                    self._dropped += 1
                    return False
                except Exception as exc:
                    self._dropped += 1
                    self._errors += 1
                    failure, fatal = exc, False
                else:
                    self._sent += 1
                    return True
            else:
                outcome = self._send_other(data)
                if isinstance(outcome, bool):
                    return outcome
                failure, fatal = outcome
        # logging happens outside the lock: a slow log handler must not stall the other sender
        if fatal:
            log.error("rankboard: cannot use broker endpoint %r (%r); this agent will send nothing",
                      self.broker, failure)
        else:
            self._warn("send", "rankboard: could not send a %s frame to %s: %r",
                       frame_type.__name__, self.broker, failure)
        return False

    def _send_other(self, data: bytes) -> bool | tuple[Exception, bool]:
        """Every send but the fast path; call with the lock held. Counts the frame and returns
        whether it was queued, or ``(failure, fatal)`` for the caller to log once unlocked."""
        if self._closed or self._broken is not None:
            self._dropped += 1
            if self._broken is not None:
                self._errors += 1
            return False
        try:
            sock = self._socket()
        except Exception as exc:
            self._broken = exc
            self._dropped += 1
            self._errors += 1
            return exc, True
        try:
            sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            self._dropped += 1
            return False
        except Exception as exc:
            self._dropped += 1
            self._errors += 1
            return exc, False
        self._sent += 1
        return True

    def _send(self, frame: Any) -> bool:
        try:
            data = _encode(frame)
        except Exception as exc:
            return self._lose("encode", "rankboard: could not encode a %s frame: %r", type(frame).__name__, exc)
        if len(data) > MAX_FRAME_BYTES:
            return self._lose("oversize", "rankboard: %s frame of %d bytes is over the 4 MiB limit; not sent",
                              type(frame).__name__, len(data))
        return self._send_bytes(data, type(frame))

    def _lose(self, kind: str, msg: str, *args: Any) -> bool:
        """Count a frame that could not even be built, log it rate-limited; return False."""
        with self._lock:
            self._dropped += 1
            self._errors += 1
        self._warn(kind, msg, *args)
        return False

    # -- the frames --------------------------------------------------------------------------

    def register(self, port: int = 0, total_epochs: int = 0) -> bool:
        """Announce this rank: world size, host, local rank, pid; ``port`` a dashboard port the
        launcher would like the web on (0: none), ``total_epochs`` if known (0: unknown)."""
        try:
            port, total_epochs = int(port), int(total_epochs)
            if not 0 <= port <= 65535:
                self._warn("port", "rankboard: port %d out of range; registering without one", port)
                port = 0
            frame = Register(
                run=self.run, rank=self.rank, world_size=self.world_size, host=self.host or "unknown",
                local_rank=self.local_rank, port=port, total_epochs=max(0, total_epochs), pid=os.getpid(),
            )
        except Exception as exc:
            return self._lose("register", "rankboard: bad register arguments: %r", exc)
        return self._send(frame)

    def set_svg(self, svg: Union[str, bytes], label: str | None = None, hash: str | None = None) -> bool:
        """Send the model graph as SVG (the broker keeps the first non-empty one of the run).

        ``label`` and ``hash`` are clamped to 256 characters; an SVG over 2 MiB (UTF-8) would
        be rejected, so it is not sent (logged)."""
        try:
            if isinstance(svg, (bytes, bytearray, memoryview)):
                svg = bytes(svg).decode("utf-8", "replace")
            svg = str(svg)
            if utf8_over(svg, MAX_SVG_BYTES):
                return self._lose("svg", "rankboard: SVG over 2 MiB; not sent")
            frame = Svg(run=self.run, rank=self.rank, svg=svg,
                        label=_clamp(label, MAX_SHORT), hash=_clamp(hash, MAX_SHORT))
        except Exception as exc:
            return self._lose("svg", "rankboard: bad SVG arguments: %r", exc)
        return self._send(frame)

    def set_metadata(self, obj_or_json_str: Any) -> bool:
        """Send the run's metadata (the broker keeps the last one, whole).

        A ``str``/``bytes`` must already be JSON; anything else is ``json.dumps``-ed (NaN and
        infinities become ``null``, as strict JSON has neither). What cannot be serialised,
        is not valid JSON, or is over 1 MiB is logged and skipped, never raised."""
        try:
            if isinstance(obj_or_json_str, (bytes, bytearray)):
                obj_or_json_str = bytes(obj_or_json_str).decode("utf-8")
            if isinstance(obj_or_json_str, str):
                text = obj_or_json_str
                json.loads(text)  # the broker discards malformed JSON: say so here instead
            else:
                try:
                    text = json.dumps(obj_or_json_str, allow_nan=False)
                except ValueError:
                    text = json.dumps(_finite_or_none(obj_or_json_str), allow_nan=False)
        except Exception as exc:
            return self._lose("metadata", "rankboard: metadata is not JSON-serialisable; skipped: %r", exc)
        if utf8_over(text, MAX_METADATA_BYTES):
            return self._lose("metadata", "rankboard: metadata over 1 MiB; skipped")
        return self._send(Metadata(run=self.run, rank=self.rank, json=text))

    def set_hardware(self, summary: str | None = None) -> bool:
        """Send this rank's hardware summary, ``"<cpu> | <gpu>"``; ``None`` detects it
        (CPU model, threads, RAM, and this rank's own GPU through NVML). Clamped to 4096."""
        try:
            if summary is None:
                summary = self._get_sampler().hardware_summary()
            frame = Hardware(run=self.run, rank=self.rank, summary=_clamp(str(summary), MAX_SUMMARY) or "")
        except Exception as exc:
            return self._lose("hardware", "rankboard: could not build the hardware summary: %r", exc)
        return self._send(frame)

    def log_epoch(
        self,
        epoch: int,
        avg_loss: float,
        batches: int = 0,
        samples: int = 0,
        epoch_ms: float = 0.0,
        scalars: Mapping[str, ScalarArg] | None = None,
        share_complete_ms: float | None = None,
    ) -> bool:
        """Send this rank's result for one epoch (the hot path: a few microseconds).

        ``scalars`` maps a name to a float (one observation) or a ``(sum, count)`` pair; names
        are clamped to 128 characters and at most 256 are sent. Numbers may be anything
        ``float()``/``int()`` accept (0-d tensors, numpy scalars). The sampler's latest
        resource sample, if sampling runs, rides along. Bad values drop the frame (counted,
        logged), never raise.

        Written for speed (it runs in the training thread): a value that already has its
        wire type (exactly ``float``, ``int`` or ``str``) is used as it is; anything else
        goes through ``float()``/``int()``/``str()``, so what is accepted, sent or dropped
        is what it always was."""
        try:
            if type(epoch) is not int:
                epoch = int(epoch)
            if type(avg_loss) is not float:
                avg_loss = float(avg_loss)
            if type(batches) is not int:
                batches = int(batches)
            if type(samples) is not int:
                samples = int(samples)
            if type(epoch_ms) is not float:
                epoch_ms = float(epoch_ms)
            if share_complete_ms is not None and type(share_complete_ms) is not float:
                share_complete_ms = float(share_complete_ms)
            if epoch < 0 or batches < 0 or samples < 0:
                raise ValueError("epoch, batches and samples must be >= 0")
            frame = Metrics(
                run=self.run, rank=self.rank, epoch=epoch, avg_loss=avg_loss,
                batches=batches, samples=samples, epoch_ms=epoch_ms,
                share_complete_ms=share_complete_ms,
                scalars=self._scalars(scalars) if scalars else {}, resources=self._latest,
            )
        except Exception as exc:
            return self._lose("metrics", "rankboard: bad log_epoch arguments; epoch not sent: %r", exc)
        return self._send(frame)

    def _scalars(self, scalars: Mapping[Any, Any]) -> Dict[str, Tuple[float, int]]:
        """``log_epoch``'s scalars as the wire wants them: ``{name: (sum, count)}``, names
        clamped to 128 characters, at most 256 entries. Raises for a bad value (the caller
        drops the frame)."""
        sc: Dict[str, Tuple[float, int]] = {}
        capped = type(scalars) is not dict or len(scalars) > MAX_SCALARS  # else it cannot bite
        for name, value in scalars.items():
            if capped and len(sc) >= MAX_SCALARS:
                self._warn("scalars", "rankboard: more than %d scalars; the rest are not sent", MAX_SCALARS)
                break
            kind = type(value)
            if kind is float:
                pair: Tuple[float, int] = (value, 1)
            elif kind is tuple or isinstance(value, (tuple, list)):
                total, count = value[0], value[1]
                if type(total) is not float:
                    total = float(total)
                if type(count) is not int:
                    count = int(count)
                if count < 0:
                    raise ValueError(f"scalar {name!r} has a negative count")
                pair = (total, count)
            else:
                pair = (float(value), 1)
            if type(name) is not str:
                name = str(name)
            if len(name) > MAX_SCALAR_NAME:
                name = name[:MAX_SCALAR_NAME]
            sc[name] = pair
        return sc

    # -- per-step points ---------------------------------------------------------------------

    def log_step(self, step: int, metrics: Mapping[str, Any] | None = None,
                 samples: int = 0, tokens: int = 0) -> bool:
        """Record one optimizer step (the per-step hot path: about a microsecond).

        The call records ``time.time()``, derives ``step_ms`` = (t - t_prev) / (step -
        step_prev) x 1000 and appends one point to a buffer; a daemon thread (started by the
        first call, and again in a forked child) sends the buffer as ``steps`` frames every
        ``step_flush`` seconds, and :meth:`finish`/:meth:`close` send what is pending first.
        Returns ``True`` when the point was buffered, ``False`` when it was not (a bad
        ``step``, or the agent is closed: counted in :attr:`dropped`, logged rate-limited).
        It never raises and never touches the socket. Call it from one thread (the
        training loop): ``step_ms`` compares with that thread's previous call.

        * ``step``: an ``int`` >= 0 (``bool`` and non-``int`` types, e.g. numpy integers,
          are refused, not converted: pass ``int(step)``).
        * ``step_ms`` is ``None`` on the first call and whenever the step did not grow. The
          anchor (t_prev, step_prev) is the first call of a step: a repeated step (see
          below) does not move it, so the next step's ``step_ms`` still spans the whole step;
          a step below the previous one (counting restarted) becomes the new anchor.
        * ``metrics``: name -> value. Values whose type is not ``int`` or ``float`` are
          skipped, ``bool`` included: a tensor is never converted, because ``.item()`` on a
          GPU tensor synchronises the device. Subclasses of ``float``/``int`` (numpy's
          ``float64``; ``IntEnum``) are ``float``/``int`` and are kept; numpy's ``float32``
          and integer scalars are not, and are skipped. Names are clamped to 128 characters
          and at most 64 are sent per point. The dict is copied: reusing it is fine.
        * ``samples``, ``tokens``: ``int`` >= 0 processed at this step (anything else
          counts as 0, logged).
        * Repeated step: consecutive calls with the same step make one point (metrics
          united, later value wins; samples and tokens summed), so a step-end call plus a
          logging hook's call, or one call per gradient-accumulation micro-batch, works.
        * At most 8192 points wait (:data:`MAX_PENDING_STEPS`); beyond that the oldest are
          dropped and counted in :attr:`dropped`.
        """
        t = time.time()  # through the module, so a test may patch time.time
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
        if self._closed:
            self._steps_dropped += 1
            return False
        prev = self._steps_prev
        if prev is None or step < prev:
            step_ms = None
            self._steps_prev, self._steps_t = step, t
        elif step > prev:
            step_ms = (t - self._steps_t) / (step - prev) * 1000.0
            self._steps_prev, self._steps_t = step, t
        else:
            step_ms = None
        buf = self._steps_buf
        if len(buf) >= MAX_PENDING_STEPS:
            self._steps_full(buf)
            buf = self._steps_buf  # a fork the hook missed replaces it
        buf.append((step, t, step_ms, m, samples, tokens))
        if self._steps_thread is None:
            self._start_steps_thread()
        return True

    def _count_arg(self, value: Any, what: str) -> int:
        """``samples``/``tokens`` that are not a plain non-negative ``int``: an ``int``
        subclass is converted, anything else (a tensor, a negative count) counts as 0."""
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return int(value)
        self._warn("step_" + what, "rankboard: log_step %s=%r is not an int >= 0; sent as 0",
                   what, type(value).__name__ if not isinstance(value, int) else value)
        return 0

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

    def _steps_full(self, buf: Deque[StepPoint]) -> None:
        """The buffer holds 8192 points: drop the oldest (counted), and make sure a flusher
        exists, since a full buffer means nothing drains it (a dead thread, or a fork that
        the at-fork hook did not see) or the loop outruns ``step_flush``."""
        try:
            buf.popleft()
            self._steps_dropped += 1
        except IndexError:  # the flusher emptied it meanwhile
            pass
        if self._pid != _getpid():  # a fork the at-fork hook did not see: fresh state
            self._reset_after_fork()
            return
        thread = self._steps_thread
        if thread is not None and not thread.is_alive():
            now = time.monotonic()
            if now >= self._steps_retry_at:  # at most one restart a second
                self._steps_retry_at = now + 1.0
                self._steps_thread = None  # log_step starts a new one

    def _start_steps_thread(self) -> None:
        """Start the flusher (a daemon thread), once per process; a failure is logged and
        leaves points waiting for finish()/close() (or a retry when the buffer fills)."""
        with self._lock:
            if self._steps_thread is not None or self._closed:
                return
            stop = self._steps_stop
            thread = threading.Thread(target=self._steps_loop, args=(stop,),
                                      name=f"rankboard-steps-{self.rank}", daemon=True)
            self._steps_thread = thread
        try:
            thread.start()
        except Exception as exc:
            self._warn("steps_thread", "rankboard: could not start the step flusher: %r", exc)

    def _steps_loop(self, stop: threading.Event) -> None:
        """The flusher: every ``step_flush`` seconds, send the buffer; never dies on an error."""
        while not stop.wait(self.step_flush):
            try:
                self._flush_steps()
            except Exception as exc:  # pragma: no cover - _send already swallows send trouble
                self._warn("steps_flush", "rankboard: step flush failed: %r", exc)

    def _flush_steps(self) -> None:
        """Send the points buffered now as ``steps`` frames (see :func:`step_frames`).

        Serialised by a lock of its own (never the socket lock, never taken by log_step), so
        frames leave in call order and a finish() cannot overtake points that the flusher
        thread has taken but not yet sent."""
        if self._pid != _getpid():  # a fork the hook missed: the parent's locks and points
            self._reset_after_fork()
        with self._steps_flush_lock:
            buf = self._steps_buf
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
            frames, self._steps_last = step_frames(self.run, self.rank, points, self._steps_last,
                                                   self._warn)
            for frame in frames:
                self._send(frame)

    @property
    def pending_steps(self) -> int:
        """Step points buffered and not yet handed to a ``steps`` frame."""
        return len(self._steps_buf)

    def finish(self, status: str = "ok") -> bool:
        """Tell the broker this rank is done: ``"ok"`` or ``"error"`` (anything else is sent
        as ``"error"``), after sending the pending :meth:`log_step` points. May be sent again
        (the broker's completion is idempotent)."""
        self._finished = True
        try:
            self._flush_steps()
        except Exception as exc:  # pragma: no cover - _send already swallows send trouble
            self._warn("steps_flush", "rankboard: step flush failed: %r", exc)
        return self._send(Finish(run=self.run, rank=self.rank, status="ok" if status == "ok" else "error"))

    # -- resource sampling -------------------------------------------------------------------

    def _get_sampler(self) -> Any:
        if self._sampler is None:
            from .sampler import Sampler

            self._sampler = Sampler(self.local_rank)
        return self._sampler

    def start_sampling(self, interval: float = 2.0) -> None:
        """Sample CPU, RAM and this rank's GPU every ``interval`` seconds (at least 0.1) in a
        daemon thread, sending each as a ``resources`` frame and keeping it for the next
        :meth:`log_epoch`. The first sample comes after ``min(interval, 0.5)`` s so that its CPU %
        covers a real interval. A second call while sampling runs does nothing; ``close()``
        stops it. Sampling does not carry over into a forked child."""
        if self._closed or (self._sampler_thread is not None and self._sampler_thread.is_alive()):
            return
        try:
            interval = max(0.1, float(interval))
            sampler = self._get_sampler()
            stop = self._sampler_stop = threading.Event()
            thread = threading.Thread(
                target=self._sample_loop, args=(sampler, stop, interval),
                name=f"rankboard-sampler-{self.rank}", daemon=True,
            )
            thread.start()
            self._sampler_thread = thread
        except Exception as exc:
            self._warn("sampler", "rankboard: could not start sampling: %r", exc)

    def _sample_loop(self, sampler: Any, stop: threading.Event, interval: float) -> None:
        wait = min(interval, 0.5)
        while not stop.wait(wait):
            wait = interval
            try:
                sample = sampler.sample()
            except Exception as exc:  # Sampler.sample already guards each figure
                self._warn("sample", "rankboard: resource sample failed: %r", exc)
                continue
            self._latest = sample
            self._send(Resources(run=self.run, rank=self.rank, sample=sample))

    @property
    def latest_sample(self) -> ResourceSample | None:
        """The sampler's most recent sample (``None`` before the first)."""
        return self._latest

    # -- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop sampling and the step flusher, send the pending :meth:`log_step` points, give
        queued frames up to ``linger_ms`` to go out, release ZeroMQ.

        Returns within about ``linger_ms`` (+ the sampler's current sample) even with no
        broker. Idempotent. In a forked child it only closes what the child itself created."""
        if self._closed:
            return
        current = threading.current_thread()
        thread = self._sampler_thread
        self._sampler_stop.set()
        if thread is not None and thread is not current:
            thread.join(timeout=2.0)
        self._sampler_thread = None
        if self._pid != _getpid():  # a fork the hook missed: not the parent's flusher or locks
            self._reset_after_fork()
        steps_thread = self._steps_thread
        self._steps_stop.set()
        if steps_thread is not None and steps_thread is not current and steps_thread.ident:
            steps_thread.join(timeout=2.0)  # a flush is non-blocking sends: bounded
        try:
            self._flush_steps()
        except Exception as exc:  # pragma: no cover - _send already swallows send trouble
            self._warn("steps_flush", "rankboard: step flush failed: %r", exc)
        with self._lock:
            self._closed = True
            if self._pid != os.getpid():
                self._reset_after_fork()
            sock, ctx = self._sock, self._ctx
            self._sock = self._ctx = self._push = None
        # points a concurrent log_step added after the flush, before _closed: lost, counted
        left = len(self._steps_buf)
        if left:
            self._steps_buf.clear()
            self._steps_dropped += left
        # outside the lock: a thread still calling log_epoch gets an immediate drop, not a
        # wait of up to linger_ms
        try:
            if sock is not None:
                sock.close(linger=self.linger_ms)
            if ctx is not None:
                ctx.term()  # bounded: the only socket had LINGER = linger_ms
        except Exception as exc:
            self._warn("close", "rankboard: error closing the socket: %r", exc)
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            try:
                sampler.close()
            except Exception:
                pass
        _AGENTS.discard(self)

    def __enter__(self) -> RankAgent:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Leaving the ``with`` block ends this rank: unless :meth:`finish` was already called,
        it sends ``finish("error")`` when an exception is propagating (``SystemExit`` with
        code 0/None counts as success) and ``finish("ok")`` otherwise; then :meth:`close`.
        The exception itself is never suppressed."""
        if not self._finished and not self._closed:
            failed = exc_type is not None
            if failed and issubclass(exc_type, SystemExit) and getattr(exc, "code", None) in (0, None):
                failed = False
            self.finish("error" if failed else "ok")
        self.close()

    def __repr__(self) -> str:
        return (f"RankAgent(broker={self.broker!r}, run={self.run!r}, rank={self.rank}, "
                f"world_size={self.world_size}, sent={self._sent}, dropped={self._dropped})")
