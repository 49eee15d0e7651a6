"""Instructions the broker executes per frame, counted by valgrind (issue 17).

Wall-clock and CPU-time figures swing by ±30 % on this shared 2-core VM within minutes,
which hides a change of a few percent; an instruction count does not move between runs.
This runs the broker's per-message path in process (as ``steps_profile.py`` does: no
socket) under ``valgrind --tool=callgrind``, counting only inside the loop over the frames
(the loop is driven by ``collections.deque(map(...))`` and callgrind collects only inside
``deque_init``), and prints instructions per frame. Two cases:

* ``steps``: ``steps`` frames of 3 points x 4 metrics from 1,024 ranks, 10 rounds
  (``steps_ingest_frames_per_s``' frames), ``Runs.ingest`` with the journal, each event
  encoded for the PUB;
* ``resources``: ``resources`` frames of 64 ranks from 2 interleaved senders
  (``ingest_floor_ratio_64r``' frames), held per batch of 256 and released as the server
  does, the journal flushed per batch;

* ``mixed``: ``ingest_ratio``'s frames: per epoch and rank of 256 (4 senders interleaved,
  8 ranks a host) a ``resources`` frame and a ``metrics`` frame, epochs closing as they
  complete, batched as ``resources`` is;

and ``decode`` (``--case steps|resources|mixed``): the decode and check alone, the floor's share;
``sketch``: the steps frames through decode, check and only the bookkeeping any closer
must do (the rank looked up, the points appended to pending columns, the watermark
counted), none of the rules, events, closes or journal: a lower bound for a broker written
in Python (BENCHMARKS.md, issue 17's fourth pass); ``steps --hold``: the broker with its
closes held back (the frames stay pending); ``close``: one step closed for 1,024
ranks x 4 metrics (``steps_close_1024_ms``: the close, the store append and the ``steps``
event's wire block; the adds before each close are not counted), per close.

(Issue 17's sixth and seventh passes also measured a "lane": the per-frame rules fused into
one function, an upper bound for a fused path. That path is not going to be built, so the
lane, a copy of the rules that nothing kept in step with the broker, is gone; BENCHMARKS.md
keeps its figures.) Two cases time what the others count:

* ``time`` (``--case steps|resources``): each variant of those frames (decode + check, the
  broker with closes held (steps), the broker) run ``--rounds`` times,
  alternated, each in a fresh process, timed by the thread's CPU clock around the same loop
  callgrind counts; the median CPU per frame and decode's time over each;
* ``rate`` (``--case steps|resources|resources256``): the floor (the bare PULL + decode
  loop) and the real broker, over real sockets with the figure's own senders and frames
  (``steps_ingest_frames_per_s``, ``ingest_floor_ratio_64r`` without the web,
  ``ingest_floor_ratio``), alternated ``--rounds`` times: frames/s and each over the floor's.

    python bench/frame_instructions.py steps|resources|decode|sketch|close [--hold]
        [--case steps|resources] [--gc N] [--annotate N]
    python bench/frame_instructions.py time|rate [--case ...] [--rounds N] [--quick]

``--hold``: for ``steps``, the run's steps never close (its closer answers nothing; the
frames stay buffered). ``--gc``: the young-generation threshold (default: the broker's, ``tune_gc``; 700 is
CPython's). ``--annotate N``: also the N C functions with the most instructions
(``callgrind_annotate``), which says where a Python path's cost lands (eval loop, dict
lookups, allocation, msgspec). Needs valgrind (not ``time`` and ``rate``); prints why and
exits 2 without it.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

STEPS_ROUNDS = 10

#: CPU and wall seconds spent inside :func:`_drive` (what ``time`` reports per frame)
_TIMED = [0.0, 0.0]


def _drive(fn, items) -> None:  # type: ignore[no-untyped-def]
    """``fn`` over ``items`` inside ``collections.deque``: callgrind collects only inside
    ``deque_init``; the clocks read around it are outside, for ``time``."""
    c0, t0 = time.thread_time(), time.perf_counter()
    collections.deque(map(fn, items), maxlen=0)
    _TIMED[0] += time.thread_time() - c0
    _TIMED[1] += time.perf_counter() - t0

RESOURCE_FRAMES = 10_240
BATCH = 256


def _steps_frames() -> Tuple[List[bytes], List[bytes]]:
    from steps_profile import frames_per_frame_case

    raws = frames_per_frame_case(rounds=STEPS_ROUNDS)
    return raws[:1024], raws[1024:]


MIXED_EPOCHS = 20


def _mixed_frames() -> Tuple[List[bytes], List[bytes]]:
    import ingest as ib

    senders = [ib.frames_for(s, MIXED_EPOCHS) for s in range(ib.SENDERS)]
    return ib.registers(), [x for group in zip(*senders) for x in group]


def _resources_frames() -> Tuple[List[bytes], List[bytes]]:
    import ingest as ib

    from rank_agent import protocol
    from rank_agent.protocol import Register

    enc = protocol.encoder.encode
    reg = [enc(Register(run=ib.RUN_64, rank=r, world_size=ib.RANKS_64, host=f"n{r // 8}",
                        local_rank=r % 8)) for r in range(ib.RANKS_64)]
    half = RESOURCE_FRAMES // 2
    a, b = ib.frames_64(0, half)[:half], ib.frames_64(1, half)[:half]
    return reg, [x for pair in zip(a, b) for x in pair]


class _Rank:
    __slots__ = ("highest", "last_seen", "ms")

    def __init__(self) -> None:
        self.highest = -1
        self.last_seen = 0.0
        self.ms: List[float] = []


def sketch(body: List[bytes]) -> None:
    """The least a Python broker does per steps frame (see the module docstring)."""
    from rank_agent import protocol

    decode, check = protocol.decoder.decode, protocol.check_steps
    ranks: dict[int, _Rank] = {}
    count: dict[int, int] = {}
    cols: List[list] = [[] for _ in range(7)]
    step, time_, ms, samples, tokens, frank, mvals = cols

    def one(raw: bytes) -> None:
        f = decode(raw)
        check(f)
        rank = f.rank
        rs = ranks.get(rank)
        if rs is None:
            rs = ranks[rank] = _Rank()
        rs.last_seen = 1.0
        steps = f.steps
        top = steps[-1]
        step.extend(steps)
        time_.extend(f.times)
        ms.extend(f.step_ms)
        samples.extend(f.samples)
        tokens.extend(f.tokens)
        frank.append(rank)
        mvals.extend(f.metrics.values())
        old = rs.highest
        if top > old:
            rs.highest = top
            c = count.get(old, 0) - 1
            if c > 0:
                count[old] = c
            else:
                count.pop(old, None)
            count[top] = count.get(top, 0) + 1

    _drive(one, body)


CLOSE_ROUNDS = 40


def closes() -> int:
    """``steps_close_1024_ms``' closes, each counted alone (returns the number of closes)."""
    from steps_bench import METRICS, RANKS

    from broker.run.steps.closer import RunSteps
    from rank_agent import protocol

    enc, dec = protocol.encoder.encode, protocol.decode
    steps = RunSteps(close_after=1e9, interval=0.0)
    steps.closer.grace = 0.0

    kept = []  # (as in steps_bench: the frames outlive the close, so it frees only its own)

    def close(s: int) -> None:
        steps.close(1.0, RANKS)
        block = steps.take(1.0)
        if block["rows"] != 1:
            raise RuntimeError(f"step {s} closed {block['rows']} rows")

    for s in range(CLOSE_ROUNDS):
        for r in range(RANKS):
            kept.append(dec(enc(protocol.Steps(
                run="instr", rank=r, steps=[s], times=[1.7e9 + s], step_ms=[100.0 + r % 7],
                samples=[32], tokens=[4096],
                metrics={m: [1.0 / (s + 1) + r * 1e-6] for m in METRICS}))))
            steps.closer.add(kept[-1], 1.0, True)
        _drive(close, [s])
    return CLOSE_ROUNDS


def inner(case: str, decode_only: bool, hold: bool = False) -> int:
    """Drive the frames; callgrind counts inside the ``deque`` (returns the frame count)."""
    from broker import feed
    from broker.journal.journal import Journal
    from broker.runs import Runs
    from rank_agent import protocol

    if case == "close":
        return closes()
    if case in ("steps", "sketch"):
        reg, body = _steps_frames()
        if case == "sketch":
            sketch(body)
            return len(body)
    elif case == "mixed":
        reg, body = _mixed_frames()
    else:
        reg, body = _resources_frames()
    if decode_only:
        decode, check_of = protocol.decoder.decode, protocol.check_of

        def one(raw: bytes) -> None:
            frame = decode(raw)
            check = check_of(type(frame))
            if check is not None:
                check(frame)

        _drive(one, body)
        return len(body)
    with tempfile.TemporaryDirectory(prefix="rankboard-instr-") as tmp:
        journal = Journal(Path(tmp) / "data")
        journal.load()
        runs = Runs(recorder=journal.accept, hold_samples=case in ("resources", "mixed"))
        for raw in reg:
            runs.ingest(raw, 1000.0)
        runs.release_samples(1000.0)
        if hold:  # (this harness's own instance: the closer answers nothing)
            for sink in runs.sinks():
                sink._closer.ready_batch = lambda now, world_size: None  # type: ignore
        ingest, encode = runs.ingest, feed.encode_event
        if case == "steps":
            now = [1000.0]

            def one(raw: bytes) -> None:
                for run, ev in ingest(raw, now[0]):
                    encode(run, ev)
                now[0] += 1e-5

            _drive(one, body)
        else:
            def batch(frames: List[bytes]) -> None:
                for raw in frames:
                    for run, ev in ingest(raw, 1000.0):
                        encode(run, ev)
                for run, ev in runs.release_samples(1000.0):
                    encode(run, ev)
                journal.flush()

            _drive(batch, [body[i:i + BATCH] for i in range(0, len(body), BATCH)])
        if runs.accepted < len(body):
            raise RuntimeError(f"{runs.accepted} of {len(body)} frames accepted: {runs.rejected}")
        if case == "steps" and (runs.steps_closed > 0) == hold:
            raise RuntimeError(f"{runs.steps_closed} steps closed ({'' if hold else 'not '}held)")
        journal.close()
    return len(body)


def _timed_variants(of: str) -> List[Tuple[str, List[str]]]:
    if of == "steps":
        return [("decode + check", ["decode", "--case", "steps"]),
                ("broker, closes held", ["steps", "--hold"]),
                ("broker", ["steps"])]
    return [("decode + check", ["decode", "--case", "resources"]),
            ("broker", ["resources"])]


def timed(of: str, rounds: int, gc_threshold: int | None) -> int:
    """The ``time`` case: each variant of ``of``'s frames run ``rounds`` times, alternated,
    each in a fresh process, timed by the thread's CPU clock inside the same loop callgrind
    counts; prints the median CPU per frame and decode's time over each variant's (the
    floor ratio without the receive, which is the same for all)."""
    import statistics

    variants = _timed_variants(of)
    cpu: dict[str, List[float]] = {name: [] for name, _ in variants}
    extra = [] if gc_threshold is None else ["--gc", str(gc_threshold)]
    for _ in range(rounds):
        for name, argv in variants:
            proc = subprocess.run([sys.executable, __file__, *argv, *extra, "--inner"],
                                  capture_output=True, text=True)
            frames = re.search(r"^frames (\d+)$", proc.stderr, re.M)
            seconds = re.search(r"^seconds ([\d.]+) ([\d.]+)$", proc.stderr, re.M)
            if proc.returncode or not frames or not seconds:
                print(proc.stderr[-4000:], file=sys.stderr)
                return 1
            cpu[name].append(float(seconds.group(1)) / int(frames.group(1)) * 1e6)
    base = statistics.median(cpu[variants[0][0]])
    print(f"{of} frames, CPU us per frame (median of {rounds}, alternated; "
          f"runs: min-max), and decode's time over it:")
    for name, _ in variants:
        med = statistics.median(cpu[name])
        print(f"  {name:22s} {med:7.3f} us  ({min(cpu[name]):.3f}-{max(cpu[name]):.3f})"
              f"  ratio {base / med:.3f}")
    return 0


def rates(of: str, rounds: int, quick: bool) -> int:
    """The ``rate`` case: the floor and the broker over real sockets (the floor's
    PULL loop and senders; the broker is the real :class:`BrokerServer` in a thread, as
    ``steps_ingest_frames_per_s``, ``ingest_floor_ratio`` (``resources256``) and
    ``ingest_floor_ratio_64r``' no-web figure measure it), alternated ``rounds`` times;
    prints the medians of frames/s and of the receiving thread's CPU per frame (where the
    figure's own code measures it: not ``resources256``'s), and each over the floor's."""
    import math
    import statistics

    import ingest as ib
    import steps_bench as sb
    from common import broker_gc

    if of == "steps":
        size = 10 if quick else 100
        runs = [("floor (recv + decode)", lambda: sb.floor_rate(size)),
                ("broker", lambda: (lambda r: (r[0], r[2]))(sb.broker_rate(size)))]
    elif of == "resources256":
        size = 40 if quick else 200
        runs = [("floor (recv + decode)", lambda: (ib.floor_rate(size), math.nan)),
                ("broker", lambda: (ib.broker_rate(size, resources_only=True)[0], math.nan))]
    else:
        size = 20_000 if quick else 200_000
        runs = [("floor (recv + decode)", lambda: ib.floor_64(size)),
                ("broker (no web)", lambda: ib.broker_64_thread(size))]
    got: dict[str, List[Tuple[float, float]]] = {name: [] for name, _ in runs}
    for _ in range(rounds):
        for name, fn in runs:
            with broker_gc():  # (every variant under the broker's collection thresholds)
                got[name].append(fn())
    fps = {name: statistics.median(r for r, _ in v) for name, v in got.items()}
    cpu = {name: statistics.median(c for _, c in v) for name, v in got.items()}
    base = runs[0][0]
    print(f"{of} frames over sockets (median of {rounds}, alternated): frames/s and the "
          "receiving thread's CPU per frame, each over the floor's")
    for name, _ in runs:
        line = f"  {name:22s} {fps[name]:9,.0f} frames/s  ratio {fps[name] / fps[base]:.3f}"
        if not math.isnan(cpu[name]):
            line += f"   {cpu[name] * 1e6:6.2f} us"
            if not math.isnan(cpu[base]):
                line += f"  cpu ratio {cpu[base] / cpu[name]:.3f}"
        print(line)
    return 0


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", choices=("steps", "resources", "mixed", "decode", "sketch", "close",
                                     "time", "rate"))
    ap.add_argument("--case", dest="of", choices=("steps", "resources", "mixed", "resources256"),
                    default="steps", help="for decode, time and rate: whose frames "
                    "(resources256: rate only)")
    ap.add_argument("--hold", action="store_true", help="steps: no step closes")
    ap.add_argument("--gc", type=int, default=None, help="young-generation GC threshold")
    ap.add_argument("--annotate", type=int, default=0, metavar="N")
    ap.add_argument("--rounds", type=int, default=5, help="time, rate: rounds of every variant")
    ap.add_argument("--quick", action="store_true", help="rate: a tenth of the frames")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.of == "resources256" and args.case != "rate":
        ap.error("--case resources256 is for rate only")
    if args.inner:
        import gc

        try:
            from broker.server import tune_gc
        except ImportError:  # a tree from before it (an A/B run): CPython's default
            pass
        else:
            tune_gc()
        if args.gc is not None:
            gc.set_threshold(args.gc, *gc.get_threshold()[1:])
        case = args.of if args.case == "decode" else args.case
        print("frames", inner(case, args.case == "decode", args.hold), file=sys.stderr)
        print(f"seconds {_TIMED[0]:.6f} {_TIMED[1]:.6f}", file=sys.stderr)
        return 0
    if args.case == "time":
        return timed(args.of, args.rounds, args.gc)
    if args.case == "rate":
        return rates(args.of, args.rounds, args.quick)
    if shutil.which("valgrind") is None:
        print("frame_instructions: needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="rankboard-cg-") as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no",
               "--toggle-collect=deque_init", f"--callgrind-out-file={out}", sys.executable,
               __file__, *argv, "--inner"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(
            os.environ, PYTHONDONTWRITEBYTECODE="1"))
        collected = re.search(r"Collected : (\d+)", proc.stderr)
        frames = re.search(r"^frames (\d+)$", proc.stderr, re.M)
        if proc.returncode or not collected or not frames:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        per = int(collected.group(1)) / int(frames.group(1))
        what = {"decode": f"decode+check of {args.of} frames",
                "sketch": "steps frames, decode + check + the least bookkeeping",
                "close": "one step closed for 1,024 ranks x 4 metrics"}.get(
                    args.case, args.case + (" (closes held)" if args.hold else ""))
        unit = "close" if args.case == "close" else "frame"
        print(f"{what}: {per:,.0f} instructions per {unit} ({frames.group(1)} {unit}s)")
        if args.annotate:
            table = subprocess.run(["callgrind_annotate", out], capture_output=True,
                                   text=True).stdout
            rows = [ln for ln in table.splitlines() if re.match(r"\s*[\d,]+ \(", ln)]
            for ln in rows[1:args.annotate + 1]:  # (the first row is the total)
                print(re.sub(r"/tmp/python-build[^ ]*?/Python-[\d.]+/", "", ln)[:140])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
