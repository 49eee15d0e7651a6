"""page_*: the dashboard page itself, in headless Chromium (Playwright + Debian's chromium),
against a real broker process and a real web process.

* ``page_first_draw_1m_steps_s``: a run holding 1,000,000 closed steps x 4 metrics (its
  journal written by the broker's own Journal code path, ``steps_bench.write_run``, then
  loaded by a real broker; a real web snapshots it). A fresh page navigates to
  ``/#run=<run>``; the figure is the time from navigation start until the loss chart has
  drawn the whole range [0, 999,999] from ``/steps`` (the chart records
  ``performance.now()`` at that draw: page load, scripts, the JSON snapshot, the SSE
  stream's first ``run`` event, the ``/steps`` answer at the chart's width, the canvas
  draw). Median of 3 fresh pages.
* ``page_live_cpu_ms_per_s``: a 1,024-rank run (128 hosts) streaming 10 steps/s: every rank
  sends a ``steps`` frame every 0.25 s (2-3 points, 4 metrics, samples, tokens; one rank
  slower) and a resources sample every 2 s, as ``RankAgent`` does; the page (1440x900,
  overview) shows it live: ``steps`` events (<= 4/s), ``ranks`` events (1/s, 1,024 ranks).
  Figure: the renderer main thread's busy time per wall second (Chrome DevTools
  ``Performance.getMetrics`` TaskDuration delta over a window after a warm-up).
* ``page_1024_ranks_update_ms``: on that page, the main-thread time to apply one ``ranks``
  event of 1,024 ranks: JSON.parse of the event's data, the state update, the synchronous
  render (rank table page, picker, heatmap canvas, straggler strip, KPIs, alerts) and the
  forced style/layout that follows. Median over 20 payloads (real ``ranks`` arrays of the
  run, each with new last_seen/step_ms so nothing is skipped), with the live feed stopped.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from common import http_get, push_socket, result, wait_for
from steps_bench import RUN as MILLION_RUN
from steps_bench import Server, write_run

from rank_agent import protocol
from rank_agent.protocol import GpuSample, Register, Resources, ResourceSample, Steps

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update"]
LIVE_RUN = "bench-page-live"
WORLD = 1024
PER_HOST = 8
SLOW = 517


class Feed:
    """1,024 ranks at 10 steps/s over one PUSH socket, in a thread (frames as RankAgent
    sends them: a steps frame per rank every 0.25 s, a resources sample every 2 s)."""

    def __init__(self, ingest: str) -> None:
        self.ctx, self.sock = push_socket(ingest)
        self.enc = protocol.encoder.encode
        self.step = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.late = 0

    def start(self) -> None:
        for r in range(WORLD):
            self.sock.send(self.enc(Register(run=LIVE_RUN, rank=r, world_size=WORLD,
                                             host=f"node-{r // PER_HOST:03d}",
                                             local_rank=r % PER_HOST)))
        for r in range(WORLD):
            self.sock.send(self._resources(r))
        self.thread.start()

    def _resources(self, r: int) -> bytes:
        util = 60.0 if r == SLOW else 92.0 + r % 7
        gpu = GpuSample(device_index=r % PER_HOST, name="NVIDIA H100 80GB HBM3", util_percent=util,
                        vram_allocated_bytes=60 << 30, vram_total_bytes=80 << 30)
        return self.enc(Resources(run=LIVE_RUN, rank=r, sample=ResourceSample(
            cpu_percent=40.0, ram_used_bytes=600 << 30, ram_total_bytes=2048 << 30,
            gpu_util_percent=util, vram_allocated_bytes=60 << 30, vram_total_bytes=80 << 30,
            gpus=[gpu])))

    def _loop(self) -> None:
        tick = 0
        t_next = time.monotonic()
        while not self.stop.is_set():
            n = 3 if tick % 2 else 2  # 2.5 steps per 0.25 s: 10 steps/s
            steps = list(range(self.step, self.step + n))
            self.step += n
            now = time.time()
            times = [now - 0.1 * (n - 1 - i) for i in range(n)]
            for r in range(WORLD):
                ms = 150.0 if r == SLOW else 100.0 + (r * 7 + tick) % 5
                self.sock.send(self.enc(Steps(
                    run=LIVE_RUN, rank=r, steps=steps, times=times, step_ms=[ms] * n,
                    samples=[16] * n, tokens=[8192] * n,
                    metrics={"loss": [2.0 / (1 + 0.001 * s) for s in steps], "lr": [3e-4] * n,
                             "grad_norm": [1.0 + 0.01 * (r % 10)] * n, "acc": [0.5] * n})))
            for r in range(tick % 8, WORLD, 8):  # each rank's sample every 2 s
                self.sock.send(self._resources(r))
            tick += 1
            t_next += 0.25
            wait = t_next - time.monotonic()
            if wait < 0:
                self.late += 1
                t_next = time.monotonic()
            else:
                self.stop.wait(wait)

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(5)
        self.sock.close()
        self.ctx.term()


def _browser(p: Any) -> Any:
    if not Path(CHROMIUM).exists():
        raise RuntimeError(f"page benchmarks need Debian's chromium at {CHROMIUM}")
    return p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def _first_draw_of(page: Any) -> Callable[[], Any]:
    return lambda: page.evaluate("window.__rankboard.firstDraw()")


def first_draw(browser: Any, port: int, n: int, tries: int) -> dict[str, Any]:
    times = []
    for _ in range(tries):
        ctx = browser.new_context(viewport={"width": 1440, "height": 900}, device_scale_factor=1)
        page = ctx.new_page()
        page.goto(f"http://127.0.0.1:{port}/#run={MILLION_RUN}")
        fd = wait_for(_first_draw_of(page), 60, "the loss chart's first full draw", interval=0.02)
        assert fd["range"] == [0, n - 1], fd
        times.append(fd["at"] / 1000.0)
        ctx.close()
    return result("page_first_draw_1m_steps_s", round(statistics.median(times), 3), "s",
                  steps=n, metrics=4, tries=[round(t, 3) for t in times])


def live(browser: Any, stack: Server, warm: float, window: float, payloads: int
         ) -> list[dict[str, Any]]:
    feed = Feed(stack.endpoints["ingest"])
    ctx = browser.new_context(viewport={"width": 1440, "height": 900}, device_scale_factor=1)
    try:
        feed.start()
        wait_for(lambda: _steps_done(stack.port) > 20, 60, "the live run's first steps", interval=0.1)
        page = ctx.new_page()
        page.goto(f"http://127.0.0.1:{stack.port}/#run={LIVE_RUN}")
        wait_for(lambda: page.evaluate("window.__rankboard.heatmapCells()") >= WORLD, 60,
                 "the 1,024-rank page drawn", interval=0.1)
        time.sleep(warm)
        cdp = ctx.new_cdp_session(page)
        cdp.send("Performance.enable")

        def metrics() -> dict[str, float]:
            return {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        live0 = len(page.evaluate("window.__rankboard.liveSteps()"))
        m0, t0 = metrics(), time.monotonic()
        time.sleep(window)
        m1, t1 = metrics(), time.monotonic()
        live1 = len(page.evaluate("window.__rankboard.liveSteps()"))
        wall = t1 - t0
        busy = (m1["TaskDuration"] - m0["TaskDuration"]) / wall * 1000.0
        parts = {k: round((m1[k] - m0[k]) / wall * 1000.0, 1)
                 for k in ("ScriptDuration", "LayoutDuration", "RecalcStyleDuration")}
        out = [result("page_live_cpu_ms_per_s", round(busy, 1), "ms/s", ranks=WORLD,
                      steps_per_s=round((live1 - live0) / wall, 1), window_s=round(wall, 1),
                      script_ms_per_s=parts["ScriptDuration"],
                      layout_ms_per_s=parts["LayoutDuration"],
                      style_ms_per_s=parts["RecalcStyleDuration"], feed_late_ticks=feed.late)]
        feed.close()
        time.sleep(1.5)  # the last ranks event has come and gone
        status, body = http_get(stack.port, f"/api/runs/{LIVE_RUN}")
        assert status == 200
        ranks = json.loads(body)["ranks"]
        assert len(ranks) == WORLD
        texts = []
        for i in range(payloads + 1):
            for r in ranks:
                r["last_seen"] = (r.get("last_seen") or time.time()) + 1.0
                if isinstance(r.get("step_ms"), (int, float)):
                    r["step_ms"] = r["step_ms"] * (1.0 + 0.001 * ((i + r["rank"]) % 7))
            texts.append(json.dumps(ranks))
        ms = page.evaluate("""(texts) => texts.map((t) => {
          const t0 = performance.now();
          window.__rankboard.applyRanksNow(JSON.parse(t));
          document.body.getBoundingClientRect();
          return performance.now() - t0;
        })""", texts)[1:]
        out.append(result("page_1024_ranks_update_ms", round(statistics.median(ms), 2), "ms",
                          ranks=WORLD, payloads=len(ms), max_ms=round(max(ms), 2),
                          payload_kib=round(len(texts[0]) / 1024)))
        return out
    finally:
        feed.close()
        ctx.close()


def _steps_done(port: int) -> int:
    status, body = http_get(port, f"/api/runs/{LIVE_RUN}")
    if status != 200:
        return -1
    done = json.loads(body).get("steps_done")
    return done if isinstance(done, int) else -1


def run(quick: bool) -> list[dict[str, Any]]:
    from playwright.sync_api import sync_playwright

    n = 100_000 if quick else 1_000_000
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rankboard-page-bench-") as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        write_run(data, n, spike=n // 3 + 7)
        server = Server(data)
        try:
            server.start_broker()
            server.start_web()
            wait_for(lambda: server.serving(n - 1), 120, "the web to serve the run", interval=0.1)
            with sync_playwright() as p:
                browser = _browser(p)
                try:
                    out.append(first_draw(browser, server.port, n, 2 if quick else 3))
                    out += live(browser, server, 1.0 if quick else 8.0, 2.0 if quick else 20.0,
                                6 if quick else 20)
                finally:
                    browser.close()
        finally:
            server.close()
    return out


if __name__ == "__main__":
    for line in run("--quick" in sys.argv):
        print(json.dumps(line))
