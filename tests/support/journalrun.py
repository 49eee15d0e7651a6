"""A small harness that plays the broker's part for the journal tests: ``sink.apply``, then
``journal.accept``, ``flush`` per batch, with a fake clock; a plausible run to feed it, and
readers of the files it writes. Shared by ``tests/broker/test_journal*.py``."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import msgspec

from broker.journal import codec
from broker.journal.journal import HEADER, Journal, read_entries
from broker.run.sink import Rejected, RunSink
from rank_agent import protocol

REPO = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000.0


def same(a: Any, b: Any) -> bool:
    """Deep equality where NaN equals NaN (records keep a NaN loss as a float NaN)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def sample(rank: int, k: int) -> protocol.ResourceSample:
    return protocol.ResourceSample(
        cpu_percent=float(k % 100), ram_used_bytes=1000 + k, ram_total_bytes=10_000,
        gpu_util_percent=float((k * 7) % 100), vram_allocated_bytes=500 + k,
        vram_total_bytes=8000,
        gpus=[protocol.GpuSample(device_index=rank % 2, name="H200", util_percent=float(k % 50))],
    )


class Server:
    """The server's part, without sockets: apply, record, note_seq; flush per batch."""

    def __init__(self, data_dir: Path, *, now: float = T0, stale_after: float = 30.0,
                 **kw: Any) -> None:
        self.journal = Journal(data_dir, **kw)
        self.sinks: dict[str, RunSink] = self.journal.load(stale_after=stale_after)
        self.stale_after = stale_after
        self.now = now
        self.issued: dict[str, int] = {}  # highest id published per run
        self.events: list[tuple[str, Any]] = []

    def send(self, frame: protocol.Frame, *, dt: float = 0.5, flush: bool = True) -> bool:
        """One frame received ``dt`` seconds after the previous one; False if rejected."""
        self.now += dt
        raw = protocol.encoder.encode(frame)
        decoded = protocol.decode(raw)
        sink = self.sinks.get(decoded.run)
        if sink is None:
            sink = RunSink(decoded.run, stale_after=self.stale_after)
        try:
            events = sink.apply(decoded, self.now)
        except Rejected:
            return False
        self.sinks[decoded.run] = sink
        self.journal.accept(sink, raw, decoded, self.now)
        self._publish(sink, events)
        if flush:
            self.journal.flush()
        return True

    def tick(self) -> None:
        for sink in self.sinks.values():
            self._publish(sink, sink.tick(self.now))
        self.journal.flush()

    def _publish(self, sink: RunSink, events: list[Any]) -> None:
        for ev in events:
            assert ev.seq > self.issued.get(sink.run, 0)
            self.issued[sink.run] = ev.seq
            self.events.append((sink.run, ev))
        self.journal.note_seq(sink)

    def close(self) -> None:
        self.journal.close()


def crash_copy(data_dir: Path, tmp_path: Path, name: str = "after-crash") -> Path:
    """What a SIGKILL leaves behind: the bytes written so far (held ones are lost)."""
    dest = tmp_path / name
    shutil.copytree(data_dir, dest)
    return dest


def reload(data_dir: Path, **kw: Any) -> tuple[Journal, dict[str, RunSink]]:
    j = Journal(data_dir, **kw)
    return j, j.load()


def training(srv: Server, run: str = "r1", *, ranks: int = 3, epochs: int = 4,
             samples_per_epoch: int = 3, finish: bool = False) -> None:
    """A plausible run: registers, svg, metadata, hardware, sampling and metrics."""
    for r in range(ranks):
        assert srv.send(protocol.Register(run=run, rank=r, world_size=ranks, host=f"h{r // 2}",
                                 local_rank=r % 2, port=8600, total_epochs=epochs, pid=100 + r))
        assert srv.send(protocol.Hardware(run=run, rank=r, summary=f"cpu{r // 2} | gpu{r}"))
    assert srv.send(protocol.Svg(run=run, rank=0, svg="<svg/>", label="net", hash="abc"))
    assert srv.send(protocol.Metadata(run=run, rank=0, json='{"lr": 0.1}'))
    k = 0
    for e in range(epochs):
        for _ in range(samples_per_epoch):
            for r in range(ranks):
                k += 1
                assert srv.send(protocol.Resources(run=run, rank=r, sample=sample(r, k)), dt=0.2)
        srv.tick()
        for r in range(ranks):
            loss = math.nan if (e == 1 and r == 0) else 1.0 / (e + 1) + r
            assert srv.send(protocol.Metrics(run=run, rank=r, epoch=e, avg_loss=loss, batches=10 + r,
                                    samples=100, epoch_ms=1000.0 + r,
                                    scalars={"acc": (0.5 * (r + 1), 1)}))
    if finish:
        for r in range(ranks):
            assert srv.send(protocol.Finish(run=run, rank=r, status="error" if r == 2 else "ok"))


def frame_entries(path: Path) -> list[protocol.Frame]:
    data = path.read_bytes()
    assert data.startswith(HEADER)
    entries, _, problem = read_entries(data[len(HEADER):])
    assert problem is None
    return [protocol.decode(bytes(p[8:])) for kind, p in entries if kind == codec.KIND_FRAME]


def journal_path(data_dir: Path, run: str) -> Path:
    return data_dir / "runs" / f"{run}.journal"


def state_parts(data_dir: Path, run: str) -> dict[str, Any]:
    """The last STATE part of each kind in ``run``'s journal (PROTOCOL 8.5), decoded: what a
    restart will restore (a test waits for it instead of sleeping)."""
    raw = journal_path(data_dir, run).read_bytes()
    out: dict[str, Any] = {}
    for kind, payload in codec.scan_entries(raw[len(HEADER):]).entries:
        if kind == codec.KIND_STATE:
            out[codec.STATE_PARTS[payload[0]]] = msgspec.msgpack.decode(bytes(payload[1:]))
    return out
