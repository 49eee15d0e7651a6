"""``POST /api/runs/<run>/stacks``: the body's rules, the per-run rate limit and the
request counters (PROTOCOL.md section 4), apart from the Flask view in ``web/app.py``.

The route's order is the contract's: the ``Host`` check (421) and auth (401) are the app's
hooks for every route, ``--read-only`` (403) comes before the run lookup (404) so a
read-only web says nothing about which runs exist to a writer, then this module:
:func:`check_media_type` (415 for a body that is not ``application/json``),
:func:`parse_body` (400 with a one-line reason; else the
:class:`~rank_agent.controlwire.ControlRequest` the pump sends, encoded once, whose bounds
and defaults are the only copy) and :class:`RequestGate` (429 when this web process accepted a request for the same
run less than :data:`MIN_INTERVAL_S` before; only accepted requests count, so a burst of
bad bodies never locks a user out).

Why 415 is a security rule and not pedantry: a page of another site can POST to the web
with ``fetch`` or a form, but only with a "simple" content type (``text/plain``, a form
encoding); ``application/json`` needs a CORS preflight that the web never grants. So
requiring it means no other site's page can make ranks dump their stacks.

Pure apart from the injected clock: no Flask, no sockets.
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from broker.stacks.gate import MIN_INTERVAL_S, RunGate
from rank_agent.controlwire import (
    DEFAULT_HZ,
    DEFAULT_SECONDS,
    MAX_HZ,
    MAX_SECONDS,
    MIN_HZ,
    MIN_SECONDS,
    ControlRequest,
)
from rank_agent.protocol import MAX_WORLD_SIZE

__all__ = ["BadBody", "MIN_INTERVAL_S", "RequestGate", "StacksCollector", "check_media_type",
           "parse_body"]

KINDS = ("stacks", "profile")
#: The outcomes counted in ``rankboard_stacks_requests_total{result}``.
RESULTS = ("accepted", "read_only", "unsupported_media_type", "bad_request", "rate_limited",
           "unavailable", "ended")

#: Run statuses in which no rank is running to answer a request (409: the page would wait
#: forever for dumps that cannot come).
ENDED = ("complete", "failed")


def ended_reason(run: str, status: Any) -> Optional[str]:
    """The one-line reason a request for ``run`` can never be answered, or None: an ended
    run's ranks have all finished (issue 43 item 4; a 409, checked after the body so a bad
    body is still named as one)."""
    if status in ENDED:
        return (f"run {run} has ended ({status}): its ranks have finished, so none is "
                f"running to answer a request for stacks")
    return None


class BadBody(ValueError):
    """A body answered with ``status`` (415 or 400); str() is the one-line reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def check_media_type(content_type: Optional[str]) -> None:
    """415 unless ``content_type`` (the mimetype without parameters) is JSON's: checked
    before the body is read (module docstring: why)."""
    if (content_type or "").strip().lower() != "application/json":
        raise BadBody(415, "the body must be JSON sent as Content-Type: application/json")


def parse_body(run: str, body: bytes, world_size: Optional[int]) -> ControlRequest:
    """The request a JSON body asks of ``run``'s ranks (the 400 rules), with a new
    ``request_id``; :class:`BadBody` otherwise. ``world_size``: the run's, or None while
    unknown (then any rank >= 0 is allowed)."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise BadBody(400, "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise BadBody(400, "the body must be a JSON object")
    kind = data.get("kind")
    if kind not in KINDS:
        raise BadBody(400, 'kind must be "stacks" or "profile"')
    ranks = _ranks(data.get("ranks"), world_size)
    request_id = uuid.uuid4().hex[:16]
    if kind == "stacks":  # seconds and hz mean nothing to a dump: ignored, whatever they are
        return ControlRequest(run=run, request_id=request_id, kind=kind, ranks=ranks)
    seconds = data.get("seconds", DEFAULT_SECONDS)
    if seconds is None:
        seconds = DEFAULT_SECONDS
    if not _is_number(seconds) or not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise BadBody(400, f"seconds must be a number from {MIN_SECONDS:g} to {MAX_SECONDS:g}")
    hz = data.get("hz", DEFAULT_HZ)
    if hz is None:
        hz = DEFAULT_HZ
    if isinstance(hz, float) and hz.is_integer():
        hz = int(hz)
    if not _is_int(hz) or not MIN_HZ <= hz <= MAX_HZ:
        raise BadBody(400, f"hz must be an integer from {MIN_HZ} to {MAX_HZ}")
    return ControlRequest(run=run, request_id=request_id, kind=kind, ranks=ranks,
                          seconds=float(seconds), hz=hz)


def _ranks(value: Any, world_size: Optional[int]) -> Optional[List[int]]:
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadBody(400, "ranks must be a list of rank numbers, or null for every rank")
    if not value:
        raise BadBody(400, "ranks must not be empty (null asks every rank)")
    for rank in value:
        if not _is_int(rank):
            raise BadBody(400, "ranks must hold integers only")
        if rank < 0:
            raise BadBody(400, f"rank {rank} is negative")
        if world_size is not None and rank >= world_size:
            raise BadBody(400, f"rank {rank} is not below the world size {world_size}")
        if rank >= MAX_WORLD_SIZE:
            raise BadBody(400, f"rank {rank} is not below the largest world size "
                               f"{MAX_WORLD_SIZE}")
    return sorted(set(value))


@dataclass
class RequestGate:
    """Per run, when this web process last accepted a request (the 429 rule), and how
    every ``POST /stacks`` ended (``/metrics``). One per app; the gevent server runs one
    greenlet at a time, so no lock is needed. The interval and the bounded table are the
    broker's forwarding rule's (:class:`~broker.stacks.gate.RunGate`): one rule, two
    places it is applied (a web answers 429 before the broker would refuse)."""

    clock: Callable[[], float] = time.monotonic
    runs: RunGate = field(default_factory=RunGate)
    results: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))

    def count(self, result: str) -> None:
        self.results[result] = self.results.get(result, 0) + 1

    def wait_left(self, run: str) -> float:
        """Seconds until ``run`` may be asked again (0: now)."""
        return self.runs.wait_left(run, self.clock())

    def accepted(self, run: str) -> None:
        self.runs.let_through(run, self.clock())
        self.count("accepted")


class StacksCollector:
    """``/metrics``: the requests of this web (``rankboard_stacks_requests_total{result}``)
    and which ranks are stalled now (``rankboard_rank_stalled{run,rank,host}``, 1 or 0,
    like ``rankboard_rank_stale``), so an alert rule can fire on a hang without the page."""

    def __init__(self, gate: RequestGate, hub: Any) -> None:
        self.gate = gate
        self.hub = hub

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "rankboard_stacks_requests", "POST /api/runs/<run>/stacks answered by this web, "
            "by result (accepted, or why it was refused).", labels=["result"])
        for result, count in sorted(self.gate.results.items()):
            requests.add_metric([result], count)
        yield requests
        stalled = GaugeMetricFamily(
            "rankboard_rank_stalled", "1 while the rank is stalled (alive, its training "
            "loop silent for stall_after: a hang), else 0.", labels=["run", "rank", "host"])
        for state in self.hub.runs.values():
            for entry in state.ranks_full:
                if isinstance(entry, dict):
                    stalled.add_metric([state.run, str(entry.get("rank")),
                                        str(entry.get("host") or "")],
                                       1.0 if entry.get("status") == "stalled" else 0.0)
        yield stalled
