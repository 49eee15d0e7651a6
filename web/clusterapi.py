"""The cluster routes (PROTOCOL 7.4): ``GET /api/runs`` with its filters and counts, and
``GET /api/hosts``.

A Blueprint of its own so ``web/app.py`` stays the run routes; the app-wide hooks there
(the ``Host`` check, auth, security and ``no-store`` headers, the JSON error handlers) apply
to these routes as to every other. The rules live in :mod:`web.cluster`; this module only
parses the query and encodes the answer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import msgspec
from flask import Blueprint, Response, current_app, request

from web.cluster import BadFilter, parse_runs_filter
from web.hostsanswer import HostsAnswer

if TYPE_CHECKING:
    from web.hub import Hub

bp = Blueprint("cluster", __name__)
_json = msgspec.json.Encoder()


def _hub() -> Hub:
    hub: Hub = current_app.extensions["rankboard"].hub
    return hub


def _answer(payload: Any, status: int = 200) -> Response:
    """JSON as ``web.app.json_response`` writes it (non-finite floats become null)."""
    return Response(_json.encode(payload), status=status, mimetype="application/json")


@bp.get("/api/runs")
def runs() -> Response:
    """Every run the web holds, newest first; ``status``, ``q``, ``limit``, ``offset``
    narrow it (a bad value: 400 with a one-line reason)."""
    try:
        filt = parse_runs_filter(request.args)
    except BadFilter as exc:
        return _answer({"error": str(exc)}, 400)
    hub = _hub()
    return _answer(hub.cluster.runs(hub, filt))


@bp.get("/api/hosts")
def hosts() -> Response:
    """Every host of the runs the web holds, suspects first (PROTOCOL 7.4)."""
    hub = _hub()
    answers = current_app.extensions.setdefault("rankboard_hosts", HostsAnswer())
    # built off the loop, cached per state of the runs' headers (web/hostsanswer.py)
    data = answers.get(hub, hub.cluster, _json.encode, _offload)
    return Response(data, mimetype="application/json")


def _offload(fn: Callable[[], Any]) -> Any:
    """``fn()`` in gevent's thread pool, this greenlet waiting (the loop serves meanwhile)."""
    import gevent

    return gevent.get_hub().threadpool.apply(fn)
