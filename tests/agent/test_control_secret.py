"""The control thread under a secret (issue 38 finding 6), over a real PUB -> SUB channel: a
flood of unsigned requests is refused, counted and logged once, while a signed one is still
answered; a secret that is configured but unusable leaves the channel closed (never open to
anyone) with one error line; without a secret or CURVE the thread says once that anyone on
this host who binds the endpoint is obeyed, and with one, what it checks."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import pytest

from rank_agent import control as control_mod
from rank_agent.control import Control
from rank_agent.controlauth import SecretError, sign_request
from rank_agent.controlwire import ControlRequest, control_topic, encode_request
from rank_agent.ratelimit import RateLimitedLog
from tests.support.agent import Publisher, control_connected
from tests.support.polling import wait_for

RUN = "guarded"
KEY = b"s" * 64


def started(publisher: Publisher, sent: list[Any],
            secret: Callable[[], tuple[Optional[bytes], str]]) -> Control:
    c = Control(publisher.endpoint, RUN, 0, sent.append, socket_options=lambda: None,
                secret=secret)
    c.start()
    publisher.wait_subscriptions([control_topic(RUN)])
    return c


@pytest.fixture(autouse=True)
def fresh_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another test of this process may have said a line for the same key or endpoint."""
    monkeypatch.setattr(control_mod, "_rlog",
                        RateLimitedLog(control_mod.log, control_mod.WARN_INTERVAL_S))
    monkeypatch.setattr(control_mod, "_TRUST_SAID", set())


def test_unsigned_requests_are_refused_counted_and_logged_once(
        publisher: Publisher, caplog: pytest.LogCaptureFixture) -> None:
    sent: list[Any] = []
    with caplog.at_level(logging.INFO, logger="rank_agent.control"):
        c = started(publisher, sent, lambda: (KEY, "/the/secret"))
        try:
            for i in range(300):
                publisher.sock.send_multipart(encode_request(ControlRequest(
                    run=RUN, request_id=f"plain-{i}", kind="stacks")))
            wait_for(lambda: c.refused["unsigned"] > 0, timeout=10.0, what="a refusal")
            n = 0

            def signed_answered() -> bool:  # again if the SUB's queue dropped it in the flood
                nonlocal n
                n += 1
                publisher.sock.send_multipart(sign_request(KEY, ControlRequest(
                    run=RUN, request_id=f"signed-{n}", kind="stacks"), time.time()))
                return any(f.request_id.startswith("signed-") for f in sent)

            wait_for(signed_answered, timeout=20.0, what="a signed request answered")
        finally:
            c.close()
    assert not any(f.request_id.startswith("plain-") for f in sent)
    assert c.refused["unsigned"] >= 64 and c.refused["bad_mac"] == 0  # at least the SUB's queue
    refusals = [r for r in caplog.records if "control message refused (unsigned)" in r.getMessage()]
    assert len(refusals) == 1
    said = [r.getMessage() for r in caplog.records if "control channel" in r.getMessage()]
    assert said == [f"rankboard: control channel {publisher.endpoint}: only requests signed "
                    "with the broker's secret (/the/secret) are obeyed"]


def test_a_secret_that_cannot_be_used_leaves_the_channel_closed(
        publisher: Publisher, caplog: pytest.LogCaptureFixture) -> None:
    def unusable() -> tuple[Optional[bytes], str]:
        raise SecretError("cannot read control secret /nope: No such file or directory")

    sent: list[Any] = []
    c = Control(publisher.endpoint, RUN, 0, sent.append, socket_options=lambda: None,
                secret=unusable)
    with caplog.at_level(logging.ERROR, logger="rank_agent.control"):
        c.start()
        wait_for(lambda: not c.running, timeout=10.0, what="the channel closing")
    c.close()
    assert not control_connected(c, 0)  # it never subscribed: no request can reach it
    assert [r.getMessage() for r in caplog.records] == [
        "rankboard: cannot read control secret /nope: No such file or directory; this rank "
        "will not answer requests for stacks"]
    assert sent == []


def test_without_a_secret_or_curve_it_says_anyone_here_is_obeyed_once(
        publisher: Publisher, caplog: pytest.LogCaptureFixture) -> None:
    sent: list[Any] = []
    # said once, at INFO: the broker and `up` say the trust model to the user; a WARNING
    # from every rank of every job would be 1,024 lines for 1,024 ranks
    with caplog.at_level(logging.INFO, logger="rank_agent.control"):
        for _ in range(2):  # the second joins late (the XPUB saw this topic already): ask again
            c = started(publisher, sent, lambda: (None, "no secret here"))
            n = len(sent)
            wait_for(lambda n=n: publisher.request(RUN, "plain") and len(sent) > n, timeout=10.0,
                     what="a plain request obeyed")
            c.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and "not authenticated" in r.getMessage()]
    warned = [r.getMessage() for r in caplog.records if "not authenticated" in r.getMessage()]
    assert warned == [f"rankboard: control channel {publisher.endpoint} is not authenticated "
                      "(no secret here): any process on this host that binds it can ask this "
                      "rank for stacks and profiles; set RANKBOARD_CONTROL_SECRET_FILE to the "
                      "broker's control.secret, or use CURVE"]
