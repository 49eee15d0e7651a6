"""Fixtures for the broker tests: a broker on ephemeral ports, feed clients, a PUSH socket.
The frame builders and the classes behind the fixtures are in ``tests/support``.

Sockets are closed with linger=0 and contexts terminated, so nothing leaks under
``filterwarnings = error``; every wait polls with a deadline (no sleeps as synchronisation).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest
import zmq

from broker.server import BrokerServer
from broker.webhooks.notifier import WebhookNotifier
from tests.support.brokers import LOOPBACK_ANY, FeedClient, RunningBroker
from tests.support.receiver import Receiver


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


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A real HTTP receiver of webhook POSTs on loopback."""
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def notifiers() -> Iterator[list[WebhookNotifier]]:
    """The webhook notifiers a test made, closed after it."""
    made: list[WebhookNotifier] = []
    yield made
    for n in made:
        n.close(timeout=5)
