"""The page's store and model run without a DOM and can be fed from JSON alone.

A saved report page is meant to reuse the dashboard's modules with a run's JSON embedded
instead of the live stream; that holds only while ``store.js`` and ``model.js`` (and what
they import) never touch ``document``. These tests load them in a module Worker, where
there is no DOM, feed the store the run's real ``GET /api/runs/<run>`` snapshot (plus a
replayed record, as after a reconnect) and check what the views would be given.
"""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any, Set

import pytest

from tests.support.browser import Stack, epoch, register
from tests.support.polling import wait_for as wait_until

pytestmark = pytest.mark.browser

STATIC = Path(__file__).resolve().parents[2] / "web" / "static"
_IMPORT = re.compile(r'^import [^;]*? from "\./([\w]+\.js)";', re.M | re.S)


def imported_modules(entry: str = "dashboard.js") -> Set[str]:
    """Every module ``entry`` imports, directly or not (relative imports only)."""
    seen: Set[str] = set()
    todo = [entry]
    while todo:
        for dep in _IMPORT.findall((STATIC / todo.pop()).read_text()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen

# A same-origin worker script served by the test (the page's CSP allows 'self' scripts only).
PROBE = "/static/__test_probe_worker.js"
PROBE_JS = """
import { Store } from "/static/store.js";
import { currentResources, isBig, metricNames, rankRows } from "/static/model.js";
// a big run's `ranks` event leaves out an unchanged entry's hardware (issue 32): the store
// keeps the one it has (applied last, on a copy, so the checks above see the snapshot)
const keptHardware = (store, r0) => {
  store.applyRanks([{ ...r0, hardware: "EPYC | H100" }], true, 0, null);
  const { hardware, ...without } = r0;
  store.applyRanks([without], true, 0, null);
  return store.rankMap.get(r0.rank).hardware;
};
self.onmessage = (ev) => {
  try {
    const snap = ev.data;
    const store = new Store();
    const parts = new Set();
    store.subscribe((...p) => p.forEach((x) => parts.add(x)));
    store.reset(snap.run);
    store.loadSnapshot(snap);
    for (const r of snap.records) store.addRecord(r); // a replay never duplicates
    postMessage({
      dom: typeof document !== "undefined",
      run: store.header.run,
      records: store.records.map((r) => r.epoch),
      parts: [...parts].sort(),
      rows: rankRows(store, null).map((r) => [r.rank, r.host, r.localRank, r.status]),
      cpu: currentResources(store).cpu_percent,
      big: isBig(store),
      names: metricNames(store),
      hardwareKept: keptHardware(store, snap.ranks[0]),
    });
  } catch (err) {
    postMessage({ error: String(err && err.stack || err) });
  }
};
"""


def test_store_and_model_run_in_a_worker_from_a_json_snapshot(stack: Stack, page: Any) -> None:
    run = "modules-json"
    register(stack, run, 2, 4, hosts=["node-a"], per_host=2)
    for e in (0, 1):
        epoch(stack, run, e, range(2), loss=1.5 - 0.5 * e)
    stack.wait_run(run, epochs=2)

    def snapshot() -> Any:
        s = stack.get_json(f"/api/runs/{run}")
        return s if len(s.get("ranks") or []) == 2 else None

    snap = wait_until(snapshot, 10.0, "both ranks in the snapshot")

    page.route(f"**{PROBE}", lambda route: route.fulfill(
        status=200, content_type="text/javascript", body=PROBE_JS))
    page.goto(f"{stack.url}/healthz")
    got = page.evaluate("""([url, snap]) => new Promise((resolve, reject) => {
        const w = new Worker(url, { type: "module" });
        w.onmessage = (ev) => resolve(ev.data);
        w.onerror = (ev) => reject(new Error(ev.message || "worker failed to load"));
        w.postMessage(snap);
    })""", [PROBE, json.loads(json.dumps(snap))])

    assert "error" not in got, got.get("error")
    assert got["dom"] is False
    assert got["run"] == run
    assert got["records"] == [0, 1]
    assert got["parts"] == ["header", "ranks", "records"]
    assert got["rows"] == [[0, "node-a", 0, "ok"], [1, "node-a", 1, "ok"]]
    assert got["big"] is False
    assert got["names"][0] == "loss"
    assert got["hardwareKept"] == "EPYC | H100"
    page.errors.check()


def test_the_page_preloads_every_module_it_imports(stack: Stack) -> None:
    """A split page costs one request per module; preloading them all keeps its first draw
    from waiting on one import level at a time. A module left out of index.html fails here."""
    with urllib.request.urlopen(f"{stack.url}/", timeout=5) as resp:
        html = resp.read().decode()
    preloaded = set(re.findall(r'<link rel="modulepreload" href="/static/([\w]+\.js)">', html))
    wanted = imported_modules()
    assert len(wanted) > 10  # the graph was read
    assert preloaded == wanted
    for name in sorted(preloaded):
        with urllib.request.urlopen(f"{stack.url}/static/{name}", timeout=5) as resp:
            assert resp.status == 200 and "javascript" in resp.headers["Content-Type"], name


def test_one_helper_pushes_a_single_step_bucket(stack: Stack, page: Any) -> None:
    """``Buckets.pushStep``: the one place a step's point becomes a 9-value bucket (the
    live chart, its zoom, the history's tail and the comparison's epochs all call it):
    the mean is its own lo and hi, the ranks' band beside it, anything non-finite NaN,
    and a non-finite mean marks the bucket bad."""
    page.goto(f"{stack.url}/")
    rows = page.evaluate("""async () => {
      const { Buckets } = await import("/static/buckets.js");
      const b = new Buckets(1);
      b.pushStep(3, 1.5, 1.0, 2.0);
      b.pushStep(4, null);
      b.pushStep(5, "x", 0, Infinity);
      const cols = ["s0", "s1", "mean", "lo", "hi", "rmin", "rmax", "cnt", "bad"];
      return [0, 1, 2].map((i) => cols.map((k) => (Number.isNaN(b[k][i]) ? "NaN" : b[k][i])));
    }""")
    nan = "NaN"
    assert rows == [[3, 3, 1.5, 1.5, 1.5, 1, 2, 1, 0],
                    [4, 4, nan, nan, nan, nan, nan, 1, 1],
                    [5, 5, nan, nan, nan, 0, nan, 1, 1]]
    page.errors.check()


def test_a_finished_runs_conditions_read_as_over_and_its_events_stay(stack: Stack, page: Any) -> None:
    """``alertState``: a data straggler (7.1), like a throttled GPU, is a state of a training
    run; once the run has ended it reads "resolved · run ended" (the demo's finished step
    run kept a red "DATA_STRAGGLER rank 7" under its resolved ones). An XID happened: it
    stays."""
    page.goto(f"{stack.url}/")
    got = page.evaluate("""async () => {
      const { alertState } = await import("/static/alertstate.js");
      const run = { status: "complete", updated_at: 1700000000 };
      const live = { status: "training", updated_at: 1700000000 };
      const st = (kind, r) => alertState({ kind, rank: 7 }, new Map([[7, "finished"]]), r);
      return [st("data_straggler", run), st("gpu_throttle", run), st("gpu_xid", run),
              st("data_straggler", live)].map((s) => [s.over, s.why]);
    }""")
    assert got == [[True, "run ended"], [True, "run ended"], [False, ""], [False, ""]]
    page.errors.check()
