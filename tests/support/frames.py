"""Wire frames for tests: real ``rank_agent.protocol`` Structs with plausible defaults, and
their bytes (a plain dict encodes too, for frames the schema must reject)."""
from __future__ import annotations

from typing import Any

from rank_agent import protocol
from rank_agent.protocol import Finish, Metadata, Metrics, Register


def enc(frame: Any) -> bytes:
    """Wire bytes of a frame Struct or a plain dict (for frames the schema must reject)."""
    return protocol.encoder.encode(frame)


def register(run: str = "r1", rank: int = 0, world_size: int = 1, **kw: Any) -> Register:
    kw.setdefault("host", "h0")
    return Register(run=run, rank=rank, world_size=world_size, **kw)


def metrics(run: str = "r1", rank: int = 0, epoch: int = 0, avg_loss: float = 1.0,
            **kw: Any) -> Metrics:
    kw.setdefault("batches", 10)
    kw.setdefault("samples", 100)
    kw.setdefault("epoch_ms", 50.0)
    return Metrics(run=run, rank=rank, epoch=epoch, avg_loss=avg_loss, **kw)


def finish(run: str = "r1", rank: int = 0, status: str = "ok") -> Finish:
    return Finish(run=run, rank=rank, status=status)


def bad_metadata(run: str = "r1", rank: int = 0) -> Metadata:
    return Metadata(run=run, rank=rank, json="{not json")
