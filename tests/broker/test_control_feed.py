"""Control requests travel on the broker's publish socket beside the web feed
(``rank_agent/controlwire.py``): a web decoding the feed must ignore them, never act on
them or fail on them, and their topics must not be taken for a run's events."""
from __future__ import annotations

from broker import feed
from rank_agent.controlwire import CONTROL_PREFIX, ControlRequest, decode_request, encode_request


def test_a_web_ignores_control_requests_on_the_feed() -> None:
    for kind in ("stacks", "profile"):
        parts = encode_request(ControlRequest(run="run-1", request_id="q", kind=kind,  # type: ignore[arg-type]
                                              ranks=[0, 1]))
        assert feed.decode_update(parts) is None
        assert decode_request(parts).run == "run-1"


def test_control_topics_cannot_collide_with_feed_topics() -> None:
    assert not CONTROL_PREFIX.startswith(feed.RUN_PREFIX)
    for topic in (feed.TOPIC_HEARTBEAT, feed.TOPIC_PORT):
        assert not topic.startswith(CONTROL_PREFIX) and not CONTROL_PREFIX.startswith(topic)
