"""Every HTTP route of PROTOCOL 4 over real sockets: a real broker, a real web subprocess."""
from __future__ import annotations

import csv
import io
import math
from typing import Any

from rank_agent import protocol
from tests.support.brokers import Pusher
from tests.support.http import fetch, get_json
from tests.support.polling import wait_for

HEADER_KEYS = {"run", "status", "world_size", "total_epochs", "label", "shard", "hash", "port", "metadata",
               "hardware", "has_svg", "hosts", "alerts", "started_at", "updated_at",
               "steps_done", "step_metrics", "data_share", "data_stragglers",
               "collectives_last", "total_steps", "eta_secs", "alert_ranks", "failure"}
HEADER_KEYS |= {"nonfinite", "nonfinite_more", "replica_divergence"}  # v5, 8.3
HEADER_KEYS |= {"attempt", "attempts", "alert_attempts"}  # v5, 8.1
RANK_KEYS = {"rank", "host", "local_rank", "status", "last_seen", "epoch", "hardware", "resources",
             "step", "step_ms", "data_ms", "slowest_share"} | {"error"}
RECORD_KEYS = {"epoch", "total_epochs", "duration_secs", "elapsed_secs", "eta_secs", "metrics",
               "resources", "gpu_metrics", "missing_ranks", "attempt"}
LIST_KEYS = {"run", "status", "world_size", "total_epochs", "epochs_done", "label", "started_at",
             "updated_at", "shard", "ranks_stalled", "ranks_stale", "alerts", "steps_done", "attempt"}
PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
            "connect-src 'self'; frame-ancestors 'none'; object-src 'none'; base-uri 'none'")
SVG = '<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="5" height="5"/></svg>'


def full_run(p: Pusher, run: str, epochs: int = 3, nan_epoch: int = -1) -> None:
    """A finished 2-rank run with metadata, svg, hardware, resources and a scalar."""
    p.register(run, 0, 2, host="node-a", local_rank=0, port=8686, total_epochs=epochs)
    p.register(run, 1, 2, host="node-b", local_rank=0, total_epochs=epochs)
    p.send(protocol.Metadata(run=run, rank=0, json='{"lr": 0.1, "name": "x"}'),
           protocol.Svg(run=run, rank=0, svg=SVG, label="net", hash="abc123"),
           protocol.Hardware(run=run, rank=0, summary="cpu0 | gpu0"),
           protocol.Resources(run=run, rank=0, sample=protocol.ResourceSample(
               cpu_percent=40.0, ram_used_bytes=10, ram_total_bytes=100, gpu_util_percent=90.0,
               vram_allocated_bytes=5, vram_total_bytes=50)))
    for e in range(epochs):
        loss = math.nan if e == nan_epoch else 1.0 / (e + 1)
        p.epoch(run, e, 2, loss=loss, scalars={"acc": (0.5 + e / 10, 1)} if e else {})
    for rank in range(2):
        p.send(protocol.Finish(run=run, rank=rank))


def wait_run(port: int, run: str, pred: Any, what: str) -> dict[str, Any]:
    def check() -> Any:
        r = fetch(port, f"/api/runs/{run}")
        if r.status != 200:
            return None
        body = r.json()
        return body if pred(body) else None

    return wait_for(check, what=what)


def test_run_routes_and_exact_shapes(web: Any, pusher: Pusher) -> None:
    run = "exp-1:a.b_c"
    full_run(pusher, run, nan_epoch=1)
    body = wait_run(web.port, run, lambda b: b["status"] == "complete" and len(b["records"]) == 3
                    and b["ranks"] and all(r["status"] == "finished" for r in b["ranks"]),
                    "the run to complete")
    assert set(body) == HEADER_KEYS | {"ranks", "records"}
    assert body["run"] == run and body["world_size"] == 2 and body["total_epochs"] == 3
    assert body["label"] == "net" and body["hash"] == "abc123" and body["port"] == 8686
    assert body["metadata"] == {"lr": 0.1, "name": "x"} and body["has_svg"] is True
    assert body["hosts"] == [{"host": "node-a", "ranks": [0]}, {"host": "node-b", "ranks": [1]}]
    assert body["hardware"].startswith("node-a: cpu0")
    for rank in body["ranks"]:
        assert set(rank) == RANK_KEYS  # the feed's "loss" is not public
    for rec in body["records"]:
        assert set(rec) == RECORD_KEYS
    assert [r["epoch"] for r in body["records"]] == [0, 1, 2]
    assert body["records"][1]["metrics"]["loss"] is None  # NaN -> null
    assert list(body["records"][1]["metrics"]) == ["loss", "acc"]

    runs = get_json(web.port, "/api/runs")
    assert [set(r) for r in runs] == [LIST_KEYS]
    assert runs[0]["epochs_done"] == 3 and runs[0]["status"] == "complete"

    assert get_json(web.port, f"/api/runs/{run}/history") == body["records"]

    r = fetch(web.port, f"/api/runs/{run}/history.csv")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/csv")
    rows = list(csv.reader(io.StringIO(r.text)))
    assert rows[0] == ["epoch", "duration_secs", "loss", "acc", "cpu_percent", "ram_used_bytes",
                       "ram_total_bytes", "gpu_util_percent", "vram_allocated_bytes",
                       "vram_total_bytes"]
    assert [row[0] for row in rows[1:]] == ["0", "1", "2"]
    assert rows[1][3] == "" and rows[2][2] == ""  # absent acc, NaN loss
    assert rows[1][4] == "40.0"

    r = fetch(web.port, f"/api/runs/{run}/graph.svg")
    assert r.status == 200 and r.text == SVG
    assert r.headers["Content-Type"] == "image/svg+xml"
    assert r.headers["Content-Security-Policy"] == "default-src 'none'; style-src 'unsafe-inline'; sandbox"
    assert r.headers["X-Content-Type-Options"] == "nosniff"

    # URL-path-escaped run ids work
    assert fetch(web.port, "/api/runs/exp-1%3Aa.b_c/history").status == 200


def test_run_without_svg_and_unknown_runs_404(web: Any, pusher: Pusher) -> None:
    pusher.register("plain", 0, 1)
    wait_run(web.port, "plain", lambda b: b["world_size"] == 1, "the run")
    assert fetch(web.port, "/api/runs/plain/graph.svg").status == 404
    for suffix in ("", "/history", "/history.csv", "/graph.svg", "/events"):
        for run in ("nope", "bad%20id", "x" * 200, "%2e%2e"):
            r = fetch(web.port, f"/api/runs/{run}{suffix}")
            assert r.status == 404, (run, suffix)
            assert "error" in r.json()
    r = fetch(web.port, "/no/such/route")
    assert r.status == 404 and r.json()["error"]
    r = fetch(web.port, "/api/runs", method="POST")
    assert r.status == 405
    assert "Traceback" not in web.output("stderr")


def test_security_headers_on_every_response(web: Any) -> None:
    for path in ("/", "/healthz", "/api/runs", "/metrics", "/nope", "/static/nope.js"):
        r = fetch(web.port, path)
        assert r.headers["Content-Security-Policy"] == PAGE_CSP, path
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["X-Frame-Options"] == "DENY"
        assert r.headers["Referrer-Policy"] == "no-referrer"


def test_page_and_static(web: Any) -> None:
    r = fetch(web.port, "/")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
    assert b"<script>" not in r.body.replace(b" ", b"")  # no inline script
    r = fetch(web.port, "/static/dashboard.js")
    assert r.status == 200 and "javascript" in r.headers["Content-Type"]


def test_healthz_and_metrics(web: Any, pusher: Pusher) -> None:
    r = fetch(web.port, "/healthz")
    assert r.status == 200 and r.json() == {"ok": True, "shards": [
        {"shard": 0, "connected": True, "journal": "ok"}], "journal": "ok"}
    pusher.sock.send(b"\xc1 not msgpack")
    pusher.register("m", 0, 1, host="h0")
    pusher.send(protocol.Resources(run="m", rank=0, sample=protocol.ResourceSample(
        cpu_percent=33.0, gpu_util_percent=70.0, vram_allocated_bytes=1024)))
    pusher.epoch("m", 0, 1, loss=0.75)

    def scrape() -> str:
        text = fetch(web.port, "/metrics").text
        return text if ('rankboard_rank_loss{host="h0",rank="0",run="m"} 0.75' in text
                        and 'reason="decode"' in text) else ""

    text = wait_for(scrape, what="per-rank gauges and the reject counter")
    assert 'rankboard_frames_rejected_total{reason="decode"} 1.0' in text
    assert 'rankboard_rank_cpu_percent{host="h0",rank="0",run="m"} 33.0' in text
    assert 'rankboard_rank_gpu_util_percent{host="h0",rank="0",run="m"} 70.0' in text
    assert 'rankboard_rank_vram_used_bytes{host="h0",rank="0",run="m"} 1024.0' in text
    assert 'rankboard_rank_epoch{host="h0",rank="0",run="m"} 0.0' in text
    assert 'rankboard_rank_last_seen_age_seconds{host="h0",rank="0",run="m"}' in text
    assert "rankboard_frames_accepted_total" in text
    assert 'rankboard_runs{status="training"} 1.0' in text


def test_healthz_503_until_a_late_broker_comes_up(spawn: Any, tmp_path: Any) -> None:
    from tests.support.brokers import Broker
    from tests.support.procs import start_web

    class Nowhere:  # endpoints nobody binds yet (ipc in an empty tmp dir)
        publish = f"ipc://{tmp_path}/pub"
        snapshot = f"ipc://{tmp_path}/snap"

    web = start_web(spawn, Nowhere(), healthy=False)
    r = fetch(web.port, "/healthz")
    assert r.status == 503 and r.json() == {"ok": False, "shards": [
        {"shard": 0, "connected": False, "journal": "ok"}], "journal": "ok"}
    assert fetch(web.port, "/api/runs").json() == []

    late = Broker(tmp_path / "data", {"ingest": "tcp://127.0.0.1:*", "publish": Nowhere.publish,
                                      "snapshot": Nowhere.snapshot})
    pusher = Pusher(late.ingest)
    try:
        wait_for(lambda: fetch(web.port, "/healthz").status == 200, what="healthy once it is up")
        pusher.register("late", 0, 1)
        wait_for(lambda: fetch(web.port, "/api/runs/late").status == 200, what="its run")
    finally:
        pusher.close()
        late.stop()


def test_web_restart_restores_history_from_the_broker(spawn: Any, broker: Any,
                                                      pusher: Pusher) -> None:
    from tests.support.procs import start_web

    first = start_web(spawn, broker)
    full_run(pusher, "kept", epochs=4)
    before = wait_run(first.port, "kept", lambda b: len(b["records"]) == 4, "4 records")
    assert first.stop() == 0
    second = start_web(spawn, broker)
    after = get_json(second.port, "/api/runs/kept")
    assert after["records"] == before["records"]
    assert after["status"] == before["status"] == "complete"


def test_malformed_http_is_a_clean_4xx_without_traceback(web: Any) -> None:
    import socket

    for raw in (b"GARBAGE\r\n\r\n",
                b"GET /api/runs/%zz%00/events HTTP/1.1\r\nHost: 127.0.0.1\r\nLast-Event-ID: \xff\xfe\r\n\r\n",
                b"GET /api/runs/a/events HTTP/1.1\r\nHost: 127.0.0.1\r\nLast-Event-ID: 1\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", web.port), timeout=10) as s:
            s.sendall(raw)
            data = b""
            while b"\r\n" not in data:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        status = data.split(b"\r\n", 1)[0]
        assert status.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")), (raw, status)
    assert "Traceback" not in web.output("stderr")
