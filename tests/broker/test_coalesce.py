"""Large metadata frames coalesced within an ingest batch (broker/coalesce.py; issue 19: a
flood of valid 4 MiB metadata frames held an honest run's frames one parse each).

The pure rule first, then a real broker loop fed through an ``inproc`` PUSH socket: inproc
pipes hand a message over inside ``send``, so every frame sent before the loop starts is
in the broker's queue when its first batch is drained (no timing involved)."""
from __future__ import annotations

import json
from typing import Any, Iterator

import msgspec
import pytest
import zmq

from broker.coalesce import COALESCE_MIN_BYTES, Coalescer, peek_metadata_run
from broker.server import BrokerServer
from rank_agent import protocol
from tests.support.brokers import LOOPBACK_ANY, RunningBroker
from tests.support.frames import enc, metrics, register
from tests.support.polling import wait_for


def big_metadata(run: str, i: int, *, pad: int = 0) -> bytes:
    """A valid metadata frame over COALESCE_MIN_BYTES (its JSON ~100 KiB), numbered ``i``."""
    blob = json.dumps({"i": i, "v": list(range(20_000))})
    body: dict[str, Any] = {"type": "metadata", "run": run, "rank": 0, "json": blob}
    if pad:
        body["pad"] = "x" * pad  # an ignored key, as the hostile soak sends
    raw = msgspec.msgpack.encode(body)
    assert len(raw) >= COALESCE_MIN_BYTES
    return raw


# ------------------------------------------------------------------ the pure rule
def test_only_the_newest_large_metadata_of_each_run_is_kept_in_arrival_order() -> None:
    c = Coalescer()
    a0, b0, a1, a2 = (big_metadata("a", 0), big_metadata("b", 0), big_metadata("a", 1),
                      big_metadata("a", 2))
    assert c.offer(a0) == (True, 0)
    assert c.offer(b0) == (True, 0)
    assert c.offer(a1) == (True, len(a0))  # the bytes of the one it replaced come back
    assert c.offer(a2) == (True, len(a1))
    assert c.superseded == 2 and len(c) == 2
    assert c.take() == [b0, a2]  # a's newest moved behind b's: the order they arrived in
    assert len(c) == 0 and c.take() == []


def test_a_small_metadata_supersedes_a_large_one_kept_aside() -> None:
    """Last write wins even when the later frame is small (the server offers small frames
    while anything is aside); a small one of another run is not taken (it is parsed, and
    counted malformed when it is)."""
    c = Coalescer()
    c.offer(big_metadata("a", 0))
    other = enc(protocol.Metadata(run="b", rank=0, json='{"x\\udcff": 1}'))
    assert c.offer(other) == (False, 0)
    small = enc(protocol.Metadata(run="a", rank=0, json='{"lr": 1}'))
    assert c.offer(small) == (True, len(big_metadata("a", 0)))
    assert c.take() == [small]


@pytest.mark.parametrize("raw", [
    enc(register(run="a")),                                   # another frame type
    enc(metrics(run="a")),
    b"\xc1" * 100,                                            # not MessagePack
    msgspec.msgpack.encode([1, 2, 3]),                        # not a map
    msgspec.msgpack.encode({"type": "metadata", "run": 5}),   # run not a string
    msgspec.msgpack.encode({"type": "metadata"}),             # no run
    b"\x91" * 50_000 + b"\xc0",                               # nested too deep
])
def test_anything_else_takes_the_ordinary_path(raw: bytes) -> None:
    c = Coalescer()
    assert c.offer(raw) == (False, 0)
    assert peek_metadata_run(raw) is None and len(c) == 0


def test_the_peek_skips_ignored_keys_and_reads_the_run() -> None:
    assert peek_metadata_run(big_metadata("run-1", 0, pad=3 << 20)) == "run-1"


# ------------------------------------------------------------------ a real broker loop
@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_a_burst_applies_the_newest_metadata_once_and_every_small_frame(
        ctx: zmq.Context) -> None:
    """Eight large metadata frames of one run interleaved with an honest run's frames, all
    in one batch: the honest frames all apply, only the newest blob is parsed and applied
    (seven counted ``metadata_superseded``), and it is the one the run keeps."""
    server = BrokerServer("inproc://coalesce", LOOPBACK_ANY, LOOPBACK_ANY, context=ctx,
                          heartbeat_interval=0.1, poll_interval=0.02)
    server.bind()
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.sndhwm = 1000
    push.connect("inproc://coalesce")
    push.send(enc(register(run="ok", world_size=1)))
    for i in range(8):
        push.send(big_metadata("md", i))
        push.send(enc(metrics(run="ok", epoch=i)))
    rb = RunningBroker(server)
    try:
        runs = server.runs
        wait_for(lambda: runs.accepted + runs.rejected_total >= 10, 10, "the batch applied")
        assert runs.rejected == {"metadata_superseded": 7}
        assert runs.accepted == 1 + 8 + 1  # register, 8 metrics, the newest metadata
        md = runs.get("md")
        ok = runs.get("ok")
        assert md is not None and ok is not None
        assert md.metadata["i"] == 7
        wait_for(lambda: len(ok.records) >= 7, 10, "the honest run's epochs")
    finally:
        push.close(linger=0)
        rb.stop()


def test_without_a_burst_nothing_is_superseded(ctx: zmq.Context) -> None:
    """One large metadata frame at a time (the broker keeps up): each is applied; a
    malformed one is still counted as malformed."""
    server = BrokerServer("inproc://coalesce1", LOOPBACK_ANY, LOOPBACK_ANY, context=ctx,
                          heartbeat_interval=0.1, poll_interval=0.02)
    rb = RunningBroker(server)
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.connect("inproc://coalesce1")
    try:
        runs = server.runs
        for i in range(3):
            push.send(big_metadata("md", i))
            wait_for(lambda n=i + 1: runs.accepted == n, 10, f"metadata {i} applied")
        bad = msgspec.msgpack.encode({"type": "metadata", "run": "md", "rank": 0,
                                      "json": "{" + " " * COALESCE_MIN_BYTES})
        push.send(bad)
        wait_for(lambda: runs.rejected_total == 1, 10, "the malformed one rejected")
        assert runs.rejected == {"bad_metadata_json": 1}
        md = runs.get("md")
        assert md is not None and md.metadata["i"] == 2
    finally:
        push.close(linger=0)
        rb.stop()
