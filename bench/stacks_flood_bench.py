"""``stacks_request_flood_step_ratio`` (issue 32 finding 1): a training loop's step time while
a peer of the broker's snapshot socket floods it with requests for dumps, over the same loop's
step time without the flood, measured in the same run.

Processes, all real, on ephemeral loopback ports:

* a ``rankboard broker`` (``common.Stack``, no web);
* a rank: a training-like loop in its own process with a real :class:`RankAgent` (control
  channel on, connected to the broker's publish socket), doing a fixed amount of Python work
  (calibrated to about ``--busy-ms``) then ``log_step`` each step; it records every step's
  end, duration, the process's CPU time and the thread's run delay, and says when its count
  of answered requests changes (``tests/support/stacksflood.py``, shared with the test);
* a flooder: a DEALER on the snapshot socket sending ``STACKS`` requests for the rank's run
  as fast as the broker takes them (the attack of finding 1: 116,600 in 15 s), alternating a
  dump of every rank (identical but for its id: ``coalesced``) with another shape
  (``rate_limited``); ``--kind profile`` makes every other request a profile at 250 Hz for
  60 s instead (the most a request may ask), so the rank samples itself continuously.

Phases (full run; ``--quick`` is shorter): 10 s without a flood (the baseline); a decoy
flood of 15 s, the same requests for a run the broker does not hold (refused as
``unknown_run``: the broker and the flooder busy as in the flood, the rank asked nothing),
and 10 s after it; the flood of 15 s and 10 s after it (issue 32 saw the loop slow for 16 s
after a flood ended). The figure is the mean step during the flood and after it over the
baseline's mean. With it: the p99s and each phase's mean; ``ratio_to_decoy`` (the flood over
the decoy: what the requests that reach the rank cost, with the machine's share of the flood
in both); ``cpu_ratio``, the process's CPU per step (the agent's threads included, not what
other processes take from the loop); ``cpu_wait_ms_per_step_*``, the time the loop's thread
waited for a CPU (the scheduler's run delay) and ``own_ratio``, the step less that wait,
under over without (the flood's cost to the rank on a machine where other processes take
its CPU); and the requests the rank answered. Unless ``--no-pin``, on a machine with 2 or
more CPUs the rank runs on the first and the broker and flooder on the others, so the
figure is what the flood costs the rank, not what two busy processes take from a third.

    python bench/stacks_flood_bench.py [--quick] [--kind stacks|profile]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Stack, result  # noqa: E402

from tests.support.stacksflood import Rank, flood, phase, pin, warm_up  # noqa: E402

RUN = "bench-stacks-flood"


def measure(quiet: float, flood_s: float, after: float, kind: str, busy_ms: float,
            pinned: bool) -> dict[str, Any]:
    """Run the phases once (module docstring); each phase's figures."""
    cpus = sorted(os.sched_getaffinity(0))
    rank_cpus = others = None
    if pinned and len(cpus) >= 2:
        rank_cpus, others = {cpus[0]}, set(cpus[1:])
    with tempfile.TemporaryDirectory(prefix="rankboard-bench-") as tmp:
        stack = Stack(Path(tmp) / "data", web=False)
        rank: Optional[Rank] = None
        try:
            if others is not None:
                pin(stack.broker.pid, others)
            rank = Rank(stack.ingest, stack.endpoints["publish"], RUN, busy_ms, rank_cpus)
            if not rank.ready.wait(60):
                raise RuntimeError("the rank did not start")
            warm_up(stack.endpoints["snapshot"], rank, RUN)
            time.sleep(1.0)  # the warm-up's answer sent; the baseline starts clean
            marks = {"quiet": time.monotonic()}
            time.sleep(quiet)
            # the same flood for a run the broker does not hold: the machine's share of it
            marks["decoy"] = time.monotonic()
            decoy_sent = flood(stack.endpoints["snapshot"], RUN + "-decoy", flood_s, kind,
                               others)
            marks["decoy_after"] = time.monotonic()
            time.sleep(after)
            marks["flood"] = time.monotonic()
            answered_before = rank.answered
            sent = flood(stack.endpoints["snapshot"], RUN, flood_s, kind, others)
            marks["after"] = time.monotonic()
            time.sleep(after)
            marks["end"] = time.monotonic()
            answered = rank.answered - answered_before
        finally:
            if rank is not None:
                rank.stop()
            stack.close()
    steps = rank.steps
    return {"quiet": phase(steps, marks["quiet"], marks["decoy"]),
            "decoy": phase(steps, marks["decoy"], marks["flood"]),
            "flood": phase(steps, marks["flood"], marks["after"]),
            "after": phase(steps, marks["after"], marks["end"]),
            "under": phase(steps, marks["flood"], marks["end"]),
            "sent": sent, "decoy_sent": decoy_sent,
            "flood_s": marks["after"] - marks["flood"], "answered": answered,
            "pinned": rank_cpus is not None}


def run(quick: bool = False, kind: str = "stacks", busy_ms: float = 10.0,
        pinned: bool = True) -> list[dict[str, Any]]:
    quiet, flood_s, after = (2.0, 2.0, 1.0) if quick else (10.0, 15.0, 10.0)
    got = measure(quiet, flood_s, after, kind, busy_ms, pinned)
    base, under, decoy = got["quiet"], got["under"], got["decoy"]
    suffix = "" if kind == "stacks" else f"_{kind}"

    def r3(x: float) -> float:
        return round(x, 3)

    return [
        result(f"stacks_request_flood_step_ratio{suffix}",
               r3(under["mean_ms"] / base["mean_ms"]), "ratio",
               baseline=r3(base["mean_ms"]), ratio=r3(under["mean_ms"] / base["mean_ms"]),
               quiet_mean_ms=r3(base["mean_ms"]), quiet_p99_ms=r3(base["p99_ms"]),
               flood_mean_ms=r3(got["flood"]["mean_ms"]),
               flood_p99_ms=r3(got["flood"]["p99_ms"]),
               after_mean_ms=r3(got["after"]["mean_ms"]),
               after_p99_ms=r3(got["after"]["p99_ms"]),
               p99_ratio=r3(under["p99_ms"] / base["p99_ms"]),
               decoy_mean_ms=r3(decoy["mean_ms"]), decoy_p99_ms=r3(decoy["p99_ms"]),
               ratio_to_decoy=r3(under["mean_ms"] / decoy["mean_ms"]),
               cpu_ms_per_step_quiet=r3(base["cpu_ms"]),
               cpu_ms_per_step_under=r3(under["cpu_ms"]),
               cpu_ratio=r3(under["cpu_ms"] / base["cpu_ms"]),
               cpu_wait_ms_per_step_quiet=r3(base["wait_ms"]),
               cpu_wait_ms_per_step_under=r3(under["wait_ms"]),
               own_ratio=r3((under["mean_ms"] - under["wait_ms"])
                            / (base["mean_ms"] - base["wait_ms"])),
               requests_sent=got["sent"], decoy_sent=got["decoy_sent"],
               flood_s=r3(got["flood_s"]),
               requests_answered=got["answered"], steps=under["steps"] + base["steps"],
               pinned=got["pinned"], kind=kind),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="4 s quiet, floods of 4 s, 2 s after each")
    parser.add_argument("--kind", choices=("stacks", "profile"), default="stacks")
    parser.add_argument("--busy-ms", type=float, default=10.0)
    parser.add_argument("--no-pin", action="store_true",
                        help="leave every process on every CPU")
    args = parser.parse_args()
    for line in run(args.quick, args.kind, args.busy_ms, not args.no_pin):
        print(json.dumps(line))


if __name__ == "__main__":
    main()
