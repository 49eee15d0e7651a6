"""A real broker in a thread of the test process, the web's side of its feed, and a raw PUSH
socket for ranks: all on ephemeral loopback endpoints, sockets closed with ``linger=0`` so
nothing leaks under ``filterwarnings = error``.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import zmq

from broker import feed
from broker.server import BrokerServer
from rank_agent import protocol

#: Any free port on loopback, for a ZeroMQ endpoint.
LOOPBACK_ANY = "tcp://127.0.0.1:*"


class Broker:
    """A BrokerServer serving in a thread; ``restart()`` keeps its endpoints and data dir."""

    def __init__(self, data_dir: Path, endpoints: Optional[dict[str, str]] = None) -> None:
        self.data_dir = data_dir
        eps = endpoints or {"ingest": LOOPBACK_ANY, "publish": LOOPBACK_ANY,
                            "snapshot": LOOPBACK_ANY}
        self.server = BrokerServer(eps["ingest"], eps["publish"], eps["snapshot"],
                                   data_dir=data_dir, stale_after=30.0)
        self.endpoints = self.server.bind()
        self.thread = threading.Thread(target=self.server.serve_forever, name="broker", daemon=True)
        self.thread.start()

    @property
    def ingest(self) -> str:
        return self.endpoints["ingest"]

    @property
    def publish(self) -> str:
        return self.endpoints["publish"]

    @property
    def snapshot(self) -> str:
        return self.endpoints["snapshot"]

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(10)
        self.server.close()

    def restart(self) -> Broker:
        self.stop()
        return Broker(self.data_dir, self.endpoints)


class BrokerRef:
    """What the web tests' ``broker`` fixture hands out: delegates to the current
    :class:`Broker`, survives ``restart()``."""

    def __init__(self, holder: dict[str, Broker]) -> None:
        self._holder = holder

    def restart(self) -> None:
        self._holder["b"] = self._holder["b"].restart()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._holder["b"], name)


class RunningBroker:
    """A BrokerServer serving in a thread on ephemeral loopback ports."""

    def __init__(self, server: BrokerServer) -> None:
        self.server = server
        self.endpoints = server.bind()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="broker", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.server.serve_forever()
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(10)
        assert not self.thread.is_alive(), "broker loop did not stop"
        self.server.close()
        if self.error is not None:
            raise self.error


class FeedClient:
    """The web's side of the feed, minimal: a SUB to everything plus a DEALER for snapshots."""

    def __init__(self, ctx: zmq.Context, publish: str, snapshot: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.linger = 0
        self.sub.rcvhwm = 0
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(publish)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.linger = 0
        self.dealer.connect(snapshot)

    def recv(self, timeout: float = 10.0) -> feed.Update:
        """Next decoded feed update (heartbeats included), or fail after ``timeout``."""
        if not self.sub.poll(int(timeout * 1000)):
            pytest.fail(f"no feed message within {timeout:.1f} s")
        update = feed.decode_update(self.sub.recv_multipart())
        assert update is not None
        return update

    def until(self, predicate: Callable[[feed.Update], bool], timeout: float = 10.0,
              what: str = "feed update") -> tuple[feed.Update, list[feed.Update]]:
        """Read until an update matches; returns it and everything read before it."""
        deadline = time.monotonic() + timeout
        seen: list[feed.Update] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"timed out waiting for {what}; saw {seen[-5:]!r}")
            update = self.recv(left)
            if predicate(update):
                return update, seen
            seen.append(update)

    def events(self, run: str, until: Callable[[feed.EventUpdate], bool],
               timeout: float = 10.0) -> list[feed.EventUpdate]:
        """The run's events up to and including the first matching ``until``."""
        out: list[feed.EventUpdate] = []

        def pred(u: feed.Update) -> bool:
            if isinstance(u, feed.EventUpdate) and u.run == run:
                out.append(u)
                return until(u)
            return False

        self.until(pred, timeout, what=f"event of {run}")
        return out

    def snapshot(self, run: str | None = None, timeout: float = 10.0
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Request a snapshot: (run snapshots, END info)."""
        self.dealer.send_multipart(feed.encode_snapshot_request(run))
        runs: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.dealer.poll(int(left * 1000)):
                pytest.fail("no snapshot reply")
            kind, body = feed.decode_snapshot_reply(self.dealer.recv_multipart())
            if kind == "END":
                assert body["runs"] == len(runs)
                return runs, body
            runs.append(body)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)


class Pusher:
    """A raw PUSH socket sending real wire frames (rank_agent.protocol) to the broker."""

    def __init__(self, ingest: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.linger = 0
        self.sock.connect(ingest)

    def send(self, *frames: Any) -> None:
        for frame in frames:
            self.sock.send(protocol.encoder.encode(frame))

    def register(self, run: str, rank: int, world_size: int, host: str = "node-a",
                 **kw: Any) -> None:
        self.send(protocol.Register(run=run, rank=rank, world_size=world_size, host=host,
                                    local_rank=kw.pop("local_rank", rank), **kw))

    def epoch(self, run: str, epoch: int, world_size: int, loss: float = 1.0,
              scalars: Optional[dict[str, tuple[float, int]]] = None, **kw: Any) -> None:
        for rank in range(world_size):
            self.send(protocol.Metrics(run=run, rank=rank, epoch=epoch, avg_loss=loss, batches=10,
                                       samples=640, epoch_ms=100.0, scalars=scalars or {}, **kw))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
