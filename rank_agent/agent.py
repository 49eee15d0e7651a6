"""RankAgent: the piece of rankboard that lives inside every training rank (PROTOCOL.md section 5).

It is a guest in someone else's training loop, and every design choice follows from that:
never block, never raise (the only exceptions are ``ValueError``/``TypeError`` from the
constructor for arguments that could never produce a valid frame: set-up bugs, before
training), no I/O in the constructor, fork safety, bounded memory and a bounded shutdown.
The parts live apart, each with its own rules:

* :mod:`rank_agent.launcher`: what the launcher's environment says (``from_env``);
* :mod:`rank_agent.pusher`: the socket, its bounded queue, counters and fork safety;
* :mod:`rank_agent.stepbuffer`: the ``log_step`` buffer and its flusher thread (frames built
  by the pure :mod:`rank_agent.stepframes`);
* :mod:`rank_agent.shared`: one agent per process and run, shared by its users;
* this module: the public class, the frames it builds (strings clamped to the wire limits,
  the run id sanitised, so the agent never produces a frame the broker rejects);
* :mod:`rank_agent.lifecycle`: the process-wide fork and exit hooks over every live agent.
"""
from __future__ import annotations

import json
import logging
import os
import socket as _socket
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Tuple, Union

from . import shared
from .control import Control, control_endpoint
from .errorinfo import error_info, exit_is_success
from .label import resolve_label
from .launcher import DEFAULT_BROKER, generated_run_id, launch_args, sanitize_run_id
from .lifecycle import AGENTS as _AGENTS
from .lifecycle import watch_uncaught
from .procid import proc_id
from .protocol import (
    MAX_METADATA_BYTES,
    MAX_SHORT,
    MAX_SUMMARY,
    MAX_SVG_BYTES,
    MAX_WORLD_SIZE,
    ErrorInfo,
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
from .pusher import Pusher
from .ratelimit import RateLimitedLog
from .replicated import replicated_names
from .shards import pick_endpoint
from .stallwatch import StallWatch
from .stepbuffer import MAX_PENDING_STEPS, StepBuffer, checked_step_flush
from .values import clamp, finite_or_none, wire_scalars

log = logging.getLogger(__name__)

_monotonic = time.monotonic
_get_ident = threading.get_ident

#: Each kind of trouble the agent warns about is logged at most once a minute.
WARN_EVERY = 60.0

__all__ = ["RankAgent", "DEFAULT_BROKER", "MAX_PENDING_STEPS", "sanitize_run_id"]

ScalarArg = Union[float, Tuple[float, int]]

#: The largest ``total_steps`` sent (MessagePack's signed 64-bit range); beyond it: unknown.
MAX_TOTAL_STEPS = 2**63 - 1


def checked_total_steps(value: Any) -> int:
    """``total_steps`` as the wire takes it (8.5): a whole number of steps, 0 for unknown.

    Frameworks hand over what they have (Lightning's ``estimated_stepping_batches`` is
    ``inf`` for an endless fit, a float elsewhere): anything that is not a finite number of
    at least 1 is "unknown" rather than an error, since a guest in a training loop must
    not fail its caller over a progress figure."""
    if isinstance(value, bool):
        return 0
    try:
        steps = int(value)
    except (TypeError, ValueError, OverflowError):
        return 0
    return steps if 0 < steps <= MAX_TOTAL_STEPS else 0


class RankAgent:
    """One training rank's connection to the rankboard broker.

    ``broker`` is the broker's ingest endpoint (e.g. ``tcp://head-node:5585``), or N of them
    comma-separated, shard 0 first (the agent connects to its run's own: PROTOCOL 7.3); ``run`` the
    run id shared by every rank of the job (sanitised with :func:`sanitize_run_id`); ``rank``
    the global rank (0 <= rank < world_size); ``world_size`` the number of ranks (1-65536);
    ``local_rank`` the rank on its host (it picks the GPU the sampler reads); ``host`` the
    host name shown in the dashboard (default: this machine's hostname; clamped to 256
    characters).

    Keyword-only tuning: ``sndhwm`` (frames queued while the broker is slow or gone before
    new ones are dropped), ``linger_ms`` (how long ``close()`` may wait to deliver what is
    queued), ``step_flush`` (seconds between two sends of the :meth:`log_step` buffer; the
    interval in force is ``max(step_flush, world_size / 16384)``, and a point leaves the
    process within about that long, at most twice it).

    Diagnosis (PROTOCOL.md section 2.5): ``stall_after`` (``None`` automatic, ``0`` off,
    else seconds) sets the stall watch, a thread that dumps every thread's stack when
    ``log_step``/``log_epoch`` have been silent that long; ``control`` (``True`` the
    default endpoint or ``RANKBOARD_CONTROL``, ``False`` none, or an endpoint) the SUB
    socket on which the broker forwards requests for dumps and profiles, with the CURVE keys
    ingest uses. Both start with the first ``register``/``log_step``/``log_epoch``/
    ``start_sampling`` (never in the constructor), again in a forked child, and stop at
    ``finish``/``close``; the training thread pays one timestamp per call.

    ``label`` (section 7.5): the run's readable name, sent in every ``register`` (cut to 128
    characters); ``None`` = the training script's name (``train.py`` -> ``train``).

    ``total_steps`` (section 8.5): the run's optimizer steps in all (0 = unknown), sent in
    every ``register`` so the board can say "step 1,200/10,000" and an ETA for a step run.
    ``replicated`` (section 8.3): names of step metrics every rank computes to the same value
    by construction (the gradient norm after the all-reduce and clipping), sent in every
    ``register`` so the broker can name a replica that disagrees (silent data corruption).
    At most 64 names of at most 128 characters are kept (the wire's bound; others are
    logged and left out, so the register is never rejected for them).

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
        stall_after: float | None = None,
        control: Union[bool, str, None] = True,
        label: str | None = None,
        total_steps: int = 0,
        replicated: Iterable[str] | None = None,
    ) -> None:
        rank, world_size, local_rank = int(rank), int(world_size), int(local_rank)
        step_flush = checked_step_flush(step_flush)
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be 1..{MAX_WORLD_SIZE}, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be 0..world_size-1 ({world_size - 1}), got {rank}")
        if local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {local_rank}")
        self.run = sanitize_run_id(run)
        if self.run != str(run):
            log.info("run id %r sent as %r (wire pattern)", run, self.run)
        #: the run's own shard's endpoint (a list names one per shard: PROTOCOL 7.3)
        self.broker, self.shard, shards = pick_endpoint(str(broker), self.run)
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.host = clamp(host if host is not None else _socket.gethostname(), MAX_SHORT) or "unknown"
        self.sndhwm = max(1, int(sndhwm))
        self.label = resolve_label(label)  # section 7.5: in every register, implicit too
        #: (8.5) the run's optimizer steps in all (0: unknown), in every register, implicit too
        self.total_steps = checked_total_steps(total_steps)
        #: (8.3) the step metrics every rank computes alike, sent in every register
        self.replicated = replicated_names(replicated)
        self.linger_ms = max(0, int(linger_ms))
        self._finished = False
        #: users of a shared agent (:mod:`rank_agent.shared`): the last one's close() closes
        self._users = 1
        self._users_lock = threading.Lock()
        #: the worst status a user's finish() asked for while others still held the agent
        self._pending_status: str | None = None
        #: ... and the earliest error a user's finish() gave with it (PROTOCOL 8.2)
        self._pending_error: ErrorInfo | None = None
        #: the process that built this agent: only it ever finishes the rank (a forked
        #: data-loader worker closes what it made and never ends its parent's rank)
        self._pid = os.getpid()
        self._warn = RateLimitedLog(log, WARN_EVERY)
        self._pusher = Pusher(self.broker, sndhwm=self.sndhwm, linger_ms=self.linger_ms,
                              warn=self._warn, on_fork=self._reset_after_fork,
                              introduce=self._implicit_register)
        # the hot paths call the pusher's and the buffer's bound methods directly: no
        # delegating call in between (log_epoch's send, every log_step)
        self._send: Callable[[Any], bool] = self._pusher.send
        self._lose: Callable[..., bool] = self._pusher.lose
        self._steps = StepBuffer(self.run, rank, step_flush, send=self._send, lose=self._lose,
                                 warn=self._warn, on_fork=self._reset_after_fork,
                                 world_size=world_size)
        self.log_step = self._steps.log_step  # type: ignore[method-assign]
        self.batch_ready = self._steps.batch_ready  # type: ignore[method-assign]

        # diagnosis (section 2.5): a bad stall_after is a set-up error (ValueError)
        if stall_after is not None:
            stall_after = float(stall_after)
        self._watch = StallWatch(self._send, self.run, rank, stall_after)
        endpoint = control_endpoint(control, self.broker, shard=self.shard, shards=shards)
        if endpoint is None and control not in (False, None):
            log.info("rankboard: no control channel for broker %s (no TCP port; set %s)",
                     self.broker, "RANKBOARD_CONTROL")
        self._control: Control | None = None
        if endpoint is not None:
            self._control = Control(endpoint, self.run, rank, self._send,
                                    training_thread=self._watch.training_thread,
                                    idle_s=self._watch.idle_s, broker=self.broker)
        # log_step stores the watch's timestamp inline when anything reads it (the stall
        # watch, or a profile's choice of thread): with neither, it pays nothing
        if self._watch.enabled or self._control is not None:
            self._steps.watch = self._watch
        self._steps._on_start = self._start_diag
        #: both started in this process (reset in a forked child): log_epoch's one check
        self._diag_started = False

        #: resource sampling (rank_agent.sampler.SamplingThread), created on first need
        self._sampling: Any = None
        _AGENTS.add(self)
        watch_uncaught()  # the exit rule (8.2) needs the exception ending the process

    @property
    def step_flush(self) -> float:
        """Seconds between two flushes of the step buffer (read by the flusher on each wait)."""
        return self._steps.step_flush

    @step_flush.setter
    def step_flush(self, value: float) -> None:
        """Checked as the constructor's argument is (``ValueError`` unless positive)."""
        self._steps.step_flush = value

    # -- construction from the launcher's environment ----------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> RankAgent:
        """Build an agent from the environment a launcher (torchrun, Slurm, or none) set up
        (:mod:`rank_agent.launcher`).

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

        **One agent per process and run** (:mod:`rank_agent.shared`): if this process already
        has a live agent for that run and rank (an earlier ``from_env``, a framework tracker),
        it is returned, with one more user, instead of a second agent registering again; the
        other keyword arguments then do not apply. Its users end it together: each one's
        ``finish()``/``close()``/``with`` end counts, and the last one sends ``finish`` (with
        ``error`` if any user said so) and closes. When no launcher names the run (a generated
        id), the process's latest agent of that rank is the one.

        ``env`` defaults to ``os.environ``; ``kwargs`` (``sndhwm``, ``linger_ms``,
        ``step_flush``, or any constructor argument) override what the environment says.
        Unparseable integers and an inconsistent rank/world size raise ``ValueError`` naming
        the variable.
        """
        args = launch_args(env, generate=False)
        args.update(kwargs)
        run = args["run"]

        def make() -> RankAgent:
            if not args["run"]:
                args["run"] = generated_run_id()
            return cls(**args)

        return shared.acquire(sanitize_run_id(run) if run else None, int(args["rank"]), make)

    def _add_user(self) -> bool:
        """One more user of this shared agent (:mod:`rank_agent.shared`); False once closed."""
        with self._users_lock:
            if self.closed:
                return False
            self._users += 1
            return True

    def _implicit_register(self) -> bytes:
        """The ``register`` the pusher sends ahead of a first frame that is not one (section 5:
        an agent registers itself, so a run whose code never calls register() still learns
        its world size and completes): port 0, total_epochs 0."""
        return encoder.encode(Register(
            run=self.run, rank=self.rank, world_size=self.world_size, host=self.host or "unknown",
            local_rank=self.local_rank, pid=os.getpid(), label=self.label,
            total_steps=self.total_steps, replicated=self.replicated, proc=proc_id()))

    # -- counters ----------------------------------------------------------------------------

    @property
    def sent(self) -> int:
        """Frames handed to ZeroMQ (queued; delivery is ZeroMQ's job from there)."""
        return self._pusher.sent

    @property
    def dropped(self) -> int:
        """Frames lost for any reason (queue full because the broker is slow or gone, after
        ``close()``, or an error, also counted in :attr:`errors`) plus step points lost: pushed
        out of the full :meth:`log_step` buffer, logged after ``close()``, or a bad call.
        A ``steps`` frame lost in the queue counts once, as a frame."""
        return self._pusher.dropped + self._steps.dropped

    @property
    def errors(self) -> int:
        """Frames lost to something other than a full queue (bad value, encode or socket error)."""
        return self._pusher.errors

    @property
    def closed(self) -> bool:
        return self._pusher.closed

    def _start_diag(self) -> None:
        """Start the stall watch and the control channel (each cheap once running, and each
        fork-safe: in a forked child it makes fresh ones). Never after finish/close."""
        if self._finished or self._pusher.closed:
            return
        self._watch.start()
        if self._control is not None:
            self._control.start()
        self._diag_started = True

    def _stop_diag(self) -> None:
        """Stop both; no thread, socket or context is left (bounded waits)."""
        self._watch.close()
        if self._control is not None:
            self._control.close()

    def _reset_after_fork(self) -> None:
        """In a forked child: forget the parent's zmq objects, threads and pending points
        without touching them (the parent sends its own; threads come back lazily)."""
        self._pusher.reset_after_fork()
        self._diag_started = False  # the watch and the channel come back in this process
        if self._sampling is not None:
            self._sampling.reset_after_fork()
        self._steps.reset()

    # -- the frames --------------------------------------------------------------------------

    def register(self, port: int = 0, total_epochs: int = 0,
                 total_steps: int | None = None) -> bool:
        """Announce this rank: world size, host, local rank, pid; ``port`` a dashboard port the
        launcher would like the web on (0: none), ``total_epochs`` if known (0: unknown).
        ``total_steps`` (8.5): the run's optimizer steps, kept for every later register too
        (None: the agent's own, from its constructor or an earlier call)."""
        try:
            if total_steps is not None:
                self.total_steps = checked_total_steps(total_steps)
            port, total_epochs = int(port), int(total_epochs)
            if not 0 <= port <= 65535:
                self._warn("port", "rankboard: port %d out of range; registering without one", port)
                port = 0
            frame = Register(
                run=self.run, rank=self.rank, world_size=self.world_size, host=self.host or "unknown",
                local_rank=self.local_rank, port=port, total_epochs=max(0, total_epochs), pid=os.getpid(),
                label=self.label, total_steps=self.total_steps,
                replicated=self.replicated, proc=proc_id())
        except Exception as exc:
            return self._lose("register", "rankboard: bad register arguments: %r", exc)
        self._start_diag()
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
                        label=clamp(label, MAX_SHORT), hash=clamp(hash, MAX_SHORT))
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
                    text = json.dumps(finite_or_none(obj_or_json_str), allow_nan=False)
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
                summary = self._get_sampling().get_sampler().hardware_summary()
            frame = Hardware(run=self.run, rank=self.rank, summary=clamp(str(summary), MAX_SUMMARY) or "")
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
        watch = self._watch  # the stall watch's note(), inlined, then its (cheap) start
        watch._last = _monotonic()
        watch._tid = _get_ident()
        if not self._diag_started:
            self._start_diag()
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
                scalars=wire_scalars(scalars, self._warn) if scalars else {}, resources=self.latest_sample,
            )
        except Exception as exc:
            return self._lose("metrics", "rankboard: bad log_epoch arguments; epoch not sent: %r", exc)
        return self._send(frame)

    # -- per-step points ---------------------------------------------------------------------

    def batch_ready(self) -> None:
        """Call when the loop has its batch in hand (PROTOCOL 7.1): one timestamp; the next
        :meth:`log_step` sends the wait since the previous one as its ``data_ms``."""
        self._steps.batch_ready()

    def log_step(self, step: int, metrics: Mapping[str, Any] | None = None,
                 samples: int = 0, tokens: int = 0, *, data_ms: float | None = None) -> bool:
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
        * ``data_ms`` (7.1): the ms the loop waited for this step's batch; ``None``: the time
          from the previous call to the latest :meth:`batch_ready` since it, or none.
        """
        # each agent binds log_step to its buffer's method in __init__ (no call in between);
        # this method documents it and serves a call through the class
        return self._steps.log_step(step, metrics, samples, tokens, data_ms=data_ms)

    @property
    def pending_steps(self) -> int:
        """Step points buffered and not yet handed to a ``steps`` frame."""
        return self._steps.pending

    def finish(self, status: str = "ok",
               error: BaseException | ErrorInfo | None = None) -> bool:
        """Tell the broker this rank is done: ``"ok"`` or ``"error"`` (anything else is sent
        as ``"error"``), after sending the pending :meth:`log_step` points. May be sent again
        (the broker's completion is idempotent).

        ``error`` (PROTOCOL 8.2): the exception that ended the rank (the status is then
        ``error``), sent as an ``ErrorInfo``: its class, message (cut to 4,096 characters),
        the innermost 64 frames of its traceback and the time of this call, so the board
        can name the rank that failed first and why. An ``ErrorInfo`` is sent as it is.

        A shared agent (:meth:`from_env`) still held by another user only sends its points
        and remembers the status (``error`` sticks, with the earliest error given): the last
        user's finish or close sends it."""
        info: ErrorInfo | None = None
        if error is not None:
            status = "error"
            if isinstance(error, ErrorInfo):
                info = error
            elif isinstance(error, BaseException):
                info = error_info(error)
        status = "ok" if status == "ok" else "error"
        self._finished = True
        self._steps.safe_flush()
        with self._users_lock:
            if self._pending_status is not None and status == "ok":
                status = self._pending_status
            pending = self._pending_error
            if pending is not None and (info is None or pending.at <= info.at):
                info = pending  # the earliest failure of the agent's users is the cause
            if self._users > 1:
                self._pending_status = status
                self._pending_error = info
                return True
            self._pending_status = None
            self._pending_error = None
        self._watch.close()  # the stall watch ends with the loop (section 2.5)
        if status == "ok":
            return self._send(Finish(run=self.run, rank=self.rank, status="ok"))
        return self._send(Finish(run=self.run, rank=self.rank, status="error", error=info))

    # -- resource sampling -------------------------------------------------------------------

    def _get_sampling(self) -> Any:
        if self._sampling is None:
            from .sampler import SamplingThread  # psutil and NVML only when sampling is used

            self._sampling = SamplingThread(
                self.local_rank, f"rankboard-sampler-{self.rank}",
                lambda sample: self._send(Resources(run=self.run, rank=self.rank, sample=sample)),
                self._warn)
        return self._sampling

    def start_sampling(self, interval: float = 2.0) -> None:
        """Sample CPU, RAM and this rank's GPU every ``interval`` seconds (at least 0.1) in a
        daemon thread (:class:`rank_agent.sampler.SamplingThread`), sending each as a
        ``resources`` frame and keeping it for the next :meth:`log_epoch`. A second call
        while sampling runs does nothing; ``close()`` stops it. Sampling does not carry
        over into a forked child."""
        if self.closed or (self._sampling is not None and self._sampling.running):
            return
        self._start_diag()
        try:
            self._get_sampling().start(interval)
        except Exception as exc:
            self._warn("sampler", "rankboard: could not start sampling: %r", exc)

    @property
    def latest_sample(self) -> ResourceSample | None:
        """The sampler's most recent sample (``None`` before the first)."""
        return None if self._sampling is None else self._sampling.latest

    # -- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Finish an unfinished agent that has spoken ``ok`` (sections 5, 8.2; never in a
        forked child: the rank is its parent's), stop sampling and the step flusher, send the pending
        :meth:`log_step` points, give queued frames up to ``linger_ms`` to go out, release
        ZeroMQ.

        Returns within about ``linger_ms`` (+ the sampler's current sample) even with no
        broker. Idempotent. In a forked child it only closes what the child itself created."""
        if self._pusher.closed:
            return
        with self._users_lock:
            self._users -= 1
            shared_still = self._users > 0
        if shared_still:  # another user holds this agent: it closes it
            self._steps.safe_flush()
            return
        self._users = 0
        if self._pending_status is not None:  # an earlier user's finish, deferred to now
            self.finish(self._pending_status)
        elif not self._finished and self._pid == os.getpid() and self._spoke():
            self.finish("ok")
        if self._sampling is not None:
            self._sampling.stop()
        self._stop_diag()  # before the PUSH socket: a dump in progress still has it
        self._steps.close()
        self._pusher.close()
        # points a concurrent log_step added after the flush, before closing: lost, counted
        self._steps.discard_pending()
        shared.forget(self)
        _AGENTS.discard(self)

    def __enter__(self) -> RankAgent:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Leaving the ``with`` block ends this rank: unless :meth:`finish` was already called,
        it sends ``finish(error=exc)`` when an exception is propagating (``SystemExit`` with
        code 0/None counts as success; ``KeyboardInterrupt`` is an error) and
        ``finish("ok")`` otherwise; then :meth:`close`. The exception itself is never
        suppressed. A shared agent (:meth:`from_env`) counts this block's outcome and ends
        when its last user does. In a forked child the block only closes (the rank is the
        parent's)."""
        if self._pid != os.getpid():
            self.close()
            return
        failed = isinstance(exc, BaseException) and not exit_is_success(exc)
        if not self.closed and (not self._finished or self._users > 1):
            if failed:
                self.finish("error", error=exc)
            else:
                self.finish("ok")
        self.close()

    def _end_at_exit(self, caught: tuple[BaseException, float] | None) -> None:
        """The exit rule (PROTOCOL 8.2, :mod:`rank_agent.lifecycle`): an agent this process
        built that has not finished finishes, with ``caught`` (the exception ending the
        process and when it was caught) as its error, ``ok`` without one; then it closes."""
        if self._pid == os.getpid() and not self._finished and not self.closed:
            if caught is not None and not exit_is_success(caught[0]):
                self.finish("error", error=error_info(caught[0], caught[1]))
            elif self._spoke():
                self.finish("ok")
        self.close()

    def _spoke(self) -> bool:
        """This agent sent (or holds step points for) something: its rank is on the board.
        An agent that never spoke is closed without a ``finish``, which would put on the
        board a rank that did nothing; a failure is sent whether it spoke or not (a script
        that dies while setting up is news)."""
        return self._pusher.introduced or self._steps.pending > 0

    def __repr__(self) -> str:
        return (f"RankAgent(broker={self.broker!r}, run={self.run!r}, rank={self.rank}, "
                f"world_size={self.world_size}, sent={self.sent}, dropped={self.dropped})")
