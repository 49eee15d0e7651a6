"""dump_budget_rss_web_mib / dump_budget_rss_broker_mib (issue 32, finding 2).

1,000 runs each fed distinct stack dumps (``--mib-per-run``, default 2 MiB: 10 ranks' dumps
of ~200 KiB; a run's cap is 64 MiB, so this is what the per-run cap let through, scaled) in
one process, as the broker keeps them (``Runs.ingest`` of real ``stacks`` frames,
``--max-runs 1000``) and as the web does (``Hub.handle_pub`` of the ``stacks`` feed events).
The figure is each process's peak RSS growth, against the process budget
(``broker.budget.DEFAULT_BUDGET_BYTES``, 256 MiB) + 256 MiB. Before the budget, the same
feed held 1,000 x 2 MiB = ~2 GiB of dumps in each.

    python bench/dump_budget_bench.py [--runs 1000] [--mib-per-run 2]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import result  # noqa: E402

RANKS = 10


def frames_of(run: str, per_rank: int) -> list[bytes]:
    from rank_agent.protocol import StackFrame, Stacks, ThreadStack, encoder
    out = []
    for rank in range(RANKS):
        threads = [ThreadStack(name=f"t-{run}-{rank}-{i}", main=i == 0, frames=[
            StackFrame(file=f"/src/{run}/{rank}/{i}/m{j}.py", line=j, function=f"f{j}_{'y' * 40}",
                       code="z" * 60) for j in range(128)]) for i in range(per_rank // 24_000)]
        out.append(encoder.encode(Stacks(run=run, rank=rank, reason="stall", taken_at=1.0,
                                         idle_s=70.0, threads=threads)))
    return out


def child(side: str, runs: int, per_run: int) -> None:
    from types import SimpleNamespace

    from broker import feed
    from broker.budget import PROCESS_BUDGET
    from broker.runs import Runs
    from broker.stacks.store import wire_of
    from rank_agent.protocol import Register, decoder, encoder
    from web.hub import Hub
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    per_rank = per_run // RANKS
    if side == "broker":
        broker = Runs(max_runs=1000)
        for i in range(runs):
            run = f"run{i:04d}"
            broker.ingest(encoder.encode(Register(run=run, rank=0, world_size=RANKS, host="h")), 1.0)
            for raw in frames_of(run, per_rank):
                broker.ingest(raw, 2.0)
    else:
        hub = Hub()
        hub.next_request()
        hub.handle_snapshot(feed.encode_snapshot_end("i1", 0))
        for i in range(runs):
            run = f"run{i:04d}"
            dumps = [wire_of(decoder.decode(raw)) for raw in frames_of(run, per_rank)]
            hub.handle_pub(feed.encode_event(run, SimpleNamespace(
                seq=1, kind="stacks", data={"dumps": dumps, "gone": []})))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_mib": (peak - base) / 1024, "budget_used": PROCESS_BUDGET.used,
                      "dropped": PROCESS_BUDGET.dropped, "limit": PROCESS_BUDGET.limit}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--mib-per-run", type=float, default=2.0)
    parser.add_argument("--child", choices=("web", "broker"))
    args = parser.parse_args()
    per_run = int(args.mib_per_run * 1024 * 1024)
    if args.child:
        child(args.child, args.runs, per_run)
        return
    for line in measure(args.runs, args.mib_per_run):
        print(json.dumps(line))


def measure(runs: int, mib_per_run: float) -> list[dict[str, Any]]:
    """Each side in a child process of its own (its RSS is the figure)."""
    out_lines = []
    for side in ("broker", "web"):
        out = subprocess.run([sys.executable, __file__, "--child", side, "--runs", str(runs),
                              "--mib-per-run", str(mib_per_run)],
                             capture_output=True, text=True, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        limit_mib = got["limit"] / 2**20
        out_lines.append(result(f"dump_budget_rss_{side}_mib", round(got["growth_mib"], 1),
                                "MiB", target_mib=limit_mib + 256, fed_mib=runs * mib_per_run,
                                budget_used_mib=round(got["budget_used"] / 2**20, 1),
                                dropped=got["dropped"]))
    return out_lines


def run(quick: bool) -> list[dict[str, Any]]:
    """For ``run_all.py``'s full run (1,000 runs of 2 MiB: past the budget, as it must be)."""
    return measure(1000, 2.0)


if __name__ == "__main__":
    main()
