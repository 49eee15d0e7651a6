"""``web/stacksapi.py`` in memory: the POST body's rules (PROTOCOL 4), the 429 gate with an
injected clock, and the counters' exposition. The HTTP order of the rules is checked
against real webs in ``test_stacks_routes.py``."""
from __future__ import annotations

from typing import Optional

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from web.hub import Hub
from web.stacksapi import (
    MIN_INTERVAL_S,
    BadBody,
    RequestGate,
    StacksCollector,
    check_media_type,
    parse_body,
)


def asked(body: bytes, world_size: Optional[int]) -> tuple:
    """What a body asks, without its random request id."""
    req = parse_body("run-1", body, world_size)
    assert req.run == "run-1" and len(req.request_id) == 16
    return (req.kind, req.ranks, req.seconds, req.hz)


@pytest.mark.parametrize("content_type", [None, "", "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data", "application/jsonp",
                                          "application/json-seq"])
def test_only_json_bodies_pass(content_type: Optional[str]) -> None:
    with pytest.raises(BadBody) as exc:
        check_media_type(content_type)
    assert exc.value.status == 415


def test_json_media_type_case_and_blanks() -> None:
    check_media_type("application/json")
    check_media_type(" Application/JSON ")


def test_defaults_and_ignored_fields() -> None:
    assert asked(b'{"kind": "stacks"}', 4) == ("stacks", None, 5.0, 100)
    assert asked(b'{"kind": "stacks", "ranks": null, "hz": "x", "seconds": -1}', 4) == \
        ("stacks", None, 5.0, 100)
    assert asked(b'{"kind": "profile"}', None) == ("profile", None, 5.0, 100)
    assert asked(b'{"kind": "profile", "seconds": 60, "hz": 250.0, "ranks": [3, 0, 3]}',
                 4) == ("profile", [0, 3], 60.0, 250)
    assert asked(b'{"kind": "profile", "seconds": 0.5, "hz": 1}', 4)[2] == 0.5
    # an unknown world size allows any rank the protocol allows
    assert asked(b'{"kind": "stacks", "ranks": [65535]}', None)[1] == [65535]


def test_an_accepted_body_is_a_request_the_broker_and_agents_accept() -> None:
    """What the web accepts, it encodes once, and those bytes pass the type's constraints
    (the broker forwards them unchanged)."""
    from broker import feed

    for body in (b'{"kind": "stacks"}', b'{"kind": "profile", "seconds": 60, "hz": 250}',
                 b'{"kind": "stacks", "ranks": [0, 65535]}', b'{"kind": "profile", "hz": 1.0}'):
        req = parse_body("run-1", body, None)
        assert feed.decode_stacks_request(feed.encode_stacks_request(req))[0] == req


@pytest.mark.parametrize("body", [
    b'{"kind": "profile", "seconds": NaN}', b'{"kind": "profile", "seconds": 1e999}',
    b'{"kind": "profile", "hz": 100.5}', b'{"kind": "stacks", "ranks": [0, null]}',
    b'{"kind": "stacks", "ranks": {"0": 1}}', b'"stacks"', b"", b"\xff",
    b'{"kind": "stacks", "ranks": [65536]}'])
def test_bad_bodies(body: bytes) -> None:
    with pytest.raises(BadBody) as exc:
        parse_body("run-1", body, None if b"65536" in body else 4)
    assert exc.value.status == 400 and "\n" not in str(exc.value)


def test_gate_is_per_run_and_counts_only_accepted() -> None:
    now = [100.0]
    gate = RequestGate(clock=lambda: now[0])
    assert gate.wait_left("a") == 0.0
    gate.count("bad_request")  # a refusal stamps nothing
    assert gate.wait_left("a") == 0.0
    gate.accepted("a")
    assert gate.wait_left("a") == pytest.approx(MIN_INTERVAL_S)
    assert gate.wait_left("b") == 0.0
    now[0] += 0.999
    assert gate.wait_left("a") > 0
    now[0] += 0.001
    assert gate.wait_left("a") == 0.0
    assert gate.results["accepted"] == 1 and gate.results["bad_request"] == 1


def test_gate_forgets_runs_asked_long_ago() -> None:
    now = [0.0]
    gate = RequestGate(clock=lambda: now[0])
    for i in range(5000):
        now[0] += 0.01
        gate.accepted(f"run-{i}")
    assert len(gate.runs) <= 4097
    assert gate.wait_left("run-4999") > 0


def test_collector_exposes_every_result() -> None:
    gate = RequestGate()
    gate.count("rate_limited")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StacksCollector(gate, Hub()))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    for result in ("accepted", "read_only", "unsupported_media_type", "bad_request",
                   "unavailable"):
        assert f'rankboard_stacks_requests_total{{result="{result}"}} 0.0' in text
    assert 'rankboard_stacks_requests_total{result="rate_limited"} 1.0' in text
    assert "# TYPE rankboard_rank_stalled gauge" in text
