"""Builders for the step tests (PROTOCOL.md 2.4): frames through the real schema, and a
:class:`Drive` that feeds a :class:`~broker.run.sink.RunSink` with a fake clock and keeps every
event and published step record. Shared by ``tests/broker/test_step_*.py``."""
from __future__ import annotations

from typing import Any, Iterable, Optional

import msgspec

from broker.run.sink import Event, RunSink
from broker.run.steps.closer import StepCloser
from broker.run.steps.store import wire_records
from rank_agent.protocol import Finish, Register, Steps, decode, encoder

RUN = "steps-run"
T0 = 1_000.0



def wire(frame: Any) -> Any:
    """The frame as the broker sees it: encoded and decoded through the real schema."""
    return decode(encoder.encode(frame))


def stp(rank: int, steps: Iterable[int], *, ms: Any = 100.0, times: Any = None,
        samples: Optional[list[int]] = None, tokens: Optional[list[int]] = None,
        metrics: Optional[dict[str, list[Optional[float]]]] = None, loss: Any = None,
        run: str = RUN) -> Steps:
    """A steps frame of ``rank``. ``ms`` / ``loss``: a list, or one value for every point;
    ``times`` default: T0 + step."""
    s = list(steps)
    n = len(s)
    step_ms = list(ms) if isinstance(ms, (list, tuple)) else [ms] * n
    m = dict(metrics or {})
    if loss is not None:
        m["loss"] = list(loss) if isinstance(loss, (list, tuple)) else [loss] * n
    return wire(Steps(run=run, rank=rank, steps=s,
                      times=list(times) if times is not None else [T0 + x for x in s],
                      step_ms=step_ms, samples=samples or [], tokens=tokens or [], metrics=m))


def reg(rank: int, ws: int, run: str = RUN) -> Register:
    return wire(Register(run=run, rank=rank, world_size=ws, host="h", local_rank=rank))


def fin(rank: int, status: str = "ok") -> Finish:
    return wire(Finish(run=RUN, rank=rank, status=status))


def numbers(records: list[dict[str, Any]]) -> list[int]:
    return [r["step"] for r in records]


def same(a: Any, b: Any) -> bool:
    """Equality where NaN equals NaN."""
    return msgspec.msgpack.encode(a) == msgspec.msgpack.encode(b)


class Drive:
    """A RunSink with a fake clock, keeping every event and every published step record."""

    def __init__(self, ws: Optional[int] = None, *, t: float = 0.0, **kw: Any) -> None:
        kw.setdefault("step_close_after", 1000.0)
        self.sink = RunSink(RUN, **kw)
        self.events: list[tuple[float, Event]] = []
        self.t = t
        if ws is not None:
            for r in range(ws):
                self.send(reg(r, ws))

    def send(self, frame: Any, t: Optional[float] = None) -> list[Event]:
        if t is not None:
            self.t = t
        events = self.sink.apply(frame, self.t)
        self.events += [(self.t, e) for e in events]
        return events

    def tick(self, t: Optional[float] = None) -> list[Event]:
        if t is not None:
            self.t = t
        events = self.sink.tick(self.t)
        self.events += [(self.t, e) for e in events]
        return events

    @property
    def records(self) -> list[dict[str, Any]]:
        return [r for _, e in self.events if e.kind == "steps" for r in wire_records(e.data)]

    @property
    def closed(self) -> list[int]:
        return numbers(self.records)

    def rank(self, rank: int) -> dict[str, Any]:
        return next(r for r in self.sink.ranks() if r["rank"] == rank)


def closer_with(*frames: tuple[Steps, float], grace: float = 0.0,
                close_after: float = 1000.0) -> StepCloser:
    c = StepCloser(close_after=close_after, grace=grace)
    for frame, t in frames:
        c.add(frame, t, True)
    return c
