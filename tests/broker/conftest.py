"""Fixtures for the broker tests: frame builders, a broker on ephemeral ports, feed clients.

Sockets are closed with linger=0 and contexts terminated, so nothing leaks under
``filterwarnings = error``; every wait polls with a deadline (no sleeps as synchronisation).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

import pytest
import zmq

from broker import feed
from broker.server import BrokerServer
from rank_agent import protocol
from rank_agent.protocol import Finish, Metadata, Metrics, Register
from tests import polling

LOOPBACK_ANY = "tcp://127.0.0.1:*"


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


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """:func:`tests.polling.wait_for`, polling every 5 ms (socket round trips are fast)."""
    return polling.wait_for(predicate, timeout, what, interval=0.005)


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


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


@pytest.fixture
def start_broker() -> Iterator[Callable[..., RunningBroker]]:
    """Factory: ``start_broker(**BrokerServer kwargs)``; every broker is stopped at teardown."""
    started: list[RunningBroker] = []

    def start(**kw: Any) -> RunningBroker:
        kw.setdefault("heartbeat_interval", 0.1)
        kw.setdefault("poll_interval", 0.02)
        server = BrokerServer(LOOPBACK_ANY, LOOPBACK_ANY, LOOPBACK_ANY, **kw)
        rb = RunningBroker(server)
        started.append(rb)
        return rb

    yield start
    for rb in started:
        if rb.thread.is_alive() or not rb.server._closed:
            rb.stop()


@pytest.fixture
def broker(start_broker: Callable[..., RunningBroker]) -> RunningBroker:
    return start_broker()


@pytest.fixture
def client(ctx: zmq.Context, broker: RunningBroker) -> Iterator[FeedClient]:
    c = FeedClient(ctx, broker.endpoints["publish"], broker.endpoints["snapshot"])
    yield c
    c.close()


@pytest.fixture
def push(ctx: zmq.Context, broker: RunningBroker) -> Iterator[zmq.Socket]:
    """A plain PUSH socket to the broker (stand-in for a rank; not the RankAgent)."""
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    sock.connect(broker.endpoints["ingest"])
    yield sock
    sock.close(linger=0)
