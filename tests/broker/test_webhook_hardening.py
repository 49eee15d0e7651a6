"""Issue 32, findings 6 and 7 and the webhook Low items, against real sockets: a trickling
receiver holds up only its own URL and each attempt has one deadline; bodies name at most
MAX_BODY_RANKS ranks and MAX_BODY_HOSTS hosts; the queue is bounded in bytes; redirects are
refused; user:pass URLs are rejected at start; mentions and links are neutralised."""
from __future__ import annotations

import json
import time
from typing import Any, Iterator

import pytest

from broker.webhooks.notifier import (
    MAX_BODY_HOSTS,
    MAX_BODY_RANKS,
    AlertGrouper,
    WebhookNotifier,
    chat_line,
    webhook_urls,
)
from tests.support.polling import wait_for
from tests.support.receiver import Receiver, Trickler


@pytest.fixture
def trickler() -> Iterator[Trickler]:
    t = Trickler(interval=0.3)
    yield t
    t.close()


def make(notifiers: list[WebhookNotifier], urls: list[str], **kw: Any) -> WebhookNotifier:
    kw = {"window": 0.1, "retry_delays": (0.05,), "timeout": 1.0, **kw}
    n = WebhookNotifier(urls, **kw)
    notifiers.append(n.start())
    return n


def test_a_trickling_receiver_holds_up_only_its_own_url(receiver: Receiver, trickler: Trickler,
                                                       notifiers: list[WebhookNotifier]) -> None:
    """A byte every 0.3 s never trips a 1 s per-read timeout: before, the one thread sat in
    that attempt (for ever, here) and the good URL heard nothing."""
    n = make(notifiers, [trickler.url, receiver.url])
    t0 = time.monotonic()
    for i in range(3):
        n.run_ended(f"r{i}", "complete")
    wait_for(lambda: receiver.count() == 3, timeout=5.0, what="the good URL's three POSTs")
    assert time.monotonic() - t0 < 2.0
    # and the trickler's attempt ends at its 1 s deadline (failed, then retried once)
    wait_for(lambda: n.counters()["failed"] >= 1, timeout=5.0, what="the attempt's deadline")


def test_one_attempt_ends_at_its_deadline(trickler: Trickler,
                                          notifiers: list[WebhookNotifier]) -> None:
    n = make(notifiers, [trickler.url], retry_delays=())
    t0 = time.monotonic()
    n.run_ended("r", "complete")
    wait_for(lambda: n.counters()["dropped"] == 1, timeout=5.0, what="the attempt given up")
    assert time.monotonic() - t0 < 3.0  # 1 s deadline (+ scheduling), not 100,000 x 0.3 s
    assert n.counters() == {"sent": 0, "failed": 1, "dropped": 1}


def test_a_body_names_at_most_the_first_ranks_and_hosts() -> None:
    g = AlertGrouper(window=5.0)
    for rank in range(65536):
        g.alert("wide", "stale", rank, "silent", 1.0, host=f"node{rank // 8:05d}" + "h" * 240)
    (payload,) = g.due(10.0)
    assert payload["count"] == 65536
    assert payload["ranks"] == list(range(MAX_BODY_RANKS))
    assert len(payload["hosts"]) == MAX_BODY_HOSTS and payload["hosts"][0].startswith("node00000")
    assert len(json.dumps(payload)) < 128 * 1024  # it was 16.6 MiB
    assert "65,536 ranks" in payload["text"]


def test_the_queue_is_bounded_in_bytes(receiver: Receiver, notifiers: list[WebhookNotifier]) -> None:
    receiver.hang = True
    n = make(notifiers, [receiver.url], timeout=5.0, max_queue_bytes=4096)
    n.run_ended("r0", "complete")
    wait_for(lambda: receiver.count() == 1, what="the first POST in flight")
    for i in range(1, 200):
        n.run_ended(f"r{i}", "complete")
        assert n.queued_bytes() <= 4096
    assert n.counters()["dropped"] >= 150


def test_a_redirect_is_refused_not_followed(receiver: Receiver,
                                            notifiers: list[WebhookNotifier]) -> None:
    bouncer = Trickler(redirect=receiver.url)
    try:
        n = make(notifiers, [bouncer.url])
        n.run_ended("r", "complete")
        wait_for(lambda: n.counters()["dropped"] == 1, what="the redirected POST refused")
        assert n.counters() == {"sent": 0, "failed": 1, "dropped": 1}
        assert receiver.count() == 0  # the alert did not go where the 302 pointed
    finally:
        bouncer.close()


def test_user_info_in_a_url_is_refused_at_start_without_showing_it() -> None:
    with pytest.raises(ValueError) as exc:
        webhook_urls(["https://alice:s3cret@hooks.example.org/T0/B0"], {})
    assert "user:password" in str(exc.value) and "s3cret" not in str(exc.value)
    assert "alice" not in str(exc.value)


def test_mentions_and_links_are_neutralised() -> None:
    line = chat_line("r", "stalled", [1], ["h"], "stalled in @everyone <!channel> <@U123> "
                     "@here see https://evil.example/x")
    for raw in ("@everyone", "@here", "<!channel>", "<@U123>", "https://"):
        assert raw not in line
    assert "everyone" in line and "evil.example/x" in line  # still readable
    payload = AlertGrouper(window=0.0).run_ended("r", "complete", 1.0)[0]
    assert payload["allowed_mentions"] == {"parse": []}


def test_the_environments_proxy_is_used_as_urlopen_would(
        receiver: Receiver, notifiers: list[WebhookNotifier],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline-bound POST keeps urlopen's proxy rule (a cluster behind a proxy): the
    receiver stands in for the proxy and sees the absolute URL."""
    for name in ("no_proxy", "NO_PROXY", "HTTP_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", receiver.url.split("/hooks")[0])
    n = make(notifiers, ["http://hooks.invalid:81/T0/SECRET"])
    n.run_ended("r", "complete")
    wait_for(lambda: n.counters()["sent"] == 1, what="the POST through the proxy")
    assert receiver.paths == ["http://hooks.invalid:81/T0/SECRET"]
