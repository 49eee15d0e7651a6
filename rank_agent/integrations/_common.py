"""What the three framework integrations share: run-id agreement, agent set-up, the
device-sync-free path from framework values to ``log_step``, and the end-of-run guard.

Nothing here imports a framework or torch: tensors are handled by duck typing (``device``,
``numel``, ``detach``, ``to``, ``item``), and the torch event class is looked up only when a
device tensor has actually been seen, i.e. when torch is already loaded.

**Run ids.** Every rank of a job must send the same run id, or the dashboard shows one run
per rank. :func:`agree_run_id` takes, in order: an explicit ``run=``; an id the launcher
already gave every rank (:func:`rank_agent.launcher.launcher_run_id`: ``RANKBOARD_RUN``,
torchrun's ``TORCHELASTIC_RUN_ID``, Slurm's ``SLURM_JOB_ID[.SLURM_STEP_ID]``); otherwise rank 0 makes
``<prefix>-<YYYYmmdd-HHMMSS>-<6 hex>`` and the framework's own broadcast hands it to every
rank (one collective at set-up, never per step). Without a process group (a single process)
rank 0's generated id is the id.

**No device synchronisation per step.** A loss a framework hands over is often a GPU tensor,
and ``.item()`` on it stalls the host until the device has caught up, every step.
:class:`StepPipeline` never does that: a CPU tensor is read at once (no device involved);
for a device tensor it queues an asynchronous copy to pinned host memory and records an
event behind it, and sends the step with ``log_step`` once ``event.query()`` (which never
waits) says the copy is done. Points leave in step order, at most one per pushed step while
the backlog is short, so on a device that runs k steps behind the host the points go out a
steady k steps late and the time between ``log_step`` calls (the agent's ``step_ms``) is
still one loop period; only :meth:`StepPipeline.drain` at the end of training waits, once.
:class:`Sum` adds device tensors on the device and reads them once, when an epoch ends.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import enum
import inspect
import logging
import numbers
import os
import threading
import time
from pathlib import PurePath
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Tuple

from ..agent import RankAgent, checked_total_steps
from ..errorinfo import exit_is_success
from ..launcher import launcher_run_id, new_run_id, sanitize_run_id
from ..lifecycle import uncaught

log = logging.getLogger(__name__)

#: RankAgent keyword arguments an integration accepts in ``**agent_kwargs`` (checked in the
#: integration's constructor, so a typo fails before training, not at set-up on every rank).
AGENT_KWARGS = frozenset(inspect.signature(RankAgent.__init__).parameters) - {"self"}


def check_agent_kwargs(kwargs: Mapping[str, Any], where: str) -> None:
    """Raise ``TypeError`` for a keyword that ``RankAgent`` does not take."""
    unknown = sorted(set(kwargs) - AGENT_KWARGS)
    if unknown:
        raise TypeError(f"{where} got unexpected keyword argument(s) {unknown}; "
                        f"RankAgent takes {sorted(AGENT_KWARGS)}")


# -- run ids ---------------------------------------------------------------------------------

def agree_run_id(prefix: str, rank: int, world_size: int,
                 broadcast: Callable[[str], str] | None,
                 env: Mapping[str, str] | None = None) -> str:
    """The run id every rank of the job computes alike (module docstring, "Run ids").

    ``broadcast(obj)`` must be a collective that returns rank 0's ``obj`` on every rank (a
    Lightning strategy's ``broadcast``, ``torch.distributed.broadcast_object_list``); it is
    called on every rank or on none, so it cannot hang a job. ``None`` (no process group):
    each process makes its own id, which is right for one process and warned about for more."""
    shared = launcher_run_id(env)
    if shared:
        return shared
    mine = new_run_id(prefix)
    if world_size <= 1:
        return mine
    if broadcast is None:
        log.warning("rankboard: rank %d of %d has no shared run id (no RANKBOARD_RUN, "
                    "TORCHELASTIC_RUN_ID or SLURM_JOB_ID, and no process group to agree on "
                    "one): pass run=... to name the run", rank, world_size)
        return mine
    agreed = broadcast(mine)
    return sanitize_run_id(str(agreed))


def make_agent(*, run: str, rank: int, world_size: int, local_rank: int,
               agent_kwargs: Mapping[str, Any]) -> RankAgent:
    """A :class:`RankAgent` for what the framework knows; ``agent_kwargs`` win. The broker
    and host come from the environment exactly as :meth:`RankAgent.from_env` reads them
    (``RANKBOARD_BROKER``, ``RANKBOARD_HOST``); from_env sees only those two variables, so
    its own rank and run-id logic (and its warnings) stay out of it. Through ``from_env`` it
    is the process's shared agent for that run and rank (:mod:`rank_agent.shared`): a
    per-rank recipe's ``RankAgent.from_env()`` in the same process adds to the same rank
    instead of registering a second agent, and the rank finishes when the last user ends."""
    env = {name: os.environ[name] for name in ("RANKBOARD_BROKER", "RANKBOARD_HOST")
           if name in os.environ}
    kwargs: Dict[str, Any] = {"run": run, "rank": rank, "world_size": world_size,
                              "local_rank": local_rank}
    kwargs.update(agent_kwargs)
    return RankAgent.from_env(env, **kwargs)


# -- metadata --------------------------------------------------------------------------------

def jsonable(obj: Any, depth: int = 0) -> Any:
    """A JSON-ready copy of ``obj`` for ``set_metadata``: containers are walked (at most
    1000 entries each, 8 levels), numbers and strings kept, small tensors and arrays become
    lists, anything else its ``repr`` (clamped to 200 characters). Hyperparameters hold all
    sorts of objects, and one unserialisable value must not lose the whole blob."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if depth >= 8:
        return _short_repr(obj)
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v, depth + 1) for k, v in list(obj.items())[:1000]}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v, depth + 1) for v in list(obj)[:1000]]
    if isinstance(obj, enum.Enum):
        return jsonable(obj.value, depth + 1)
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    if isinstance(obj, PurePath):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, depth + 1)
    tolist = getattr(obj, "tolist", None)
    numel = getattr(obj, "numel", None) or getattr(obj, "size", None)
    if callable(tolist):
        try:
            n = numel() if callable(numel) else numel
            if isinstance(n, int) and n <= 64:
                return jsonable(tolist(), depth + 1)
        except Exception:
            pass
    return _short_repr(obj)


def _short_repr(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception:
        text = f"<{type(obj).__name__}>"
    return text if len(text) <= 200 else text[:197] + "..."


# -- values without a device sync ------------------------------------------------------------

def classify(value: Any) -> Tuple[Any, Any]:
    """``(number, None)`` for a value readable now without touching a device (a Python or
    numpy number, a one-element CPU tensor), ``(None, tensor)`` for a one-element tensor on a
    device (detached), ``(None, None)`` for anything else (bools, strings, bigger tensors).
    Runs on every step: the common cases come first and cost one or two attribute reads."""
    kind = type(value)
    if kind is float or kind is int:
        return value, None
    if kind is bool:
        return None, None
    numel = getattr(value, "numel", None)
    if numel is not None:  # a tensor (numpy has no numel)
        try:
            if numel() != 1:
                return None, None
            if value.device.type == "cpu":
                number = value.item()  # a host read: no device involved
                kind = type(number)
                return (number, None) if kind is float or kind is int else (None, None)
            return None, value.detach()
        except Exception:
            return None, None
    if isinstance(value, numbers.Real) and not isinstance(value, enum.Enum) and (
            kind.__name__ != "bool_"):  # numpy scalars, Fraction
        return (int(value) if isinstance(value, numbers.Integral) else float(value)), None
    return None, None


def _read_now(dev: Any) -> Any:
    """``dev.item()``, the waiting read, for a device that has no events."""
    try:
        number = dev.item()
    except Exception:
        return None
    return None if type(number) is bool else number


def _put(metrics: Dict[str, Any], name: str, number: Any) -> None:
    if number is not None:
        metrics[name] = number


def default_event(device: Any) -> Any:
    """A fresh event on ``device`` with ``record()``/``query()``/``synchronize()``: torch's
    device-generic ``torch.Event`` where it has one, else ``torch.cuda.Event``. torch is
    already imported here (a device tensor exists)."""
    import torch

    event_cls = getattr(torch, "Event", None)
    if event_cls is not None:
        try:
            return event_cls(device=device)
        except Exception:  # an older torch, or a device torch.Event does not know
            pass
    if getattr(device, "type", None) == "cuda":
        return torch.cuda.Event()
    raise RuntimeError(f"no event type for device {device}")


class _Entry:
    """One optimizer step waiting in :class:`StepPipeline`."""

    __slots__ = ("step", "ready", "hosts", "events", "samples", "tokens", "data_ms")

    def __init__(self, step: int, ready: Dict[str, Any], hosts: List[Tuple[str, Any]],
                 events: List[Any], samples: int, tokens: int,
                 data_ms: Optional[float] = None) -> None:
        self.data_ms = data_ms  # (7.1) sent explicitly: the point may leave steps late
        self.step = step
        self.ready = ready
        self.hosts = hosts
        self.events = events
        self.samples = samples
        self.tokens = tokens


class StepPipeline:
    """Feeds ``log_step`` from framework values without a per-step device synchronisation
    (module docstring). Called from the training thread only.

    ``max_lag``: with more steps than this waiting, every finished one is sent at once (a
    burst, rather than an ever-growing backlog); with more than ``hard_cap`` waiting, the
    oldest is waited for (counted in :attr:`forced_syncs`), which a real device never makes
    necessary: a host cannot queue that many steps of work ahead of it.
    ``event_factory(device)`` makes the events (injected by tests)."""

    def __init__(self, log_step: Callable[..., Any], *, max_lag: int = 64, hard_cap: int = 1024,
                 event_factory: Callable[[Any], Any] | None = None) -> None:
        self._log_step = log_step
        self.max_lag = max(1, int(max_lag))
        self.hard_cap = max(self.max_lag, int(hard_cap))
        self._event_factory = event_factory or default_event
        self._queue: Deque[_Entry] = collections.deque()
        self._free: Dict[Any, List[Any]] = {}  # device -> events ready for reuse
        self._no_events: set[str] = set()  # device types events failed for (warned once)
        self.forced_syncs = 0

    @property
    def pending(self) -> int:
        """Steps waiting for their device values."""
        return len(self._queue)

    def push(self, step: int, metrics: Mapping[str, Any] | None = None,
             samples: int = 0, tokens: int = 0, data_ms: Optional[float] = None) -> None:
        """One optimizer step's values: numbers go as they are, device tensors are copied
        to the host asynchronously and sent once the copy is done (never waited for here)."""
        ready: Dict[str, Any] = {}
        devs: List[Tuple[str, Any]] = []
        if metrics:
            for name, value in metrics.items():
                kind = type(value)
                if kind is float or kind is int:
                    ready[name] = value
                    continue
                number, dev = classify(value)
                if number is not None:
                    ready[name] = number
                elif dev is not None:
                    devs.append((name, dev))
        queue = self._queue
        if not devs:
            if not queue:
                self._send(_Entry(step, ready, [], [], samples, tokens, data_ms))
                return
            queue.append(_Entry(step, ready, [], [], samples, tokens, data_ms))
        else:
            hosts, events = self._copy(devs, ready)
            queue.append(_Entry(step, ready, hosts, events, samples, tokens, data_ms))
        self._emit(burst=len(queue) > self.max_lag)
        if len(queue) > self.hard_cap:
            self.forced_syncs += 1
            self._wait(queue[0])
            self._emit(burst=False)

    def _copy(self, devs: List[Tuple[str, Any]], ready: Dict[str, Any]
              ) -> Tuple[List[Tuple[str, Any]], List[Tuple[Any, Any]]]:
        """Start the device-to-host copies of one step and record one event per device
        behind them. On a device without events a value is read with ``.item()``, which
        waits for the device (warned once per device type)."""
        copies: List[Tuple[str, Any, Any]] = []
        for name, dev in devs:
            if str(getattr(dev.device, "type", dev.device)) in self._no_events:
                _put(ready, name, _read_now(dev))
            else:
                copies.append((name, dev, dev.to("cpu", non_blocking=True)))
        hosts: List[Tuple[str, Any]] = []
        events: List[Tuple[Any, Any]] = []
        for device in {dev.device: None for _, dev, _ in copies}:
            mine = [c for c in copies if c[1].device == device]
            try:
                free = self._free.get(device)
                event = free.pop() if free else self._event_factory(device)
                event.record()
            except Exception as exc:
                kind = str(getattr(device, "type", device))
                self._no_events.add(kind)
                log.warning("rankboard: cannot record events on %s (%r); its values are read "
                            "with .item(), which waits for the device", kind, exc)
                for name, dev, _ in mine:
                    _put(ready, name, _read_now(dev))
                continue
            events.append((device, event))
            hosts.extend((name, host) for name, _, host in mine)
        return hosts, events

    def _emit(self, burst: bool) -> None:
        """Send the oldest waiting step if its copies are done; with ``burst``, every
        consecutive finished one."""
        queue = self._queue
        while queue:
            head = queue[0]
            for _, event in head.events:
                if not event.query():
                    return
            queue.popleft()
            self._send(head)
            if not burst:
                return

    def _send(self, entry: _Entry) -> None:
        metrics = entry.ready
        for name, host in entry.hosts:
            number = host.item()  # host memory the finished copy wrote: no device involved
            if type(number) is not bool:
                metrics[name] = number
        for device, event in entry.events:
            self._free.setdefault(device, []).append(event)
        entry.events = []
        if entry.data_ms is None:
            self._log_step(entry.step, metrics, entry.samples, entry.tokens)
        else:
            self._log_step(entry.step, metrics, entry.samples, entry.tokens,
                           data_ms=entry.data_ms)

    def _wait(self, entry: _Entry) -> None:
        for _, event in entry.events:
            if not event.query():
                event.synchronize()

    def drain(self) -> None:
        """Send every waiting step, waiting (once) for the device if needed: the end of
        training. Stream order makes the newest step's events the only ones worth waiting for;
        older ones are then done unless they ran on another stream (waited for too)."""
        queue = self._queue
        if not queue:
            return
        try:
            self._wait(queue[-1])
            for entry in queue:
                self._wait(entry)
        except Exception as exc:  # a device in an error state (the run is failing anyway)
            log.warning("rankboard: could not read the last %d steps' values from the device: %r",
                        len(queue), exc)
            for entry in queue:
                entry.hosts = []
                entry.events = []
        while queue:
            self._send(queue.popleft())


class Sum:
    """A running sum of per-batch values (losses) that reads the device once, when it is
    taken: device tensors are added on the device (one small kernel per add, asynchronous)."""

    __slots__ = ("_num", "_dev", "count")

    def __init__(self) -> None:
        self._num = 0.0
        self._dev: Any = None
        self.count = 0

    def add(self, value: Any) -> None:
        kind = type(value)
        if kind is float or kind is int:
            self._num += value
            self.count += 1
            return
        number, dev = classify(value)
        if number is not None:
            self._num += number
        elif dev is not None:
            if self._dev is None:
                self._dev = dev.float().clone()  # our own buffer: never add into the caller's
            else:
                self._dev.add_(dev)
        else:
            return
        self.count += 1

    def take(self) -> float:
        """The sum as a float (reads the device once if a device value was added); resets."""
        total = self._num
        if self._dev is not None:
            total += float(self._dev.item())
        self.reset()
        return total

    def take_raw(self) -> Any:
        """The sum without reading the device: a float, or a device tensor for
        :class:`StepPipeline`; resets. ``None`` when nothing was added."""
        if not self.count:
            return None
        if self._dev is None:
            out: Any = self._num
        else:
            out = self._dev if not self._num else self._dev.add_(self._num)
        self.reset()
        return out

    def reset(self) -> None:
        self._num = 0.0
        self._dev = None
        self.count = 0


def numbers_only(values: Mapping[str, Any], skip: frozenset[str] = frozenset()) -> Dict[str, Any]:
    """The entries of a framework's log dict worth sending as step metrics: numbers and
    one-element tensors (left for :class:`StepPipeline` to read), not strings or bools."""
    out: Dict[str, Any] = {}
    for name, value in values.items():
        if name in skip:
            continue
        kind = type(value)
        if kind is float or kind is int:
            out[str(name)] = value
        elif kind is not bool and kind is not str and (
                isinstance(value, numbers.Real) or hasattr(value, "numel")):
            out[str(name)] = value
    return out


# -- one rank's report -----------------------------------------------------------------------

class Reporter:
    """One rank's agent and what every integration does around it: the start frames, the
    step pipeline, the epoch frame, and an end that happens exactly once.

    The end is guarded: if the process exits before the framework told the integration that
    training ended, an ``atexit`` hook ends the rank: ``finish("error")`` when an uncaught
    exception is ending the process, else ``finish(clean_exit)`` (``"error"`` by default:
    training did not reach its end; the Accelerate tracker passes ``"ok"``, since scripts
    often skip ``end_training()``). So the dashboard shows a failed run, not a rank that went
    quiet. A process killed by a signal runs no ``atexit`` hooks: its rank goes stale."""

    def __init__(self, agent: RankAgent, *, clean_exit: str = "error",
                 event_factory: Callable[[Any], Any] | None = None) -> None:
        self.agent = agent
        self.steps = StepPipeline(agent.log_step, event_factory=event_factory)
        self.clean_exit = clean_exit
        self.ended: str | None = None
        self._lock = threading.Lock()
        # a step held back by hold_step(): [step, metrics, samples, tokens, data_ms]
        self._held: list[Any] | None = None
        # the data wait (7.1): the latest batch_ready() since the last step, and that step's
        # time (time.time(), the agent's clock)
        self._ready: float | None = None
        self._step_t: float | None = None
        atexit.register(self._at_exit)

    def start(self, *, total_epochs: int = 0, metadata: Any = None, port: int = 0,
              sample_interval: float | None = 2.0, total_steps: Any = 0) -> None:
        """Register, send metadata and hardware, start resource sampling (``None``: don't).

        ``total_steps`` (8.5): the framework's figure, sent unless the user gave the agent
        one (``total_steps=`` among the agent's keyword arguments wins)."""
        agent = self.agent
        steps = None if agent.total_steps else checked_total_steps(total_steps)
        agent.register(port=port, total_epochs=max(0, int(total_epochs or 0)),
                       total_steps=steps)
        if metadata is not None:
            agent.set_metadata(jsonable(metadata))
        agent.set_hardware()
        if sample_interval is not None:
            agent.start_sampling(interval=sample_interval)

    def step(self, step: int, metrics: Mapping[str, Any] | None = None, samples: int = 0,
             tokens: int = 0) -> None:
        """One step's point; metrics for the step being held (:meth:`hold_step`) join it."""
        held = self._held
        if held is not None and held[0] == step:
            if metrics:
                held[1].update(metrics)
            held[2] += samples
            held[3] += tokens
            return
        self.steps.push(step, metrics, samples, tokens, self._data_ms())

    def batch_ready(self) -> None:
        """The framework has the step's batch in hand (PROTOCOL 7.1: the integration calls
        this for the user): the next step's point carries the wait since the previous step
        as an explicit ``data_ms``, since the pipeline may send the point later than the
        step (the agent's own derivation would then measure the wrong gap)."""
        self._ready = time.time()

    def _data_ms(self) -> Optional[float]:
        """At a step's end: the wait from the previous step's end to the latest
        :meth:`batch_ready` since, in ms (None: no batch_ready since, or no previous step)."""
        now = time.time()
        ready, last = self._ready, self._step_t
        self._ready, self._step_t = None, now
        if ready is None or last is None:
            return None
        return (ready - last) * 1000.0 if ready > last else 0.0

    def hold_step(self, step: int, samples: int = 0, tokens: int = 0) -> None:
        """Start the point of ``step`` but send it only at the next :meth:`hold_step` (or the
        end): a framework that logs a step's numbers after its step-end event (the Trainer's
        ``on_log``) gets one complete point per step. Sent straight away, the step-end point
        could reach the broker first from every rank and close the step; the logged numbers
        would then be late, dropped. Every point is one step late, so step times stay one
        loop period each."""
        self.release_step()
        self._held = [step, {}, samples, tokens, self._data_ms()]

    def release_step(self) -> None:
        """Send the held step, if any."""
        held, self._held = self._held, None
        if held is not None:
            self.steps.push(held[0], held[1] or None, held[2], held[3], held[4])

    def epoch(self, epoch: int, avg_loss: float, *, batches: int = 0, samples: int = 0,
              epoch_ms: float = 0.0, scalars: Mapping[str, Any] | None = None) -> None:
        self.agent.log_epoch(epoch, avg_loss, batches=batches, samples=samples,
                             epoch_ms=epoch_ms, scalars=scalars_only(scalars) if scalars else None)

    def end(self, status: str, error: BaseException | None = None) -> None:
        """Send what waits, ``finish(status, error)``, close the agent. Only the first call
        acts. ``error``: the exception that ended training (PROTOCOL 8.2)."""
        with self._lock:
            if self.ended is not None:
                return
            self.ended = status
        try:
            atexit.unregister(self._at_exit)
        except Exception:  # pragma: no cover - interpreter teardown
            pass
        try:
            self.release_step()
            self.steps.drain()
        except Exception as exc:
            log.warning("rankboard: could not send the last steps: %r", exc)
        self.agent.finish(status, error=error)
        self.agent.close()

    def _at_exit(self) -> None:
        if self.ended is not None:
            return
        # the exit rule of PROTOCOL 8.2: the uncaught exception the agent's excepthook
        # wrapper saw (or the interpreter's sys.last_value) is the rank's error
        caught = uncaught()
        error = caught[0] if caught is not None and not exit_is_success(caught[0]) else None
        status = "error" if error is not None else self.clean_exit
        if status != "ok":
            log.warning("rankboard: the process is exiting before training ended; rank %d of "
                        "run %r reports an error", self.agent.rank, self.agent.run)
        self.end(status, error)


def scalars_only(values: Mapping[str, Any]) -> Dict[str, Any]:
    """Epoch scalars for ``log_epoch``: a number (or one-element tensor) becomes a float, a
    ``(sum, count)`` pair stays a pair; anything else is left out. Called once per epoch, so
    reading a device tensor here is one wait per epoch at most."""
    out: Dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, tuple) and len(value) == 2:
            out[str(name)] = (float(value[0]), int(value[1]))
            continue
        number, dev = classify(value)
        if number is None and dev is not None:
            try:
                number = dev.item()
            except Exception:
                number = None
        if number is not None and type(number) is not bool:
            out[str(name)] = float(number)
    return out
