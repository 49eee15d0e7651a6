"""Alert webhooks (PROTOCOL.md section 3.1): the pure grouper with an injected clock, then the
delivery thread against a real HTTP receiver on loopback (``http.server`` in a thread).

Waits poll with a deadline; retry delays, the grouping window and the timeout are
constructor arguments, so nothing here sleeps to synchronise.
"""
from __future__ import annotations

import logging
import socket
import time
from typing import Any

import pytest

from broker.webhooks.notifier import (
    AlertGrouper,
    WebhookNotifier,
    chat_line,
    redact,
    run_link,
    webhook_urls,
)
from tests.support.polling import wait_for

FIRING_KEYS = {"status", "run", "kind", "ranks", "hosts", "count", "message", "at", "url", "text", "content",
               "allowed_mentions"}  # issue 32: Discord told to ping nobody

# -- the pure grouper ---------------------------------------------------------------------------


def test_alerts_of_one_run_and_kind_within_the_window_are_one_payload():
    g = AlertGrouper(window=5.0, public_url="https://board.example.org/")
    for rank in range(1024):
        g.alert("run-7", "stale", 1023 - rank, f"rank {1023 - rank} stale", 100.0 + rank * 0.004,
                host=f"node{(1023 - rank) // 8:03d}")
    g.alert("run-7", "stalled", 3, "stalled 75s in all_reduce (dist.py:10)", 101.0, host="node000")
    assert g.due(104.99) == []
    assert g.next_due() == 105.0
    (stale,) = g.due(105.0)
    assert set(stale) == FIRING_KEYS
    assert stale["status"] == "firing" and stale["kind"] == "stale" and stale["run"] == "run-7"
    assert stale["ranks"] == list(range(1024)) and stale["count"] == 1024
    assert stale["hosts"] == [f"node{i:03d}" for i in range(128)]
    assert stale["message"] == "rank 1023 stale"  # the first alert's
    assert stale["at"] == 100.0
    assert stale["url"] == "https://board.example.org/#run=run-7"
    assert stale["text"] == stale["content"] == "[rankboard] run-7: stale on 1,024 ranks (node000…): rank 1023 stale"
    (stalled,) = g.due(106.0)
    assert stalled["ranks"] == [3] and stalled["count"] == 1
    assert stalled["text"] == "[rankboard] run-7: stalled on rank 3 (node000): stalled 75s in all_reduce (dist.py:10)"
    assert g.due(1000.0) == [] and g.next_due() is None


def test_an_alert_after_the_window_opens_a_new_group():
    g = AlertGrouper(window=5.0)
    g.alert("r", "stale", 0, "m", 0.0)
    g.alert("r", "stale", 1, "m", 4.9)
    (first,) = g.due(5.0)
    assert first["ranks"] == [0, 1]
    g.alert("r", "stale", 2, "m", 5.1)
    (second,) = g.due(10.1)
    assert second["ranks"] == [2] and second["url"] is None


def test_repeat_suppression_per_run_kind_rank():
    g = AlertGrouper(window=5.0, repeat=3600.0)
    assert g.alert("r", "gpu_xid", 1, "XID 79 on GPU 0", 0.0)
    assert g.due(5.0)[0]["ranks"] == [1]
    assert not g.alert("r", "gpu_xid", 1, "XID 79 on GPU 0", 60.0)  # posted less than an hour ago
    assert g.alert("r", "gpu_xid", 2, "XID 79 on GPU 0", 60.0)  # another rank
    assert g.alert("r", "gpu_ecc", 1, "1 uncorrected ECC errors on GPU 0", 60.0)  # another kind
    assert g.alert("other", "gpu_xid", 1, "XID 79 on GPU 0", 60.0)  # another run
    assert {(p["run"], p["kind"], tuple(p["ranks"])) for p in g.due(65.0)} == {
        ("r", "gpu_xid", (2,)), ("r", "gpu_ecc", (1,)), ("other", "gpu_xid", (1,))}
    assert g.due(3600.0) == []  # not raised again: nothing to post
    assert g.alert("r", "gpu_xid", 1, "XID 79 on GPU 0", 3600.0)  # an hour later, raised again
    assert g.due(3605.0)[0]["ranks"] == [1]
    # repeat memory is swept, so it stays bounded
    g.due(100_000.0)
    assert g._posted == {}


def test_run_wide_alerts_have_no_ranks_and_group_and_repeat_per_run_and_kind():
    g = AlertGrouper(window=5.0, repeat=100.0)
    assert g.alert("r", "nonfinite_loss", None, "epoch 3: loss is nan", 0.0)
    assert not g.alert("r", "nonfinite_loss", None, "epoch 4: loss is nan", 1.0)
    (p,) = g.due(5.0)
    assert (p["ranks"], p["hosts"], p["count"], p["message"]) == ([], [], 0, "epoch 3: loss is nan")
    assert p["text"] == "[rankboard] r: nonfinite_loss: epoch 3: loss is nan"


def test_a_rank_without_a_host_adds_nothing_to_hosts():
    g = AlertGrouper(window=1.0)
    g.alert("r", "stale", 0, "m", 0.0, host=None)
    g.alert("r", "stale", 1, "m", 0.0, host="b")
    g.alert("r", "stale", 2, "m", 0.0, host="a")
    (p,) = g.due(1.0)
    assert p["hosts"] == ["a", "b"] and p["ranks"] == [0, 1, 2]


def test_run_end_posts_open_groups_then_resolved_at_once():
    g = AlertGrouper(window=5.0, public_url="http://h:8585")
    g.alert("r:1", "rank_error", 0, "rank 0 finished with error", 10.0)
    g.alert("r:2", "stale", 0, "m", 10.0)
    out = g.run_ended("r:1", "failed", 11.0)
    assert [p["status"] for p in out] == ["firing", "resolved"]
    resolved = out[1]
    assert set(resolved) == FIRING_KEYS
    assert resolved == {"status": "resolved", "run": "r:1", "kind": "run_failed", "ranks": [], "hosts": [],
                        "count": 0, "message": "run failed", "at": 11.0, "url": "http://h:8585/#run=r%3A1",
                        "text": "[rankboard] r:1: run failed", "content": "[rankboard] r:1: run failed",
                        "allowed_mentions": {"parse": []}}
    assert g.run_ended("r:2", "complete", 12.0)[-1]["kind"] == "run_complete"
    assert g.next_due() is None
    # the ended run's repeat memory is gone: a reopened run alerts afresh
    assert g.alert("r:1", "rank_error", 0, "again", 20.0)


def test_run_link_percent_encodes_all_but_unreserved():
    assert run_link(None, "x") is None
    assert run_link("https://b.example/dash/", "A-z.0_9~:x") == "https://b.example/dash/#run=A-z.0_9~%3Ax"
    assert run_link("https://b.example", "..a") == "https://b.example/#run=..a"


def test_chat_line_forms():
    assert chat_line("r", "stale", [], [], "m") == "[rankboard] r: stale: m"
    assert chat_line("r", "stale", [5], [], "m") == "[rankboard] r: stale on rank 5: m"
    assert chat_line("r", "stale", [1, 2], ["a", "b"], "m") == "[rankboard] r: stale on 2 ranks (a…): m"
    long = chat_line("r", "stalled", [1], [], "x" * 5000)  # Discord refuses content over 2,000
    assert len(long) == 2000 and long.endswith("x…")


def test_urls_from_flags_and_environment_and_redaction():
    env = {"RANKBOARD_ALERT_WEBHOOK": " https://hooks.slack.com/services/T0/B0/SECRET\n"
                                      "https://discord.com/api/webhooks/1/TOKEN  "}
    urls = webhook_urls(["http://127.0.0.1:9/x?token=abc", "https://discord.com/api/webhooks/1/TOKEN"], env)
    assert urls == ["http://127.0.0.1:9/x?token=abc", "https://discord.com/api/webhooks/1/TOKEN",
                    "https://hooks.slack.com/services/T0/B0/SECRET"]
    assert webhook_urls([], {}) == []
    assert redact("https://user:pw@hooks.slack.com/services/T0/B0/SECRET?x=1#f") == "https://hooks.slack.com"
    assert redact("http://[::1]:8080/secret") == "http://[::1]:8080"
    for bad in ("ftp://h/SECRET", "hooks.slack.com/SECRET", "http:///SECRET", "http://h:99999/SECRET"):
        with pytest.raises(ValueError) as info:
            webhook_urls([bad], {})
        assert "SECRET" not in str(info.value)


# -- a real receiver ----------------------------------------------------------------------------


FAST = {"window": 0.2, "retry_delays": (0.02, 0.04, 0.08), "timeout": 2.0}


def make(notifiers: list[WebhookNotifier], urls: list[str], **kw: Any) -> WebhookNotifier:
    n = WebhookNotifier(urls, **{**FAST, **kw})
    notifiers.append(n.start())
    return n


def test_1024_stale_ranks_are_one_post(receiver, notifiers):
    n = make(notifiers, [receiver.url], public_url="https://board.example.org")
    for rank in range(1024):
        n.alert("run-7", "stale", rank, f"rank {rank} stale", host=f"node{rank // 8:03d}")
    wait_for(lambda: n.counters()["sent"] == 1, what="the grouped POST")
    wait_for(lambda: n.pending() == 0, what="an idle notifier")
    assert receiver.count() == 1
    (post,) = receiver.posts
    assert post["type"] == "application/json"
    body = post["body"]
    assert body["count"] == 1024 and body["ranks"] == list(range(1024)) and len(body["hosts"]) == 128
    assert n.counters() == {"sent": 1, "failed": 0, "dropped": 0}


def test_slack_and_discord_style_receivers_read_text_and_content(receiver, notifiers):
    slack, discord = receiver.url + "/slack", receiver.url + "/discord"
    n = make(notifiers, [slack, discord], public_url="http://localhost:8585/")
    n.alert("run-7", "stalled", 3, "stalled 75s in all_reduce (dist.py:10)", host="node001")
    wait_for(lambda: n.counters()["sent"] == 2, what="one POST per URL")
    assert sorted(receiver.paths) == sorted(["/hooks/T000/SECRET-TOKEN/slack", "/hooks/T000/SECRET-TOKEN/discord"])
    a, b = (p["body"] for p in receiver.posts)
    assert a == b and set(a) == FIRING_KEYS
    line = "[rankboard] run-7: stalled on rank 3 (node001): stalled 75s in all_reduce (dist.py:10)"
    assert a["text"] == line  # what Slack-style incoming webhooks read
    assert a["content"] == line  # what Discord-style incoming webhooks read
    assert a["url"] == "http://localhost:8585/#run=run-7"
    assert isinstance(a["at"], float) and abs(a["at"] - time.time()) < 60


def test_run_end_posts_resolved_at_once(receiver, notifiers):
    n = make(notifiers, [receiver.url], window=60.0)
    n.alert("r", "rank_error", 1, "rank 1 finished with error")
    n.run_ended("r", "failed")
    wait_for(lambda: receiver.count() == 2, what="the open group and resolved")  # not 60 s later
    assert [p["body"]["status"] for p in receiver.posts] == ["firing", "resolved"]
    assert receiver.posts[1]["body"]["kind"] == "run_failed"


@pytest.mark.parametrize("status", [500, 503, 429])
def test_retry_after_a_server_error_or_429(receiver, notifiers, status):
    receiver.statuses = [status]
    n = make(notifiers, [receiver.url])
    n.run_ended("r", "complete")
    wait_for(lambda: n.counters()["sent"] == 1, what="the retried POST")
    assert receiver.count() == 2
    assert receiver.posts[0]["body"] == receiver.posts[1]["body"]
    assert n.counters() == {"sent": 1, "failed": 1, "dropped": 0}


def test_three_retries_then_dropped(receiver, notifiers):
    receiver.statuses = [502] * 10
    n = make(notifiers, [receiver.url])
    n.run_ended("r", "complete")
    wait_for(lambda: n.counters()["dropped"] == 1, what="the POST given up")
    assert receiver.count() == 4  # the first try and three retries
    assert n.counters() == {"sent": 0, "failed": 4, "dropped": 1}


def test_a_4xx_other_than_429_is_not_retried(receiver, notifiers):
    receiver.statuses = [404]
    n = make(notifiers, [receiver.url])
    n.run_ended("r", "complete")
    wait_for(lambda: n.counters()["dropped"] == 1, what="the refused POST")
    wait_for(lambda: n.pending() == 0, what="an idle notifier")
    assert receiver.count() == 1 and n.counters()["failed"] == 1


def test_a_receiver_that_is_down_is_retried_then_dropped_and_its_secret_never_logged(notifiers, caplog):
    with socket.socket() as bound:  # bound but not listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}/hooks/SECRET-TOKEN?key=SECRET2"
        with caplog.at_level(logging.DEBUG, logger="broker.webhooks.notifier"):
            n = make(notifiers, [url])
            n.run_ended("r", "complete")
            wait_for(lambda: n.counters()["dropped"] == 1, what="the undeliverable POST dropped")
            n.close()
    assert n.counters() == {"sent": 0, "failed": 4, "dropped": 1}
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"http://127.0.0.1:{url.split(':')[2].split('/')[0]}" in text
    assert "SECRET" not in text and "/hooks" not in text


def test_a_hanging_receiver_never_blocks_the_caller(receiver, notifiers):
    receiver.hang = True
    n = make(notifiers, [receiver.url], timeout=0.3, window=0.05)
    n.run_ended("first", "complete")
    wait_for(lambda: receiver.count() == 1, what="the first POST in flight")
    worst = 0.0
    t0 = time.perf_counter()
    for i in range(20000):  # what a broker raising alerts for a big run does meanwhile
        t = time.perf_counter()
        n.alert(f"run{i % 50}", "stale", i, "stale")
        worst = max(worst, time.perf_counter() - t)
    total = time.perf_counter() - t0
    assert total < 2.0 and worst < 0.1  # no call waits for the receiver (a 0.3 s timeout)
    # the hung attempt times out and is retried: the receiver sees it again
    wait_for(lambda: n.counters()["failed"] >= 1, what="the timed-out attempt")
    assert n.counters()["sent"] == 0


def test_the_queue_is_bounded_and_drops_the_oldest(receiver, notifiers):
    receiver.hang = True
    n = make(notifiers, [receiver.url], timeout=5.0, max_queue=3)
    n.run_ended("r0", "complete")
    wait_for(lambda: receiver.count() == 1, what="the first POST in flight")
    for i in range(1, 6):
        n.run_ended(f"r{i}", "complete")  # five more: three fit, the two oldest are dropped
    assert n.counters()["dropped"] == 2
    receiver.hang = False
    receiver.release.set()  # the hung one is answered (without a response: a failed attempt)
    wait_for(lambda: n.counters()["sent"] >= 3, what="the queued POSTs")
    runs = [p["body"]["run"] for p in receiver.posts]
    assert runs[:1] == ["r0"] and {"r3", "r4", "r5"} <= set(runs) and not {"r1", "r2"} & set(runs)


def test_without_urls_nothing_runs():
    n = WebhookNotifier([]).start()
    n.alert("r", "stale", 0, "m")
    n.run_ended("r", "complete")
    assert n.pending() == 0 and n._thread is None
    n.close()


def test_close_drops_and_counts_what_is_left(receiver, notifiers):
    n = make(notifiers, [receiver.url], window=60.0)
    n.alert("r", "stale", 0, "m")
    n.close()
    assert n.counters()["dropped"] == 1 and receiver.count() == 0
    n.alert("r", "stale", 1, "m")  # after close: ignored
    assert n.pending() == 0
