"""Issue 32, finding 8, over a real PUB -> SUB channel: the control thread's warnings are
rate-limited (20,000 malformed messages are not 20,000 lines on the training job's
stderr), ``close()`` stops the thread even while a flood goes on, and an endpoint obeyed
without CURVE that is not the broker's own is warned about once."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from rank_agent import control as control_mod
from rank_agent.control import Control, squatter_warning
from rank_agent.controlwire import control_topic
from rank_agent.ratelimit import RateLimitedLog
from tests.support.agent import Publisher
from tests.support.polling import wait_for

RUN = "flood"


def started(publisher: Publisher, sent: list[Any], **kw: Any) -> Control:
    c = Control(publisher.endpoint, RUN, 0, sent.append, socket_options=lambda: None, **kw)
    c.start()
    publisher.wait_subscriptions([control_topic(RUN)])
    return c


def garbage(publisher: Publisher, n: int) -> None:
    for i in range(n):
        publisher.sock.send_multipart([control_topic(RUN), b"\xc1not msgpack %d" % i])


def test_a_flood_of_malformed_messages_is_a_few_lines(
        publisher: Publisher, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a fresh limiter: another test of this process may have logged the key just now
    monkeypatch.setattr(control_mod, "_rlog",
                        RateLimitedLog(control_mod.log, control_mod.WARN_INTERVAL_S))
    sent: list[Any] = []
    c = started(publisher, sent)
    try:
        with caplog.at_level(logging.WARNING, logger="rank_agent.control"):
            for _ in range(20):  # 20,000 in all
                garbage(publisher, 1000)

            def answered() -> bool:
                # asked again on every poll: a request sent into a full queue is dropped
                # (the SUB's high-water mark), as any message of the flood may be
                publisher.request(RUN, "last")
                return any(f.request_id == "last" for f in sent)

            wait_for(answered, timeout=20.0, what="a request sent after the flood answered")
        lines = [r for r in caplog.records if "ignoring a control message" in r.getMessage()]
        assert 1 <= len(lines) <= 3, len(lines)
    finally:
        c.close()


def test_close_stops_the_thread_while_a_flood_goes_on(publisher: Publisher,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control_mod, "_rlog",
                        RateLimitedLog(control_mod.log, control_mod.WARN_INTERVAL_S))
    sent: list[Any] = []
    c = started(publisher, sent)
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            garbage(publisher, 200)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        wait_for(lambda: control_mod._rlog._keys.get("bad") is not None, timeout=10.0,
                 what="the flood reaching the control thread")
        thread = c._thread
        t0 = time.monotonic()
        c.close(timeout=3.0)
        assert time.monotonic() - t0 < 2.0
        assert thread is not None and not thread.is_alive()
    finally:
        stop.set()
        flooder.join(5)


def test_a_plain_endpoint_that_is_not_the_brokers_is_warned_about_once(
        publisher: Publisher, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control_mod, "_WARNED", set())
    port = int(publisher.endpoint.rsplit(":", 1)[1])
    with caplog.at_level(logging.WARNING, logger="rank_agent.control"):
        for _ in range(2):
            c = started(publisher, [], broker=f"tcp://127.0.0.1:{port + 5}")
            c.close()
        own = started(publisher, [], broker=f"tcp://127.0.0.1:{port - 1}")  # port + 1: its own
        own.close()
    warned = [r for r in caplog.records if "not the broker's publish socket" in r.getMessage()]
    assert len(warned) == 1


def test_squatter_warning_rules() -> None:
    assert squatter_warning("tcp://h:5586", "tcp://h:5585", plain=True) is None
    assert squatter_warning("tcp://h:7000", "tcp://h:5585", plain=False) is None  # CURVE
    assert "CURVE" in (squatter_warning("tcp://h:7000", "tcp://h:5585", plain=True) or "")
