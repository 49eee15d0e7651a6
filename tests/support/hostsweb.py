"""A web process serving ``/api/hosts`` and ``/metrics`` over a hub of many hosts (no broker).

``python -m tests.support.hostsweb HOSTS``: monkey-patches like the real web
(``web.serve.patch``), builds a hub of runs of 1,000 hosts each (HOSTS in all, 8 ranks a
host, a GPU XID on every hundredth host, a stall on every tenth), serves the real app with
gevent's WSGI server on an ephemeral loopback port and prints ``port N``. Used by
tests/web/test_hosts_answer.py: the answer is built in a real gevent process while the
caller probes ``/healthz`` from outside it (:func:`tests.support.scrapeprobe.probe`).
"""
from __future__ import annotations

import sys
from typing import Any

from web.serve import patch

patch()

from broker import feed  # noqa: E402
from tests.support.hubserve import serve  # noqa: E402
from web.hub import Hub  # noqa: E402
from web.runstate import RunState  # noqa: E402

PER_RUN = 1000


def header(run: str, first: int, hosts: int) -> dict[str, Any]:
    entries, alerts = [], []
    for h in range(first, first + hosts):
        ranks = list(range((h - first) * 8, (h - first) * 8 + 8))
        entries.append({"host": f"node-{h:06d}", "ranks": ranks})
        if h % 100 == 0:
            alerts.append({"kind": "gpu_xid", "rank": ranks[0], "message": "m", "at": 1.0 + h})
        elif h % 10 == 0:
            alerts.append({"kind": "stalled", "rank": ranks[1], "message": "m", "at": 1.0 + h})
    return {"run": run, "status": "training", "world_size": hosts * 8, "started_at": 1.0,
            "hosts": entries, "alerts": alerts}


def build_hub(hosts: int) -> Hub:
    hub = Hub()
    hub.next_request()
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 0))
    for k, first in enumerate(range(0, hosts, PER_RUN)):
        state = hub.runs[f"run-{k:03d}"] = RunState(f"run-{k:03d}")
        state.seq = 1
        state.set_header(header(state.run, first, min(PER_RUN, hosts - first)))
    return hub


def main() -> None:
    serve(build_hub(int(sys.argv[1])))


if __name__ == "__main__":
    main()
