"""Which requests for dumps the broker relays to ranks (broker/stacks/requests.py, issue 32
finding 1): the rules in memory with an injected clock, then a real broker flooded on its
snapshot socket (ranks get about one a second, the log stays bounded) and a CURVE broker
that relays only the webs' keys."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import zmq

from broker import feed
from broker.server import BrokerServer
from broker.stacks.requests import MIN_INTERVAL_S, ForwardGate
from rank_agent.controlwire import ControlRequest, control_topic, decode_request
from rank_agent.curve import client_options
from rank_agent.protocol import Register, encoder
from tests.support.brokers import Pusher, RunningBroker
from tests.support.polling import wait_for

RUN = "flooded"
LOCAL = "tcp://127.0.0.1:*"


def req(request_id: str = "q", kind: str = "stacks", ranks: Optional[list[int]] = None,
        run: str = RUN, **kw: Any) -> ControlRequest:
    return ControlRequest(run=run, request_id=request_id, kind=kind,  # type: ignore[arg-type]
                          ranks=ranks, **kw)


# ------------------------------------------------------------------ the rules, in memory
def test_one_request_a_run_a_second_identical_ones_coalesced() -> None:
    gate = ForwardGate()
    assert gate.admit(req("a"), None, True, 100.0) is None
    assert gate.admit(req("b"), None, True, 100.5) == "coalesced"  # same shape, new id
    assert gate.admit(req("c", "profile"), None, True, 100.6) == "rate_limited"
    assert gate.admit(req("d", run="other"), None, True, 100.6) is None  # per run
    assert gate.admit(req("e", "profile"), None, True, 100.0 + MIN_INTERVAL_S) is None
    assert gate.forwarded == 3
    assert gate.refused["coalesced"] == 1 and gate.refused["rate_limited"] == 1


def test_only_runs_held_and_under_curve_only_web_keys() -> None:
    gate = ForwardGate(web_keys=frozenset({"webkey"}))
    assert gate.admit(req(), "rankkey", True, 1.0) == "unauthorized"
    assert gate.admit(req(), None, True, 1.0) == "unauthorized"
    assert gate.admit(req(), "webkey", False, 1.0) == "unknown_run"
    assert gate.admit(req(), "webkey", True, 1.0) is None
    assert gate.refused == {"malformed": 0, "unauthorized": 2, "unknown_run": 1,
                            "rate_limited": 0, "coalesced": 0}


def test_the_table_of_runs_is_pruned() -> None:
    gate = ForwardGate()
    for n in range(5000):
        assert gate.admit(req(run=f"r{n}"), None, True, float(n)) is None
    assert len(gate.runs) <= 4097


# ------------------------------------------------------------------ a real broker, flooded
def test_a_flood_on_the_snapshot_socket_reaches_ranks_about_once_a_second(
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 32 finding 1: 116,600 requests in 15 s reached the ranks one for one and wrote
    126,501 log lines. Now: a rank sees at most one a second, the log a handful of lines."""
    caplog.set_level(logging.INFO, logger="broker.server")
    broker = RunningBroker(BrokerServer(LOCAL, LOCAL, LOCAL))
    ctx = zmq.Context()
    rank = ctx.socket(zmq.SUB)  # what an agent of the run subscribes to
    dealer = ctx.socket(zmq.DEALER)
    pusher = Pusher(broker.endpoints["ingest"])
    try:
        for sock in (rank, dealer):
            sock.linger = 0
        rank.rcvhwm = 0
        rank.setsockopt(zmq.SUBSCRIBE, control_topic(RUN))
        rank.connect(broker.endpoints["publish"])
        dealer.sndhwm = 0
        dealer.connect(broker.endpoints["snapshot"])
        pusher.register(RUN, 0, 2)
        wait_for(lambda: broker.server.runs.get(RUN), timeout=10, what="the run")
        gate = broker.server.stacks_gate
        # the SUB is connected once a request sent for it arrives (slow joiner)
        n = 0

        def joined() -> bool:
            nonlocal n
            n += 1
            dealer.send_multipart(feed.encode_stacks_request(req(f"j{n}", ranks=[n])))
            return bool(rank.poll(300))

        wait_for(joined, timeout=15, what="the rank's subscription")
        while rank.poll(0):
            rank.recv_multipart()
        caplog.clear()
        start = gate.forwarded + sum(gate.refused.values())
        forwarded_before = gate.forwarded
        sent, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 3.0:
            for i in range(200):  # identical ones and different ones
                dealer.send_multipart(feed.encode_stacks_request(
                    req(f"f{sent}", "profile" if i % 2 else "stacks", ranks=[i % 3])))
                sent += 1
        wait_for(lambda: gate.forwarded + sum(gate.refused.values()) - start >= sent,
                 timeout=30, what="the broker to read the flood")
        elapsed = time.monotonic() - t0
        got = 0
        while rank.poll(500):
            assert decode_request(rank.recv_multipart()).run == RUN
            got += 1
        forwarded = gate.forwarded - forwarded_before
        assert sent > 1000
        assert got == forwarded
        assert 1 <= forwarded <= elapsed / MIN_INTERVAL_S + 2, (forwarded, elapsed)
        assert gate.refused["coalesced"] > 0 and gate.refused["rate_limited"] > 0
        lines = [r for r in caplog.records if r.name == "broker.server"]
        assert len(lines) <= 10, [r.getMessage() for r in lines]
    finally:
        pusher.close()
        rank.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
        broker.stop()


def test_under_curve_only_the_web_keys_reach_ranks(tmp_path: Path) -> None:
    """A rank's key may connect to the snapshot socket (it is authorized) but its requests
    for dumps are refused and counted; a web's key in --curve-web-authorized gets through."""
    from rankboard.keys import create_keys

    keys = tmp_path / "keys"
    create_keys(keys, clients=1, webs=1)
    server = BrokerServer(LOCAL, LOCAL, LOCAL, curve_secret_key=keys / "server.key_secret",
                          curve_authorized=keys / "authorized",
                          curve_web_authorized=keys / "authorized-webs")
    broker = RunningBroker(server)
    rank_key = client_options(keys / "server.key", keys / "clients" / "client-1.key_secret")
    web_key = client_options(keys / "server.key", keys / "webs" / "web-1.key_secret")
    ctx = zmq.Context()

    def client(kind: int, options: dict[int, bytes], endpoint: str) -> zmq.Socket:
        sock = ctx.socket(kind)
        sock.linger = 0
        for option, value in options.items():
            sock.setsockopt(option, value)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, control_topic(RUN))
        sock.connect(endpoint)
        return sock

    push = client(zmq.PUSH, rank_key, broker.endpoints["ingest"])
    rank = client(zmq.SUB, rank_key, broker.endpoints["publish"])
    intruder = client(zmq.DEALER, rank_key, broker.endpoints["snapshot"])
    web = client(zmq.DEALER, web_key, broker.endpoints["snapshot"])
    gate = server.stacks_gate
    try:
        push.send(encoder.encode(Register(run=RUN, rank=0, world_size=1, host="h")))
        wait_for(lambda: server.runs.get(RUN), timeout=15, what="the run")
        for n in range(3):
            intruder.send_multipart(feed.encode_stacks_request(req(f"x{n}", ranks=[n])))
        wait_for(lambda: gate.refused["unauthorized"] == 3, timeout=15,
                 what="the rank key's requests refused")
        assert gate.forwarded == 0
        n = 0

        def relayed() -> Any:
            nonlocal n
            n += 1
            web.send_multipart(feed.encode_stacks_request(req(f"w{n}", ranks=[0])))
            return decode_request(rank.recv_multipart()) if rank.poll(1200) else None

        got = wait_for(relayed, timeout=20, what="the web's request at the rank")
        assert got.request_id.startswith("w") and gate.refused["unauthorized"] == 3
    finally:
        for sock in (push, rank, intruder, web):
            sock.close(linger=0)
        ctx.term()
        broker.stop()
