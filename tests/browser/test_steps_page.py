"""Step charts, the straggler board, run comparison and the 1,024-rank page in Chromium.

Frames go in through the real broker's ingest as training ranks send them; what the page
shows is read back from the page itself: the step charts' drawn columns and data
(``window.__rankboard``, a read-only view of what each chart holds and drew), canvas
pixels, and the DOM. Never from the API.
"""
from __future__ import annotations

import socket
import threading
from typing import Any, Iterable, List

import pytest
from playwright.sync_api import expect

from rank_agent import protocol as wire

from .conftest import ARTIFACTS, Stack, wait_until
from .test_dashboard import HOSTILE, coloured, sample, wait_js

pytestmark = pytest.mark.browser

T0 = 1_700_000_000.0


class Proxy:
    """A TCP forwarder between the browser and the web whose connections the test can cut
    (Chromium's offline emulation leaves an open EventSource alone)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit("//", 1)[1].split(":")
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.conns: List[socket.socket] = []
        self.lock = threading.Lock()
        self.refusing = False
        self.closed = False
        self.pumps: List[threading.Thread] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.refusing:
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self.lock:
                self.conns += [client, server]
            for a, b in ((client, server), (server, client)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()
                self.pumps.append(t)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def drop(self, refuse: bool = False) -> None:
        """Cut every open connection; with ``refuse``, close new ones at once until resume()."""
        self.refusing = refuse
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def resume(self) -> None:
        self.refusing = False

    def __enter__(self) -> "Proxy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.closed = True
        self.listener.close()
        self.drop()
        self.thread.join(timeout=5)
        for t in self.pumps:
            t.join(timeout=5)


def send_steps(stack: Stack, run: str, rank: int, steps: Iterable[int], *,
               step_ms: float = 100.0, loss: Any = None, metrics: Any = None,
               samples: int = 32, tokens: int = 4096) -> None:
    """Steps frames (<= 1024 points each) of one rank: loss decays, lr and grad_norm."""
    steps = list(steps)
    for i in range(0, len(steps), 1024):
        chunk = steps[i:i + 1024]
        ms = [step_ms * (1.0 + 0.02 * ((s * 7 + rank) % 5)) for s in chunk]
        losses = [loss(s) if callable(loss) else 2.0 * 0.999**s + 0.1 + 0.01 * rank for s in chunk]
        m = {"loss": losses, "lr": [3e-4] * len(chunk), "grad_norm": [1.0 + 0.1 * rank] * len(chunk)}
        if metrics:
            m.update({k: [v] * len(chunk) for k, v in metrics.items()})
        stack.send(wire.Steps(run=run, rank=rank, steps=chunk,
                              times=[T0 + s * step_ms / 1000.0 for s in chunk], step_ms=ms,
                              samples=[samples] * len(chunk), tokens=[tokens] * len(chunk),
                              metrics=m))


def register(stack: Stack, run: str, world: int, per_host: int = 4, total: int = 0) -> None:
    for r in range(world):
        stack.send(wire.Register(run=run, rank=r, world_size=world, host=f"node-{r // per_host:03d}",
                                 local_rank=r % per_host, total_epochs=total))


def steps_done(stack: Stack, run: str) -> Any:
    try:
        return stack.get_json(f"/api/runs/{run}")["steps_done"]
    except Exception:  # noqa: BLE001 - not there yet
        return None


def wait_steps(stack: Stack, run: str, last: int, timeout: float = 30.0) -> None:
    wait_until(lambda: (steps_done(stack, run) or -1) >= last, timeout, f"{run} step {last} closed")


def open_run(page: Any, stack: Stack, run: str) -> None:
    page.goto(f"{stack.url}/#run={run}")
    expect(page.locator("#run-picker")).to_have_value(run)


def chart(page: Any, name: str) -> Any:
    return page.evaluate("(n) => window.__rankboard.stepChart(n)", name)


def chart_data(page: Any, name: str) -> Any:
    return page.evaluate("(n) => window.__rankboard.stepData(n)", name)


def wait_chart(page: Any, name: str, pred: Any, what: str, timeout: float = 15.0) -> Any:
    def ok() -> Any:
        snap = chart(page, name)
        return snap if snap and pred(snap) else None
    return wait_until(ok, timeout, what)


def drawn_steps(snap: Any) -> List[int]:
    """Steps covered by the drawn columns of the first series."""
    return [int(c[7]) for c in snap["series"][0]["columns"]]


# --------------------------------------------------------------------------------- tests

def test_step_charts_draw_history_then_live_steps(stack: Stack, page: Any) -> None:
    run = "steps-live"
    register(stack, run, world=4)
    for r in range(4):
        send_steps(stack, run, r, range(0, 400), step_ms=130.0 if r == 2 else 100.0)
    wait_steps(stack, run, 399)
    open_run(page, stack, run)
    section = page.locator("#step-section")
    expect(section).to_be_visible()
    # history from /steps up to the stream's steps_done, at about the chart's width
    snap = wait_chart(page, "loss", lambda s: s["range"][1] == 399, "loss history drawn")
    assert snap["cut"] == 399 and snap["range"][0] == 0
    fetches = page.evaluate("window.__rankboard.stepFetches()")
    assert any("metric=loss&end=399&points=" in f for f in fetches)
    # every step metric, plus step time and throughput, each with a drawn mean line
    for name in ("loss", "grad_norm", "lr", "step_ms", "samples_per_s", "tokens_per_s"):
        expect(page.locator(f'[data-step-chart="{name}"]')).to_be_visible()
    names = page.locator("#step-section [data-step-chart]").evaluate_all(
        "els => els.filter(e => !e.hidden).map(e => e.dataset.stepChart)")
    assert names[0] == "loss"
    assert coloured(page, '[data-step-chart="loss"] canvas') > 30

    # live steps are appended to the drawn range
    for r in range(4):
        send_steps(stack, run, r, range(400, 460), step_ms=130.0 if r == 2 else 100.0)
    snap = wait_chart(page, "loss", lambda s: s["range"][1] == 459, "live steps appended")
    live = page.evaluate("window.__rankboard.liveSteps()")
    assert live == list(range(400, 460))
    # a steps-only run: no empty epoch panel
    expect(page.locator("#metrics-card")).to_be_hidden()
    expect(page.locator("#log-card")).to_be_hidden()
    expect(page.locator("#ranks-card")).to_be_visible()
    expect(page.locator("#step-stat")).to_contain_text("459")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "steps-live.png"), full_page=True)
    page.errors.check()


SPIKE_STEP = 123_457
SPIKE = 50.0


def test_a_one_step_spike_in_200k_steps_is_visible_and_zoom_refetches(stack: Stack, page: Any) -> None:
    run = "spike-200k"
    register(stack, run, world=1)
    send_steps(stack, run, 0, range(200_000), step_ms=50.0,
               loss=lambda s: SPIKE if s == SPIKE_STEP else 1.0 + 0.5 * ((s // 1000) % 2))
    wait_steps(stack, run, 199_999, timeout=120)
    open_run(page, stack, run)
    snap = wait_chart(page, "loss", lambda s: s["range"] == [0, 199_999], "200k steps drawn")
    cols = snap["series"][0]["columns"]
    # one drawn column per device pixel at most, each holding many steps
    assert len(cols) <= snap["columns"] and max(c[7] for c in cols) > 100
    spike = [c for c in cols if c[0] <= SPIKE_STEP <= c[1]]
    assert len(spike) == 1 and spike[0][4] == SPIKE, spike  # hi of its column is the spike
    assert all(c[4] <= 1.5 for c in cols if c is not spike[0])
    # and it is on the canvas: the envelope of that column reaches the spike's height
    x = snap["plot"]["left"] + (spike[0][8] + 0.5) / snap["plot"]["dpr"]
    y_spike = spike[0][9]
    lit = page.evaluate("""([x, y]) => {
      const c = document.querySelector('[data-step-chart="loss"] canvas');
      const d = c.getContext('2d').getImageData(Math.floor(x) - 1, Math.floor(y), 3, 4).data;
      let n = 0;
      for (let i = 0; i < d.length; i += 4) if (Math.max(d[i], d[i+1], d[i+2]) - Math.min(d[i], d[i+1], d[i+2]) > 40) n++;
      return n;
    }""", [x, y_spike + 1])
    assert lit > 0, "the spike's envelope is not on the canvas"

    # drag to zoom around the spike, twice: each zoom refetches its range at the chart's width
    canvas = page.locator('[data-step-chart="loss"] canvas')
    box = canvas.bounding_box()
    assert box is not None

    def drag_around(step: int, s: Any, half_px: float) -> None:
        p = s["plot"]
        lo, hi = s["range"]
        cx = box["x"] + p["left"] + (step - lo) / (hi - lo) * p["width"]
        cy = box["y"] + p["top"] + p["height"] / 2
        page.mouse.move(cx - half_px, cy)
        page.mouse.down()
        page.mouse.move(cx + half_px, cy, steps=4)
        page.mouse.up()

    before = len(page.evaluate("window.__rankboard.stepFetches()"))
    drag_around(SPIKE_STEP, snap, 6)
    snap = wait_chart(page, "loss", lambda s: s["view"] is not None and s["range"][1] - s["range"][0] < 20_000
                      and any(c[0] <= SPIKE_STEP <= c[1] and c[4] == SPIKE for c in s["series"][0]["columns"]),
                      "first zoom drawn")
    fetches = page.evaluate("window.__rankboard.stepFetches()")[before:]
    lo, hi = snap["range"]
    assert any(f"metric=loss&start={lo}&end={hi}&points=" in f for f in fetches), fetches
    drag_around(SPIKE_STEP, snap, 8)

    def full_resolution(s: Any) -> bool:
        c = s["series"][0]["columns"]
        return (s["range"][1] - s["range"][0] < 300 and all(x[7] == 1 for x in c)
                and len(c) == s["range"][1] - s["range"][0] + 1)
    snap = wait_chart(page, "loss", full_resolution, "second zoom at full resolution")
    at = [c for c in snap["series"][0]["columns"] if c[0] == SPIKE_STEP]
    assert at and at[0][2] == SPIKE and at[0][1] == SPIKE_STEP
    # the other step charts followed the zoom
    assert chart(page, "step_ms")["range"] == snap["range"]
    page.locator('[data-action="steps-reset-zoom"]').click()
    wait_chart(page, "loss", lambda s: s["range"] == [0, 199_999] and s["view"] is None, "zoom reset")
    page.errors.check()


def assert_each_step_once(buckets: List[List[float]], first: int, last: int) -> None:
    """Buckets [first, last, count] ascending, disjoint, and together every step once."""
    assert buckets[0][0] == first and buckets[-1][1] == last, (buckets[:2], buckets[-2:])
    for a, b in zip(buckets, buckets[1:]):
        assert b[0] > a[1], f"overlap: {a} then {b}"
    assert sum(b[2] for b in buckets) == last - first + 1, "a step is missing or held twice"


def test_reconnect_leaves_no_gap_and_no_duplicate(stack: Stack, page: Any) -> None:
    run = "steps-reconnect"
    register(stack, run, world=2)
    for r in range(2):
        send_steps(stack, run, r, range(0, 200))
    wait_steps(stack, run, 199)
    with Proxy(stack.url) as proxy:
        page.goto(f"{proxy.url}/#run={run}")
        wait_chart(page, "loss", lambda s: s["range"][1] == 199, "history drawn")
        assert page.evaluate("window.__rankboard.stepCut()") == 199
        for r in range(2):
            send_steps(stack, run, r, range(200, 260))
        wait_chart(page, "loss", lambda s: s["range"][1] == 259, "live steps drawn")
        assert_each_step_once(chart_data(page, "loss"), 0, 259)

        # the network drops (every connection cut, new ones refused); steps close meanwhile;
        # the network comes back, the browser reconnects by itself, more steps close
        proxy.drop(refuse=True)
        expect(page.locator("#conn")).not_to_have_attribute("data-state", "live")
        for r in range(2):
            send_steps(stack, run, r, range(260, 340))
        wait_steps(stack, run, 339)
        proxy.resume()
        wait_until(lambda: (page.evaluate("window.__rankboard.stepCut()") or 0) >= 339, 20,
                   "the reconnection's cut")
        for r in range(2):
            send_steps(stack, run, r, range(340, 400))
        wait_chart(page, "loss", lambda s: s["range"][1] == 399, "steps after the reconnect drawn")
        for name in ("loss", "step_ms", "samples_per_s"):
            assert_each_step_once(chart_data(page, name), 0, 399)
        assert page.evaluate("window.__rankboard.liveSteps()") == list(range(340, 400))
    # the cut itself is logged by the browser (the stream's chunked body ended mid-way);
    # nothing else may be
    page.errors[:] = [e for e in page.errors if "net::ERR_" not in e]
    page.errors.check()
