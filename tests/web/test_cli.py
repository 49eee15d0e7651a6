"""The web commands as subprocesses: token auth, the bind refusal, ``up``'s lazy bind and
``demo`` end to end (start, a run that advances, clean SIGINT)."""
from __future__ import annotations

import re
import signal
import socket
import time
from typing import Any

import psutil

from tests.support.brokers import Pusher
from tests.support.demorun import step_runs
from tests.support.http import SSEClient, fetch, get_json
from tests.support.polling import wait_for
from tests.support.procs import start_web

TOKEN = "s3cret-token"


def test_token_auth(spawn: Any, broker: Any, pusher: Pusher) -> None:
    web = start_web(spawn, broker, "--token", TOKEN)
    pusher.register("authrun", 0, 1)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    wait_for(lambda: fetch(web.port, "/api/runs/authrun", bearer).status == 200, what="run")

    assert fetch(web.port, "/healthz").status == 200  # open
    for path in ("/", "/api/runs", "/api/runs/authrun", "/api/runs/authrun/history",
                 "/api/runs/authrun/history.csv", "/api/runs/authrun/graph.svg",
                 "/api/runs/authrun/events", "/metrics", "/static/dashboard.js", "/nope"):
        r = fetch(web.port, path)
        assert r.status == 401, path
        assert r.headers["X-Frame-Options"] == "DENY"
        assert fetch(web.port, path, {"Authorization": "Bearer wrong"}).status == 401
        assert fetch(web.port, path + "?token=wrong").status == 401
    assert fetch(web.port, "/api/runs", bearer).status == 200
    assert fetch(web.port, "/metrics", bearer).status == 200

    r = fetch(web.port, f"/?token={TOKEN}")
    assert r.status == 200
    cookie = r.headers["Set-Cookie"]
    attrs = [a.strip().lower() for a in cookie.split(";")]
    assert "httponly" in attrs and "samesite=strict" in attrs and "path=/" in attrs
    assert TOKEN not in cookie
    pair = cookie.split(";")[0]
    with_cookie = {"Cookie": pair}
    assert fetch(web.port, "/api/runs", with_cookie).status == 200
    assert fetch(web.port, "/api/runs", {"Cookie": pair + "x"}).status == 401
    with SSEClient(web.port, "/api/runs/authrun/events", with_cookie) as c:
        assert c.status == 200
        ev = c.next_event()
        assert ev is not None and ev["event"] == "run"


def test_non_loopback_bind_without_token_is_refused(spawn: Any, broker: Any) -> None:
    for cmd in ("web", "up"):
        proc = spawn(cmd, "--publish", broker.publish, "--snapshot", broker.snapshot,
                     "--host", "0.0.0.0", "--port", "0")
        code = proc.proc.wait(30)
        proc.close()
        assert code != 0
        err = [line for line in proc.lines["stderr"] if line.strip()]
        assert len(err) == 1, err
        assert "--token" in err[0] and "0.0.0.0" in err[0]


def test_web_bind_failure_is_one_line(spawn: Any, broker: Any) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        port = holder.getsockname()[1]
        proc = spawn("web", "--publish", broker.publish, "--snapshot", broker.snapshot,
                     "--port", str(port))
        code = proc.proc.wait(30)
        proc.close()
    finally:
        holder.close()
    assert code == 1
    err = [line for line in proc.lines["stderr"] if "rankboard web:" in line]
    assert len(err) == 1 and str(port) in err[0] and "in use" in err[0].lower(), proc.lines


def test_up_binds_lazily_on_the_first_registered_port(spawn: Any, tmp_path: Any) -> None:
    up = spawn("up", "--ingest", "tcp://127.0.0.1:*", "--publish", "tcp://127.0.0.1:*",
               "--snapshot", "tcp://127.0.0.1:*", "--data-dir", str(tmp_path / "data"),
               "--port-from-rank")
    ingest = up.wait_line(r"broker ingest bound at (\S+)", stream="stderr").group(1)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    pusher = Pusher(ingest)
    try:
        # the port is taken: the bind fails, is reported, and the web waits for the next one
        def failed() -> bool:
            pusher.register("launch", 0, 2, port=port)
            return f"cannot bind the web to 127.0.0.1:{port}" in up.output()

        wait_for(failed, what="a failed lazy bind")
        # before the web binds, up has said only which shard it serves and the ranks' line
        # (the control channel's trust line, issue 38 finding 6, is the last start-up line)
        assert up.lines["stdout"][:2] == ["shard 0/1", f"RANKBOARD_BROKER={ingest}"]
        assert [line for line in up.lines["stdout"][2:] if not line.startswith("control channel:")] == []
        holder.close()
        n = len(up.lines["stdout"])

        def bound() -> bool:
            pusher.register("launch", 1, 2, port=port)
            return any(line.startswith("dashboard:") for line in up.lines["stdout"][n:])

        wait_for(bound, what="the lazy bind")
        assert up.wait_line(r"^dashboard: http://localhost:(\d+)$").group(1) == str(port)
        assert up.wait_line(rf"^ssh -L {port}:localhost:{port} \S+$")
        wait_for(lambda: fetch(port, "/healthz").status == 200, what="healthz")
        assert get_json(port, "/api/runs")[0]["run"] == "launch"
        # a later, different port is warned about and ignored
        pusher.register("other", 0, 1, port=port + 1 if port < 65535 else port - 1)
        up.wait_line(rf"already on {port} \(ignored\)", stream="stderr")
    finally:
        pusher.close()
        holder.close()
    assert up.stop(signal.SIGINT) == 0


def test_demo_runs_and_stops_cleanly_on_sigint(spawn: Any) -> None:
    # 4 epochs: the epoch job fails at its next-to-last (the demo's first failure, 8.2), so
    # epochs 0 and 1 close
    demo = spawn("demo", "--port", "0", "--ranks", "4", "--hosts", "2", "--epochs", "4",
                 "--epoch-seconds", "0.3")
    port = demo.wait_dashboard(timeout=30)
    wait_for(lambda: fetch(port, "/healthz").status == 200, what="healthz")

    def advanced() -> Any:
        runs = get_json(port, "/api/runs")
        return runs if runs and runs[-1]["epochs_done"] >= 2 else None

    runs = wait_for(advanced, timeout=30, what="the demo run to advance")
    run = runs[-1]["run"]
    body = get_json(port, f"/api/runs/{run}")
    assert body["world_size"] == 4 and body["total_epochs"] == 4
    assert [h["host"] for h in body["hosts"]] == ["node-a", "node-b"]
    assert body["has_svg"] and body["metadata"]["world_size"] == 4
    assert fetch(port, f"/api/runs/{run}/graph.svg").status == 200
    assert {"loss", "accuracy"} <= set(body["records"][0]["metrics"])

    # the simulated GPUs (rankboard.demogpu), both on the last host, node-b: rank 3's (local
    # rank 1) throttles thermally, rank 2's (local rank 0) reports XID 79, and the broker
    # raises both alerts; the step run lasts long enough for both (the epoch runs here are
    # two samples long)
    def gpu_alerts() -> Any:
        steps = step_runs(port)
        if not steps:
            return None
        alerts = {(a["kind"], a["rank"]): a["message"] for a in get_json(port, f"/api/runs/{steps[-1]}")["alerts"]}
        return alerts if ("gpu_xid", 2) in alerts and ("gpu_throttle", 3) in alerts else None

    alerts = wait_for(gpu_alerts, timeout=30, what="the demo's gpu_throttle and gpu_xid alerts")
    assert alerts[("gpu_xid", 2)] == "XID 79 on GPU 0"
    assert alerts[("gpu_throttle", 3)] == "hw_thermal throttling on GPU 1 (SM 1410 MHz)"
    assert {kind for kind, _ in alerts if kind.startswith("gpu_")} == {"gpu_xid", "gpu_throttle"}
    # the cluster view names node-b (rank 2's host) a suspect for that XID (PROTOCOL 7.4)
    steps_run = step_runs(port)[-1]
    node_b = next(h for h in get_json(port, "/api/hosts") if h["host"] == "node-b")
    assert node_b["suspect"] is True and f"gpu_xid in {steps_run}" in node_b["reasons"]
    assert get_json(port, "/api/hosts")[0]["suspect"] is True

    children = psutil.Process(demo.proc.pid).children(recursive=True)
    assert children, "the broker child should be running"
    started = time.monotonic()
    assert demo.stop(signal.SIGINT, timeout=20) == 0
    assert time.monotonic() - started < 15
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive
    out = demo.output()
    assert "Traceback" not in out
    # the demo's broker sits in the default port layout (publish = ingest + 1), so no rank
    # warns that its control channel might be someone else's socket
    assert "is not the broker's publish socket" not in out


def test_up_broker_bind_failure_is_one_line(spawn: Any, tmp_path: Any) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        port = holder.getsockname()[1]
        proc = spawn("up", "--ingest", f"tcp://127.0.0.1:{port}", "--publish", "tcp://127.0.0.1:*",
                     "--snapshot", "tcp://127.0.0.1:*", "--data-dir", str(tmp_path / "d"),
                     "--port", "0")
        code = proc.proc.wait(30)
        proc.close()
    finally:
        holder.close()
    assert code == 1
    err = [line for line in proc.lines["stderr"] if line.startswith("rankboard ")]
    assert len(err) == 1 and err[0].startswith("rankboard up:"), proc.lines["stderr"]
    assert str(port) in err[0] and "in use" in err[0].lower()


def test_another_loopback_host_prints_a_url_that_reaches_it(spawn: Any, broker: Any) -> None:
    """``--host 127.0.0.2``: the printed URL names 127.0.0.2 (``localhost`` does not reach
    it), and a request to it answers, its ``Host`` (the bound address) accepted."""
    import http.client

    web = spawn("web", "--publish", broker.publish, "--snapshot", broker.snapshot,
                "--host", "127.0.0.2", "--port", "0")
    url = web.wait_line(r"^dashboard: (http://\S+)$").group(1)
    m = re.fullmatch(r"http://127\.0\.0\.2:(\d+)", url)
    assert m, url
    web.wait_line(rf"^ssh -L {m.group(1)}:127\.0\.0\.2:{m.group(1)} \S+$")

    def answered() -> bool:
        conn = http.client.HTTPConnection("127.0.0.2", int(m.group(1)), timeout=5)
        try:
            conn.request("GET", "/api/runs")
            return conn.getresponse().status == 200
        finally:
            conn.close()

    wait_for(answered, what="the web at the printed URL", retry_on=(OSError,))


def test_a_web_with_no_broker_says_so_once_in_its_log(spawn: Any) -> None:
    """No heartbeat within FeedPump.SILENCE_LOG_AFTER of start: one error line naming the
    endpoint (libzmq does not retry a connection whose handshake failed, so without it a web
    meeting a broker it cannot talk to could sit at 503 with nothing in its log)."""
    from tests.support.procs import Endpoints, start_web

    with socket.socket() as a, socket.socket() as b:  # two ports nobody listens on
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        dead = Endpoints("tcp://127.0.0.1:1", f"tcp://127.0.0.1:{a.getsockname()[1]}",
                         f"tcp://127.0.0.1:{b.getsockname()[1]}")
        web = start_web(spawn, dead, healthy=False)
        line = web.wait_line(r"no heartbeat from the broker at (\S+) after 10 s", stream="stderr",
                             timeout=30.0)
        assert line.group(1) == dead.publish
        assert "Traceback" not in web.output()


def test_up_survives_a_burst_of_signals_and_exits_0(spawn: Any) -> None:
    """Issue 27: SIGTERM and SIGINT sent many times over (as systemd, Kubernetes or a
    Ctrl-C to the process group do) stop ``up`` and its broker child cleanly: exit 0
    within seconds, no traceback."""
    from tests.broker.test_cli_broker import burst

    up = spawn("up", "--port", "0", "--ingest", "tcp://127.0.0.1:*",
               "--publish", "tcp://127.0.0.1:*", "--snapshot", "tcp://127.0.0.1:*")
    up.wait_dashboard(timeout=30)
    children = psutil.Process(up.proc.pid).children(recursive=True)
    assert children  # the broker
    started = time.monotonic()
    burst(up.proc.pid)
    assert up.proc.wait(20) == 0, up.output("stderr")[-3000:]
    assert time.monotonic() - started < 15
    assert "Traceback" not in up.output("stderr"), up.output("stderr")[-3000:]
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
