"""The page on a big run whose ``ranks`` events carry samples in rotation (issue 32,
finding 5; ``web/ranksbound.py``): fed the web's real bounded events, the store keeps every
rank's latest carried sample, so the rank table, host heatmap, GPU health and resources now
read what a page given every sample each time would, and a kept sample never becomes a new
point of a rank's series (the rank panel's chart).

The events come from a real :class:`web.hub.Hub` with the bounds scaled down (a few hundred
8-GPU ranks then behave as 65,536 would); the page's modules run in a module Worker as in
``test_page_modules.py``, in real Chromium.
"""
from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tests.support.browser import Stack
from tests.web.test_hub import drain, ev, ready_hub
from tests.web.test_ranks_event_bound import entries
from web import ranksbound

pytestmark = pytest.mark.browser

RUN = "r1"
N = 384
PROBE = "/static/__test_ranks_bound_worker.js"
PROBE_JS = """
import { Store } from "/static/store.js";
import { currentResources, hostGroups, rankRows } from "/static/model.js";
import { levelValue } from "/static/gpuhealth.js";
const view = (store) => {
  const rows = rankRows(store, null);
  return {
    rows: rows.map((r) => [r.rank, r.host, r.status, r.util, r.vu, r.vt, r.health.level,
                           r.health.text, levelValue(r.health.level)]),
    hosts: hostGroups(store, rows).map((g) => [g.host, g.ranks.length]),
    now: currentResources(store),
  };
};
self.onmessage = (ev) => {
  try {
    const { snap, events, truth, lateTruth } = ev.data;
    // a page whose snapshot answer was overtaken by the stream (it is older than the
    // events): it fills only what the events never gave (store.js `unheld`)
    const late = new Store();
    late.reset(snap.run);
    late.applyHeader(structuredClone(snap), true);
    for (const [seq, ranks] of structuredClone(events.slice(0, 3))) late.applyRanks(ranks, true, seq, seq);
    const unheld = late.unheld.size;
    late.applyRanks(structuredClone(snap.ranks), false, 0, 1);
    const lateOther = new Store();
    lateOther.reset(snap.run);
    lateOther.loadSnapshot(lateTruth);
    const store = new Store();
    store.reset(snap.run);
    store.loadSnapshot(snap);
    for (const [seq, ranks] of events) store.applyRanks(ranks, true, seq, seq);
    const other = new Store();
    other.reset(snap.run);
    other.loadSnapshot(truth);
    const series = {};
    for (const [rank, pts] of store.rankSeries) series[rank] = pts.map((p) => p.util);
    postMessage({ page: view(store), truth: view(other), series, unheld,
                  late: view(late), lateTruth: view(lateOther), lateLeft: late.unheld.size,
                  hardware: store.rankMap.get(0).hardware });
  } catch (err) {
    postMessage({ error: String(err && err.stack || err) });
  }
};
"""


def ranks_at(seq: int) -> list[dict[str, Any]]:
    """Every rank's sample changes each event (GPU 0's utilisation is ``seq``); from seq 5
    rank 7's GPU 2 reports an XID and hardware slowdown."""
    out = entries(N, **{f"r{r}": float(seq) for r in range(N)})
    for r in out:
        r["last_seen"] = float(seq)
    if seq >= 5:
        g2 = out[7]["resources"]["gpus"][2]
        g2["xid_errors"], g2["throttle_reasons"] = [79], ["hw_slowdown"]
    return out


def own_util(rank: int, resources: dict[str, Any]) -> float:
    """The utilisation the page charts for a rank (store.js ``rankGpu``: its own device)."""
    gpus = resources["gpus"]
    return next((g for g in gpus if g["device_index"] == rank), gpus[0])["util_percent"]


def test_the_page_keeps_rotated_samples_of_a_big_run(stack: Stack, page: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ranksbound, "RANKS_EVENT_BYTES", 256 * 1024)
    monkeypatch.setattr(ranksbound, "RESOURCES_EVENT_BYTES", 40 * 1024)
    hub = ready_hub()
    sub, _, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
    hosts = [{"host": f"node-{h}", "ranks": list(range(h * 8, h * 8 + 8))} for h in range(N // 8)]
    snap = {"run": RUN, "status": "training", "world_size": N, "hosts": hosts, "alerts": [],
            "records": [], "ranks": ranks_at(1)}
    latest = {r["rank"]: r["resources"] for r in snap["ranks"]}
    points = {r: [own_util(r, latest[r])] for r in range(N)}
    events = []
    for seq in range(2, 32):
        hub.handle_pub(ev(seq, "ranks", ranks_at(seq)))
        ((_, data),) = drain(sub)
        payload = json.loads(data.decode().split("data: ", 1)[1])
        events.append([seq, payload])
        for r in payload:
            if "resources" in r:
                latest[r["rank"]] = r["resources"]
                points[r["rank"]].append(own_util(r["rank"], r["resources"]))
    assert sum("resources" in r for r in events[-1][1]) < N // 4  # bounded: a slice each
    assert latest[7]["gpus"][2]["xid_errors"] == [79]  # the XID reached the page's data
    truth = copy.deepcopy(snap)
    for r in truth["ranks"]:
        r["resources"] = latest[r["rank"]]
    late_truth = copy.deepcopy(snap)  # the first three events' samples, else the snapshot's
    for _, payload in events[:3]:
        for r in payload:
            if "resources" in r:
                late_truth["ranks"][r["rank"]]["resources"] = r["resources"]

    page.route(f"**{PROBE}", lambda route: route.fulfill(
        status=200, content_type="text/javascript", body=PROBE_JS))
    page.goto(f"{stack.url}/healthz")
    got = page.evaluate("""([url, msg]) => new Promise((resolve, reject) => {
        const w = new Worker(url, { type: "module" });
        w.onmessage = (ev) => resolve(ev.data);
        w.onerror = (ev) => reject(new Error(ev.message || "worker failed to load"));
        w.postMessage(msg);
    })""", [PROBE, {"snap": snap, "events": events, "truth": truth,
                                        "lateTruth": late_truth}])

    assert "error" not in got, got.get("error")
    assert got["page"] == got["truth"]  # table, heatmap, health, resources now
    rows = {row[0]: row for row in got["page"]["rows"]}
    assert len(rows) == N and rows[7][6] not in ("ok", "none")  # the XID shows
    assert rows[8][6] == "ok"
    assert got["page"]["hosts"] == [[h["host"], 8] for h in hosts]
    assert got["series"] == {str(r): points[r] for r in range(N)}  # no kept point repeated
    assert got["hardware"] == "cpu | gpu"
    assert got["unheld"] > N // 2  # the events alone left most samples unknown
    assert got["late"] == got["lateTruth"] and got["lateLeft"] == 0  # the old answer filled them
    page.errors.check()
