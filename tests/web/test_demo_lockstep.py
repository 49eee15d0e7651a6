"""``rankboard demo``'s step job is synchronous, as data-parallel training is (issue 34, item
6): every rank's step ends when the slowest rank's does (``rankboard/democlock.py``), so the
ranks' highest steps stay within a few steps of each other and their step times are alike;
the slow rank stays slow because of its data (its ``data_ms``), not by stepping on its own."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from rankboard import democlock
from tests.support.demorun import newest_step_run
from tests.support.http import get_json
from tests.support.polling import wait_for

#: the demo's stall is at step 50 of 100 (``--epochs 2 --epoch-seconds 0.5``); the checks
#: read the ranks between these steps, before it
FIRST, LAST = 25, 45


def test_demo_ranks_step_in_lockstep_and_the_slow_one_waits_for_data(spawn: Any) -> None:
    demo = spawn("demo", "--port", "0", "--ranks", "4", "--hosts", "2", "--epochs", "2",
                 "--epoch-seconds", "0.5", "--no-browser")
    port = demo.wait_dashboard(timeout=30)
    run = wait_for(lambda: newest_step_run(port), timeout=30, what="the demo's step run")

    def ranks_at(lo: int) -> Any:
        ranks = get_json(port, f"/api/runs/{run}")["ranks"]
        steps = [r.get("step") for r in ranks]
        if len(ranks) != 4 or any(s is None for s in steps) or min(steps) < lo:
            return None
        return ranks

    seen = []
    ranks = wait_for(lambda: ranks_at(FIRST), timeout=60, what=f"every rank past step {FIRST}")
    while max(r["step"] for r in ranks) <= LAST:
        seen.append(ranks)
        ranks = wait_for(lambda: ranks_at(FIRST), timeout=10, what="the ranks")
        if len(seen) > 200:
            break
    assert seen, "no sample before the stall"
    for sample in seen:
        steps = {r["rank"]: r["step"] for r in sample}
        # (each rank's step is as of its last flush: a few steps of slack)
        assert max(steps.values()) - min(steps.values()) <= 6, steps
    last = seen[-1]
    step_ms = {r["rank"]: r["step_ms"] for r in last}
    assert max(step_ms.values()) / min(step_ms.values()) < 1.12, step_ms
    data_ms = {r["rank"]: r["data_ms"] for r in last}
    assert max(data_ms, key=lambda k: data_ms[k]) == 3, data_ms
    assert data_ms[3] > 3 * sorted(data_ms.values())[1], data_ms


def test_a_step_clock_waits_for_every_rank_and_gives_up_on_a_dead_one(tmp_path: Path) -> None:
    """``StepClock``: a rank's ``arrive(n)`` returns once every rank has finished n steps
    (here the other rank arrives from a thread), and returns False after its timeout when a
    peer never does (a demo rank never hangs for good)."""
    path = str(tmp_path / "clock")
    democlock.create(path, 2)
    a, b = democlock.StepClock(path, 0, 2), democlock.StepClock(path, 1, 2)
    try:
        assert not a.arrive(1, timeout=0.05)  # rank 1 has not finished step 1
        peer = threading.Thread(target=b.arrive, args=(1, 10.0))
        peer.start()
        assert a.arrive(1, timeout=10.0)
        peer.join(timeout=10.0)
        assert a.counts() == (1, 1)
    finally:
        a.close()
        b.close()
