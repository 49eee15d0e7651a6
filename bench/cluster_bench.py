"""cluster_*: the cluster view (PROTOCOL 7.4) over 3,000 runs. Run: ``python
bench/cluster_bench.py [--quick]``; it prints one JSON line per figure.

* ``runs_api_3000_p99_ms``: ``GET /api/runs`` filtered and paged (five queries in turn:
  a status, two statuses, a search, a deep page, all three), through the real app (Flask's
  test client: routing, the hooks, the JSON encoding) over a real :class:`web.hub.Hub`
  holding 3 shards x 1,000 runs of 8 ranks on 1,024 hosts. Before each request the ranks
  of the 10 training runs are replaced, as their ``ranks`` events do, so the per-run cache
  is never all warm. p99 of 400 requests.
* ``hosts_api_3000_ms``: ``GET /api/hosts`` over the same hub, **cold** (every run's
  derived hosts built afresh, as after a web start or a full re-snapshot, which replaces
  every run's state): median of 5 fresh hubs. ``warm_p50_ms``: after 10 runs' headers
  changed (the live case).
* ``cluster_page_first_draw_3000_s``: a real broker (``--max-runs 4000``) and a real web
  process holding 3,000 runs registered by real frames (8 ranks each on 1,024 hosts; 150
  failed with a ``rank_error``, 30 with a GPU XID, 10 training); headless Chromium opens
  ``/#cluster``; from navigation start until both tables have drawn their data (the view
  records ``performance.now()``). Median of 3 fresh pages.
* ``cluster_page_live_cpu_ms_per_s``: that page kept open while the 10 training runs send
  steps frames (every rank every 0.25 s): the renderer main thread's busy time per wall
  second (DevTools ``Performance.getMetrics`` TaskDuration), after a warm-up.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import Proc, http_get, percentile, push_socket, result, wait_for

from rank_agent import protocol
from rank_agent.protocol import Finish, GpuSample, Register, Resources, ResourceSample, Steps
from web.children import terminate_all

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update"]
RUNS = 3000
SHARDS = 3
HOSTS = 1024
WORLD = 8
PER_HOST = 4
TRAINING = 10
QUERIES = ["/api/runs?status=failed&limit=50",
           "/api/runs?status=training,waiting&limit=100",
           "/api/runs?q=run-01&limit=50",
           "/api/runs?limit=100&offset=2900",
           "/api/runs?status=complete&q=7&limit=50&offset=100"]


def run_id(i: int) -> str:
    return f"run-{i:05d}"


def host_of(i: int, rank: int) -> str:
    return f"node-{(2 * i + rank // PER_HOST) % HOSTS:04d}"


def status_of(i: int) -> str:
    if i >= RUNS - TRAINING:
        return "training"
    if i % 20 == 3:
        return "failed"
    if i % 75 == 1:
        return "waiting"
    return "complete"


# ---------------------------------------------------------------- in-process API figures
def _hub() -> Any:
    from web.hub import Hub
    from web.runstate import RunState

    hub = Hub()
    for i in range(RUNS):
        state = RunState(run_id(i))
        alerts = []
        if i % 10 == 0:
            alerts.append({"kind": "stale", "rank": 5, "message": "stale", "at": 1000.0 + i})
        if i % 100 == 7:
            alerts.append({"kind": "gpu_xid", "rank": 0, "message": "XID 79", "at": 2000.0 + i})
        if status_of(i) == "failed":
            alerts.append({"kind": "rank_error", "rank": 1, "message": "x", "at": 3000.0 + i})
        hosts: dict[str, list[int]] = {}
        for r in range(WORLD):
            hosts.setdefault(host_of(i, r), []).append(r)
        state.set_header({
            "run": run_id(i), "status": status_of(i), "world_size": WORLD, "total_epochs": 10,
            "label": f"sweep {i % 37}", "started_at": 1e6 + i, "updated_at": 1e6 + i + 60,
            "shard": i % SHARDS, "alerts": alerts,
            "hosts": [{"host": h, "ranks": rs} for h, rs in hosts.items()]})
        state.set_ranks([{"rank": r, "status": "stale" if (i % 10 == 0 and r == 5) else "ok"}
                         for r in range(WORLD)], 1)
        hub.runs[state.run] = state
    return hub


def _touch(hub: Any, what: str) -> None:
    """What the live feed does to the 10 training runs: new ranks arrays, new headers."""
    for i in range(RUNS - TRAINING, RUNS):
        state = hub.runs[run_id(i)]
        if what == "ranks":
            state.set_ranks([dict(r) for r in state.ranks], state.ranks_seq + 1)
        else:
            state.set_header(dict(state.header, updated_at=state.header["updated_at"] + 1))


def api_figures(quick: bool) -> list[dict[str, Any]]:
    from web.app import create_app

    hub = _hub()
    client = create_app(hub, {"allowed_hosts": ["localhost"]}).test_client()
    headers = {"Host": "localhost"}
    n = 40 if quick else 400
    times = []
    for k in range(n):
        _touch(hub, "ranks")
        t0 = time.perf_counter()
        resp = client.get(QUERIES[k % len(QUERIES)], headers=headers)
        times.append((time.perf_counter() - t0) * 1000.0)
        assert resp.status_code == 200
    full = []
    for _ in range(8 if quick else 20):  # what the page polls: every run, unfiltered
        _touch(hub, "ranks")
        t0 = time.perf_counter()
        assert len(client.get("/api/runs", headers=headers).get_json()) == RUNS
        full.append((time.perf_counter() - t0) * 1000.0)
    out = [result("runs_api_3000_p99_ms", round(percentile(times, 99), 2), "ms", runs=RUNS,
                  shards=SHARDS, requests=n, p50_ms=round(percentile(times, 50), 2),
                  unfiltered_p50_ms=round(statistics.median(full), 2))]
    cold = []
    size = 0
    for _ in range(2 if quick else 5):
        fresh = _hub()
        c = create_app(fresh, {"allowed_hosts": ["localhost"]}).test_client()
        t0 = time.perf_counter()
        resp = c.get("/api/hosts", headers=headers)
        cold.append((time.perf_counter() - t0) * 1000.0)
        size = len(resp.data)
        body = json.loads(resp.data)
        assert len(body) == HOSTS and body[0]["suspect"], body[0]
    warm = []
    for _ in range(10 if quick else 20):
        _touch(hub, "header")
        t0 = time.perf_counter()
        assert client.get("/api/hosts", headers=headers).status_code == 200
        warm.append((time.perf_counter() - t0) * 1000.0)
    out.append(result("hosts_api_3000_ms", round(statistics.median(cold), 1), "ms", runs=RUNS,
                      hosts=HOSTS, warm_p50_ms=round(statistics.median(warm), 2),
                      answer_kib=round(size / 1024)))
    return out


# --------------------------------------------------------------------- the page figures
class Feed:
    """Every run's frames over one PUSH socket; then the training runs' steps, in a thread."""

    def __init__(self, ingest: str) -> None:
        self.ctx, self.sock = push_socket(ingest)
        self.enc = protocol.encoder.encode
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def populate(self) -> None:
        xid = ResourceSample(gpus=[GpuSample(device_index=0, name="H100", xid_errors=[79])])
        for i in range(RUNS):
            run = run_id(i)
            for r in range(WORLD):
                self.sock.send(self.enc(Register(run=run, rank=r, world_size=WORLD,
                                                 host=host_of(i, r), local_rank=r % PER_HOST)))
            if i % 100 == 7:
                self.sock.send(self.enc(Resources(run=run, rank=0, sample=xid)))
            st = status_of(i)
            if st in ("complete", "failed"):
                for r in range(WORLD):
                    self.sock.send(self.enc(Finish(run=run, rank=r, status="error"
                                                   if st == "failed" and r == 1 else "ok")))

    def _loop(self) -> None:
        step = 0
        t_next = time.monotonic()
        while not self.stop.is_set():
            now = time.time()
            for i in range(RUNS - TRAINING, RUNS):
                for r in range(WORLD):
                    self.sock.send(self.enc(Steps(run=run_id(i), rank=r, steps=[step, step + 1],
                                                  times=[now - 0.1, now], step_ms=[100.0, 101.0],
                                                  metrics={"loss": [1.0, 0.99]})))
            step += 2
            t_next += 0.25
            self.stop.wait(max(0.0, t_next - time.monotonic()))

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(5)
        self.sock.close()
        self.ctx.term()


def _start(data: Path, procs: list[Proc]) -> tuple[str, int]:
    """A broker and a web on ephemeral loopback ports (appended to ``procs`` at once, so
    the caller stops them even when one fails to start): ``(ingest, web port)``."""
    import re
    broker = Proc(["broker", "--ingest", "tcp://127.0.0.1:*", "--publish", "tcp://127.0.0.1:*",
                   "--snapshot", "tcp://127.0.0.1:*", "--data-dir", str(data),
                   "--max-runs", "4000", "--log-level", "INFO"])
    procs.append(broker)
    bound = re.compile(r"broker (ingest|publish|snapshot) bound at (\S+)")
    ends = wait_for(lambda: (lambda f: f if len(f) == 3 else None)(
        {m.group(1): m.group(2) for m in broker.find(bound)}), 60, "the broker to bind")
    web = Proc(["web", "--publish", ends["publish"], "--snapshot", ends["snapshot"],
                "--port", "0", "--log-level", "WARNING"])
    procs.append(web)
    dash = re.compile(r"dashboard: http://localhost:(\d+)")
    port = int(wait_for(lambda: web.find(dash), 60, "the web to bind")[0].group(1))
    return ends["ingest"], port


def _drawn(page: Any) -> Any:
    """The view's snapshot once both tables have drawn, else None."""
    snap = page.evaluate("window.__rankboard && window.__rankboard.cluster()")
    return snap if snap and snap["firstDraw"] else None


def _page_figures(browser: Any, port: int, feed: Feed, quick: bool) -> list[dict[str, Any]]:
    draws = []
    for _ in range(2 if quick else 3):
        ctx = browser.new_context(viewport={"width": 1440, "height": 900}, device_scale_factor=1)
        page = ctx.new_page()
        page.goto(f"http://127.0.0.1:{port}/#cluster")
        snap = wait_for(lambda pg=page: _drawn(pg), 60, "the cluster view's first draw",
                        interval=0.02)
        assert snap["runs"] == RUNS and snap["hosts"] == HOSTS, snap
        draws.append(snap["firstDraw"] / 1000.0)
        ctx.close()
    ctx = browser.new_context(viewport={"width": 1440, "height": 900}, device_scale_factor=1)
    try:
        page = ctx.new_page()
        page.goto(f"http://127.0.0.1:{port}/#cluster")
        wait_for(lambda: page.evaluate("window.__rankboard.cluster().firstDraw"), 60, "drawn")
        time.sleep(1.0 if quick else 6.0)  # a warm-up window, not a synchronisation
        cdp = ctx.new_cdp_session(page)
        cdp.send("Performance.enable")

        def metrics() -> dict[str, float]:
            return {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        s0 = page.evaluate("window.__rankboard.cluster()")
        m0, t0 = metrics(), time.monotonic()
        time.sleep(3.0 if quick else 20.0)  # the measured window
        m1, t1 = metrics(), time.monotonic()
        s1 = page.evaluate("window.__rankboard.cluster()")
        wall = t1 - t0
        busy = (m1["TaskDuration"] - m0["TaskDuration"]) / wall * 1000.0
        return [
            result("cluster_page_first_draw_3000_s", round(statistics.median(draws), 3), "s",
                   runs=RUNS, hosts=HOSTS, tries=[round(d, 3) for d in draws]),
            result("cluster_page_live_cpu_ms_per_s", round(busy, 1), "ms/s", runs=RUNS,
                   training=TRAINING, window_s=round(wall, 1),
                   polls=s1["fetches"] - s0["fetches"], redraws=s1["draws"] - s0["draws"],
                   **{f"{key}_ms_per_s": round((m1[name] - m0[name]) / wall * 1000.0, 1)
                      for key, name in (("script", "ScriptDuration"), ("layout", "LayoutDuration"),
                                        ("style", "RecalcStyleDuration"))}),
        ]
    finally:
        ctx.close()


def page_figures(quick: bool) -> list[dict[str, Any]]:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="rankboard-cluster-bench-") as tmp:
        procs: list[Proc] = []
        feed = None
        try:
            ingest, port = _start(Path(tmp), procs)
            feed = Feed(ingest)
            feed.populate()
            feed.thread.start()

            def loaded() -> bool:
                status, body = http_get(port, "/api/runs?status=training")
                if status != 200 or len(json.loads(body)) < TRAINING:
                    return False
                status, body = http_get(port, "/api/runs?limit=1&offset=2999")
                return status == 200 and len(json.loads(body)) == 1
            wait_for(loaded, 120, "the web to hold 3,000 runs, 10 training", interval=0.2)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                try:
                    return _page_figures(browser, port, feed, quick)
                finally:
                    browser.close()
        finally:
            if feed is not None:
                feed.close()
            terminate_all([proc.proc for proc in reversed(procs)], 10)


def run(quick: bool) -> list[dict[str, Any]]:
    return api_figures(quick) + page_figures(quick)


if __name__ == "__main__":
    for line in run("--quick" in sys.argv):
        print(json.dumps(line))
