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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import percentile, result  # noqa: E402

from tests.support import scrapeprobe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=65536)
    parser.add_argument("--gpus", type=int, default=1)
    args = parser.parse_args()
    proc, port = scrapeprobe.start(args.ranks, args.gpus)
    try:
        scrapeprobe.probe(port)  # warm: imports, first thread-pool thread
        out = scrapeprobe.probe(port)
    finally:
        scrapeprobe.stop(proc)
    probes = out["healthz_s"]
    for line in (
        result(f"metrics_{args.ranks}_ranks_s", round(out["scrape_s"], 3), "s",
               bytes=len(out["text"]), gpus_per_rank=args.gpus),
        result("healthz_p99_during_scrape_ms", round(percentile(probes, 99) * 1000, 1), "ms",
               probes=len(probes), max_ms=round(max(probes, default=0) * 1000, 1)),
    ):
        print(json.dumps(line))


if __name__ == "__main__":
    main()
