"""Ctrl-C at the terminal that runs ``rankboard demo``: SIGINT reaches the demo and its ranks
at once (one process group), never its broker, which the demo stops last, after its ranks
have closed, so no rank's last frames (the steps it had not flushed yet, its close) go to a
broker that already left."""
from __future__ import annotations

import os
import time
from typing import Any

import psutil

from tests.support.demorun import step_runs
from tests.support.http import get_json
from tests.support.polling import wait_for


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ctrl_c_stops_the_ranks_before_the_broker(spawn: Any) -> None:
    demo = spawn("demo", "--port", "0", "--ranks", "4", "--hosts", "2", "--epochs", "50",
                 "--epoch-seconds", "0.3")
    port = demo.wait_dashboard(timeout=30)
    wait_for(lambda: any(r["epochs_done"] >= 1 for r in get_json(port, "/api/runs") or []),
             timeout=30, what="a demo run training")

    def step_job_registered() -> bool:
        runs = step_runs(port)
        return bool(runs) and len(get_json(port, f"/api/runs/{runs[0]}")["ranks"]) == 4

    # the step job starts 2.5 s after the epoch job: Ctrl-C is pressed once its ranks have
    # registered (a rank started as Ctrl-C lands may rightly say its frames went nowhere)
    wait_for(step_job_registered, timeout=30, what="the step job's ranks registered")

    def children() -> Any:
        kids = psutil.Process(demo.proc.pid).children()
        brokers = [k for k in kids if "rankboard.demo" not in " ".join(k.cmdline())]
        ranks = [k for k in kids if "rankboard.demo" in " ".join(k.cmdline())]
        return (brokers, ranks) if len(brokers) == 1 and len(ranks) == 8 else None

    (broker,), ranks = wait_for(children, timeout=20, what="the broker and the ranks",
                                retry_on=(psutil.Error,))  # a rank ending as it is listed
    pgid = os.getpgid(demo.proc.pid)
    assert os.getpgid(broker.pid) != pgid, "the broker must not share the terminal's group"
    assert all(os.getpgid(r.pid) == pgid for r in ranks)

    demo.interrupt()
    deadline = time.monotonic() + 20
    while any(_alive(r) for r in ranks):
        assert _alive(broker), "the broker left while a rank was still closing"
        assert time.monotonic() < deadline, "the ranks did not stop"
        time.sleep(0.005)  # a sampling interval, not a synchronisation
    assert demo.proc.wait(20) == 0
    psutil.wait_procs([broker], timeout=10)
    assert not _alive(broker)
    out = demo.output()
    assert "Traceback" not in out
    assert "went nowhere" not in out, out[-2000:]
