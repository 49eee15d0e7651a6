"""What a run leaves behind (PROTOCOL.md 8.5) through a real broker SIGKILL: a ``rankboard
broker`` process posting to a real HTTP webhook receiver, a 3-rank run that raises every kind
of alert the broker's rules raise live (GPU health, a gloo hang's ``collective_behind``,
stall dumps, an error, silent ranks, a data straggler), then SIGKILL and a broker restarted
on the same data dir. A web started after the restart must answer as the web did before it:
the same alerts (order, kind, rank, message, last ``at``), the same ``collectives_last``,
the same step figures per rank, the same ``/api/hosts``; the receiver gets nothing for what
the journal replayed, and an old ECC count raises nothing new.

Real processes, real signals, real sockets on 127.0.0.1 ephemeral ports; every wait polls
with a deadline.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from rank_agent import protocol as wire
from tests.support.brokers import Pusher
from tests.support.http import fetch, get_json
from tests.support.journalrun import state_parts
from tests.support.polling import wait_for
from tests.support.procs import Proc, no_traceback, start_broker, start_web
from tests.support.receiver import Receiver

RUN = "night"
FIGURES = ("rank", "step", "step_ms", "data_ms", "slowest_share")


def gpu(rank: int, *, index: int = 0, ecc: int = 0, xid: list[int] | None = None) -> wire.Resources:
    return wire.Resources(run=RUN, rank=rank, sample=wire.ResourceSample(gpus=[wire.GpuSample(
        device_index=index, name="NVIDIA H100", ecc_uncorrected=ecc, xid_errors=xid or [])]))


def coll(rank: int, enqueued: int) -> wire.Collectives:
    return wire.Collectives(run=RUN, rank=rank, reason="stall", taken_at=time.time(), groups=[
        wire.ProcessGroupStatus(pg="0", desc="default_pg", size=3, last_enqueued=enqueued,
                                last_completed=enqueued - 1)],
        entries=[wire.CollectiveEntry(pg="0", seq=enqueued, op="gloo:all_reduce",
                                      input_sizes=[[4, 8]])])


def stall(rank: int) -> wire.Stacks:
    return wire.Stacks(run=RUN, rank=rank, reason="stall", taken_at=time.time(), idle_s=75.0,
                       threads=[wire.ThreadStack(name="MainThread", main=True, frames=[
                           wire.StackFrame(file="/job/train.py", line=41, function="all_reduce")])])


def journal_state(data: Path) -> dict[str, Any]:
    return state_parts(data, RUN)


def run_of(port: int) -> dict[str, Any]:
    """The run's header, ranks and records from a web ({} while it does not know the run)."""
    r = fetch(port, f"/api/runs/{RUN}")
    return r.json() if r.status == 200 else {}


def figures(port: int) -> list[dict[str, Any]]:
    return [{k: r[k] for k in FIGURES} for r in get_json(port, f"/api/runs/{RUN}")["ranks"]]


def test_a_sigkilled_broker_restarts_with_every_alert_the_verdict_figures_and_hosts(
        spawn: Callable[..., Proc], tmp_path: Path) -> None:
    data = tmp_path / "data"
    receiver = Receiver()
    pusher = None
    try:
        broker, eps = start_broker(spawn, data, "--alert-webhook", receiver.url,
                                   "--stale-after", "3")
        web = start_web(spawn, eps)
        pusher = Pusher(eps.ingest)
        for rank in range(3):
            pusher.register(RUN, rank, 3, host=f"node-{rank}")
        now = time.time()
        for rank in range(3):  # rank 2 is the slow one, and waits for data
            pusher.send(wire.Steps(run=RUN, rank=rank, steps=list(range(20)),
                                   times=[now + i for i in range(20)],
                                   step_ms=[100.0 + 100 * rank] * 20,
                                   data_ms=[2.0 + 100 * rank] * 20))
        pusher.send(gpu(0, index=1, xid=[79]), gpu(1, ecc=2))
        pusher.send(coll(0, 101), coll(1, 101), coll(2, 100))  # rank 2 never entered #101
        pusher.send(stall(0), stall(1))
        pusher.send(wire.Finish(run=RUN, rank=1, status="error"))
        # every kind listed (ranks 0 and 2 go silent for 3 s: stale), and posted
        want = {"gpu_xid", "gpu_ecc", "collective_behind", "stalled", "rank_error", "stale",
                "data_straggler"}

        def listed() -> set[str]:
            return {a["kind"] for a in run_of(web.port).get("alerts", [])}

        wait_for(lambda: listed() >= want, 30.0, f"alerts {sorted(want)} listed")
        wait_for(lambda: {b["kind"] for b in receiver.bodies()} >= want, 30.0,
                 "every kind posted")
        header = get_json(web.port, f"/api/runs/{RUN}")
        assert header["collectives_last"]["groups"][0]["behind"][0]["rank"] == 2
        # the broker has written what the web shows (a handshake, not a sleep): the last
        # STATE parts in its journal are the listed alerts and the ranks' figures
        wait_for(lambda: journal_state(data).get("alerts", {}).get("alerts") == [
            a for a in get_json(web.port, f"/api/runs/{RUN}")["alerts"]
            if not a["message"].endswith("listed")], 30.0, "the alert list journaled")
        wait_for(lambda: [[r[0], r[1]] for r in journal_state(data).get("figures", [])]
                 == [[r["rank"], r["step"]] for r in figures(web.port)], 30.0,
                 "the step figures journaled")
        before = get_json(web.port, f"/api/runs/{RUN}")
        before_figures = figures(web.port)
        before_hosts = get_json(web.port, "/api/hosts")
        assert {h["host"] for h in before_hosts if h["suspect"]} == {"node-0", "node-1"}
        assert before_figures[2]["step_ms"] == 300.0 and before_figures[2]["slowest_share"] == 1.0
        posted = receiver.count()

        broker.proc.kill()  # SIGKILL: no close, no last flush
        assert broker.proc.wait(10) == -9
        start_broker(spawn, data, "--alert-webhook", receiver.url, "--stale-after", "60",
                     endpoints=eps)
        fresh = start_web(spawn, eps)  # a web that knows only the restarted broker
        after = wait_for(lambda: (lambda r: r if r.get("alerts") else None)(run_of(fresh.port)),
                         30.0, "the run after the restart")
        assert after["alerts"] == before["alerts"]
        assert after["collectives_last"] == before["collectives_last"]
        assert figures(fresh.port) == before_figures
        assert get_json(fresh.port, "/api/hosts") == before_hosts

        # live again: rank 1's GPU reports the ECC count it had (nothing new), then rank 2's
        # an XID. The XID's POST is the first and only one since the restart: nothing the
        # journal replayed was posted (it would have gone out before, or with, the XID).
        pusher.send(gpu(1, ecc=2))
        pusher.send(gpu(2, index=3, xid=[48]))
        wait_for(lambda: receiver.count() > posted, 30.0, "the live XID posted")
        new = receiver.bodies()[posted:]
        assert [(b["kind"], b["ranks"]) for b in new] == [("gpu_xid", [2])], new
        ecc = [a for a in get_json(fresh.port, f"/api/runs/{RUN}")["alerts"]
               if a["kind"] == "gpu_ecc"]
        assert ecc == [a for a in before["alerts"] if a["kind"] == "gpu_ecc"]
        no_traceback(web, fresh)
    finally:
        if pusher is not None:
            pusher.close()
        receiver.close()
