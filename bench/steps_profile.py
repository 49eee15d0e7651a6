"""cProfile of the broker thread's work on ``steps`` frames, in process (issue 17).

The broker's per-message path without the socket: ``Runs.ingest`` (decode, sink, the
journal's ``accept``), each event encoded for the PUB as the server does, the journal
flushed once per 1,000 messages (the server's batch), ``tick`` every 0.1 s of simulated
time. Two shapes:

* ``frame``: 3 points x 4 metrics from 1,024 ranks (``steps_ingest_frames_per_s``' frames);
* ``close``: 1 rank, 200,000 steps x 4 metrics in 1,000-point frames (``steps_close_per_s``).

    python bench/steps_profile.py frame|close [--profile] [--top N]

Prints the broker CPU per frame and per closed step (``time.thread_time``), and with
``--profile`` the cProfile table sorted by internal time.
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import broker_gc  # noqa: E402

from broker import feed  # noqa: E402
from broker.journal.journal import Journal  # noqa: E402
from broker.runs import Runs  # noqa: E402
from rank_agent import protocol  # noqa: E402

METRICS = ("loss", "lr", "grad_norm", "acc")
RUN = "prof-steps"


def frames_per_frame_case(ranks: int = 1024, rounds: int = 20) -> List[bytes]:
    enc = protocol.encoder.encode
    out = [enc(protocol.Register(run=RUN, rank=r, world_size=ranks, host=f"n{r // 8}",
                                 local_rank=r % 8)) for r in range(ranks)]
    t = 1.7e9
    for k in range(rounds):
        steps = [3 * k, 3 * k + 1, 3 * k + 2]
        for rank in range(ranks):
            out.append(enc(protocol.Steps(
                run=RUN, rank=rank, steps=steps, times=[t + s for s in steps],
                step_ms=[100.0 + rank % 7] * 3, samples=[32] * 3, tokens=[4096] * 3,
                metrics={m: [1.0 / (s + 1) + rank * 1e-6 for s in steps] for m in METRICS})))
    return out


def frames_close_case(steps: int = 200_000, per: int = 1000) -> List[bytes]:
    enc = protocol.encoder.encode
    out = [enc(protocol.Register(run=RUN, rank=0, world_size=1, host="n0"))]
    for s0 in range(0, steps, per):
        st = list(range(s0, s0 + per))
        out.append(enc(protocol.Steps(
            run=RUN, rank=0, steps=st, times=[1.7e9 + s * 0.01 for s in st],
            step_ms=[10.0] * per, samples=[32] * per, tokens=[4096] * per,
            metrics={m: [1.0 / (s + 1) for s in st] for m in METRICS})))
    return out


def drive(raws: List[bytes], dt: float) -> tuple[Runs, float, int]:
    """Feed ``raws`` as the server would, ``dt`` simulated seconds apart; returns the runs,
    the CPU seconds the loop took and the events published."""
    with broker_gc(), tempfile.TemporaryDirectory(prefix="rankboard-prof-") as tmp:
        journal = Journal(Path(tmp) / "data")
        journal.load()
        runs = Runs(recorder=journal.accept)
        now = 1000.0
        next_tick = now
        published = 0
        encode = feed.encode_event
        t0 = time.thread_time()
        for i, raw in enumerate(raws):
            for run, ev in runs.ingest(raw, now):
                encode(run, ev)
                published += 1
            now += dt
            if i % 1000 == 999:
                journal.flush()
            if now >= next_tick:
                for run, ev in runs.tick(now):
                    encode(run, ev)
                    published += 1
                next_tick = now + 0.1
        # the tail: let the last steps close and publish
        for _ in range(30):
            now += 0.1
            for run, ev in runs.tick(now):
                encode(run, ev)
                published += 1
        journal.flush()
        cpu = time.thread_time() - t0
        journal.close()
    return runs, cpu, published


def decode_cpu(raws: List[bytes]) -> float:
    """CPU seconds of decoding (and validating) ``raws``: the floor of any broker."""
    decode = protocol.decode
    t0 = time.thread_time()
    for raw in raws:
        decode(raw)
    return time.thread_time() - t0


def split(raws: List[bytes], dt: float) -> None:
    """Broker CPU per frame split into decode, sink (``Runs.apply`` without a journal) and
    the whole path (journal on), best of 3 each, interleaved (a loaded machine)."""
    frames = [protocol.decode(r) for r in raws]
    best: dict[str, float] = {}
    for _ in range(3):
        best["decode"] = min(best.get("decode", 1e9), decode_cpu(raws))
        runs = Runs()
        now = 1000.0
        t0 = time.thread_time()
        for f in frames:
            runs.apply(f, now)
            now += dt
        for _ in range(30):
            now += 0.1
            runs.tick(now)
        best["sink"] = min(best.get("sink", 1e9), time.thread_time() - t0)
        best["all"] = min(best.get("all", 1e9), drive(raws, dt)[1])
    n = len(raws)
    d, k, a = (best[x] / n * 1e6 for x in ("decode", "sink", "all"))
    print(f"  per frame: decode {d:.2f} us, sink (no decode, no journal) {k:.2f} us, "
          f"all {a:.2f} us; all / decode {a / d:.2f}")


def main(argv: List[str]) -> None:
    case = argv[0] if argv else "frame"
    if case == "frame":
        raws = frames_per_frame_case()
        dt = 1 / 100_000
        n_setup = 1024
    else:
        raws = frames_close_case()
        dt = 1 / 1000
        n_setup = 1
    if "--split" in argv:
        split(raws, dt)
        return
    prof = cProfile.Profile() if "--profile" in argv else None
    if prof is not None:
        prof.enable()
    runs, cpu, published = drive(raws, dt)
    if prof is not None:
        prof.disable()
    sink: Any = runs.get(RUN)
    closed = sink.steps_published
    frames = len(raws) - n_setup
    print(f"{case}: {frames} steps frames, {closed} steps closed, {published} events, "
          f"late {sink.late_steps}, rejected {dict(runs.rejected)}")
    print(f"  broker CPU {cpu:.3f} s: {cpu / frames * 1e6:.2f} us/frame, "
          f"{cpu / max(closed, 1) * 1e6:.2f} us/closed step")
    if prof is not None:
        top = int(argv[argv.index("--top") + 1]) if "--top" in argv else 25
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    main(sys.argv[1:])
