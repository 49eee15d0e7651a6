"""Bounds: every limit of PROTOCOL 2 at the limit (accepted) and one past it (rejected and
counted), the transport cap on a real socket, and the run cap against a flood of run ids."""
from __future__ import annotations

import gc
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any, Iterator

import msgspec
import pytest
import zmq

from broker import feed
from broker.runs import Runs
from broker.server import BrokerServer
from rank_agent import protocol

MiB = 1024 * 1024
T0 = 1_000_000.0
_enc = msgspec.msgpack.Encoder()


def reg(**kw: Any) -> dict[str, Any]:
    d = {"type": "register", "run": "b", "rank": 0, "world_size": 1, "host": "h"}
    d.update(kw)
    return d


def svg(**kw: Any) -> dict[str, Any]:
    d = {"type": "svg", "run": "b", "rank": 0, "svg": "<svg/>"}
    d.update(kw)
    return d


def met(**kw: Any) -> dict[str, Any]:
    d = {"type": "metrics", "run": "b", "rank": 0, "epoch": 0, "avg_loss": 1.0}
    d.update(kw)
    return d


def gpus(n: int) -> dict[str, Any]:
    return {"type": "resources", "run": "b", "rank": 0,
            "sample": {"gpus": [{"device_index": i, "name": "g"} for i in range(n)]}}


def exactly(n: int) -> dict[str, Any]:
    """A valid frame of exactly ``n`` bytes (the padding is an ignored extra key)."""
    base = reg(pad=b"")
    overhead = len(_enc.encode(base))
    pad = n - overhead - 4  # bin8 -> bin32 header grows by 3 (+1 for safety below)
    frame = reg(pad=b"\0" * pad)
    while len(_enc.encode(frame)) < n:
        frame["pad"] += b"\0"
    assert len(_enc.encode(frame)) == n
    return frame


# (name, frame at the limit, frame past it, reason past it)
LIMITS: list[tuple[str, Any, Any, str]] = [
    ("frame 4 MiB", exactly(protocol.MAX_FRAME_BYTES), exactly(protocol.MAX_FRAME_BYTES + 1),
     "oversize"),
    ("svg 2 MiB (chars)", svg(svg="x" * (2 * MiB)), svg(svg="x" * (2 * MiB + 1)), "schema"),
    ("svg 2 MiB (UTF-8 bytes)", svg(svg="\u00e9" * MiB), svg(svg="\u00e9" * MiB + "x"), "limit"),
    ("metadata 1 MiB (chars)", {"type": "metadata", "run": "b", "rank": 0,
                                "json": '"' + "x" * (MiB - 2) + '"'},
     {"type": "metadata", "run": "b", "rank": 0, "json": '"' + "x" * (MiB - 1) + '"'}, "schema"),
    ("metadata 1 MiB (UTF-8 bytes)", {"type": "metadata", "run": "b", "rank": 0,
                                      "json": '"' + "\u00e9" * (MiB // 2 - 1) + '"'},
     {"type": "metadata", "run": "b", "rank": 0, "json": '"' + "\u00e9" * (MiB // 2) + '"'},
     "limit"),
    ("host 256", reg(host="h" * 256), reg(host="h" * 257), "schema"),
    ("label 256", svg(label="l" * 256), svg(label="l" * 257), "schema"),
    ("hash 256", svg(hash="h" * 256), svg(hash="h" * 257), "schema"),
    ("summary 4096", {"type": "hardware", "run": "b", "rank": 0, "summary": "s" * 4096},
     {"type": "hardware", "run": "b", "rank": 0, "summary": "s" * 4097}, "schema"),
    ("256 scalars", met(scalars={f"s{i}": [1.0, 1] for i in range(256)}),
     met(scalars={f"s{i}": [1.0, 1] for i in range(257)}), "schema"),
    ("scalar name 128", met(scalars={"n" * 128: [1.0, 1]}), met(scalars={"n" * 129: [1.0, 1]}),
     "schema"),
    ("64 gpus", gpus(64), gpus(65), "schema"),
    ("gpu name 256", {"type": "resources", "run": "b", "rank": 0,
                      "sample": {"gpus": [{"device_index": 0, "name": "g" * 256}]}},
     {"type": "resources", "run": "b", "rank": 0,
      "sample": {"gpus": [{"device_index": 0, "name": "g" * 257}]}}, "schema"),
    ("world_size max 65536", reg(world_size=65536), reg(world_size=65537), "schema"),
    ("world_size min 1", reg(world_size=1), reg(world_size=0), "schema"),
    ("rank max 65535", reg(world_size=65536, rank=65535), reg(world_size=65536, rank=65536),
     "schema"),
    ("rank min 0", reg(rank=0), reg(rank=-1), "schema"),
    ("port max 65535", reg(port=65535), reg(port=65536), "schema"),
    ("port min 0", reg(port=0), reg(port=-1), "schema"),
    ("run id 128 chars", reg(run="r" * 128), reg(run="r" * 129), "schema"),
    ("run id not empty", reg(run="a"), reg(run=""), "schema"),
    ("run id charset", reg(run="AZaz09._:-"), reg(run="a/b"), "schema"),
    ("run id no space", reg(run="a_b"), reg(run="a b"), "schema"),
    ("run id no unicode", reg(run="e"), reg(run="\u00e9"), "schema"),
    ("epoch min 0", met(epoch=0), met(epoch=-1), "schema"),
    ("scalar count min 0", met(scalars={"a": [1.0, 0]}), met(scalars={"a": [1.0, -1]}), "schema"),
    ("finish status", {"type": "finish", "run": "b", "rank": 0, "status": "error"},
     {"type": "finish", "run": "b", "rank": 0, "status": "crashed"}, "schema"),
]


@pytest.mark.parametrize("name, at, past, reason", LIMITS, ids=[x[0] for x in LIMITS])
def test_limit_is_exact(name: str, at: Any, past: Any, reason: str) -> None:
    runs = Runs()
    assert runs.ingest(_enc.encode(at), T0) or runs.accepted == 1, name
    assert runs.accepted == 1 and not runs.rejected, (name, dict(runs.rejected))
    runs = Runs()
    assert runs.ingest(_enc.encode(past), T0) == []
    assert runs.accepted == 0 and runs.rejected == {reason: 1}, (name, dict(runs.rejected))
    assert len(runs) == 0  # a rejected frame never creates a run


# -------------------------------------------------------------- a real broker, in a thread
class Served:
    def __init__(self, **kw: Any) -> None:
        kw.setdefault("heartbeat_interval", 0.05)
        kw.setdefault("poll_interval", 0.02)
        any_port = "tcp://127.0.0.1:*"
        self.server = BrokerServer(any_port, any_port, any_port, **kw)
        self.endpoints = self.server.bind()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.linger = 0
        self.sub.setsockopt(zmq.SUBSCRIBE, b"!hb")
        self.sub.connect(self.endpoints["publish"])

    def push(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.linger = 0
        sock.connect(self.endpoints["ingest"])
        return sock

    def heartbeat_until(self, pred: Any, timeout: float = 20.0) -> feed.Heartbeat:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.sub.poll(int(left * 1000)), "no matching heartbeat"
            hb = feed.decode_update(self.sub.recv_multipart())
            if isinstance(hb, feed.Heartbeat) and pred(hb):
                return hb

    def snapshot_runs(self) -> list[str]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(self.endpoints["snapshot"])
        try:
            dealer.send_multipart(feed.encode_snapshot_request())
            names = []
            while True:
                assert dealer.poll(10_000)
                verb, body = feed.decode_snapshot_reply(dealer.recv_multipart())
                if verb == "END":
                    return names
                names.append(body["run"])
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()
        self.server.stop()
        self.thread.join(10)
        self.server.close()


@pytest.fixture
def served() -> Iterator[Any]:
    made: list[Served] = []

    def make(**kw: Any) -> Served:
        s = Served(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_transport_caps_on_a_real_socket(served: Any) -> None:
    b = served()
    push = b.push()
    try:
        push.send(_enc.encode(exactly(protocol.MAX_FRAME_BYTES)))
        push.send(b"\0" * (protocol.MAX_FRAME_BYTES + 1))  # reaches Runs: counted
        b.heartbeat_until(lambda hb: hb.rejected.get("oversize") == 1 and hb.accepted == 1)
        # over ZeroMQ's cap (4 MiB + 64 KiB): dropped and the peer disconnected, uncounted
        push.send(b"\0" * (2 * protocol.MAX_FRAME_BYTES + 1))
    finally:
        push.close(linger=0)
    again = b.push()
    try:
        again.send(_enc.encode(reg(run="after")))
        hb = b.heartbeat_until(lambda hb: hb.accepted == 2)
        assert hb.rejected == {"oversize": 1}
    finally:
        again.close(linger=0)
    assert b.thread.is_alive()


def _flood(runs: Runs, n: int, finished: bool, prefix: str) -> None:
    for i in range(n):
        run = f"{prefix}-{i:06d}-" + "x" * 100
        runs.ingest(_enc.encode(reg(run=run)), T0 + i)
        if finished:
            runs.ingest(_enc.encode({"type": "finish", "run": run, "rank": 0}), T0 + i)


@pytest.mark.parametrize("finished", [False, True], ids=["unfinished", "finished"])
def test_a_flood_of_run_ids_keeps_memory_bounded(finished: bool) -> None:
    runs = Runs(max_runs=10)
    _flood(runs, 500, finished, "warm")  # warm up (caches, interned strings)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        _flood(runs, 5000, finished, "flood")
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(runs) <= 10
    if finished:
        # each new run evicts the oldest finished one; only its last id is remembered
        # (bounded at 100 000 runs), about 200 bytes a run here
        assert runs.rejected == {}
        assert grown < 5000 * 400, grown
    else:
        # v3: never-finished runs are evicted too (least recently active first), so a flood
        # is bounded like the finished one
        assert runs.rejected == {}
        assert grown < 5000 * 400, grown


def test_run_cap_on_the_real_broker_evicts_least_recently_active_keeps_their_journal(
        served: Any, tmp_path: Path) -> None:
    b = served(max_runs=3, data_dir=tmp_path / "data")
    push = b.push()
    try:
        for i in range(3):
            push.send(_enc.encode(reg(run=f"old{i}")))
        push.send(_enc.encode(met(run="old0")))
        push.send(_enc.encode({"type": "finish", "run": "old0", "rank": 0}))
        b.heartbeat_until(lambda hb: hb.accepted == 5 and hb.runs == 3)
        for i in range(5000):  # a flood of new run ids: each takes the oldest place (v3)
            push.send(_enc.encode(reg(run=f"new{i}")))
        hb = b.heartbeat_until(lambda hb: hb.accepted + sum(hb.rejected.values()) == 5005)
        assert hb.runs == 3 and hb.rejected == {}
        assert sorted(b.snapshot_runs()) == ["new4997", "new4998", "new4999"]
        for run in ("old0", "old1", "new0"):  # kept on disk
            assert (tmp_path / "data" / "runs" / f"{run}.journal").exists()
    finally:
        push.close(linger=0)
