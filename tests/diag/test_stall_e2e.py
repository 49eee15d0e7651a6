"""Diagnosis end to end through the broker (PROTOCOL.md sections 2.5 and 3): real agent
processes (``tests/diag/stall_child.py``) hang in named functions, a real broker marks them
``stalled`` with the contract's alert, a web's hub (fed by a real :class:`FeedPump`) groups
their dumps, they recover and turn ``ok``; a request from the hub reaches only the ranks
asked and their answers come back to it; a broker restart keeps the dumps but not the
stalled status.

The hub runs under gevent in this (unpatched) process, the broker in a thread, the ranks as
subprocesses; every wait polls a condition against a deadline (``gevent.sleep`` lets the
pump's greenlet run between polls).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import gevent
import pytest

from rank_agent.controlwire import ControlRequest
from tests.support import REPO
from tests.support.brokers import Broker
from web.hub import Hub
from web.pump import FeedPump

RUN = "hang-1"
WORLD = 4
#: rank -> the function it hangs in
WHERE = {0: "collective", 1: "collective", 2: "collective", 3: "loader"}


def green_wait(pred: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        gevent.sleep(0.05)


class Web:
    """A web's feed side: a Hub and its FeedPump on the broker's endpoints."""

    def __init__(self, broker: Broker) -> None:
        self.hub = Hub()
        self.pump = FeedPump(self.hub, broker.publish, broker.snapshot, poll_ms=50)
        self.pump.start()
        green_wait(lambda: self.hub.connected, what="the hub's first snapshot")

    def ranks(self) -> dict[int, str]:
        state = self.hub.runs.get(RUN)
        return {} if state is None else {r["rank"]: r["status"] for r in state.ranks}

    def alerts(self) -> list[dict[str, Any]]:
        state = self.hub.runs.get(RUN)
        return [] if state is None else state.header.get("alerts") or []

    def stop(self) -> None:
        self.pump.stop()


def spawn(broker: Broker, rank: int) -> subprocess.Popen[str]:
    env = dict(os.environ, RANKBOARD_CONTROL=broker.publish)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.diag.stall_child", broker.ingest, RUN, str(rank),
         str(WORLD), WHERE[rank]], cwd=REPO, env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)


def line(proc: subprocess.Popen[str], word: str) -> None:
    assert proc.stdout is not None
    got = proc.stdout.readline()  # the child prints promptly; pytest-timeout bounds a hang
    assert got.startswith(word), f"expected {word!r}, child said {got!r}"


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[dict[str, Broker]]:
    holder = {"b": Broker(tmp_path / "data")}
    yield holder
    holder["b"].stop()


@pytest.fixture
def ranks(broker: dict[str, Broker]) -> Iterator[list[subprocess.Popen[str]]]:
    procs = [spawn(broker["b"], r) for r in range(WORLD)]
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass


def group_of(view: dict[str, Any], function: str, reason: str = "stall"
             ) -> Optional[dict[str, Any]]:
    for group in view["groups"]:
        if group["reason"] == reason and group["frames"] and \
                group["frames"][-1]["function"] == function:
            return group
    return None


def test_hung_ranks_are_stalled_grouped_asked_and_recover(
        broker: dict[str, Broker], ranks: list[subprocess.Popen[str]]) -> None:
    web = Web(broker["b"])
    try:
        for proc in ranks:
            line(proc, "hanging")
        # the broker marks every rank stalled (ranks array) and raises the stalled alerts
        green_wait(lambda: web.ranks() == {r: "stalled" for r in range(WORLD)},
                   what="every rank stalled")
        # (the header, alerts included, is coalesced: up to a second after the ranks array)
        def stalled_alerts() -> dict[int, dict[str, Any]]:
            got = {a["rank"]: a for a in web.alerts() if a["kind"] == "stalled"}
            return got if set(got) == set(range(WORLD)) else {}

        alerts = green_wait(stalled_alerts, what="a stalled alert of every rank")
        assert alerts[0]["message"].startswith("stalled ")
        assert " in hang_in_all_reduce (" in alerts[0]["message"]
        assert "stall_child.py:" in alerts[0]["message"]
        assert " in hang_in_next_batch (" in alerts[3]["message"]

        # the hub groups them: three ranks in the collective, one in the loader
        def grouped() -> Any:
            view = web.hub.stacks_view(RUN)
            a, b = group_of(view, "hang_in_all_reduce"), group_of(view, "hang_in_next_batch")
            return (view, a, b) if a and b and len(a["ranks"]) == 3 else None

        view, collective, loader = green_wait(grouped, what="the stall groups")
        assert view["groups"][0] is collective  # largest first
        assert collective["ranks"] == [0, 1, 2] and loader["ranks"] == [3]
        assert [f["function"] for f in collective["frames"]][-2:] == ["main",
                                                                     "hang_in_all_reduce"]
        stall_dumps = [d for d in view["dumps"] if d["reason"] == "stall"]
        assert sorted(d["rank"] for d in stall_dumps) == [0, 1, 2, 3]
        assert all(d["idle_s"] >= 1.0 and d["host"] for d in stall_dumps)
        assert all(any(t["main"] for t in d["threads"]) for d in stall_dumps)

        # a request from the hub reaches only the ranks asked; the answers come back to it
        asked = [1, 3]

        def answered() -> bool:
            rid = web.pump.request_stacks(ControlRequest(run=RUN, request_id=uuid.uuid4().hex,
                                                         kind="stacks", ranks=asked))
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                view = web.hub.stacks_view(RUN)
                got = {d["rank"] for d in view["dumps"]
                       if d["reason"] == "request" and d["request_id"] == rid}
                if got == set(asked):
                    return True
                gevent.sleep(0.05)
            return False  # a SUB may still have been joining: ask again

        green_wait(answered, timeout=30, what="answers of ranks 1 and 3")
        view = web.hub.stacks_view(RUN)
        answers = {d["rank"] for d in view["dumps"] if d["reason"] == "request"}
        assert answers == {1, 3}, "a rank that was not asked answered"
        rid = web.hub.stacks[RUN].latest_request
        mine = [g for g in view["groups"] if g["reason"] == "request"]
        assert {r for g in mine for r in g["ranks"]} == {1, 3}
        assert all(g["request_id"] == rid for g in mine)

        # they recover: the next steps frame makes each rank ok again
        for proc in ranks:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in ranks:
            line(proc, "recovered")
        green_wait(lambda: web.ranks() == {r: "ok" for r in range(WORLD)},
                   what="every rank ok again")
        view = web.hub.stacks_view(RUN)
        assert not [g for g in view["groups"] if g["reason"] == "stall"]
        assert len([d for d in view["dumps"] if d["reason"] == "stall"]) == WORLD  # still listed
    finally:
        web.stop()
    for proc in ranks:
        assert proc.stdin is not None
        proc.stdin.close()
        line(proc, "closed")
        assert proc.wait(10) == 0


def test_a_restart_keeps_the_dumps_but_not_the_stalled_status(
        broker: dict[str, Broker], ranks: list[subprocess.Popen[str]]) -> None:
    web = Web(broker["b"])
    try:
        for proc in ranks:
            line(proc, "hanging")
        green_wait(lambda: web.ranks() == {r: "stalled" for r in range(WORLD)},
                   what="every rank stalled")
        # the stall watch sends one dump per second while the stall lasts: stop the ranks
        # first, so that no dump arrives after the restart
        for proc in ranks:
            proc.kill()
            proc.wait()
    finally:
        web.stop()
    broker["b"] = broker["b"].restart()
    web = Web(broker["b"])
    try:
        green_wait(lambda: web.ranks(), what="the run after the restart")
        assert set(web.ranks().values()) == {"ok"}
        view = web.hub.stacks_view(RUN)
        assert sorted(d["rank"] for d in view["dumps"] if d["reason"] == "stall") == [0, 1, 2, 3]
        assert view["groups"] == []  # no rank is stalled now
    finally:
        web.stop()
