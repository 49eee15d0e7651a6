"""Frames for the sink tests (PROTOCOL.md 2 and 3), built through the real schema, and the
small readers of a :class:`~broker.run.sink.RunSink`'s events and state that
``tests/broker/test_sink*.py`` share."""
from __future__ import annotations

import msgspec

from broker.run.sink import Event, RunSink
from rank_agent import protocol
from rank_agent.protocol import decode, encoder

RUN = "run-1"
HEADER_KEYS = [
    "run", "status", "world_size", "total_epochs", "label", "shard", "hash", "port", "metadata",
    "hardware", "has_svg", "hosts", "alerts", "started_at", "updated_at", "steps_done",
    "step_metrics", "data_share", "data_stragglers",
    "collectives_last", "total_steps", "eta_secs", "alert_ranks", "failure",
]
HEADER_KEYS += ["nonfinite", "nonfinite_more", "replica_divergence"]  # v5, 8.3
HEADER_KEYS += ["attempt", "attempts", "alert_attempts"]  # v5, 8.1


def wire(frame):
    """The frame as the broker sees it: encoded and decoded through the real schema."""
    return decode(encoder.encode(frame))


def reg(rank: int, ws: int = 2, host: str = "a", lr: int | None = None, **kw) -> protocol.Register:
    return wire(protocol.Register(run=RUN, rank=rank, world_size=ws, host=host,
                         local_rank=rank if lr is None else lr, **kw))


def met(rank: int, epoch: int, loss: float = 1.0, b: int = 1, **kw) -> protocol.Metrics:
    return wire(protocol.Metrics(run=RUN, rank=rank, epoch=epoch, avg_loss=loss, batches=b, **kw))


def fin(rank: int, status: str = "ok") -> protocol.Finish:
    return wire(protocol.Finish(run=RUN, rank=rank, status=status))


def res(rank: int, **kw) -> protocol.Resources:
    return wire(protocol.Resources(run=RUN, rank=rank, sample=protocol.ResourceSample(**kw)))


def hw(rank: int, summary: str) -> protocol.Hardware:
    return wire(protocol.Hardware(run=RUN, rank=rank, summary=summary))


def svg(rank: int, text: str, label=None, hash=None) -> protocol.Svg:
    return wire(protocol.Svg(run=RUN, rank=rank, svg=text, label=label, hash=hash))


def meta(rank: int, text: str) -> protocol.Metadata:
    return wire(protocol.Metadata(run=RUN, rank=rank, json=text))


def kinds(events: list[Event]) -> list[str]:
    return [e.kind for e in events]


def of_kind(events: list[Event], kind: str) -> list:
    return [e.data for e in events if e.kind == kind]


def registered(ws: int = 2, hosts=None, **kw) -> RunSink:
    """A sink whose ranks 0..ws-1 registered at t=0 (host of rank r: hosts[r], default "a")."""
    sink = RunSink(RUN, **kw)
    for r in range(ws):
        sink.apply(reg(r, ws, hosts[r] if hosts else "a"), 0.0)
    return sink


def state(sink: RunSink) -> bytes:
    """Everything observable about a sink, as bytes (NaN-safe equality)."""
    extra = (sink.late_metrics, sink.port_conflicts, sink.status, sink.started_at, sink.updated_at)
    return msgspec.msgpack.encode([sink.snapshot(), extra])
