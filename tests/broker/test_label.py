"""The run's label (PROTOCOL.md section 7.5): the latched svg's label when it has one, else
the first non-empty register label, else null; a label over 128 characters is ``schema``."""
from __future__ import annotations

import msgspec
import pytest

from broker import feed
from broker.run.sink import RunSink
from rank_agent import protocol
from rank_agent.protocol import Register, Svg, decode, encoder
from tests.support.brokers import FeedClient, RunningBroker
from tests.support.frames import enc, metrics, register

RUN = "9f1c2a5e-4b7d-4e0a-9c3f-2d6b8e1a7c40"  # what plain torchrun names a job


def wire(frame):
    return decode(encoder.encode(frame))


def reg(rank: int, label: str = "") -> Register:
    return wire(Register(run=RUN, rank=rank, world_size=2, host="a", label=label))


def svg(label: str | None) -> Svg:
    return wire(Svg(run=RUN, rank=0, svg="<svg/>", label=label))


def test_the_first_non_empty_register_label_names_the_run() -> None:
    sink = RunSink(RUN)
    sink.apply(reg(0), 0.0)
    assert sink.header()["label"] is None
    sink.apply(reg(1, "gpt-small"), 1.0)
    sink.apply(reg(0, "other"), 2.0)
    assert sink.header()["label"] == "gpt-small"


@pytest.mark.parametrize("svg_first", [True, False])
def test_the_latched_svgs_label_wins_and_a_label_less_svg_keeps_the_registers(svg_first: bool) -> None:
    named = RunSink(RUN)
    frames = [svg("resnet"), reg(0, "train")]
    for f in frames if svg_first else frames[::-1]:
        named.apply(f, 1.0)
    assert named.header()["label"] == "resnet"

    bare = RunSink(RUN)
    frames = [svg(None), reg(0, "train")]
    for f in frames if svg_first else frames[::-1]:
        bare.apply(f, 1.0)
    assert bare.header()["label"] == "train" and bare.header()["has_svg"]


def test_a_label_over_128_characters_rejects_the_register() -> None:
    assert decode(encoder.encode(Register(run=RUN, rank=0, world_size=1, host="a",
                                          label="x" * 128))).label == "x" * 128
    with pytest.raises(msgspec.ValidationError):
        decode(encoder.encode({"type": "register", "run": RUN, "rank": 0, "world_size": 1,
                               "host": "a", "label": "x" * 129}))


def test_the_broker_counts_a_long_label_as_schema_and_serves_a_good_one(
        broker: RunningBroker, client: FeedClient, push) -> None:
    # the SUB has joined once a heartbeat came: events published before that would be lost
    client.until(lambda u: isinstance(u, feed.Heartbeat), what="a heartbeat")
    push.send(enc({"type": "register", "run": "r1", "rank": 0, "world_size": 1, "host": "h0",
                   "label": "x" * 129}))
    push.send(enc(register(run="r1", label="resnet50 · lr 0.1")))
    push.send(enc(metrics(run="r1")))
    client.events("r1", until=lambda u: u.kind == "epoch")
    client.until(lambda u: getattr(u, "rejected", None) == {"schema": 1},
                         what="the schema rejection")
    runs, _ = client.snapshot("r1")
    assert [r["header"]["label"] for r in runs] == ["resnet50 · lr 0.1"]
    assert protocol.MAX_LABEL == 128
