"""stacks_six_tabs_cpu_ms (issue 32, Low): the web's CPU per second for six tabs reading
``GET /api/runs/<run>/stacks`` once a second, on a run of 4,096 stalled ranks whose dumps
differ (a distinct innermost frame each, 16 frames deep). Measured on the real ``Hub``: six
reads of the cached answer (``Hub.stacks_view_json``, what the route serves) against six
builds and encodings of it (``Hub.stacks_view`` + the JSON encoder: the route before).

    python bench/stacks_tabs_bench.py [--ranks 4096]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
from common import result  # noqa: E402

from broker import feed  # noqa: E402
from broker.stacks.store import wire_of  # noqa: E402
from rank_agent.protocol import StackFrame, Stacks, ThreadStack  # noqa: E402
from web.hub import Hub  # noqa: E402

RUN = "tabs"


def measure(n: int) -> list[dict[str, Any]]:
    """Six reads of ``/stacks`` of ``n`` stalled ranks, built each time and then cached."""
    hub = Hub()
    hub.next_request()
    hub.handle_snapshot(feed.encode_snapshot_end("i1", 0))
    hub.handle_pub(feed.encode_event(RUN, SimpleNamespace(seq=1, kind="ranks", data=[
        {"rank": r, "host": f"node{r // 8}", "status": "stalled"} for r in range(n)])))
    dumps = [wire_of(Stacks(run=RUN, rank=r, reason="stall", taken_at=1.0, idle_s=70.0, threads=[
        ThreadStack(name="MainThread", main=True, frames=[
            StackFrame(file=f"/src/m{i}.py", line=i, function=f"f{i}", code="x()")
            for i in range(15)] + [StackFrame(file="/src/x.py", line=r, function="wait", code="")])
    ])) for r in range(n)]
    hub.handle_pub(feed.encode_event(RUN, SimpleNamespace(
        seq=2, kind="stacks", data={"dumps": dumps, "gone": []})))
    encode = msgspec.json.Encoder().encode
    t0 = time.process_time()
    for _ in range(6):
        encode(hub.stacks_view(RUN))
    before = (time.process_time() - t0) * 1000
    hub.stacks_view_json(RUN, encode)  # the first read builds it
    t0 = time.process_time()
    for _ in range(6):
        hub.stacks_view_json(RUN, encode)
    after = (time.process_time() - t0) * 1000
    return [result("stacks_six_tabs_cpu_ms", round(after, 3), "ms",
                   baseline=round(before, 1), ratio=round(after / before, 5), ranks=n)]


def run(quick: bool) -> list[dict[str, Any]]:
    """For ``run_all.py``: 1,024 ranks quick, 4,096 in the full run."""
    return measure(1024 if quick else 4096)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4096)
    args = parser.parse_args()
    for line in measure(args.ranks):
        print(json.dumps(line))


if __name__ == "__main__":
    main()
