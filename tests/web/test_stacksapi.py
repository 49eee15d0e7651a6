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
    StacksRequest,
    check_media_type,
    parse_body,
    parse_request,
)


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
    assert parse_body(b'{"kind": "stacks"}', 4) == StacksRequest("stacks", None)
    assert parse_body(b'{"kind": "stacks", "ranks": null, "hz": "x", "seconds": -1}', 4) == \
        StacksRequest("stacks", None)
    assert parse_body(b'{"kind": "profile"}', None) == StacksRequest("profile", None, 5.0, 100)
    assert parse_body(b'{"kind": "profile", "seconds": 60, "hz": 250.0, "ranks": [3, 0, 3]}',
                      4) == StacksRequest("profile", [0, 3], 60.0, 250)
    assert parse_body(b'{"kind": "profile", "seconds": 0.5, "hz": 1}', 4).seconds == 0.5
    # an unknown world size allows any rank >= 0
    assert parse_body(b'{"kind": "stacks", "ranks": [70000]}', None).ranks == [70000]


@pytest.mark.parametrize("body", [
    b'{"kind": "profile", "seconds": NaN}', b'{"kind": "profile", "seconds": 1e999}',
    b'{"kind": "profile", "hz": 100.5}', b'{"kind": "stacks", "ranks": [0, null]}',
    b'{"kind": "stacks", "ranks": {"0": 1}}', b'"stacks"', b"", b"\xff"])
def test_bad_bodies(body: bytes) -> None:
    with pytest.raises(BadBody) as exc:
        parse_request("application/json", body, 4)
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
    assert len(gate.last) <= 4097
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
