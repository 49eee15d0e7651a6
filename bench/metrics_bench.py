"""metrics_65536_ranks_s and healthz_p99_during_scrape_ms (issue 32, finding 4).

A real gevent web process (``tests/support/metricsweb.py``: the real app over a hub holding
one run of 65,536 ranks, one health-reporting GPU each) is scraped once while this process
GETs ``/healthz`` back to back; the figures are the scrape's wall time and the p99 of the
probes answered during it. Before the fix the scrape took 17.7 s on the web's event loop and
the probes stalled as long. ``--ranks N`` for another size; ``--gpus G`` GPUs per rank.

    python bench/metrics_bench.py [--ranks 65536] [--gpus 1]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import percentile, result  # noqa: E402

from tests.support import scrapeprobe  # noqa: E402


def measure(ranks: int, gpus: int) -> list[dict[str, Any]]:
    """One scrape of ``ranks`` ranks (``gpus`` health-reporting GPUs each), after a warm one."""
    proc, port = scrapeprobe.start(ranks, gpus)
    try:
        scrapeprobe.probe(port)  # warm: imports, first thread-pool thread
        out = scrapeprobe.probe(port)
    finally:
        scrapeprobe.stop(proc)
    probes = out["healthz_s"]
    return [
        result(f"metrics_{ranks}_ranks_s", round(out["scrape_s"], 3), "s",
               bytes=len(out["text"]), gpus_per_rank=gpus),
        result("healthz_p99_during_scrape_ms", round(percentile(probes, 99) * 1000, 1), "ms",
               probes=len(probes), max_ms=round(max(probes, default=0) * 1000, 1)),
    ]


def run(quick: bool) -> list[dict[str, Any]]:
    """For ``run_all.py``: 65,536 ranks in both runs (a few seconds; the figure's name)."""
    return measure(65536, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=65536)
    parser.add_argument("--gpus", type=int, default=1)
    args = parser.parse_args()
    for line in measure(args.ranks, args.gpus):
        print(json.dumps(line))


if __name__ == "__main__":
    main()
