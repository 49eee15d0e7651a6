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

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, Optional

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from broker.stacks.gate import MIN_INTERVAL_S, RunGate
from rank_agent.controlwire import DEFAULT_HZ, DEFAULT_SECONDS, ControlRequest

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


def check_media_type(content_type: Optional[str]) -> None:
    """415 unless ``content_type`` (the mimetype without parameters) is JSON's: checked
    before the body is read (module docstring: why)."""
    if (content_type or "").strip().lower() != "application/json":
        raise BadBody(415, "the body must be JSON sent as Content-Type: application/json")


def parse_body(run: str, body: bytes, world_size: Optional[int]) -> ControlRequest:
    """The request a JSON body asks of ``run``'s ranks (the 400 rules), with a new
    ``request_id``; :class:`BadBody` otherwise. ``world_size``: the run's, or None while
    unknown (then any rank the protocol allows).

    The bounds are :class:`ControlRequest`'s own constraints, checked by converting to it
    (issue 44 item 5: they were written here a second time); the 400 message quotes them
    from the type (:func:`_rule`). What is the web's alone: the body is an object, ``null``
    means the default, an integral float is an ``hz``, the world size of the run."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise BadBody(400, "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise BadBody(400, "the body must be a JSON object")
    kind = data.get("kind")
    if kind not in KINDS:
        raise BadBody(400, 'kind must be "stacks" or "profile"')
    ranks = data.get("ranks")
    if ranks is not None:  # the shape in the web's words; the bounds are the type's
        if not isinstance(ranks, list):
            raise BadBody(400, "ranks must be a list of rank numbers, or null for every rank")
        if not ranks:
            raise BadBody(400, "ranks must not be empty (null asks every rank)")
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise BadBody(400, "ranks must hold integers only")
    asked: Dict[str, Any] = {"run": run, "request_id": uuid.uuid4().hex[:16], "kind": kind,
                             "ranks": ranks}
    if kind == "profile":  # seconds and hz mean nothing to a dump: ignored, whatever they are
        for name, default in (("seconds", DEFAULT_SECONDS), ("hz", DEFAULT_HZ)):
            value = data.get(name)
            asked[name] = default if value is None else value
        hz = asked["hz"]
        if isinstance(hz, float) and hz.is_integer():
            asked["hz"] = int(hz)
    try:
        req = msgspec.convert(asked, ControlRequest)
    except msgspec.ValidationError as exc:
        raise BadBody(400, _rule(str(exc), asked)) from None
    if req.ranks is None:
        return req
    if world_size is not None and max(req.ranks) >= world_size:
        raise BadBody(400, f"rank {max(req.ranks)} is not below the world size {world_size}")
    return msgspec.structs.replace(req, ranks=sorted(set(req.ranks)))


def _bounds(t: Any) -> str:
    """``from A to B`` (or ``>= A``) of a msgspec number type's constraints."""
    lo = t.ge if t.ge is not None else t.gt
    hi = t.le if t.le is not None else (t.lt - 1 if isinstance(t, msgspec.inspect.IntType)
                                        and t.lt is not None else t.lt)
    if hi is None:
        return f">= {lo:g}"
    return f"from {lo:g} to {hi:g}"


def _field_rules() -> Dict[str, str]:
    """What each field a body may give must be, read from :class:`ControlRequest`'s
    constraints (the only copy of the bounds)."""
    info = msgspec.inspect.type_info(ControlRequest)
    assert isinstance(info, msgspec.inspect.StructType)
    types: Dict[str, Any] = {f.name: f.type for f in info.fields}
    listed = next(t for t in types["ranks"].types if isinstance(t, msgspec.inspect.ListType))
    return {
        "hz": f"hz must be an integer {_bounds(types['hz'])}",
        "seconds": f"seconds must be a number {_bounds(types['seconds'])}",
        "ranks": (f"ranks must hold {listed.min_length} to {listed.max_length} rank numbers, "
                  f"each {_bounds(listed.item_type)}"),
    }


_RULES = _field_rules()


def _rule(error: str, asked: Dict[str, Any]) -> str:
    """The one-line 400 reason for msgspec's ``error`` (``... - at `$.hz```) on ``asked``:
    the rule of the field it names (a rank out of bounds named, and whether negative)."""
    where = error.rpartition("`$.")[2].rstrip("`")
    name, _, index = where.partition("[")
    rule = _RULES.get(name)
    if rule is None:
        return error
    if name == "ranks" and index.rstrip("]").isdigit():
        rank = asked["ranks"][int(index.rstrip("]"))]
        return f"rank {rank} is {'negative' if rank < 0 else 'out of bounds'}: {rule}"
    return f"{rule} ({error})"


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
