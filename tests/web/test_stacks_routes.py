"""``GET``/``POST /api/runs/<run>/stacks`` against real webs (PROTOCOL.md section 4): every
rule of the POST in the contract's order (421 / 401 / 403 / 404 / 415 / 400 / 429; each
test pits two rules against each other, so a check moved out of order fails), the 202
answer, no CORS for a cross-site page, the counters on ``/metrics``, and real agent
processes (``tests/diag/stall_child.py``) hanging, grouped at ``GET /stacks`` and answering
a request for one rank only.

Each web is a real ``rankboard web`` subprocess on a broker in a thread; runs come from real
wire frames. Nothing sleeps to synchronise: waits poll a condition against a deadline."""
from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
from typing import Any, Callable, Iterator, Optional

import pytest

from rank_agent import protocol
from tests.support import REPO
from tests.support.brokers import Broker, Pusher
from tests.support.http import Resp, fetch, get_json
from tests.support.polling import wait_for
from tests.support.procs import Proc, start_web

RUN = "stk-1"
WORLD = 4
TOKEN = "s3cret-token"
JSON = {"Content-Type": "application/json"}
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def post(port: int, path: str, body: Any = None, headers: Optional[dict[str, str]] = None,
         raw: Optional[bytes] = None) -> Resp:
    """A POST with ``body`` as JSON (or ``raw`` bytes) and exactly ``headers``."""
    data = raw if raw is not None else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10.0)
    try:
        conn.request("POST", path, body=data, headers=headers or {})
        r = conn.getresponse()
        return Resp(r.status, r.headers, r.read())
    finally:
        conn.close()


def one_line_error(r: Resp, status: int) -> str:
    assert r.status == status, (r.status, r.body[:300])
    reason = r.json()["error"]
    assert reason and "\n" not in reason and "Traceback" not in reason
    return str(reason)


def has_run(port: int, run: str, headers: Optional[dict[str, str]] = None) -> bool:
    return fetch(port, f"/api/runs/{run}", headers=headers).status == 200


@pytest.fixture
def runs(pusher: Pusher) -> Callable[..., None]:
    """``runs(*names)``: register every rank of each run (world size :data:`WORLD`)."""
    def make(*names: str) -> None:
        for run in names:
            for rank in range(WORLD):
                pusher.register(run, rank, WORLD)
    return make


def start(spawn: Callable[..., Proc], broker: Broker, *extra: str, token: bool = False
          ) -> int:
    env = dict(os.environ, RANKBOARD_TOKEN=TOKEN) if token else None
    if not token:
        env = dict(os.environ)
        env.pop("RANKBOARD_TOKEN", None)
    return start_web(spawn, broker, *extra, env=env).wait_dashboard()


def test_host_check_comes_first(spawn: Callable[..., Proc], broker: Broker,
                                runs: Callable[..., None]) -> None:
    """421 before everything else: a rebinding page's Host is refused even where the web
    is read-only (403) and the run unknown (404) and the body no JSON (415)."""
    port = start(spawn, broker, "--read-only")
    for path in (f"/api/runs/{RUN}/stacks", "/api/runs/nope/stacks"):
        r = post(port, path, raw=b"x", headers={"Host": "evil.example", "Content-Type":
                                                 "text/plain"})
        one_line_error(r, 421)


def test_auth_then_read_only_then_unknown_run(spawn: Callable[..., Proc], broker: Broker,
                                              runs: Callable[..., None]) -> None:
    runs(RUN)
    port = start(spawn, broker, "--read-only", token=True)
    wait_for(lambda: has_run(port, RUN, BEARER), what="the run at the web")
    # no token: 401, whether the run exists or not (a refused caller learns nothing)
    for path in (f"/api/runs/{RUN}/stacks", "/api/runs/nope/stacks"):
        r = post(port, path, {"kind": "stacks"}, JSON)
        one_line_error(r, 401)
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    # with it: read-only refuses, before the run lookup (403 for an unknown run too)
    for path in (f"/api/runs/{RUN}/stacks", "/api/runs/nope/stacks"):
        assert "read-only" in one_line_error(post(port, path, {"kind": "stacks"},
                                                  {**JSON, **BEARER}), 403)
    # reading stays allowed on a read-only web
    r = fetch(port, f"/api/runs/{RUN}/stacks", headers=BEARER)
    assert r.status == 200 and r.json() == {"dumps": [], "groups": []}
    assert r.headers["Cache-Control"] == "no-store"
    assert r.headers["Content-Type"] == "application/json"
    # the page is told, and leaves its buttons out (tests/browser/test_stall_view.py)
    page = fetch(port, "/", headers=BEARER).text
    assert 'data-read-only="true"' in page
    metrics = fetch(port, "/metrics", headers=BEARER).text
    assert 'rankboard_stacks_requests_total{result="read_only"} 2.0' in metrics


def test_unknown_run_before_media_type_before_body(spawn: Callable[..., Proc], broker: Broker,
                                                   runs: Callable[..., None]) -> None:
    runs(RUN)
    port = start(spawn, broker)
    wait_for(lambda: has_run(port, RUN), what="the run at the web")
    assert 'data-read-only="false"' in fetch(port, "/").text
    # 404 before 415: an unknown run with a text body
    r = post(port, "/api/runs/nope/stacks", raw=b"{}", headers={"Content-Type": "text/plain"})
    assert one_line_error(r, 404) == "unknown run"
    assert fetch(port, "/api/runs/nope/stacks").status == 404
    # 415 before 400: what a cross-site page can send (a form, text/plain, no type at all),
    # even holding a valid request
    good = json.dumps({"kind": "stacks"}).encode()
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "text/plain;charset=UTF-8"},
                    {"Content-Type": "application/x-www-form-urlencoded"},
                    {"Content-Type": "multipart/form-data; boundary=x"}, {}):
        for body in (good, b"not json"):
            r = post(port, f"/api/runs/{RUN}/stacks", raw=body, headers=headers)
            assert "application/json" in one_line_error(r, 415)
            assert "Access-Control-Allow-Origin" not in r.headers
    # and no CORS preflight is ever granted, so a cross-origin JSON POST never leaves a browser
    r = fetch(port, f"/api/runs/{RUN}/stacks", method="OPTIONS",
              headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
                       "Access-Control-Request-Headers": "content-type"})
    assert "Access-Control-Allow-Origin" not in r.headers
    assert "Access-Control-Allow-Headers" not in r.headers


BAD_BODIES: list[tuple[bytes, str]] = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"kind": "heap"}', "kind"),
    (b"{}", "kind"),
    (b'{"kind": "stacks", "ranks": []}', "empty"),
    (b'{"kind": "stacks", "ranks": [-1]}', "negative"),
    (b'{"kind": "stacks", "ranks": [0, 4]}', "world size 4"),
    (b'{"kind": "stacks", "ranks": ["1"]}', "integers"),
    (b'{"kind": "stacks", "ranks": [true]}', "integers"),
    (b'{"kind": "stacks", "ranks": [1.5]}', "integers"),
    (b'{"kind": "stacks", "ranks": 1}', "list"),
    (b'{"kind": "profile", "seconds": 0.4}', "seconds"),
    (b'{"kind": "profile", "seconds": 60.5}', "seconds"),
    (b'{"kind": "profile", "seconds": "5"}', "seconds"),
    (b'{"kind": "profile", "seconds": true}', "seconds"),
    (b'{"kind": "profile", "hz": 0}', "hz"),
    (b'{"kind": "profile", "hz": 251}', "hz"),
    (b'{"kind": "profile", "hz": 1.5}', "hz"),
    (b'{"kind": "profile", "hz": "100"}', "hz"),
    (b'{"kind": "profile", "ranks": [9]}', "world size"),
]


def test_bad_bodies_are_400_and_do_not_count_for_429(
        spawn: Callable[..., Proc], broker: Broker, runs: Callable[..., None]) -> None:
    runs(RUN, "stk-2")
    port = start(spawn, broker)
    wait_for(lambda: has_run(port, RUN) and has_run(port, "stk-2"), what="the runs at the web")
    path = f"/api/runs/{RUN}/stacks"
    for body, word in BAD_BODIES:
        reason = one_line_error(post(port, path, raw=body, headers=JSON), 400)
        assert word in reason, (body, reason)
    # right after every refusal, an accepted request: refused ones never count for 429;
    # seconds/hz are ignored for a dump, whatever they hold
    r = post(port, path, {"kind": "stacks", "seconds": "soon", "hz": -3}, JSON)
    assert r.status == 202, r.body
    body = r.json()
    assert re.fullmatch(r"[0-9a-f]{16}", body["request_id"])
    assert body == {"request_id": body["request_id"], "kind": "stacks", "ranks": None}
    # 400 before 429: a bad body for the run just asked is still a 400
    one_line_error(post(port, path, {"kind": "nope"}, JSON), 400)
    # 429 for the same run within 1 s; another run is not held up
    assert "1 s" in one_line_error(post(port, path, {"kind": "profile"}, JSON), 429)
    r = post(port, "/api/runs/stk-2/stacks", {"kind": "profile", "ranks": [3, 1, 3],
                                              "seconds": 0.5, "hz": 250}, JSON)
    assert r.status == 202 and r.json()["kind"] == "profile" and r.json()["ranks"] == [1, 3]
    # a second later the run may be asked again
    ok = wait_for(lambda: (lambda r: r if r.status == 202 else None)(
        post(port, path, {"kind": "stacks", "ranks": [2]}, JSON)), timeout=5.0,
        interval=0.2, what="a request accepted after 1 s")
    assert ok.json()["ranks"] == [2]
    metrics = fetch(port, "/metrics").text
    assert 'rankboard_stacks_requests_total{result="accepted"} 3.0' in metrics
    assert f'rankboard_stacks_requests_total{{result="bad_request"}} {len(BAD_BODIES) + 1}.0' \
        in metrics
    assert re.search(r'rankboard_stacks_requests_total\{result="rate_limited"\} [1-9]', metrics)
    assert f'rankboard_rank_stalled{{host="node-a",rank="0",run="{RUN}"}} 0.0' in metrics


# ------------------------------------------------------------ real agents, end to end
def spawn_rank(broker: Broker, run: str, rank: int, where: str) -> subprocess.Popen[str]:
    env = dict(os.environ, RANKBOARD_CONTROL=broker.publish)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.diag.stall_child", broker.ingest, run, str(rank),
         str(WORLD), where], cwd=REPO, env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)


@pytest.fixture
def agents(broker: Broker) -> Iterator[list[subprocess.Popen[str]]]:
    where = ["collective", "collective", "collective", "loader"]
    procs = [spawn_rank(broker, "hang-web", r, where[r]) for r in range(WORLD)]
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def test_real_agents_are_grouped_and_answer_only_when_asked(
        spawn: Callable[..., Proc], broker: Broker, agents: list[subprocess.Popen[str]]) -> None:
    port = start(spawn, broker)
    for proc in agents:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("hanging")
    path = "/api/runs/hang-web/stacks"

    def groups() -> Any:
        view = get_json(port, path)
        top = view["groups"]
        return view if len(top) == 2 and top[0]["ranks"] == [0, 1, 2] else None

    view = wait_for(groups, timeout=30.0, what="the stall groups at GET /stacks")
    first, second = view["groups"]
    assert first["reason"] == "stall" and first["frames"][-1]["function"] == "hang_in_all_reduce"
    assert second["ranks"] == [3] and second["frames"][-1]["function"] == "hang_in_next_batch"
    assert all(set(f) == {"file", "line", "function", "code"} for f in first["frames"])
    wait_for(lambda: 'rankboard_rank_stalled{host=' in fetch(port, "/metrics").text and
             re.search(r'rankboard_rank_stalled\{[^}]*rank="3",run="hang-web"\} 1\.0',
                       fetch(port, "/metrics").text), what="the stalled gauge")

    r = post(port, path, {"kind": "stacks", "ranks": [1]}, JSON)
    assert r.status == 202, r.body
    request_id = r.json()["request_id"]

    def answered() -> Any:
        view = get_json(port, path)
        got = [d for d in view["dumps"] if d["reason"] == "request"]
        return view if got else None

    view = wait_for(answered, timeout=10.0, what="rank 1's answer")
    answers = [d for d in view["dumps"] if d["reason"] == "request"]
    assert [(d["rank"], d["request_id"]) for d in answers] == [(1, request_id)]
    assert any(g["reason"] == "request" and g["request_id"] == request_id and g["ranks"] == [1]
               for g in view["groups"])
    assert len(answers[0]["threads"]) >= 2  # every thread: the training one and the agent's


def test_read_only_flag_reaches_web_up_demo_and_workers() -> None:
    """``--read-only`` parses on ``web``, ``up`` and ``demo``, and a ``--workers`` supervisor
    writes it into its workers' command lines (WebConfig.argv), which parse back to it."""
    from rankboard import cli
    from rankboard.config import DemoConfig, UpConfig, WebConfig, from_args

    parser = cli.build_parser()

    def web_of(*argv: str) -> WebConfig:
        cfg = from_args(parser.parse_args(list(argv)))
        if isinstance(cfg, DemoConfig):
            return cfg.up.web
        if isinstance(cfg, UpConfig):
            return cfg.web
        assert isinstance(cfg, WebConfig)
        return cfg

    for command in ("web", "up", "demo"):
        assert web_of(command, "--read-only").read_only is True, command
        assert web_of(command).read_only is False, command
    worker = web_of("web", "--read-only", "--workers", "2").worker(1, 8585)
    assert "--read-only" in worker.argv()
    assert web_of(*worker.argv()).read_only is True


def test_get_stacks_is_json_with_non_finite_as_null(spawn: Callable[..., Proc], broker: Broker,
                                                    pusher: Pusher,
                                                    runs: Callable[..., None]) -> None:
    """A rank's dump with a non-finite ``idle_s`` is served with ``null`` there (PROTOCOL 4:
    every JSON route), not as ``Infinity``, which no JSON parser reads. (A NaN one is a
    schema reject since issue 32; infinity is still valid.)"""
    from rank_agent import protocol as wire

    runs(RUN)
    port = start(spawn, broker)
    thread = wire.ThreadStack(name="MainThread", main=True, frames=[
        wire.StackFrame(file="/job/train.py", line=3, function="wait", code="x()")])
    pusher.send(wire.Stacks(run=RUN, rank=2, reason="stall", taken_at=1.0e9,
                            idle_s=float("inf"), threads=[thread]))

    def dumped() -> Any:
        r = fetch(port, f"/api/runs/{RUN}/stacks")
        return r if r.status == 200 and json.loads(r.body)["dumps"] else None

    r = wait_for(dumped, what="the dump at GET /stacks")
    assert b"NaN" not in r.body and b"Infinity" not in r.body
    dump = r.json()["dumps"][0]
    assert dump["rank"] == 2 and dump["idle_s"] is None and dump["host"] == "node-a"
    assert dump["threads"][0]["frames"][0]["function"] == "wait"


def test_an_ended_run_is_409_with_its_reason(spawn: Callable[..., Proc], broker: Broker,
                                            pusher: Pusher, runs: Callable[..., None]) -> None:
    """Issue 43 item 4: a request for a run whose ranks have all finished can never be
    answered: 409 and one line saying so (a bad body is still 400: checked after it)."""
    port = start(spawn, broker)
    runs("ended-2")
    for rank in range(WORLD):
        pusher.send(protocol.Finish(run="ended-2", rank=rank,
                                    status="error" if rank == 1 else "ok"))
    wait_for(lambda: has_run(port, "ended-2")
             and get_json(port, "/api/runs/ended-2")["status"] == "failed",
             what="the run failed")
    path = "/api/runs/ended-2/stacks"
    assert "has ended (failed)" in one_line_error(post(port, path, {"kind": "stacks"}, JSON), 409)
    one_line_error(post(port, path, {"kind": "nope"}, JSON), 400)
    metrics = fetch(port, "/metrics").body.decode()
    assert 'rankboard_stacks_requests_total{result="ended"} 1.0' in metrics
