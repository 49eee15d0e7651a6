"""The Flask app: ``create_app(hub, config)`` and the routes of PROTOCOL.md section 4.

The routes are module-level views on one Blueprint (:data:`bp`); ``create_app`` builds the
app, keeps this app's hub, token and ping interval as a :class:`Board` in
``app.extensions``, and registers the Blueprint. Every route with a ``<run>`` in its path
gets the run from one lookup (:func:`_find_run`), which answers an unknown or malformed run
with 404 after authorisation, exactly as each route used to on its own.

The app only reads the :class:`~web.hub.Hub` (it never touches sockets), so it works under
any WSGI server; the SSE stream relies on gevent to block in its queue cheaply, which is why
``web/serve.py`` serves it with gevent's pywsgi.

Config keys (all optional):

* ``token``: the bearer token; None disables auth (the CLI refuses that off loopback);
* ``allowed_hosts``: the ``Host`` names (lower case, no port, IPv6 in brackets) a web
  without a token answers; others get 421 (PROTOCOL 4 "Hardening"; default: loopback names,
  see :func:`web.serve.allowed_hosts`);
* ``ping_interval``: seconds between ``: ping`` comments on idle and busy streams (15);
* ``read_only``: refuse ``POST /stacks`` with 403 and leave the page's request buttons out
  (``--read-only``);
* ``request_stacks``: the callable that sends a stacks request to the broker
  (:meth:`web.pump.FeedPump.request_stacks`); None: ``POST /stacks`` answers 503;
* ``template_folder`` / ``static_folder``: override the page's folders (tests).
"""
from __future__ import annotations

import csv
import hashlib
import hmac
import io
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional

import gevent
import msgspec
from flask import Blueprint, Flask, Response, current_app, g, render_template, request
from prometheus_client import CONTENT_TYPE_LATEST
from werkzeug.exceptions import HTTPException

from broker.run.steps.encodings import csv_columns
from rank_agent.digits import is_ascii_digits
from rank_agent.protocol import valid_run_id
from web.clusterapi import bp as cluster_bp
from web.hub import parse_position
from web.metrics import make_registry
from web.pump import StacksRequestError
from web.report import attachment_name, report_of_state
from web.report import render as render_report
from web.report import shell as report_shell
from web.runstate import RunState
from web.scrape import ScrapeRegistry
from web.shards import AnyHub, journal_states, shard_states
from web.stacksapi import (
    BadBody,
    RequestGate,
    StacksCollector,
    check_media_type,
    ended_reason,
    parse_body,
)
from web.stream import client_stream

log = logging.getLogger(__name__)

DEFAULT_PING_INTERVAL = 15.0
#: The cookie a valid ``?token=`` sets, so the page's EventSource (which cannot send headers)
#: is authorised. Its value is derived from the token, never the token itself.
COOKIE_NAME = "rankboard_session"

PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
            "connect-src 'self'; frame-ancestors 'none'; object-src 'none'; base-uri 'none'")
SVG_CSP = "default-src 'none'; style-src 'unsafe-inline'; sandbox"
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
#: What a tokenless web answers by default: loopback names only (``web/serve.py`` adds the
#: bound address and ``--allowed-host`` names).
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
#: A CSV text cell starting with one of these is a formula to a spreadsheet: it gets a
#: leading ``'`` (PROTOCOL 4 "Hardening").
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
#: Routes whose answers no cache may keep (``Cache-Control: no-store``): run data and metrics.
NO_STORE_PREFIXES = ("/api/", "/metrics")
RESOURCE_COLUMNS = ("cpu_percent", "ram_used_bytes", "ram_total_bytes", "gpu_util_percent",
                    "vram_allocated_bytes", "vram_total_bytes")

_json = msgspec.json.Encoder()
#: ``/steps``: the most buckets one answer may hold, and the default.
MAX_POINTS = 10_000
DEFAULT_POINTS = 1000
_INT = re.compile(r"^[0-9]{1,19}$")
#: ``POST /stacks``: the largest body read (PROTOCOL 4 names no bound; 1 MiB holds every
#: rank of the largest world size as a JSON list)
MAX_BODY = 1 << 20


class BadQuery(ValueError):
    """A ``/steps`` query parameter that PROTOCOL 4 answers with 400; str() is the reason."""


def _int_arg(args: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = args.get(name)
    if raw is None or raw == "":
        return default
    text = raw.strip()
    if text.startswith("-") and _INT.match(text[1:]):
        raise BadQuery(f"{name} must not be negative")
    if not _INT.match(text):
        raise BadQuery(f"{name} must be a non-negative integer")
    return int(text)


def steps_query(args: Mapping[str, str]) -> tuple[str, int | None, int | None, int]:
    """``(metric, start, end, points)`` of a ``/steps`` query; :class:`BadQuery` otherwise."""
    metric = args.get("metric")
    if not metric:
        raise BadQuery("metric is required (a step metric, step_ms, data_ms, samples_per_s or "
                       "tokens_per_s)")
    raw_points = args.get("points")
    if raw_points is not None and raw_points != "" and not _INT.match(raw_points.strip()):
        raise BadQuery(f"points must be an integer from 1 to {MAX_POINTS}")
    points = _int_arg(args, "points", DEFAULT_POINTS)
    assert points is not None
    if not 1 <= points <= MAX_POINTS:
        raise BadQuery(f"points must be an integer from 1 to {MAX_POINTS}")
    start = _int_arg(args, "start", None)
    end = _int_arg(args, "end", None)
    if start is not None and end is not None and start > end:
        raise BadQuery("start must not be greater than end")
    return metric, start, end, points


#: Response header of ``GET /api/runs/<run>``: the run sequence number its ``ranks`` are as of.
RANKS_SEQ_HEADER = "X-Rankboard-Ranks-Seq"


def json_response(payload: Any, status: int = 200) -> Response:
    """JSON via msgspec: non-finite floats become null (PROTOCOL 4)."""
    return Response(_json.encode(payload), status=status, mimetype="application/json")


def error(status: int, message: str) -> Response:
    return json_response({"error": message}, status)


def _cell(value: Any) -> str:
    """A CSV cell: absent, non-numeric and non-finite values are empty."""
    if isinstance(value, bool) or value is None:
        return ""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if value == value and value not in (float("inf"), float("-inf")) else ""
    return ""


def text_cell(text: str) -> str:
    """A CSV text cell (a header name) a spreadsheet shows as text: one starting like a
    formula (:data:`FORMULA_START`) gets a leading ``'``. Metric names come from ranks,
    so a name like ``=HYPERLINK(...)`` must not run when an export is opened."""
    return "'" + text if text.startswith(FORMULA_START) else text


def steps_csv_header(metric_names: list[str]) -> str:
    """The ``/steps.csv`` header line of PROTOCOL 4 (CRLF), text cells neutralised
    (:func:`text_cell`). Written here rather than by the step store: the store's rows are
    numbers only, and the header is the one place a rank's string reaches the file."""
    cols = csv_columns(metric_names)
    out = io.StringIO()
    csv.writer(out, lineterminator="\r\n").writerow([text_cell(c) for c in cols])
    return out.getvalue()


def history_csv(records: list[dict[str, Any]],
                named: list[dict[str, Any]] | None = None) -> str:
    """The CSV export: ``epoch,duration_secs,<metrics>,<resources>``; metric columns are the
    union over records (and over ``named``: 8.1, the superseded records' metrics are named
    too), ``loss`` first then sorted."""
    names: set[str] = set()
    for record in [*records, *(named or ())]:
        metrics = record.get("metrics")
        if isinstance(metrics, dict):
            names.update(str(k) for k in metrics)
    metric_columns = (["loss"] if "loss" in names else []) + sorted(names - {"loss"})
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow([text_cell(c) for c in ("epoch", "duration_secs", *metric_columns,
                                            *RESOURCE_COLUMNS)])
    for record in records:
        metrics = record.get("metrics")
        metrics = metrics if isinstance(metrics, dict) else {}
        resources = record.get("resources")
        resources = resources if isinstance(resources, dict) else {}
        writer.writerow([
            _cell(record.get("epoch")), _cell(record.get("duration_secs")),
            *(_cell(metrics.get(name)) for name in metric_columns),
            *(_cell(resources.get(name)) for name in RESOURCE_COLUMNS),
        ])
    return out.getvalue()


def _session_value(token: str) -> str:
    return hmac.new(token.encode("utf-8"), b"rankboard-session-v1", hashlib.sha256).hexdigest()


def _same(supplied: str | None, expected: str) -> bool:
    return supplied is not None and hmac.compare_digest(
        supplied.encode("utf-8", "surrogateescape"), expected.encode("utf-8"))


@dataclass(frozen=True)
class Board:
    """What the views need of one app, built once by :func:`create_app`."""

    hub: AnyHub
    #: the bearer token; None: no auth
    token: str | None
    #: ``Host`` names answered without a token (see the module docstring)
    allowed_hosts: frozenset[str]
    ping_interval: float
    registry: ScrapeRegistry
    #: ``--read-only``: ``POST /stacks`` answers 403
    read_only: bool = False
    #: ``FeedPump.request_stacks`` (None: no feed to send it on, 503)
    request_stacks: Optional[Callable[..., str]] = None
    #: is this run's shard connected (a web of N brokers, PROTOCOL 7.3; None: one broker)
    run_live: Optional[Callable[[str], bool]] = None
    #: the 429 rule and the request counters of ``POST /stacks``
    gate: RequestGate = field(default_factory=RequestGate)


def _board() -> Board:
    board: Board = current_app.extensions["rankboard"]
    return board


bp = Blueprint("rankboard", __name__)


# --------------------------------------------------------------- app-wide hooks
def host_name(value: str | None) -> str | None:
    """A ``Host`` header's name without its port, lower case (``[::1]`` keeps its
    brackets); None when there is none or it is malformed."""
    if not value:
        return None
    value = value.strip().lower()
    if value.startswith("["):
        name, bracket, rest = value.partition("]")
        if not bracket:
            return None
        name += "]"
    else:
        name, _, rest = value.partition(":")
        rest = ":" + rest if _ else ""
    if rest and not (rest.startswith(":") and is_ascii_digits(rest[1:])):
        return None
    return name or None


@bp.before_app_request
def _check_host() -> Response | None:
    """A web without a token answers only the ``Host`` names it was told of (421
    otherwise; ``/healthz`` is exempt for probes). With no token, the only thing keeping
    another site's page from reading the dashboard is the browser's same-origin rule, and
    DNS rebinding (a name of that site that now resolves to 127.0.0.1) defeats it: the
    ``Host`` it sends is still that site's name (issue 19, finding 9)."""
    board = _board()
    if board.token is not None or request.path == "/healthz":
        return None
    if host_name(request.environ.get("HTTP_HOST")) in board.allowed_hosts:
        return None
    board.hub.count_limit("host")
    return error(421, "misdirected request: this dashboard answers only its own host names "
                 "(see rankboard web --allowed-host)")


@bp.before_app_request
def _authorise() -> Response | None:
    token = _board().token
    if token is None or request.path == "/healthz":
        return None
    auth = request.headers.get("Authorization", "")
    scheme, _, credentials = auth.partition(" ")
    if scheme.lower() == "bearer" and _same(credentials.strip(), token):
        return None
    if _same(request.args.get("token"), token):
        g.set_session_cookie = True
        return None
    if _same(request.cookies.get(COOKIE_NAME), _session_value(token)):
        return None
    response = error(401, "unauthorized: pass Authorization: Bearer <token> or ?token=<token>")
    response.headers["WWW-Authenticate"] = 'Bearer realm="rankboard"'
    return response


@bp.after_app_request
def _headers(response: Response) -> Response:
    response.headers.setdefault("Content-Security-Policy", PAGE_CSP)
    for name, value in SECURITY_HEADERS.items():
        response.headers[name] = value
    if request.path.startswith(NO_STORE_PREFIXES):
        response.headers["Cache-Control"] = "no-store"
    token = _board().token
    if token is not None and g.get("set_session_cookie"):
        response.set_cookie(COOKIE_NAME, _session_value(token), httponly=True,
                            samesite="Strict", secure=request.is_secure, path="/")
    return response


@bp.app_errorhandler(HTTPException)
def _http_error(exc: HTTPException) -> Response:
    response = error(exc.code or 500, (exc.description or exc.name).strip())
    if exc.code == 405 and exc.response is None:
        allowed = getattr(exc, "valid_methods", None)
        if allowed:
            response.headers["Allow"] = ", ".join(allowed)
    return response


@bp.app_errorhandler(Exception)
def _internal_error(exc: Exception) -> Response:
    log.exception("request %s %s failed", request.method, request.path)
    return error(500, "internal error")


# ------------------------------------------------------------------ the run lookup
def unknown_run(run: str) -> Response:
    return error(404, "unknown run" if valid_run_id(run) else "not a valid run id")


@bp.before_request
def _refuse_writes() -> Response | None:
    """``--read-only`` refuses the one route that acts (``POST /stacks``) with 403, after
    the ``Host`` check and auth (app-wide hooks) and before the run lookup (PROTOCOL 4's
    order: a read-only web tells a would-be writer nothing about which runs exist)."""
    board = _board()
    if request.method != "POST" or not board.read_only:
        return None
    board.gate.count("read_only")
    return error(403, "this dashboard is read-only (rankboard web --read-only)")


@bp.before_request
def _find_run() -> Response | None:
    """The one run lookup of every ``<run>`` route: 404 for a run this web does not have (or
    a malformed id), else the run's state in ``g.run_state`` (read by :func:`_run`).

    A Blueprint ``before_request`` runs after the app-wide :func:`_authorise` (a URL value
    preprocessor would run before it and leak which runs exist to a caller without the
    token), and not at all when routing failed (405 stays 405). ``OPTIONS`` is answered by
    Flask itself without a lookup, as it was when each view looked the run up."""
    run = (request.view_args or {}).get("run")
    if run is None:
        return None
    rule = request.url_rule
    if request.method == "OPTIONS" and getattr(rule, "provide_automatic_options", False):
        return None
    state = _board().hub.runs.get(run) if valid_run_id(run) else None
    if state is None:
        return unknown_run(run)
    g.run_state = state
    return None


def _run() -> RunState:
    """The current request's run, found by :func:`_find_run`."""
    state: RunState = g.run_state
    return state


# -------------------------------------------------------------------------- views
@bp.get("/")
def index() -> str:
    return render_template("index.html", read_only=_board().read_only)


@bp.get("/healthz")
def healthz() -> Response:
    shards = shard_states(_board().hub)  # PROTOCOL 7.3: by shard, one for one broker
    ok = any(shard["connected"] for shard in shards)
    # PROTOCOL 8.4: failing while any connected shard's journal is
    for shard, state in zip(shards, journal_states(_board().hub)):
        shard["journal"] = state
    failing = any(s["connected"] and s["journal"] == "failing" for s in shards)
    return json_response({"ok": ok, "shards": shards, "journal": "failing" if failing else "ok"},
                         200 if ok else 503)


@bp.get("/api/runs/<run>")
def run_detail(run: str) -> Response:
    state = _run()
    body = state.public_header()
    body["ranks"] = state.ranks
    body["records"] = [record for _, record in state.records]
    response = json_response(body)
    # the run sequence number the ranks are as of: the page fetches them once its stream is
    # subscribed and keeps whichever of these and its stream's ``ranks`` events is newer
    response.headers[RANKS_SEQ_HEADER] = str(state.ranks_seq)
    return response


def attempt_arg(state: RunState) -> int | Response | None:
    """The ``?attempt=K`` of ``/steps``, ``/steps.csv``, ``/history`` and ``/history.csv``
    (8.1): None when absent or empty, else K, or the error to answer: 400 when K is not
    ASCII digits, 404 when the run does not have attempt K or no longer lists it."""
    raw = request.args.get("attempt", "")
    if raw == "":
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        return error(400, "attempt must be a whole number of ASCII digits")
    k = int(raw)
    listed = state.header.get("attempts")
    if not isinstance(listed, list) or not any(
            isinstance(a, dict) and a.get("attempt") == k for a in listed):
        if not (k == 0 and not isinstance(listed, list)):  # (an older broker: attempt 0 only)
            return error(404, f"this run has no attempt {k}")
    return k


def _history_records(state: RunState) -> list[dict[str, Any]] | Response:
    """The line's epoch records, or attempt K's own (8.1), or the error to answer."""
    k = attempt_arg(state)
    if isinstance(k, Response):
        return k
    line = [record for _, record in state.records]
    return line if k is None else state.epoch_line.of_attempt(line, k)


@bp.get("/api/runs/<run>/history")
def history(run: str) -> Response:
    records = _history_records(_run())
    return records if isinstance(records, Response) else json_response(records)


@bp.get("/api/runs/<run>/resources")
def resources(run: str) -> Response:
    """The cluster's resources over time (web/resourcetimeline.py): what the page's
    "Cluster resources" chart draws, a time series of the ranks' samples."""
    return json_response(_run().resources.to_json())


@bp.get("/api/runs/<run>/history.csv")
def history_export(run: str) -> Response:
    state = _run()
    records = _history_records(state)
    if isinstance(records, Response):
        return records
    body = history_csv(records, state.epoch_line.superseded)  # (8.1: their metric names too)
    response = Response(body, mimetype="text/csv")
    response.headers["Content-Disposition"] = f'attachment; filename="{run}-history.csv"'
    return response


@bp.get("/api/runs/<run>/steps")
def steps(run: str) -> Response:
    state = _run()
    try:
        metric, start, end, points = steps_query(request.args)
    except BadQuery as exc:
        return error(400, str(exc))
    k = attempt_arg(state)  # 8.1: attempt K's own closed steps, superseded or not
    if isinstance(k, Response):
        return k
    store = state.steps if k is None else state.line.of_attempt(k)
    buckets = store.series(metric, start, end, points)
    return json_response({"metric": metric, "start": start, "end": end,
                          "buckets": buckets})


@bp.get("/api/runs/<run>/steps.csv")
def steps_export(run: str) -> Response:
    state = _run()
    k = attempt_arg(state)  # 8.1: attempt K's own closed steps, superseded or not
    if isinstance(k, Response):
        return k
    store = state.steps if k is None else state.line.of_attempt(k)
    names = state.line.metric_names()  # (8.1: superseded records' metrics too)
    line = state.line

    def attempts(r0: int, r1: int) -> Any:
        return line.attempts_of(r0, r1) if k is None else [k] * (r1 - r0)

    def body() -> Iterator[str]:
        # Streamed a few thousand rows at a time: a million-row export is never built
        # in memory, and the server's other greenlets run between chunks.
        yield steps_csv_header(names)[:-2] + ",attempt\r\n"  # 8.1: the last column
        for chunk in store.csv_rows(names=names, attempts=attempts):
            yield chunk
            gevent.sleep(0)

    response = Response(body(), mimetype="text/csv")
    response.headers["Content-Disposition"] = f'attachment; filename="{run}-steps.csv"'
    return response


@bp.get("/api/runs/<run>/graph.svg")
def graph(run: str) -> Response:
    state = _run()
    if not state.svg:
        return error(404, "this run has no graph")
    response = Response(state.svg, content_type="image/svg+xml")
    response.headers["Content-Security-Policy"] = SVG_CSP
    return response


@bp.get("/api/runs/<run>/report.html")
def report(run: str) -> Response:
    """The run as one self-contained HTML file (PROTOCOL 4; ``web/report.py``), streamed
    as it is made: one series at a time straight from the run's step store."""
    state = _run()
    hub = _board().hub
    # the run's dumps and verdict from their cached answers, built and decoded in the thread
    # pool (issue 38, item 2: a 65,536-rank hang's were megabytes decoded on the loop)
    stacks = hub.stacks_view_json(run, _json.encode, _threadpool)
    verdict = hub.collectives_view_json(run)
    rep = report_of_state(
        state, None if stacks is None else _threadpool(_json_decode, stacks),
        None if verdict is None else _threadpool(_verdict_decode, verdict))

    def body() -> Iterator[str]:
        for chunk in render_report(rep):
            yield chunk
            gevent.sleep(0)  # other greenlets run between series

    response = Response(body(), content_type="text/html; charset=utf-8")
    response.headers["Content-Disposition"] = f'attachment; filename="{attachment_name(run)}"'
    # the file's own policy (its meta tag says the same), not the page's 'self' one
    response.headers["Content-Security-Policy"] = report_shell().csp
    return response


@bp.get("/api/runs/<run>/stacks")
def stacks(run: str) -> Response:
    # cached per run state, built in the thread pool (web/stacksview.py)
    data = _board().hub.stacks_view_json(run, _json.encode, _threadpool)
    if data is None:  # the run went between the lookup and here
        return unknown_run(run)
    return Response(data, mimetype="application/json")


@bp.get("/api/runs/<run>/collectives")
def collectives(run: str) -> Response:
    """Section 7.2: the broker's collective verdict and the ranks' latest frames, cached per
    state of the run's frames (web/collectivesview.py), as ``/stacks`` is."""
    data = _board().hub.collectives_view_json(run)
    return unknown_run(run) if data is None else Response(data, mimetype="application/json")


class _Verdict(msgspec.Struct):
    """What a report reads of ``GET /collectives``: its listed groups (the frames skipped)."""

    groups: list[Any] = []


_json_decode = msgspec.json.Decoder().decode
_verdict_only = msgspec.json.Decoder(_Verdict).decode


def _verdict_decode(data: bytes) -> dict[str, Any]:
    return {"groups": _verdict_only(data).groups}


def _threadpool(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in gevent's thread pool, this greenlet waiting (the loop serves on)."""
    return gevent.get_hub().threadpool.apply(fn, args)


def _body() -> bytes:
    """The request body, at most :data:`MAX_BODY` bytes (a request is a few dozen; one
    naming every rank of a 65,536-rank run fits): larger is a 400, never read whole."""
    if (request.content_length or 0) > MAX_BODY:
        raise BadBody(400, f"the body is over {MAX_BODY} bytes")
    data = request.stream.read(MAX_BODY + 1)
    if len(data) > MAX_BODY:
        raise BadBody(400, f"the body is over {MAX_BODY} bytes")
    return data


@bp.post("/api/runs/<run>/stacks")
def request_stacks(run: str) -> Response:
    """Ask the run's ranks for dumps or a profile (PROTOCOL 4; 421/401/403/404 were
    answered by the hooks above, in that order; ``web/stacksapi.py`` has the rest)."""
    board = _board()
    gate = board.gate
    if board.run_live is not None and not board.run_live(run):  # its shard is away (7.3)
        gate.count("unavailable")
        return error(503, "the broker that holds this run is not connected")
    world = _run().header.get("world_size")
    try:
        check_media_type(request.mimetype or None)
        asked = parse_body(run, _body(), world if isinstance(world, int) and world > 0 else None)
    except BadBody as exc:
        gate.count("unsupported_media_type" if exc.status == 415 else "bad_request")
        return error(exc.status, str(exc))
    ended = ended_reason(run, _run().header.get("status"))
    if ended is not None:
        gate.count("ended")
        return error(409, ended)
    wait = gate.wait_left(run)
    if wait > 0:
        gate.count("rate_limited")
        response = error(429, "a request for this run was accepted less than 1 s ago")
        response.headers["Retry-After"] = "1"
        return response
    if board.request_stacks is None:
        gate.count("unavailable")
        return error(503, "this web has no broker connection to send requests on")
    try:
        request_id = board.request_stacks(asked)
    except StacksRequestError as exc:
        gate.count("unavailable")
        return error(503, str(exc))
    gate.accepted(run)
    log.info("stacks request %s for run %s: %s, ranks %s", request_id, run, asked.kind,
             "all" if asked.ranks is None else len(asked.ranks))
    return json_response({"request_id": request_id, "kind": asked.kind, "ranks": asked.ranks},
                         202)


@bp.get("/api/runs/<run>/events")
def events(run: str) -> Response:
    board = _board()
    hub = board.hub
    position = parse_position([request.headers.get("Last-Event-ID")])
    subscribed = hub.subscribe(run, position)
    if subscribed is None:
        return unknown_run(run)
    sub, initial, last = subscribed
    response = Response(
        client_stream(hub, sub, initial, last, board.ping_interval),
        content_type="text/event-stream",
    )
    response.call_on_close(lambda: hub.unsubscribe(sub))
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Accel-Buffering"] = "no"
    return response


@bp.get("/metrics")
def metrics() -> Response:
    # built off the event loop, series bounded (web/scrape.py, web/metricsranks.py)
    return Response(_board().registry.latest(), content_type=CONTENT_TYPE_LATEST)


# ------------------------------------------------------------------ the factory
def create_app(hub: AnyHub, config: Mapping[str, Any] | None = None) -> Flask:
    """The dashboard app over ``hub``; see the module docstring for ``config``."""
    config = dict(config or {})
    kwargs: dict[str, Any] = {}
    for key in ("template_folder", "static_folder"):
        if config.get(key):
            kwargs[key] = config[key]
    app = Flask(__name__, **kwargs)
    gate = RequestGate()
    registry = make_registry(hub)
    registry.register(StacksCollector(gate, registry.view))  # reads the scrape's view
    app.extensions["rankboard"] = Board(
        hub=hub,
        token=config.get("token") or None,
        allowed_hosts=frozenset(config.get("allowed_hosts") or LOOPBACK_HOSTS),
        ping_interval=float(config.get("ping_interval") or DEFAULT_PING_INTERVAL),
        registry=registry,
        read_only=bool(config.get("read_only")),
        request_stacks=config.get("request_stacks"),
        run_live=config.get("run_live"),
        gate=gate,
    )
    app.config["RANKBOARD_HUB"] = hub
    app.register_blueprint(bp)
    app.register_blueprint(cluster_bp)  # /api/runs, /api/hosts (web/clusterapi.py)
    return app
