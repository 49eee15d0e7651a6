"""report_*: a finished run as one self-contained HTML file (report.html, issue 16).

The run: 1,024 ranks on 128 hosts, 100 epochs (every rank's metrics frame with a resource
sample each epoch: records with 1,024 GPU entries), 1,000,000 closed steps x 4 metrics (plus
step time, samples/s, tokens/s), metadata, hardware, a graph; its journal written by the
real :class:`~broker.journal.journal.Journal` code path (``tests/support/reportrun.py``), loaded by a
real broker process, snapshotted by a real web process.

* ``report_1m_bytes``: the size of ``GET /api/runs/<run>/report.html`` (target <= 10 MB).
* ``report_1m_s``: seconds from sending that GET to its last byte, over one connection to
  the real web (median of 3; target <= 3).
* ``report_first_draw_s``: headless Chromium opens the saved file from ``file://`` with
  every request but the file aborted: seconds from navigation start until every chart on the
  overview (each step chart, the epoch charts, the per-rank heatmap) has drawn, read as
  ``performance.now()`` in the page at the first animation frame where all have (median of 3
  fresh pages; target <= 2).

``--quick``: 256 ranks, 20 epochs, 100,000 steps (same names, smaller run).
"""
from __future__ import annotations

import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import result, wait_for
from steps_bench import Server

from tests.support.reportrun import build_run

RUN = "bench-report"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update"]

#: In the page: resolves with performance.now() at the first frame where every visible
#: canvas of the overview shows a drawn series (strongly coloured pixels).
ALL_DRAWN = """() => new Promise((resolve) => {
  const drawn = (c) => {
    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    let n = 0;
    for (let i = 0; i < d.length && n <= 30; i += 16) {
      const mx = Math.max(d[i], d[i + 1], d[i + 2]), mn = Math.min(d[i], d[i + 1], d[i + 2]);
      if (mx - mn > 80) n++;
    }
    return n > 30;
  };
  const check = () => {
    const cs = [...document.querySelectorAll('#panel-home canvas')]
      .filter((c) => c.width > 0 && c.offsetParent !== null);
    if (cs.length >= 8 && cs.every(drawn)) resolve({ at: performance.now(), charts: cs.length });
    else requestAnimationFrame(check);
  };
  check();
})"""


def get_report(port: int) -> tuple[float, bytes, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        t0 = time.perf_counter()
        conn.request("GET", f"/api/runs/{RUN}/report.html")
        resp = conn.getresponse()
        body = resp.read()
        took = time.perf_counter() - t0
        assert resp.status == 200, (resp.status, body[:200])
        return took, body, dict(resp.getheaders())
    finally:
        conn.close()


def first_draw(path: Path, pages: int) -> tuple[float, int]:
    from playwright.sync_api import sync_playwright

    url = path.resolve().as_uri()
    times: list[float] = []
    charts = 0
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for _ in range(pages):
                ctx = browser.new_context(viewport={"width": 1440, "height": 900},
                                          device_scale_factor=1)
                page = ctx.new_page()
                attempted: list[str] = []

                def route(r: Any, attempted: list[str] = attempted) -> None:
                    if r.request.url == url:
                        r.continue_()
                    else:
                        attempted.append(r.request.url)
                        r.abort()
                page.route("**", route)
                page.goto(url, wait_until="commit")
                got = page.evaluate(ALL_DRAWN)
                assert not attempted, attempted
                times.append(got["at"] / 1000.0)
                charts = got["charts"]
                ctx.close()
        finally:
            browser.close()
    return statistics.median(times), charts


def run(quick: bool) -> list[dict[str, Any]]:
    ranks, epochs, steps = (256, 20, 100_000) if quick else (1024, 100, 1_000_000)
    with tempfile.TemporaryDirectory(prefix="rankboard-report-bench-") as tmp:
        data = Path(tmp) / "data"
        t0 = time.monotonic()
        build_run(data, RUN, ranks=ranks, epochs=epochs, steps=steps, hostile=False)
        built = time.monotonic() - t0
        server = Server(data)
        try:
            server.start_broker()
            server.start_web()

            def ready() -> bool:
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
                    conn.request("GET", f"/api/runs/{RUN}")
                    resp = conn.getresponse()
                    body = resp.read()
                    conn.close()
                except OSError:
                    return False
                return resp.status == 200 and json.loads(body).get("steps_done") == steps - 1
            wait_for(ready, 180, "the web to hold the run")
            takes = []
            body = b""
            for _ in range(3):
                took, body, headers = get_report(server.port)
                takes.append(took)
        finally:
            server.close()
        path = Path(tmp) / "report.html"
        path.write_bytes(body)
        draw, charts = first_draw(path, 2 if quick else 3)
    size = len(body)
    return [
        result("report_1m_bytes", size, "bytes", ranks=ranks, epochs=epochs, steps=steps,
               mib=round(size / 2**20, 2), build_journal_s=round(built, 1)),
        result("report_1m_s", round(statistics.median(takes), 3), "s",
               runs=[round(t, 3) for t in takes],
               disposition=headers.get("Content-Disposition", "")),
        result("report_first_draw_s", round(draw, 3), "s", charts=charts),
    ]


if __name__ == "__main__":
    for line in run("--quick" in sys.argv):
        print(json.dumps(line))
