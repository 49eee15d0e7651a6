"""A web process serving ``/metrics`` over a hub that holds one big run (no broker).

``python -m tests.support.metricsweb RANKS [GPUS_PER_RANK]``: monkey-patches like the real
web (``web.serve.patch``), builds a hub with one run of RANKS ranks (each with
GPUS_PER_RANK health-reporting GPUs, every one healthy but for rank 7's first), serves the
real app with gevent's WSGI server on an ephemeral loopback port and prints ``port N``.
Used by tests/web/test_metrics_scale.py and bench/metrics_bench.py: the scrape runs in a
real gevent process while the caller probes ``/healthz`` from outside it.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

from web.serve import patch

patch()

from broker import feed  # noqa: E402
from tests.support.gpuentry import health_gpu  # noqa: E402
from tests.support.hubserve import serve  # noqa: E402
from web.hub import Hub  # noqa: E402

RUN = "big"


def ranks(n: int, per_rank: int) -> list[dict[str, Any]]:
    out = []
    for r in range(n):
        gpus = [health_gpu(i) for i in range(per_rank)]
        if r == 7 and gpus:
            gpus[0] = health_gpu(0, ecc_uncorrected=3)
        out.append({
            "rank": r, "host": f"node-{r // 8:05d}", "local_rank": r % 8, "status": "ok",
            "last_seen": 1e9, "epoch": 3, "hardware": None, "loss": 0.5, "gpu_xids": None,
            "step": 100, "step_ms": 120.0, "slowest_share": 0.001,
            "resources": {"cpu_percent": 12.0, "gpu_util_percent": 97.0,
                          "vram_allocated_bytes": 7e10, "vram_total_bytes": 8e10, "gpus": gpus}})
    return out


def build_hub(n: int, per_rank: int) -> Hub:
    hub = Hub()
    hub.next_request()
    hub.handle_snapshot(feed.encode_run_snapshot({
        "run": RUN, "seq": 1, "header": {"run": RUN, "status": "training"}, "ranks": [],
        "records": [], "complete": None, "svg": None}))
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 1))
    hub.handle_pub(feed.encode_event(RUN, SimpleNamespace(
        seq=2, kind="ranks", data=ranks(n, per_rank))))
    return hub


def main() -> None:
    n = int(sys.argv[1])
    per_rank = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    serve(build_hub(n, per_rank))


if __name__ == "__main__":
    main()
