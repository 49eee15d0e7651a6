"""Run every rankboard benchmark; one JSON object per line on stdout.

    python bench/run_all.py --quick     # smaller sizes, under a minute on 2 cores
    python bench/run_all.py             # full sizes; also rewrites BENCHMARKS.md
    python bench/run_all.py --only ingest,epoch_close

Each line is ``{"name", "value", "unit", "baseline", "ratio"}`` (baseline and ratio are null
where no baseline applies). Ratios compare against a baseline measured in the same run, so
they hold on a noisy machine. Benchmarks print figures; none of them is a test and none
asserts a speed. Details of each measurement are in the module docstrings and BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import agent_send  # noqa: E402
import attempts_bench  # noqa: E402
import collectives_bench  # noqa: E402
import common  # noqa: E402
import datawait_bench  # noqa: E402
import epoch_close  # noqa: E402
import failure_bench  # noqa: E402
import hostile_soak  # noqa: E402
import ingest  # noqa: E402
import journal_bench  # noqa: E402
import numbers_bench  # noqa: E402
import page_bench  # noqa: E402
import report_bench  # noqa: E402
import retention_bench  # noqa: E402
import sampler_bench  # noqa: E402
import scaleout  # noqa: E402
import stacks_bench  # noqa: E402
import stacks_request_bench  # noqa: E402
import steps_bench  # noqa: E402
import web_bench  # noqa: E402
import webhook_bench  # noqa: E402

#: (group, run(quick) -> results); order: cheap and pure first.
GROUPS: list[tuple[str, Callable[[bool], list[dict[str, Any]]]]] = [
    ("epoch_close", epoch_close.run),
    ("agent", agent_send.run),
    ("sampler", sampler_bench.run),
    ("ingest", ingest.run),
    ("journal", journal_bench.run),
    ("web", web_bench.run),
    ("scaleout", scaleout.run),
    ("steps", steps_bench.run),
    ("datawait", datawait_bench.run),
    ("numbers", numbers_bench.run),
    ("page", page_bench.run),
    ("stacks", stacks_bench.run),
    ("collectives", collectives_bench.run),
    ("report", report_bench.run),
    ("webhook", webhook_bench.run),
    ("soak", hostile_soak.run),
    ("stacks_request", stacks_request_bench.run),
    ("failure", failure_bench.run),
    ("retention", retention_bench.run),
    ("attempts", attempts_bench.run),
]

#: name -> (target, "<=" or ">=") as the performance issue states them; None: measured and
#: recorded, no longer a target (issue 33: the steps-speed figures a Python broker that keeps
#: its module layout cannot reach; capacity beyond one core comes from shards)
TARGETS: dict[str, tuple[float, str] | None] = {
    "ingest_ratio": (0.5, ">="),
    "ingest_floor_ratio": (0.5, ">="),
    "ingest_floor_ratio_64r": (0.5, ">="),
    "epoch_close_4096_ms": (10.0, "<="),
    "epoch_close_scaling": (2.0, "<="),
    "e2e_latency_p50_ms": (3.0, "<="),
    "e2e_latency_p99_ms": (20.0, "<="),
    "fanout_1000_p99_ms": (200.0, "<="),
    "fanout_kib_per_client": (32.0, "<="),
    "fanout_4000_workers2_p99_ms": (400.0, "<="),
    "nginx_e2e_p99_ms": (25.0, "<="),
    "agent_send_p99_us": (20.0, "<="),
    "log_step_p99_us": (5.0, "<="),
    "sampler_sample_us": (200.0, "<="),
    "late_join_1024x100_s": (2.0, "<="),
    "steps_ingest_frames_per_s": None,  # was >= 100,000
    "steps_floor_ratio": None,  # was >= 0.5
    "steps_close_per_s": (200_000, ">="),
    "steps_close_1024_ms": None,  # was <= 0.3
    "steps_query_1m_p99_ms": (20.0, "<="),
    "steps_bytes_per_step_series": (32.0, "<="),
    "step_e2e_p99_ms": (600.0, "<="),
    "steps_restart_1m_s": (5.0, "<="),
    "page_first_draw_1m_steps_s": (1.5, "<="),
    "page_live_cpu_ms_per_s": (100.0, "<="),
    "page_1024_ranks_update_ms": (50.0, "<="),
    "journal_bytes_per_noop_frame": (0.0, "<="),
    "stacks_groups_1024_ms": (50.0, "<="),
    "profile_overhead_pct": (3.0, "<="),
    "stacks_request_s": (1.5, "<="),
    "collective_verdict_1024_ms": (20.0, "<="),
    "collectives_dump_ms": (100.0, "<="),
    # not in the table: the stall watch's whole cost on the training thread, kept
    # under a microsecond (log_step_p99_us is the contract's figure)
    "stall_note_ns": (1000.0, "<="),
    # issue 28 (7.1): the data wait
    "batch_ready_ns": (1000.0, "<="),
    "data_stragglers_1024_ms": (5.0, "<="),
    "steps_close_per_s_data_ms": (200_000, ">="),
    "report_1m_bytes": (10_000_000, "<="),
    "report_1m_s": (3.0, "<="),
    "report_first_draw_s": (2.0, "<="),
    "webhook_storm_posts": (1.0, "<="),
    "hostile_soak_honest_e2e_p99_ms": (250.0, "<="),
    "hostile_soak_max_rss_mib": (1024.0, "<="),
    "hostile_soak_honest_lost": (0.0, "<="),
    # issue 40 (8.2): the first failure of 65,536 failed ranks
    "failure_65536_ms": (50.0, "<="),
    # issue 41 (8.3): one replicated metric's check, closing 1,024-rank steps
    "replica_check_overhead_ratio": (1.05, "<="),
    "nonfinite_first_close_ms": None,
    # issue 42 (8.4): the data dir bounded in bytes; a full disk
    "retention_scan_10000_runs_s": (2.0, "<="),
    "journal_full_e2e_p99_ms": (20.0, "<="),
    # issue 39 (8.1): attempts; a restart's rewind and /steps over a rewound line
    "rewind_1m_steps_ms": (50.0, "<="),
    "steps_query_1m_rewound_p99_ms": (20.0, "<="),
}
NAMES = list(TARGETS)


def _figure(r: dict[str, Any]) -> float:
    """The figure a target applies to: the ratio where there is one, else the value."""
    return r["ratio"] if r["name"] in ("ingest_ratio", "ingest_floor_ratio",
                                       "ingest_floor_ratio_64r") else r["value"]


def write_markdown(results: list[dict[str, Any]], command: str, path: Path, seconds: float) -> None:
    m = common.machine()
    lines = [
        "# rankboard benchmarks",
        "",
        "Figures of the last full run of `bench/run_all.py` (rewritten by it; see bench/*.py for",
        "how each is measured and docs below for what the figures mean).",
        "",
        f"- command: `{command}` ({seconds:.0f} s)",
        f"- machine: {m['nproc']} CPUs ({m['affinity']} usable), {m['cpu']}; {m['platform']}",
        f"- Python {m['python']}, pyzmq {m['pyzmq']}, libzmq {m['libzmq']}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        "",
        "| benchmark | value | unit | baseline | ratio | target | met | details |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        target = TARGETS.get(r["name"])
        if target is not None:
            figure = _figure(r)
            met = figure <= target[0] if target[1] == "<=" else figure >= target[0]
            tgt = f"{target[1]} {target[0]:g}"
        else:
            met, tgt = None, ""
        extra = ", ".join(f"{k}={v}" for k, v in (r.get("_extra") or {}).items())
        lines.append(f"| {r['name']} | {r['value']} | {r['unit']} | "
                     f"{'' if r['baseline'] is None else r['baseline']} | "
                     f"{'' if r['ratio'] is None else r['ratio']} | {tgt} | "
                     f"{'' if met is None else ('yes' if met else '**no**')} | {extra} |")
    notes = path.read_text(encoding="utf-8").split("<!-- notes -->", 1)[1] if path.exists() and \
        "<!-- notes -->" in path.read_text(encoding="utf-8") else "\n"
    path.write_text("\n".join(lines) + "\n\n<!-- notes -->" + notes, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (for the test)")
    parser.add_argument("--only", default="", help="comma-separated groups: "
                        + ",".join(g for g, _ in GROUPS))
    parser.add_argument("--markdown", type=Path, default=None,
                        help="write the figures there (default: BENCHMARKS.md on a full run)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    only = {g for g in args.only.split(",") if g}
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    for group, fn in GROUPS:
        if only and group not in only:
            continue
        for r in fn(args.quick):
            results.append(r)
            print(json.dumps({k: r[k] for k in ("name", "value", "unit", "baseline", "ratio")}),
                  flush=True)
            if r.get("_extra"):
                print(f"  {r['name']}: {json.dumps(r['_extra'])}", file=sys.stderr, flush=True)
    md = args.markdown
    if md is None and not args.quick and not only:
        md = common.REPO / "BENCHMARKS.md"
    if md is not None:
        command = "python bench/run_all.py" + (" --quick" if args.quick else "") + \
            (f" --only {args.only}" if only else "")
        write_markdown(results, command, md, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
