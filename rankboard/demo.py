"""``rankboard demo``'s simulated cluster: real processes, each a real :class:`RankAgent`.

:class:`Cluster` (run inside the gevent web process) runs two simulated jobs side by side,
each ``--ranks`` processes spread over ``--hosts`` simulated hosts (``node-a``, ``node-b``,
...), run after run (a pause between runs) until stopped:

* the **epoch job**: each process runs :func:`main` (``python -m rankboard.demo ...``): it
  registers the web's port and the epoch count, rank 0 sends the model graph and the
  hyperparameters, every rank sends its hardware, samples resources with the real sampler
  reading a simulated GPU (:mod:`rankboard.demogpu`: one throttles thermally for a while,
  another reports an XID, so the GPU health panels and alerts have something to show),
  and logs plausible loss/accuracy curves with noise per epoch (the last rank is a bit
  slower, as real clusters have a straggler); at its next-to-last epoch rank 1 runs out of
  GPU memory (a ``torch.OutOfMemoryError``) and the others fail after it in the gradients'
  all-reduce (``torch.distributed.DistBackendError``), each sending its exception with its
  ``finish`` as a real job's agent does, so the board leads with the rank that failed first
  (PROTOCOL 8.2);
* the **step job** (``--mode steps``): one epoch of optimizer steps at about 10 steps/s
  (registered with ``total_steps``, so the page counts "step s/total" with an ETA),
  each logged with the real :meth:`RankAgent.log_step` (loss, lr, grad_norm, samples and
  tokens); the last rank, on the last host, is deliberately slower **because of its data**:
  each step waits for its batch (calling :meth:`RankAgent.batch_ready` when it has it, so
  every point carries ``data_ms``), and the last rank's loader takes longer, so the
  straggler board's data-wait line names it and the cause ("rank 3 waits 35
  ms a step for data, median 6 ms: input-bound on that rank", PROTOCOL 7.1). Its steps take as long as the epoch job's epochs in all.
  Half-way through, one rank's data loader hangs for :data:`STALL_SECONDS` (a dead loader
  worker, :class:`DataLoader`) while every other rank waits for it in :func:`all_reduce`, as
  ranks wait in a collective for a missing peer; the agents' stall watch (at
  :data:`STALL_AFTER`) dumps their stacks, so the page shows the ranks ``stalled`` and the
  two groups ("3 ranks in all_reduce ← backward ← train_step; rank 1 in __next__ ←
  train_step"), then the rank recovers and every rank steps again. The others wait by
  polling a file a few times a second (the demo stays cheap on CPU). Every step is
  synchronous, as under DDP: a rank's step ends when the slowest rank's does (a shared
  counter file, :mod:`rankboard.democlock`), so the ranks step together, their step times
  are alike and the slow rank shows as slow in its data wait, as a real input-bound rank does.
  Its ranks carry a simulated Flight Recorder (:mod:`rankboard.demofr`), so the hang is also
  named from the same wire a real job uses ("rank 1 has not entered nccl:all_reduce #k"), and
  they mark ``grad_norm`` replicated: from 70 % of the steps on, the rank whose GPU reports
  an XID computes a gradient norm 3 % off the others' (silent data corruption, PROTOCOL 8.3).
  At 80 % of its steps that GPU falls off the bus: its rank fails, the others after it, and
  the demo restarts the job as ``torchrun --max-restarts`` would (new processes, the same
  run id) from its checkpoint 8 % of the steps earlier: the run's second attempt re-runs
  those steps, and the board keeps both (PROTOCOL 8.1).

This module imports nothing heavy at import time: rank processes load only rank_agent. It
sits in ``rankboard/`` beside ``up`` because it drives the whole stack (agents, broker, web).
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import random
import shutil
import signal
import string
import sys
import tempfile
import time
from typing import Any, Sequence

from rankboard.democlock import StepClock
from rankboard.democlock import create as create_clock
from rankboard.demofr import SimulatedRecorder, use_simulated_recorder
from rankboard.demogpu import roles, use_simulated_gpu
from rankboard.process import PARENT_ENV, child_command, die_with_parent, terminate_all

log = logging.getLogger(__name__)

#: Pause between a finished run and the next one.
RUN_PAUSE = 3.0
#: Seconds from a run's start to its ranks' first frames (processes starting, imports): part
#: of a round as a user sees it (measured here: about 2 s).
RUN_START = 2.0
#: The epoch job's last rank is this much slower (a straggler, as real clusters have).
SLOW_EPOCH = 1.15
BATCH_SIZE = 64
BATCHES = 120
#: The step job: seconds per optimizer step of a normal rank, the slow rank's factor,
#: sequence length (tokens = samples x this) and per-rank micro-batch.
STEP_SECONDS = 0.095
SLOW_STEP = 1.3
#: The step job's wait for a batch, of a normal rank (the slow rank's is longer by all of
#: its extra step time: it is slow because of its input)
DATA_SECONDS = 0.006
SEQ_LEN = 512
STEP_BATCH = 16
MIN_STEPS = 100
#: The step job's stall: how long the stalling rank's loader hangs, and the agents'
#: ``stall_after`` (short, so a newcomer sees the dumps within seconds; the default
#: automatic one is at least 60 s).
STALL_SECONDS = 12.0
STALL_AFTER = 3.0
#: How often a rank waiting in the demo's all_reduce looks for its peer.
BARRIER_POLL = 0.1


def host_name(index: int) -> str:
    """``node-a`` .. ``node-z``, then ``node-27`` ..."""
    return f"node-{string.ascii_lowercase[index]}" if index < 26 else f"node-{index + 1}"


def layout(ranks: int, hosts: int) -> list[tuple[str, int]]:
    """(host, local_rank) of each global rank: ranks filled host by host."""
    hosts = max(1, min(hosts, ranks))
    per_host = math.ceil(ranks / hosts)
    return [(host_name(r // per_host), r % per_host) for r in range(ranks)]


def model_svg(label: str = "demo-cnn") -> str:
    """A small model graph: a column of layer boxes joined by arrows (no script)."""
    layers = ["input 1x28x28", "conv 3x3, 32", "relu", "maxpool 2x2", "conv 3x3, 64",
              "relu", "flatten", "linear 9216-128", "dropout 0.25", "linear 128-10", "softmax"]
    box_w, box_h, gap, x = 180, 26, 14, 20
    height = len(layers) * (box_h + gap) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 220 {height}" '
        f'width="220" height="{height}" font-family="sans-serif" font-size="12">',
        f"<title>{label}</title>",
        '<defs><marker id="a" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" '
        'markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#8899aa"/></marker></defs>',
    ]
    for i, name in enumerate(layers):
        y = 15 + i * (box_h + gap)
        fill = "#1f3b57" if name.split()[0] in ("conv", "linear") else "#2b2f36"
        parts.append(f'<rect x="{x}" y="{y}" width="{box_w}" height="{box_h}" rx="5" '
                     f'fill="{fill}" stroke="#8899aa"/>')
        parts.append(f'<text x="{x + box_w // 2}" y="{y + 17}" fill="#e6edf3" '
                     f'text-anchor="middle">{name}</text>')
        if i + 1 < len(layers):
            y2 = y + box_h + gap
            parts.append(f'<line x1="{x + box_w // 2}" y1="{y + box_h}" x2="{x + box_w // 2}" '
                         f'y2="{y2 - 1}" stroke="#8899aa" marker-end="url(#a)"/>')
    parts.append("</svg>")
    return "".join(parts)


def curves(epoch: int, epochs: int, rank: int, rng: random.Random) -> tuple[float, float]:
    """(loss, accuracy) of one rank for one epoch: exponential decay, per-rank bias, noise."""
    progress = epoch / max(1, epochs - 1)
    bias = 1.0 + 0.04 * math.sin(rank * 1.7)
    loss = (0.12 + 2.2 * math.exp(-4.0 * progress)) * bias
    loss *= 1.0 + rng.gauss(0.0, 0.03)
    accuracy = 0.98 - 0.88 * math.exp(-4.5 * progress) - 0.01 * (bias - 1.0) * 10
    accuracy = min(0.999, max(0.0, accuracy + rng.gauss(0.0, 0.008)))
    return max(0.0, loss), accuracy


class OutOfMemoryError(RuntimeError):
    """The demo's simulated CUDA out-of-memory error, named as torch names its own
    (``torch.OutOfMemoryError``) so the board reads as it does for a real job."""


class DistBackendError(RuntimeError):
    """What the other ranks of a real NCCL job raise once a peer died mid-collective,
    named as torch names it (``torch.distributed.DistBackendError``)."""


OutOfMemoryError.__module__ = "torch"
DistBackendError.__module__ = "torch.distributed"

#: The epoch job's failure: how long the surviving ranks wait in the collective the failed
#: rank never joins before their communicator gives up (a real NCCL watchdog waits minutes).
PEER_TIMEOUT = 1.5


def failure_plan(world_size: int, epochs: int) -> tuple[int, int]:
    """(the rank that runs out of memory, the epoch it does so at) in the epoch job: rank 1
    (rank 0 on one rank), at the next-to-last epoch (the last on one or two epochs), so the
    run has curves before it dies."""
    return (1 if world_size > 1 else 0), min(epochs - 1, max(1, epochs - 2))


def allocate_activations(epoch: int, rank: int) -> None:
    """Rank ``rank``'s activations of a batch too large for its GPU (simulated)."""
    raise OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate 2.00 GiB. GPU {rank % 8} has a total capacity "
        f"of 79.10 GiB of which 1.21 GiB is free. Of the allocated memory 75.32 GiB is "
        f"allocated by PyTorch, and 1.87 GiB is reserved by PyTorch but unallocated "
        f"(epoch {epoch}; simulated by rankboard demo)")


def forward(epoch: int, rank: int) -> None:
    allocate_activations(epoch, rank)


def all_reduce_gradients(rank: int, failed: int) -> None:
    """The surviving ranks' collective: the failed rank never joins it, and after
    :data:`PEER_TIMEOUT` the communicator is aborted (simulated)."""
    time.sleep(PEER_TIMEOUT)
    raise DistBackendError(
        f"[Rank {rank}] NCCL communicator was aborted: rank {failed} closed its connection "
        f"(ncclRemoteError: Connection closed by remote peer; simulated by rankboard demo)")


def losing_gpu(rank: int, failed: int, step: int) -> None:
    """The step job's first attempt ends (PROTOCOL 8.1): ``failed``'s GPU falls off the bus;
    the others fail after it in the all-reduce it never joins."""
    if rank == failed:
        raise AcceleratorError(f"CUDA error: unspecified launch failure at step {step} (XID 79: "
                           f"the GPU has fallen off the bus; simulated by rankboard demo)")
    all_reduce_gradients(rank, failed)


def failing_epoch(rank: int, failed: int, epoch: int) -> None:
    """The epoch job's failing epoch (PROTOCOL 8.2): ``failed`` runs out of memory in its
    forward pass; the others then fail in the gradients' all-reduce, later."""
    if rank == failed:
        forward(epoch, rank)
    all_reduce_gradients(rank, failed)


# ----------------------------------------------------------------- one rank process
def run_rank(ns: argparse.Namespace) -> int:
    from rank_agent import RankAgent

    rng = random.Random(f"{ns.run}:{ns.rank}")
    slow = SLOW_EPOCH if ns.rank == ns.world_size - 1 and ns.world_size > 1 else 1.0
    agent = RankAgent(broker=ns.broker, run=ns.run, rank=ns.rank, world_size=ns.world_size,
                      local_rank=ns.local_rank, host=ns.host, label=ns.label)
    try:
        agent.register(port=ns.port, total_epochs=ns.epochs)
        if ns.rank == 0:
            svg = model_svg()
            agent.set_svg(svg, label=f"demo-cnn · {ns.label}" if ns.label else "demo-cnn", hash=hashlib.sha256(svg.encode()).hexdigest()[:12])
            agent.set_metadata({
                "model": "demo-cnn", "dataset": "synthetic-mnist", "optimizer": "adamw",
                "lr": 3e-4, "weight_decay": 0.01, "batch_size": BATCH_SIZE,
                "epochs": ns.epochs, "world_size": ns.world_size, "hosts": ns.hosts,
                "precision": "bf16", "seed": 1234,
            })
        use_simulated_gpu(agent, ns.world_size, seed=f"{ns.run}:{ns.rank}", hosts=ns.hosts)
        agent.set_hardware()
        agent.start_sampling(interval=max(0.5, min(2.0, ns.epoch_seconds / 2)))
        failed, fail_at = failure_plan(ns.world_size, ns.epochs)
        for epoch in range(ns.epochs):
            started = time.monotonic()
            time.sleep(ns.epoch_seconds * slow * (1.0 + rng.uniform(-0.05, 0.05)))
            if epoch == fail_at:
                try:
                    failing_epoch(ns.rank, failed, epoch)
                except (OutOfMemoryError, DistBackendError) as exc:
                    # the board names the first failure from this (8.2); no traceback on
                    # the demo's console, whose output is the dashboard's URL and its log
                    agent.finish(error=exc)
                    return 1
            ms = (time.monotonic() - started) * 1000.0
            loss, accuracy = curves(epoch, ns.epochs, ns.rank, rng)
            lr = 3e-4 * 0.5 * (1.0 + math.cos(math.pi * epoch / ns.epochs))
            agent.log_epoch(epoch, loss, batches=BATCHES, samples=BATCHES * BATCH_SIZE,
                            epoch_ms=ms, share_complete_ms=ms,
                            scalars={"accuracy": accuracy, "lr": lr})
        agent.finish("ok")
    finally:
        agent.close()
    return 0


#: The step job's restart (PROTOCOL 8.1): at this share of its steps the rank whose GPU
#: reports an XID fails (its GPU fell off the bus) and the others after it; the job is
#: restarted, as torchrun --max-restarts does, and resumes from its last checkpoint this
#: share of the steps earlier: those steps are re-run, and the board keeps both.
RESTART_AT = 0.8
RESUME_BACK = 0.08


def restart_plan(steps: int) -> tuple[int, int]:
    """(the step at which the step job's first attempt fails, the step its second resumes
    from: its checkpoint)."""
    at = max(2, int(steps * RESTART_AT))
    return at, max(1, at - max(1, int(steps * RESUME_BACK)))


class AcceleratorError(RuntimeError):
    """The step job's failing GPU (simulated), named as torch (>= 2.8) names a CUDA error."""


AcceleratorError.__module__ = "torch"


#: The step job's replica that disagrees (PROTOCOL 8.3): from this share of its steps on,
#: the rank whose GPU reports an XID computes a gradient norm off by this much (silent data
#: corruption on a failing GPU).
DIVERGE_AT = 0.7
DIVERGE_BY = 0.03


def step_curves(step: int, steps: int, rank: int, rng: random.Random,
                run: str = "", diverging: int = -1) -> dict[str, float]:
    """loss, lr and grad_norm of one rank at one optimizer step: warmup then cosine decay of
    the learning rate, a loss that falls fast then slowly (each rank's own: its local loss),
    and a gradient norm after the all-reduce, the same on every rank (seeded by the run and
    the step: the replicated metric), except on ``diverging`` from :data:`DIVERGE_AT` of the
    steps on."""
    progress = step / max(1, steps - 1)
    warm = max(1, steps // 20)
    lr = 3e-4 * (step + 1) / warm if step < warm else \
        3e-4 * 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))
    loss = 2.4 * math.exp(-3.0 * progress) + 0.35 + 0.02 * math.sin(rank * 1.3)
    loss *= 1.0 + rng.gauss(0.0, 0.04)
    shared = random.Random(f"{run}:grad_norm:{step}")  # the all-reduced gradients' norm
    grad_norm = abs(1.2 * math.exp(-1.5 * progress) + 0.3 + shared.gauss(0.0, 0.12))
    if rank == diverging and step >= DIVERGE_AT * steps:
        grad_norm *= 1.0 + DIVERGE_BY
    return {"loss": max(0.0, loss), "lr": lr, "grad_norm": grad_norm}


class DataLoader:
    """The step job's data loader: ``hang_s`` > 0 makes its next batch hang that long (a
    worker that died), then release the ranks waiting in :func:`all_reduce` (``barrier``
    appears)."""

    def __init__(self, hang_s: float, barrier: str) -> None:
        self.hang_s = hang_s
        self.barrier = barrier

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> None:
        if self.hang_s > 0:
            # (sleeping releases the GIL, so the agent's watcher still dumps this stack; no
            # comment on the line below: the stall view shows it as the rank's code)
            time.sleep(self.hang_s)
            with open(self.barrier, "w"):
                pass


def all_reduce(barrier: str, timeout: float) -> None:
    """Wait for every peer, as a collective does: here, until ``barrier`` exists (at most
    ``timeout`` seconds, so a demo rank never hangs for good)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(barrier) and time.monotonic() < deadline:
        time.sleep(BARRIER_POLL)


def backward(barrier: str, timeout: float) -> None:
    all_reduce(barrier, timeout)


def train_step(loader: DataLoader, timeout: float, recorder: SimulatedRecorder, seq: int) -> None:
    """The step at which the demo stalls: the batch (one rank's loader hangs), then the
    gradients' collective #``seq`` (the others wait in it; the hung rank never enters it,
    which its Flight Recorder shows)."""
    next(loader)
    recorder.enter(seq)
    backward(loader.barrier, timeout)


def run_steps(ns: argparse.Namespace) -> int:
    """One rank of the step job: ``ns.steps`` optimizer steps at ~10/s, then one epoch."""
    from rank_agent import RankAgent

    rng = random.Random(f"{ns.run}:{ns.rank}:steps")
    slow = SLOW_STEP if ns.rank == ns.world_size - 1 and ns.world_size > 1 else 1.0
    agent = RankAgent(broker=ns.broker, run=ns.run, rank=ns.rank, world_size=ns.world_size,
                      local_rank=ns.local_rank, host=ns.host, label=ns.label,
                      stall_after=STALL_AFTER if ns.barrier else None,
                      total_steps=ns.steps,  # "step s/total" and the ETA (8.5)
                      replicated=["grad_norm"])  # the same on every rank: checked (8.3)
    loader = DataLoader(ns.stall_seconds, ns.barrier) if ns.barrier else None
    clock = StepClock(ns.clock, ns.rank, ns.world_size) if ns.clock else None
    # what a real DDP job's Flight Recorder holds: one gradient all-reduce a step (7.2)
    recorder = SimulatedRecorder(ns.world_size)
    use_simulated_recorder(recorder)
    # the replica that disagrees: the rank whose GPU reports an XID (a failing GPU)
    diverging = roles(ns.world_size, ns.hosts)[1] if ns.world_size > 2 else -1
    try:
        agent.register(port=ns.port, total_epochs=1)
        if ns.rank == 0:
            agent.set_metadata({
                "model": "demo-lm-125m", "dataset": "synthetic-text", "optimizer": "adamw",
                "lr": 3e-4, "schedule": "warmup + cosine", "seq_len": SEQ_LEN,
                "micro_batch": STEP_BATCH, "steps": ns.steps, "world_size": ns.world_size,
                "hosts": ns.hosts, "precision": "bf16",
            })
        use_simulated_gpu(agent, ns.world_size, seed=f"{ns.run}:{ns.rank}:steps",
                          hosts=ns.hosts)
        agent.set_hardware()
        agent.start_sampling(interval=1.0)
        started = time.monotonic()
        losses = []
        next_at = time.monotonic()
        data_s = DATA_SECONDS + (slow - 1.0) * STEP_SECONDS
        for step in range(ns.resume_from, ns.steps):
            if step == ns.restart_at:  # the first attempt ends here (8.1, 8.2)
                try:
                    losing_gpu(ns.rank, max(0, diverging), step)
                except (AcceleratorError, DistBackendError) as exc:
                    agent.finish(error=exc)
                    return 1
            next_at += data_s * (1.0 + rng.uniform(-0.08, 0.08))  # waiting for the batch
            time.sleep(max(0.0, next_at - time.monotonic()))
            agent.batch_ready()
            next_at += (STEP_SECONDS - DATA_SECONDS) * (1.0 + rng.uniform(-0.08, 0.08))
            time.sleep(max(0.0, next_at - time.monotonic()))
            if loader is not None and step == ns.stall_at:
                train_step(loader, timeout=4 * STALL_SECONDS + 10, recorder=recorder, seq=step + 1)
            recorder.enter(step + 1)
            if clock is not None:
                # the gradients' all-reduce: the step ends when the slowest rank's does
                clock.arrive(step + 1, timeout=4 * STALL_SECONDS + 10)
            recorder.complete(step + 1)
            if clock is not None or step == ns.stall_at:
                next_at = time.monotonic()
            values = step_curves(step, ns.steps, ns.rank, rng, ns.run, diverging)
            losses.append(values["loss"])
            agent.log_step(step, values, samples=STEP_BATCH, tokens=STEP_BATCH * SEQ_LEN)
        ms = (time.monotonic() - started) * 1000.0
        agent.log_epoch(0, sum(losses) / max(1, len(losses)), batches=ns.steps,
                        samples=ns.steps * STEP_BATCH, epoch_ms=ms, share_complete_ms=ms)
        agent.finish("ok")
    finally:
        agent.close()
        if clock is not None:
            clock.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one simulated rank (``python -m rankboard.demo``)."""
    p = argparse.ArgumentParser(prog="python -m rankboard.demo",
                                description="one simulated rank")
    p.add_argument("--broker", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--local-rank", type=int, default=0)
    p.add_argument("--host", required=True)
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--mode", choices=("epochs", "steps"), default="epochs")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--epoch-seconds", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=MIN_STEPS)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--label", default=None, help="the run's label (section 7.5)")
    p.add_argument("--barrier", default="",
                   help="steps: the file the stall's all_reduce waits for (empty: no stall)")
    p.add_argument("--stall-at", type=int, default=-1, help="steps: the step that stalls")
    p.add_argument("--restart-at", type=int, default=-1,
                   help="steps: the step at which this attempt fails (-1: none)")
    p.add_argument("--resume-from", type=int, default=0,
                   help="steps: the checkpoint's step this attempt starts from")
    p.add_argument("--clock", default="",
                   help="steps: the run's lockstep file (rankboard/democlock.py; empty: none)")
    p.add_argument("--stall-seconds", type=float, default=0.0,
                   help="steps: how long this rank's loader hangs there (0: it waits)")
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank {ns.rank}: %(message)s")

    stopping: list[bool] = []

    def _exit(*_: Any) -> None:
        # once: Ctrl-C reaches the whole process group and the demo then sends SIGTERM; a
        # second signal must not interrupt the agent's close (a no-op handler, not SIG_IGN,
        # which would make a pending signal raise inside zmq)
        if not stopping:
            stopping.append(True)
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGINT, _exit)
    die_with_parent()  # after the handlers: the parent's death is a SIGTERM, a clean stop
    return run_steps(ns) if ns.mode == "steps" else run_rank(ns)


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


# -------------------------------------------------------- the cluster (web process)
class Cluster:
    """Runs the simulated jobs back to back (under gevent, in the web process): the epoch
    job and, unless ``step_job`` is false, the step job beside it."""

    def __init__(self, ingest: str, *, ranks: int, hosts: int, epochs: int,
                 epoch_seconds: float, port: int, step_job: bool = True,
                 control: str | None = None, rounds: int = 0,
                 control_secret_file: str | None = None) -> None:
        self.ingest = ingest
        #: the broker's control secret (``RANKBOARD_CONTROL_SECRET_FILE``): the demo's data
        #: dir is not the default one the ranks would read
        self.control_secret_file = control_secret_file
        #: runs of each job before the demo stops starting new ones (0: until stopped)
        self.rounds = rounds
        #: the broker's publish endpoint, the ranks' control channel (``RANKBOARD_CONTROL``):
        #: the demo's ephemeral ports break the default "ingest port + 1", and the page's
        #: "dump stacks" and "profile 5 s" buttons should reach the simulated ranks
        self.control = control
        self.ranks = ranks
        self.hosts = max(1, min(hosts, ranks))
        self.epochs = epochs
        self.epoch_seconds = epoch_seconds
        self.port = port
        #: the step job's steps per run: about as long as the epoch job's run
        self.steps = max(MIN_STEPS, round(epochs * epoch_seconds / STEP_SECONDS))
        self.jobs = ["epochs", "steps"] if step_job else ["epochs"]
        self.procs: dict[str, list[Any]] = {job: [] for job in self.jobs}
        self.runs_started = 0
        #: the step job's stall: which rank hangs (not the slow last one, which the
        #: straggler board points at) and the run's barrier dir (removed after the run)
        self.stall_rank = 1 if ranks > 2 else 0
        self._barrier_dir: str | None = None
        self._stopping = False
        self._greenlets: list[Any] = []
        self._rounds_done: dict[str, int] = {}

    def round_seconds(self, job: str) -> float:
        """How often a new run of ``job`` starts: its run (the epoch job at its slowest
        rank's pace; the step job in lockstep at its slow rank's pace, plus the stall), its
        start-up and the pause; the epoch job up to its failure (8.2), the step job with its
        restart's re-run steps (8.1). The log, README and GUIDE give this one figure."""
        if job == "epochs":  # it fails in its epoch fail_at (8.2): fail_at + 1 epochs run
            epochs = failure_plan(self.ranks, self.epochs)[1] + 1
            run = epochs * self.epoch_seconds * (SLOW_EPOCH if self.ranks > 1 else 1.0)
            return run + PEER_TIMEOUT + RUN_START + RUN_PAUSE
        at, back = restart_plan(self.steps)
        steps = self.steps + at - back  # the re-run steps count twice
        run = steps * STEP_SECONDS * (SLOW_STEP if self.ranks > 1 else 1.0) + STALL_SECONDS
        return run + PEER_TIMEOUT + 2 * RUN_START + RUN_PAUSE

    def start(self) -> None:
        import gevent

        # the epoch job first (the oldest run), the step job a moment later: the page opens
        # the newest run, the live step charts
        if self.rounds:
            log.info("demo: %d round(s) of %s, then no new run", self.rounds, " and ".join(self.jobs))
        else:
            log.info("demo: a new run of each job as its previous one ends, until Ctrl-C "
                     "(--rounds N: stop after N): %s", ", ".join(
                         f"the {job} job about every {self.round_seconds(job):.0f} s"
                         for job in self.jobs))
        for i, job in enumerate(self.jobs):
            self._greenlets.append(gevent.spawn_later(2.5 * i, self._loop, job))

    def _spawn_run(self, job: str, resume: str | None = None) -> str:
        """Start a run of ``job``'s ranks; ``resume``: the step job's run to restart from
        its checkpoint (its second attempt: new processes, the same run id)."""
        from gevent import subprocess

        restart_at, resume_from = restart_plan(self.steps)
        if resume is None:
            self.runs_started += 1
            stamp = time.strftime("%Y%m%d-%H%M%S")
            run = f"demo-{stamp}-{self.runs_started}" if job == "epochs" else \
                f"demo-steps-{stamp}-{self.runs_started}"
            log.info("demo: starting run %s (%d ranks on %d hosts, %s)", run, self.ranks,
                     self.hosts, f"{self.epochs} epochs" if job == "epochs" else f"{self.steps} steps")
        else:
            run = resume
            log.info("demo: restarting run %s from its checkpoint at step %d (it failed at "
                     "step %d)", run, resume_from, restart_at)
        for rank, (host, local_rank) in enumerate(layout(self.ranks, self.hosts)):
            args = ["--broker", self.ingest, "--run", run, "--rank", str(rank),
                    "--world-size", str(self.ranks),
                    "--local-rank", str(local_rank), "--host", host, "--hosts", str(self.hosts),
                    "--port", str(self.port), "--mode", job,
                    "--label", f"demo {job} · round {self.round_of(job)}"]
            if job == "epochs":
                args += ["--epochs", str(self.epochs), "--epoch-seconds", repr(self.epoch_seconds)]
            else:
                args += ["--steps", str(self.steps)]
                args += (["--resume-from", str(resume_from)] if resume is not None
                         else self._stall_args(rank) + ["--restart-at", str(restart_at)])
            base = dict(os.environ)
            if self.control:
                base["RANKBOARD_CONTROL"] = self.control
            if self.control_secret_file:
                base["RANKBOARD_CONTROL_SECRET_FILE"] = self.control_secret_file
            base[PARENT_ENV] = str(os.getpid())  # a SIGKILLed demo leaves no rank behind
            cmd, env = child_command("rankboard.demo", args, base)
            self.procs[job].append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env))
        return run

    def _stall_args(self, rank: int) -> list[str]:
        """The step job's stall (module docstring): half-way, at most once per run."""
        if rank == 0:
            self._drop_barrier()
            self._barrier_dir = tempfile.mkdtemp(prefix="rankboard-demo-")
            create_clock(os.path.join(self._barrier_dir, "clock"), self.ranks)
        assert self._barrier_dir is not None
        args = ["--barrier", os.path.join(self._barrier_dir, "released"),
                "--stall-at", str(self.steps // 2), "--clock", os.path.join(self._barrier_dir, "clock")]
        if rank == self.stall_rank:
            args += ["--stall-seconds", repr(STALL_SECONDS)]
        return args

    def _drop_barrier(self) -> None:
        if self._barrier_dir is not None:
            shutil.rmtree(self._barrier_dir, ignore_errors=True)
            self._barrier_dir = None

    def round_of(self, job: str) -> int:
        """The round the job's current run is (1 for the first), for its label."""
        return self._rounds_done.get(job, 0) + 1

    def _loop(self, job: str) -> None:
        import gevent

        while not self._stopping:
            if self.rounds and self._rounds_done.get(job, 0) >= self.rounds:
                log.info("demo: %s job: %d round(s) done; no new run (the dashboard stays "
                         "up until Ctrl-C)", job, self.rounds)
                return
            run = self._spawn_run(job)
            while not self._stopping and any(p.poll() is None for p in self.procs[job]):
                gevent.sleep(0.2)
            if self._stopping:
                return
            if job == "steps":  # its first attempt failed: restarted, as a launcher would
                self.procs[job] = []
                self._spawn_run(job, resume=run)
                while not self._stopping and any(p.poll() is None for p in self.procs[job]):
                    gevent.sleep(0.2)
                if self._stopping:
                    return
            codes = [p.returncode for p in self.procs[job]]
            self.procs[job] = []
            self._rounds_done[job] = self._rounds_done.get(job, 0) + 1
            if self.rounds and self._rounds_done[job] >= self.rounds:
                continue
            log.info("demo: run %s done (exit codes %s); next run in %.0f s", run, codes, RUN_PAUSE)
            deadline = time.monotonic() + RUN_PAUSE
            while not self._stopping and time.monotonic() < deadline:
                gevent.sleep(0.2)

    def stop(self) -> None:
        """Stop starting runs and terminate the rank processes (SIGTERM, then SIGKILL)."""
        self._stopping = True
        procs = [p for job in self.jobs for p in self.procs[job]]
        self.procs = {job: [] for job in self.jobs}
        terminate_all(procs, timeout=5.0)
        for g in self._greenlets:
            g.kill(block=True, timeout=2.0)
        self._drop_barrier()


if __name__ == "__main__":
    sys.exit(main())
