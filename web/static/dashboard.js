// rankboard dashboard page: one run at a time (or a comparison of several), fed by the
// JSON API and one EventSource.
//
// Data flow: GET /api/runs (picker) -> GET /api/runs/<run> (header, ranks, records) and
// EventSource /api/runs/<run>/events (run / epoch / ranks / steps / complete). Records are
// kept in a map keyed by epoch, so the replay after a reconnect (or the overlap between the
// JSON snapshot and the stream) never duplicates a point. Step series come from /steps up
// to the `steps_done` of each connection's first `run` event, then from live `steps`
// events (steps.js). Everything is rendered at most once per animation frame. All text
// from a training job goes into the DOM through textContent; the model graph is only ever
// an <img>.
//
// Scale: a run with more than BIG ranks gets a rank picker instead of tabs, a host-grouped
// heatmap instead of GPU tiles, a paginated worst-first rank table and grouped alerts, so
// its page stays about three screens tall.

import { LineChart, colorAt, formatNumber } from "./charts.js";
import { CompareView, compareHash, parseCompareHash } from "./compare.js";
import { onFrame } from "./frame.js";
import { HostHeatmap, StragglerStrip } from "./heatmap.js";
import { BIG, RankPicker, RankTable, renderAlerts } from "./ranks.js";
import { StepView } from "./steps.js";
import {
  $, DASH, api, button, enc, fmtAgo, setText, fmtBytes, fmtDur, fmtInt, fmtLoss, fmtMs, fmtPct, h,
  isNum, pct, serverNow,
} from "./util.js";

// ---------------------------------------------------------------- state

const state = {
  gen: 0, // bumps on every run switch; stale async results compare and bail out
  run: null,
  runs: [],
  es: null,
  fresh: false, // the next `run` event is the first of a connection
  header: null,
  records: [], // ascending epoch
  byEpoch: new Map(),
  ranks: [],
  rankMap: new Map(), // rank -> ranks entry
  hostOfRank: new Map(), // rank -> host (header topology)
  rankSeries: new Map(), // rank -> [{t, util, vu, vt}] sampled from `ranks` events
  rankSeen: new Map(), // rank -> last_seen already sampled
  knownRanks: new Set(),
  tab: "home",
  graphKey: null,
  picked: false, // the user chose a run (do not auto-follow the newest)
  expandedAlerts: new Set(),
  stepRanks: false, // some rank has sent steps
  mode: "run", // "run" | "compare"
};

const dirty = new Set();
let renderQueued = false;

function invalidate(...parts) {
  for (const p of parts) dirty.add(p);
  if (renderQueued) return;
  renderQueued = true;
  onFrame("dashboard", renderNow);
}

function renderNow() {
  renderQueued = false;
  const parts = new Set(dirty);
  dirty.clear();
  try {
    if (parts.has("header")) {
      renderHeader();
      updatePickerEntry();
    }
    if (parts.has("records")) renderRecords();
    if (parts.has("records") || parts.has("ranks") || parts.has("header") || parts.has("steps")) {
      renderLayout();
      renderKpis();
    }
    if (parts.has("records") || parts.has("ranks") || parts.has("header")) renderRanks();
    if (parts.has("records") || parts.has("ranks") || parts.has("tab")) renderRankPanel();
    renderTicking();
  } catch (err) {
    console.warn("rankboard: render failed", err); // never let one bad value kill the page
  }
}

// ---------------------------------------------------------------- charts

const charts = {};
let steps = null;
let table = null;
let picker = null;
let heatmap = null;
let strip = null;
let compare = null;

function pctFmt(v) {
  return isNum(v) ? `${+v.toFixed(Math.abs(v) < 10 ? 1 : 0)}%` : DASH;
}

function makeCharts() {
  charts.metrics = new LineChart($("metrics-card"), {
    title: "Training metrics", chartId: "metrics", xLabel: "epoch", xInteger: true,
    log: true, smoothing: true, yFormat: formatNumber, height: 280, filename: "metrics",
  });
  charts.resources = new LineChart($("resources-card"), {
    title: "Cluster resources", chartId: "resources", xLabel: "epoch", xInteger: true,
    yMin: 0, yMax: 100, yFormat: pctFmt, height: 220, filename: "resources",
  });
  charts.rankUtil = new LineChart($("rank-util-card"), {
    title: "GPU utilisation and VRAM", chartId: "rank-util", xType: "time",
    yMin: 0, yMax: 100, yFormat: pctFmt, height: 240, filename: "rank-util",
    emptyText: "no GPU samples from this rank yet",
  });
  charts.rankStep = new LineChart($("rank-step-card"), {
    title: "Step time", chartId: "rank-step", xType: "time", yMin: 0,
    yFormat: fmtMs, height: 200, filename: "rank-step", emptyText: "no step time from this rank yet",
  });
  charts.rankThroughput = new LineChart($("rank-throughput-card"), {
    title: "Throughput (samples/s)", chartId: "rank-throughput", xLabel: "epoch", xInteger: true,
    log: true, smoothing: true, yFormat: formatNumber, height: 220, filename: "rank-throughput",
    emptyText: "no epochs yet",
  });
  charts.rankShare = new LineChart($("rank-share-card"), {
    title: "Batch share", chartId: "rank-share", xLabel: "epoch", xInteger: true,
    yMin: 0, yFormat: pctFmt, height: 220, filename: "rank-share", emptyText: "no epochs yet",
  });
  steps = new StepView($("step-section"), {
    straggler: stragglerText,
    onChange: () => invalidate("steps"),
  });
  table = new RankTable($("rank-table"), $("rank-pager"), {
    onOpen: (rank) => selectTab(rank),
    onChange: () => renderRanks(),
  });
  picker = new RankPicker($("rank-picker-host"), { onPick: (rank) => selectTab(rank) });
  heatmap = new HostHeatmap($("heatmap"), {
    chartId: "rank-heatmap", title: "per-rank GPU utilisation and throughput",
    onPick: (rank) => selectTab(rank), hostOf,
  });
  strip = new StragglerStrip($("straggler-strip"), {
    onPick: (rank) => selectTab(rank), ago: (t) => fmtAgo(serverNow() - t),
  });
  compare = new CompareView($("compare-view"), {
    runs: () => state.runs,
    close: () => closeCompare(),
  });
}

// ---------------------------------------------------------------- run list / picker

async function refreshRuns() {
  let runs;
  try {
    runs = await api("/api/runs");
  } catch (err) {
    setConn("error", "offline");
    return;
  }
  if (!Array.isArray(runs)) return;
  state.runs = runs;
  renderPicker();
  if (state.mode === "compare") {
    compare.renderRuns();
    return;
  }
  const wanted = runFromHash();
  if (state.run === null) {
    if (wanted && runs.some((r) => r.run === wanted)) openRun(wanted, true);
    else if (runs.length) openRun(runs[0].run, false);
    else showEmpty(true);
  } else if (!state.picked && runs.length && runs[0].run !== state.run) {
    // Nobody chose this run: when it has ended and a newer one started, follow the newest.
    const st = state.header && state.header.status;
    if (st === "complete" || st === "failed") openRun(runs[0].run, false);
  }
}

function runLabel(r) {
  const total = isNum(r.total_epochs) && r.total_epochs > 0 ? r.total_epochs : "?";
  const name = r.label ? `${r.label} (${r.run})` : r.run;
  return `${name} · ${r.status} · ${r.epochs_done ?? 0}/${total}`;
}

function renderPicker() {
  const sel = $("run-picker");
  const runs = state.runs.slice();
  if (state.run !== null && !runs.some((r) => r.run === state.run)) {
    runs.unshift({ run: state.run, status: state.header?.status ?? "", label: state.header?.label });
  }
  const opts = runs.map((r) => {
    const o = h("option", null, runLabel(r));
    o.value = r.run;
    o.dataset.status = r.status || "";
    return o;
  });
  sel.replaceChildren(...opts);
  if (state.run !== null) sel.value = state.run;
}

function runFromHash() {
  const m = /(?:^#|&)run=([^&]*)/.exec(location.hash);
  if (!m) return null;
  try {
    return decodeURIComponent(m[1]);
  } catch {
    return null;
  }
}

function showEmpty(empty) {
  $("empty-state").hidden = !empty;
  $("run-view").hidden = empty || state.mode === "compare";
}

// ---------------------------------------------------------------- comparison

function openCompare(sel) {
  state.mode = "compare";
  $("run-view").hidden = true;
  $("empty-state").hidden = true;
  $("compare-btn").setAttribute("aria-pressed", "true");
  const want = compareHash(sel);
  if (location.hash !== want) history.replaceState(null, "", `${location.pathname}${location.search}${want}`);
  compare.open(sel);
}

function closeCompare() {
  state.mode = "run";
  compare.close();
  $("compare-btn").setAttribute("aria-pressed", "false");
  const run = state.run ?? (state.runs[0] && state.runs[0].run);
  if (run) {
    const want = `#run=${enc(run)}`;
    history.replaceState(null, "", `${location.pathname}${location.search}${want}`);
    if (run === state.run && state.es) {
      $("run-view").hidden = false;
      invalidate("header", "records", "ranks");
    } else {
      openRun(run, true);
    }
  } else {
    showEmpty(true);
  }
}

// ---------------------------------------------------------------- opening a run

function resetRunState(run) {
  state.gen += 1;
  if (state.es) {
    state.es.close();
    state.es = null;
  }
  state.run = run;
  state.header = null;
  state.records = [];
  state.byEpoch = new Map();
  state.ranks = [];
  state.rankMap = new Map();
  state.hostOfRank = new Map();
  state.rankSeries = new Map();
  state.rankSeen = new Map();
  state.knownRanks = new Set();
  state.tab = "home";
  state.graphKey = null;
  state.expandedAlerts = new Set();
  state.stepRanks = false;
  $("rank-tabs").replaceChildren();
  $("graph").replaceChildren(h("p", "muted", "no model graph sent"));
  setText($("graph-label"), "");
  $("graph-open").hidden = true;
  for (const c of Object.values(charts)) c.resetZoom();
  steps.reset(run);
  table.reset();
  strip.reset();
}

function openRun(run, picked) {
  if (state.mode === "compare") {
    state.mode = "run";
    compare.close();
    $("compare-btn").setAttribute("aria-pressed", "false");
  }
  if (run === state.run && state.es) {
    $("run-view").hidden = false;
    return;
  }
  resetRunState(run);
  state.picked = picked;
  const gen = state.gen;
  showEmpty(false);
  const want = `#run=${enc(run)}`;
  if (location.hash !== want) history.replaceState(null, "", `${location.pathname}${location.search}${want}`);
  $("csv-link").href = `/api/runs/${enc(run)}/history.csv`;
  $("csv-link").setAttribute("download", `${run}.csv`);
  renderPicker();
  selectTab("home");
  invalidate("header", "records", "ranks");

  api(`/api/runs/${enc(run)}`).then((data) => {
    if (gen !== state.gen || !data) return;
    applyHeader(data, false);
    if (Array.isArray(data.records)) for (const r of data.records) addRecord(r);
    if (Array.isArray(data.ranks)) applyRanks(data.ranks, false);
  }).catch((err) => {
    if (gen !== state.gen) return;
    if (err.status === 404) {
      state.run = null;
      refreshRuns();
    }
  });
  connect(gen);
}

function connect(gen) {
  if (gen !== state.gen) return;
  const es = new EventSource(`/api/runs/${enc(state.run)}/events`, { withCredentials: true });
  state.es = es;
  state.fresh = true;
  setConn("connecting", "connecting");
  const on = (kind, fn) => es.addEventListener(kind, (ev) => {
    if (gen !== state.gen) return;
    let data;
    try {
      data = JSON.parse(ev.data);
    } catch {
      return;
    }
    fn(data);
  });
  es.addEventListener("open", () => {
    if (gen !== state.gen) return;
    state.fresh = true; // a (re)connection: its first `run` event sets the steps cut
    setConn("live", "live");
  });
  on("run", (d) => {
    const first = state.fresh;
    state.fresh = false;
    applyHeader(d, first);
  });
  on("epoch", addRecord);
  on("ranks", (d) => applyRanks(d));
  on("steps", (d) => steps.onSteps(d));
  on("complete", (d) => {
    if (state.header && d && typeof d.status === "string") {
      state.header.status = d.status;
      invalidate("header");
    }
  });
  es.addEventListener("error", () => {
    if (gen !== state.gen) return;
    if (es.readyState === EventSource.CLOSED) {
      // The browser gave up (e.g. a non-200 answer): retry ourselves. A fresh
      // EventSource replays everything; records are keyed by epoch, so no duplicates.
      setConn("error", "disconnected, retrying");
      setTimeout(() => {
        if (gen === state.gen && state.es === es) connect(gen);
      }, 3000);
    } else {
      setConn("connecting", "reconnecting");
    }
  });
}

function setConn(st, text) {
  $("conn").dataset.state = st;
  setText($("conn-text"), text);
}

// ---------------------------------------------------------------- applying data

const HEADER_KEYS = ["run", "status", "world_size", "total_epochs", "label", "hash", "port",
  "metadata", "hardware", "has_svg", "hosts", "alerts", "started_at", "updated_at",
  "steps_done", "step_metrics"];

function applyHeader(hd, firstOfConnection) {
  if (!hd || typeof hd !== "object") return;
  const out = {};
  for (const k of HEADER_KEYS) out[k] = hd[k];
  state.header = out;
  state.hostOfRank = new Map();
  for (const host of Array.isArray(hd.hosts) ? hd.hosts : []) {
    for (const r of host.ranks || []) {
      state.hostOfRank.set(r, host.host);
      noteRank(r);
    }
  }
  steps.onHeader(out, firstOfConnection);
  invalidate("header", "ranks");
}

function updatePickerEntry() {
  const hd = state.header;
  if (!hd) return;
  const entry = state.runs.find((r) => r.run === state.run);
  if (entry) {
    entry.status = hd.status;
    entry.label = hd.label;
    entry.total_epochs = hd.total_epochs;
    entry.epochs_done = state.records.length;
    const opt = [...$("run-picker").options].find((o) => o.value === state.run);
    if (opt) setText(opt, runLabel(entry));
  }
}

function addRecord(rec) {
  if (!rec || !isNum(rec.epoch)) return;
  const had = state.byEpoch.has(rec.epoch);
  state.byEpoch.set(rec.epoch, rec);
  const recs = state.records;
  if (had) {
    const i = recs.findIndex((r) => r.epoch === rec.epoch);
    recs[i] = rec;
  } else if (!recs.length || recs[recs.length - 1].epoch < rec.epoch) {
    recs.push(rec);
  } else {
    recs.push(rec);
    recs.sort((a, b) => a.epoch - b.epoch);
  }
  for (const g of rec.gpu_metrics || []) noteRank(g.device_index);
  if (state.header && isNum(rec.total_epochs) && rec.total_epochs > 0) {
    state.header.total_epochs = rec.total_epochs;
  }
  if (state.header && state.header.status === "waiting") state.header.status = "training";
  invalidate("records", "header");
}

/** A `ranks` array (from the stream, or the JSON snapshot: `sample` false, no strip column). */
function applyRanks(ranks, sample = true) {
  if (!Array.isArray(ranks)) return;
  state.ranks = ranks.slice().sort((a, b) => a.rank - b.rank);
  state.rankMap = new Map();
  const cap = state.ranks.length > BIG ? 600 : 5000;
  const stepMs = new Map();
  let anyStep = false;
  for (const r of state.ranks) {
    state.rankMap.set(r.rank, r);
    noteRank(r.rank);
    sampleRank(r, cap);
    if (isNum(r.step)) anyStep = true;
    if (isNum(r.step_ms)) stepMs.set(r.rank, r.step_ms);
  }
  if (anyStep) state.stepRanks = true;
  if (stepMs.size && sample) strip.push(serverNow(), stepMs);
  invalidate("ranks");
}

/** Append a rank's latest resources to its client-side series, once per new frame time. */
function sampleRank(r, cap) {
  const res = r.resources;
  if (!res || !isNum(r.last_seen)) return;
  if (state.rankSeen.get(r.rank) === r.last_seen) return;
  state.rankSeen.set(r.rank, r.last_seen);
  const { util, vu, vt } = rankGpu(r);
  if (!isNum(util) && !isNum(vu)) return;
  let series = state.rankSeries.get(r.rank);
  if (!series) state.rankSeries.set(r.rank, (series = []));
  series.push({ t: r.last_seen, util: isNum(util) ? util : null, vu, vt });
  if (series.length > cap) series.splice(0, series.length - cap);
}

function noteRank(rank) {
  if (!isNum(rank) || state.knownRanks.has(rank)) return;
  state.knownRanks.add(rank);
  invalidate("ranks");
}

function isBig() {
  const w = state.header && isNum(state.header.world_size) ? state.header.world_size : 0;
  return Math.max(w, state.knownRanks.size) > BIG;
}

// ---------------------------------------------------------------- header rendering

const STATUS_TEXT = { waiting: "waiting", training: "training", complete: "complete", failed: "failed" };

function renderHeader() {
  const hd = state.header;
  const run = state.run ?? "";
  const label = hd && hd.label ? hd.label : run;
  setText($("run-name"), label || DASH);
  $("run-name").title = label;
  setText($("run-id"), hd && hd.label ? run : "");
  const hash = hd && hd.hash ? String(hd.hash) : "";
  $("run-hash").hidden = !hash;
  setText($("run-hash"), hash ? `#${hash.slice(0, 10)}` : "");
  $("run-hash").title = hash ? `model hash ${hash}` : "";
  const status = (hd && hd.status) || "waiting";
  $("status").dataset.status = status;
  $("run-view").dataset.status = status;
  setText($("status-text"), STATUS_TEXT[status] || status);

  // progress
  const done = state.records.length;
  const total = hd && isNum(hd.total_epochs) && hd.total_epochs > 0 ? hd.total_epochs : null;
  setText($("epoch-count"), `${done}/${total ?? "?"}`);
  const bar = $("progress-bar");
  const frac = total ? Math.min(1, done / total) : null;
  bar.classList.toggle("indeterminate", frac === null && status === "training");
  bar.style.width = frac === null ? (status === "training" ? "30%" : "0%") : `${(frac * 100).toFixed(1)}%`;
  setText($("progress-pct"), frac === null ? "" : `${Math.floor(frac * 100)}%`);
  document.title = `${label || "rankboard"} · ${done}/${total ?? "?"} · rankboard`;

  // hardware: the exact string of the contract, one line, click to wrap
  const hw = $("hardware");
  const hwText = (hd && hd.hardware) || "";
  setText(hw, hwText);
  hw.title = hwText;
  hw.hidden = !hwText;

  renderMetadata();
  renderGraph();
}

function renderMetadata() {
  const pre = $("metadata");
  const md = state.header ? state.header.metadata : null;
  setText(pre, md === null || md === undefined ? "no metadata sent"
    : typeof md === "string" ? md : JSON.stringify(md, null, 2));
  pre.classList.toggle("muted", md === null || md === undefined);
}

function renderGraph() {
  const hd = state.header;
  const has = !!(hd && hd.has_svg);
  const key = has ? `${state.run}\u0000${hd.hash ?? ""}` : null;
  if (key === state.graphKey) return;
  state.graphKey = key;
  const box = $("graph");
  const open = $("graph-open");
  setText($("graph-label"), has && hd.label ? hd.label : "");
  if (!has) {
    box.replaceChildren(h("p", "muted", "no model graph sent"));
    open.hidden = true;
    return;
  }
  const src = `/api/runs/${enc(state.run)}/graph.svg?v=${enc(hd.hash || String(Date.now()))}`;
  const img = document.createElement("img");
  img.alt = `model graph${hd.label ? ` of ${hd.label}` : ""}`;
  img.decoding = "async";
  img.src = src;
  box.replaceChildren(img);
  open.href = src;
  open.hidden = false;
}

/** Which panels a run shows: epoch panels only once it has an epoch when it logs steps. */
function renderLayout() {
  const hd = state.header;
  const stepish = steps.hasSteps || state.stepRanks || !!(hd && hd.step_metrics && hd.step_metrics.length);
  const epochless = state.records.length === 0 && stepish;
  const panel = $("panel-home");
  panel.dataset.layout = epochless ? "steps" : stepish ? "both" : "epochs";
  for (const e of document.querySelectorAll(".epoch-panel")) e.hidden = epochless;
  $("straggler-card").hidden = !state.stepRanks;
  $("straggler-card").classList.toggle("span-8", epochless);
  $("straggler-card").classList.toggle("span-12", !epochless);
  $("config-card").classList.toggle("span-5", !epochless);
  $("config-card").classList.toggle("span-12", epochless);
  const total = hd && isNum(hd.total_epochs) && hd.total_epochs > 0;
  $("epoch-progress").hidden = epochless && !total;
  $("step-stat").hidden = !steps.hasSteps;
  if (steps.hasSteps) {
    setText($("step-count"), fmtInt(steps.lastStep));
    const rate = steps.stepsPerSecond();
    setText($("step-rate"), isNum(rate) && rate > 0 ? `${rate.toFixed(1)}/s` : "");
  }
}

// ---------------------------------------------------------------- records rendering

function metricNames() {
  const names = [];
  const seen = new Set();
  for (const r of state.records) {
    for (const k of Object.keys(r.metrics || {})) {
      if (!seen.has(k)) {
        seen.add(k);
        names.push(k);
      }
    }
  }
  const i = names.indexOf("loss");
  if (i > 0) {
    names.splice(i, 1);
    names.unshift("loss");
  }
  return names;
}

function renderRecords() {
  const recs = state.records;
  const x = recs.map((r) => r.epoch);
  const names = metricNames();
  charts.metrics.setData(x, names.map((n, i) => ({
    name: n, color: colorAt(i), values: recs.map((r) => (r.metrics ? r.metrics[n] : null)),
  })));
  const res = (r) => r.resources || {};
  charts.resources.setData(x, [
    { name: "CPU", color: "#5794f2", values: recs.map((r) => res(r).cpu_percent) },
    { name: "RAM", color: "#b877d9", values: recs.map((r) => pct(res(r).ram_used_bytes, res(r).ram_total_bytes)) },
    { name: "GPU util", color: "#73bf69", values: recs.map((r) => res(r).gpu_util_percent) },
    { name: "VRAM", color: "#ff9830", values: recs.map((r) => pct(res(r).vram_allocated_bytes, res(r).vram_total_bytes)) },
  ]);
  renderLog(names);
}

function renderLog(names) {
  const tbl = $("log-table");
  const head = h("tr");
  head.append(h("th", null, "epoch"), h("th", "num", "duration"));
  for (const n of names) {
    const th = h("th", "num metric-col", n);
    th.title = n;
    head.append(th);
  }
  head.append(h("th", null, "missing ranks"));
  tbl.tHead.replaceChildren(head);
  const rows = [];
  const recs = state.records;
  for (let i = recs.length - 1; i >= 0 && rows.length < 500; i--) {
    const r = recs[i];
    const tr = h("tr");
    tr.dataset.epoch = String(r.epoch);
    tr.append(h("td", "mono", r.epoch), h("td", "num mono", fmtDur(r.duration_secs)));
    for (const n of names) {
      const v = r.metrics ? r.metrics[n] : null;
      const td = h("td", "num mono", fmtLoss(v));
      if (n === "loss" && (v === null || v === undefined) && r.metrics && n in r.metrics) td.classList.add("bad");
      tr.append(td);
    }
    const miss = Array.isArray(r.missing_ranks) ? r.missing_ranks : [];
    const compact = miss.length > 12 ? `${miss.slice(0, 12).join(", ")} … (${fmtInt(miss.length)})` : miss.join(", ");
    const td = h("td", miss.length ? "missing" : "muted", miss.length ? compact : DASH);
    if (miss.length > 12) td.title = miss.join(", ");
    tr.append(td);
    rows.push(tr);
  }
  if (!rows.length) {
    const tr = h("tr");
    const td = h("td", "muted empty-row", "no epochs closed yet");
    td.colSpan = names.length + 3;
    tr.append(td);
    rows.push(tr);
  }
  tbl.tBodies[0].replaceChildren(...rows);
}

function renderKpis() {
  const recs = state.records;
  const last = recs[recs.length - 1];
  const prev = recs[recs.length - 2];
  const useSteps = steps.hasSteps;
  const d = $("kpi-loss-delta");
  if (useSteps) {
    const loss = steps.kpi.loss;
    setText($("kpi-loss-label"), "loss");
    setText($("kpi-loss"), fmtLoss(loss));
    $("kpi-loss").classList.toggle("bad", loss === null);
    setText(d, `step ${fmtInt(steps.lastStep)}${last && last.metrics && isNum(last.metrics.loss) ? ` · epoch ${last.epoch}: ${fmtLoss(last.metrics.loss)}` : ""}`);
    d.dataset.trend = "";
  } else {
    const loss = last && last.metrics ? last.metrics.loss : null;
    setText($("kpi-loss"), fmtLoss(loss));
    $("kpi-loss").classList.toggle("bad", !!last && last.metrics && "loss" in last.metrics && !isNum(loss));
    const pl = prev && prev.metrics ? prev.metrics.loss : null;
    if (isNum(loss) && isNum(pl)) {
      const diff = loss - pl;
      setText(d, `${diff <= 0 ? "▼" : "▲"} ${fmtLoss(Math.abs(diff))} vs previous`);
      d.dataset.trend = diff <= 0 ? "good" : "bad";
    } else {
      setText(d, last ? `epoch ${last.epoch}` : "");
      d.dataset.trend = "";
    }
  }
  if (useSteps && !last) {
    setText($("kpi-time-label"), "step time");
    setText($("kpi-epoch-time"), fmtMs(steps.kpi.step_ms));
    const rate = steps.stepsPerSecond();
    setText($("kpi-epoch-time-sub"), isNum(rate) && rate > 0 ? `${rate.toFixed(1)} steps/s` : "mean over ranks");
  } else {
    setText($("kpi-time-label"), "epoch time");
    setText($("kpi-epoch-time"), last ? fmtDur(last.duration_secs) : DASH);
    const lastFive = recs.slice(-5).map((r) => r.duration_secs).filter(isNum);
    $("kpi-epoch-time-sub").textContent = lastFive.length
      ? `mean of last ${lastFive.length}: ${fmtDur(lastFive.reduce((a, b) => a + b, 0) / lastFive.length)}`
      : "";
  }
  if (useSteps && isNum(steps.kpi.samples_per_s)) {
    setText($("kpi-throughput"), formatNumber(steps.kpi.samples_per_s));
    const tok = steps.kpi.tokens_per_s;
    setText($("kpi-throughput-sub"), isNum(tok) ? `samples/s · ${formatNumber(tok)} tokens/s` : "samples/s, last step");
  } else {
    const tp = last ? (last.gpu_metrics || []).map((g) => g.throughput).filter(isNum) : [];
    setText($("kpi-throughput"), tp.length ? formatNumber(tp.reduce((a, b) => a + b, 0) * 1000) : DASH);
    setText($("kpi-throughput-sub"), "samples/s, all ranks");
  }
}

// ---------------------------------------------------------------- ranks rendering

function rankInfo(rank) {
  return state.rankMap.get(rank) || null;
}

function hostOf(rank) {
  const r = rankInfo(rank);
  if (r && r.host) return r.host;
  return state.hostOfRank.get(rank) ?? null;
}

function latestGpuMetrics() {
  const last = state.records[state.records.length - 1];
  const map = new Map();
  for (const g of (last && last.gpu_metrics) || []) map.set(g.device_index, g);
  return map;
}

/** Fastest / slowest rank by the latest epoch's throughput (only with two or more). */
function extremes(gm) {
  const list = [...gm.values()].filter((g) => isNum(g.throughput) && g.throughput > 0);
  if (list.length < 2) return { fast: null, slow: null };
  let fast = list[0];
  let slow = list[0];
  for (const g of list) {
    if (g.throughput > fast.throughput) fast = g;
    if (g.throughput < slow.throughput) slow = g;
  }
  if (fast.throughput === slow.throughput) return { fast: null, slow: null };
  return { fast: fast.device_index, slow: slow.device_index };
}

function rankGpu(r) {
  const res = (r && r.resources) || {};
  const own = (res.gpus || []).find((g) => g.device_index === r.rank) || (res.gpus || [])[0] || {};
  return {
    util: isNum(res.gpu_util_percent) ? res.gpu_util_percent : own.util_percent,
    vu: isNum(res.vram_allocated_bytes) ? res.vram_allocated_bytes : own.vram_allocated_bytes,
    vt: isNum(res.vram_total_bytes) ? res.vram_total_bytes : own.vram_total_bytes,
    name: own.name,
  };
}

/**
 * A rank is marked a straggler when it was the slowest in a share of recent steps far
 * above the 1/world_size an even cluster gives: at least 3/N (at least 5 %, at most 75 %),
 * once 20 steps have closed.
 */
function stragglerThreshold(n) {
  return Math.min(0.75, Math.max(3 / Math.max(1, n), 0.05));
}

function worldSize() {
  const hd = state.header;
  return hd && isNum(hd.world_size) ? hd.world_size : state.knownRanks.size;
}

/** One row model per known rank (the table, the picker and the heatmap read these). */
function rankRows() {
  const ranks = [...state.knownRanks].sort((a, b) => a - b);
  const gm = latestGpuMetrics();
  const { fast, slow } = extremes(gm);
  const n = worldSize();
  const thr = stragglerThreshold(n);
  const enough = steps.lastStep !== null && steps.lastStep >= 20;
  let sum = 0;
  let cnt = 0;
  for (const r of state.ranks) {
    if (isNum(r.step_ms) && r.step_ms > 0) {
      sum += r.step_ms;
      cnt++;
    }
  }
  const meanMs = cnt ? sum / cnt : null;
  return ranks.map((rank) => {
    const r = rankInfo(rank);
    const g = rankGpu(r || { rank });
    const m = gm.get(rank);
    const marks = [];
    if (rank === fast) marks.push("fastest");
    if (rank === slow) marks.push("slowest");
    const share = r && isNum(r.slowest_share) ? r.slowest_share : null;
    if (enough && n > 1 && share !== null && share >= thr) marks.push("straggler");
    const stepMs = r && isNum(r.step_ms) ? r.step_ms : null;
    return {
      rank, host: hostOf(rank), lr: r ? r.local_rank : null, status: r ? r.status : "unknown",
      lastSeen: r ? r.last_seen : null, epoch: r ? r.epoch : null, step: r ? r.step : null,
      util: g.util, vu: g.vu, vt: g.vt,
      throughput: m && isNum(m.throughput) ? m.throughput : null,
      share: m ? m.chunk_ratio : null, stepMs,
      stepRatio: stepMs !== null && meanMs ? stepMs / meanMs : null,
      slowShare: share, marks,
    };
  });
}

function renderRanks() {
  const rows = rankRows();
  const big = isBig();
  const hd = state.header;
  const world = hd && isNum(hd.world_size) ? hd.world_size : null;
  state.rows = rows;
  table.update(rows, { epochs: state.records.length > 0, steps: state.stepRanks, big });
  renderTabs(rows, big);

  const hosts = (hd && hd.hosts) || [];
  setText($("ranks-sub"), `${fmtInt(hosts.length)} host${hosts.length === 1 ? "" : "s"} · ${fmtInt(rows.length)}${world ? ` of ${fmtInt(world)}` : ""} rank${(world ?? rows.length) === 1 ? "" : "s"}`);

  // health KPI and header count
  const counts = {};
  for (const r of state.ranks) counts[r.status] = (counts[r.status] || 0) + 1;
  const ok = counts.ok || 0;
  const denom = world ?? state.ranks.length;
  setText($("kpi-ranks"), denom ? `${fmtInt(ok)}/${fmtInt(denom)}` : DASH);
  $("kpi-ranks").classList.toggle("bad", !!(counts.stale || counts.error));
  const sub = ["stale", "error", "finished"].filter((k) => counts[k]).map((k) => `${fmtInt(counts[k])} ${k}`);
  setText($("kpi-ranks-sub"), sub.length ? sub.join(" · ") : denom ? "all reporting" : "");
  const live = !hd || hd.status === "training" || hd.status === "waiting";
  setText($("rank-count"), !denom ? DASH : live ? `${fmtInt(ok)}/${fmtInt(denom)} live` : fmtInt(denom));

  renderResourceBars(rows, big);
  renderStragglers(rows);
  renderAlertList();
}

function renderAlertList() {
  const alerts = (state.header && state.header.alerts) || [];
  const rankStatus = new Map(state.ranks.map((r) => [r.rank, r.status]));
  renderAlerts($("alerts"), alerts, rankStatus, state.expandedAlerts, (kind) => {
    if (state.expandedAlerts.has(kind)) state.expandedAlerts.delete(kind);
    else state.expandedAlerts.add(kind);
    renderAlertList();
  });
}

function renderTabs(rows, big) {
  const box = $("rank-tabs");
  $("rank-picker-host").hidden = !big;
  box.hidden = big;
  if (big) {
    if (box.childElementCount) box.replaceChildren();
    picker.update(rows, state.tab === "home" ? null : state.tab);
    return;
  }
  const existing = new Map([...box.children].map((b) => [Number(b.dataset.rank), b]));
  let prev = null;
  for (const row of rows) {
    const rank = row.rank;
    let b = existing.get(rank);
    if (!b) {
      b = button("tab rank-tab", null, () => selectTab(rank));
      b.dataset.rank = String(rank);
      b.id = `tab-rank-${rank}`;
      b.setAttribute("aria-selected", String(state.tab === rank));
      b.append(h("span", "dot"), h("span", "tab-text", `rank ${rank}`));
      b.classList.toggle("active", state.tab === rank);
      if (prev) prev.after(b);
      else box.prepend(b);
    }
    b.firstChild.dataset.status = row.status || "unknown";
    b.title = row.host ? `rank ${rank} on ${row.host}` : `rank ${rank}`;
    prev = b;
  }
}

function selectTab(tab) {
  state.tab = tab;
  const home = tab === "home";
  $("panel-home").hidden = !home;
  $("panel-rank").hidden = home;
  $("tab-home").classList.toggle("active", home);
  $("tab-home").setAttribute("aria-selected", String(home));
  for (const b of $("rank-tabs").children) {
    const on = !home && Number(b.dataset.rank) === tab;
    b.classList.toggle("active", on);
    b.setAttribute("aria-selected", String(on));
  }
  if (picker && state.rows) picker.update(state.rows, home ? null : tab);
  if (!home) {
    charts.rankUtil.resetZoom();
    charts.rankStep.resetZoom();
    charts.rankThroughput.resetZoom();
    charts.rankShare.resetZoom();
    window.scrollTo({ top: 0 });
  }
  invalidate("tab");
}

/** Cluster "now" figures from every rank's latest sample (PROTOCOL 2.3 rules). */
function currentResources() {
  const hostsCpu = new Map();
  const hostsRam = new Map();
  let usum = 0;
  let un = 0;
  let vu = 0;
  let vt = 0;
  const sorted = state.ranks.slice().sort((a, b) => (a.local_rank ?? 0) - (b.local_rank ?? 0));
  for (const r of sorted) {
    const s = r.resources;
    if (!s) continue;
    if (r.host) {
      if (isNum(s.cpu_percent) && !hostsCpu.has(r.host)) hostsCpu.set(r.host, s.cpu_percent);
      if (isNum(s.ram_used_bytes) && isNum(s.ram_total_bytes) && !hostsRam.has(r.host)) {
        hostsRam.set(r.host, [s.ram_used_bytes, s.ram_total_bytes]);
      }
    }
    if (isNum(s.gpu_util_percent)) {
      usum += s.gpu_util_percent;
      un++;
    }
    if (isNum(s.vram_allocated_bytes)) vu += s.vram_allocated_bytes;
    if (isNum(s.vram_total_bytes)) vt += s.vram_total_bytes;
  }
  const cpus = [...hostsCpu.values()];
  let ru = 0;
  let rt = 0;
  for (const [u, t] of hostsRam.values()) {
    ru += u;
    rt += t;
  }
  const out = {
    cpu_percent: cpus.length ? cpus.reduce((a, b) => a + b, 0) / cpus.length : null,
    ram_used_bytes: rt ? ru : null,
    ram_total_bytes: rt || null,
    gpu_util_percent: un ? usum / un : null,
    vram_allocated_bytes: vt ? vu : null,
    vram_total_bytes: vt || null,
  };
  const last = state.records[state.records.length - 1];
  const fallback = (last && last.resources) || {};
  for (const k of Object.keys(out)) if (out[k] === null && isNum(fallback[k])) out[k] = fallback[k];
  return out;
}

function renderResourceBars(rows, big) {
  const r = currentResources();
  const bars = [
    ["cpu", "CPU", r.cpu_percent, fmtPct(r.cpu_percent)],
    ["ram", "RAM", pct(r.ram_used_bytes, r.ram_total_bytes),
      isNum(r.ram_used_bytes) ? `${fmtBytes(r.ram_used_bytes)} / ${fmtBytes(r.ram_total_bytes)}` : DASH],
    ["gpu", "GPU util", r.gpu_util_percent, fmtPct(r.gpu_util_percent)],
    ["vram", "VRAM", pct(r.vram_allocated_bytes, r.vram_total_bytes),
      isNum(r.vram_allocated_bytes) ? `${fmtBytes(r.vram_allocated_bytes)} / ${fmtBytes(r.vram_total_bytes)}` : DASH],
  ];
  const els = bars.map(([key, label, value, text]) => {
    const row = h("div", "bar-row");
    row.dataset.resource = key;
    const top = h("div", "bar-top");
    top.append(h("span", "bar-label", label), h("span", "bar-pct mono", isNum(value) ? fmtPct(value) : DASH));
    const track = h("div", "bar-track");
    const fill = h("div", "bar-fill");
    fill.dataset.resource = key;
    fill.style.width = `${isNum(value) ? Math.max(0, Math.min(100, value)) : 0}%`;
    if ((key === "vram" || key === "ram") && isNum(value) && value >= 95) fill.dataset.level = "high";
    track.append(fill);
    row.append(top, track, h("div", "bar-detail mono", key === "ram" || key === "vram" ? text : ""));
    return row;
  });
  $("resource-bars").replaceChildren(...els);

  const minis = $("gpu-minis");
  $("heat-card").hidden = !big;
  if (big) {
    minis.replaceChildren(h("div", "gpu-minis-title", "per-rank GPU utilisation: see the heatmap below"));
    renderHeatmap(rows);
    return;
  }
  // one tile per GPU: utilisation as the fill, VRAM as text
  const tiles = rows.filter((x) => isNum(x.util) || isNum(x.vu)).map((x) => {
    const t = button("gpu-tile", null, () => selectTab(x.rank));
    t.dataset.rank = String(x.rank);
    const name = rankGpu(rankInfo(x.rank) || { rank: x.rank }).name;
    t.title = `rank ${x.rank}${x.host ? ` on ${x.host}` : ""}${name ? ` · ${name}` : ""}`;
    const fill = h("span", "gpu-tile-fill");
    fill.style.height = `${isNum(x.util) ? Math.max(0, Math.min(100, x.util)) : 0}%`;
    t.append(fill, h("span", "gpu-tile-rank", `r${x.rank}`), h("span", "gpu-tile-val mono", fmtPct(x.util)));
    return t;
  });
  if (tiles.length) {
    const grid = h("div", "gpu-grid");
    grid.append(...tiles);
    minis.replaceChildren(h("div", "gpu-minis-title", "GPU utilisation per rank"), grid);
  } else {
    minis.replaceChildren();
  }
}

/** Hosts in topology order, ranks by local rank; ranks without a host in a last group. */
function hostGroups(rows) {
  const hd = state.header;
  const groups = [];
  const placed = new Set();
  for (const hst of (hd && hd.hosts) || []) {
    const ranks = (hst.ranks || []).filter(isNum);
    for (const r of ranks) placed.add(r);
    if (ranks.length) groups.push({ host: hst.host, ranks });
  }
  const rest = rows.map((r) => r.rank).filter((r) => !placed.has(r));
  if (rest.length) groups.push({ host: "no host", ranks: rest });
  return groups;
}

function median(vals) {
  if (!vals.length) return null;
  const s = vals.slice().sort((a, b) => a - b);
  return s[s.length >> 1];
}

function renderHeatmap(rows) {
  const byRank = new Map(rows.map((r) => [r.rank, r]));
  const groups = hostGroups(rows);
  const layers = [{
    key: "util", label: "GPU utilisation", legend: ["0%", "100%"],
    value: (rank) => byRank.get(rank)?.util ?? null, scale: (v) => v / 100, format: (v) => fmtPct(v),
  }];
  const epochs = state.records.length > 0;
  const tp = rows.map((r) => (epochs ? r.throughput : isNum(r.stepMs) && r.stepMs > 0 ? 1000 / r.stepMs : null));
  const tpOf = new Map(rows.map((r, i) => [r.rank, tp[i]]));
  const med = median(tp.filter(isNum));
  if (med) {
    layers.push({
      key: "throughput",
      label: epochs ? "throughput (samples/s, last epoch)" : "step rate (1 / the rank's step time)",
      legend: ["≤50% of median", "≥110%"],
      value: (rank) => tpOf.get(rank) ?? null,
      scale: (v) => (v / med - 0.5) / 0.6,
      format: (v) => (isNum(v) ? (epochs ? `${formatNumber(v * 1000)}/s` : `${formatNumber(v)} steps/s`) : DASH),
    });
  }
  heatmap.setData(groups, layers, (rank) => {
    const st = byRank.get(rank)?.status;
    return st === "stale" || st === "error" ? st : null;
  });
}

function stragglerText() {
  const rows = state.rows || [];
  let best = null;
  for (const r of rows) if (isNum(r.slowShare) && (!best || r.slowShare > best.slowShare)) best = r;
  return best && best.slowShare > 0 ? `most often slowest: rank ${best.rank} (${fmtPct(best.slowShare * 100, 0)} of recent steps)` : null;
}

function renderStragglers(rows) {
  if (!state.stepRanks) return;
  const n = worldSize();
  const thr = stragglerThreshold(n);
  setText($("straggler-sub"), `slowest rank per closed step over the last ≤1000 steps · even share 1/${fmtInt(n)} = ${fmtPct(100 / Math.max(1, n), 1)} · marked at ≥ ${fmtPct(thr * 100, 0)}`);
  const marked = rows.filter((r) => r.marks.includes("straggler")).sort((a, b) => b.slowShare - a.slowShare);
  const top = marked.length ? marked : rows.filter((r) => isNum(r.slowShare)).sort((a, b) => b.slowShare - a.slowShare).slice(0, 1);
  const chips = top.slice(0, 6).map((r) => {
    const chip = button(`straggler-chip${r.marks.includes("straggler") ? " marked" : ""}`, null, () => selectTab(r.rank));
    chip.dataset.rank = String(r.rank);
    if (r.marks.includes("straggler")) chip.dataset.mark = "straggler";
    chip.append(h("span", "chip-rank mono", `rank ${r.rank}`), h("span", "chip-host", r.host ?? ""),
      h("span", "chip-fig mono", `slowest in ${fmtPct((r.slowShare || 0) * 100, 0)} of steps`),
      h("span", "chip-fig mono muted", isNum(r.stepRatio) ? `${fmtMs(r.stepMs)} · ${r.stepRatio.toFixed(2)}× mean` : fmtMs(r.stepMs)));
    return chip;
  });
  if (marked.length > 6) chips.push(h("span", "muted", `and ${fmtInt(marked.length - 6)} more marked`));
  if (!marked.length) chips.unshift(h("span", "muted straggler-none", "no straggler: the slowest rank changes from step to step"));
  $("straggler-marks").replaceChildren(...chips);
  const groups = hostGroups(rows);
  const perRank = rows.length <= 48;
  const stripRows = perRank
    ? groups.flatMap((g) => g.ranks.map((r) => ({ label: `rank ${r}`, host: g.host, ranks: [r] })))
    : groups.map((g) => ({ label: g.host, host: g.host, ranks: g.ranks }));
  strip.setRows(stripRows);
  setText($("strip-what"), `${perRank ? "one row per rank" : `one row per host (its slowest rank) · ${fmtInt(groups.length)} hosts`} · one column per ranks update (~1/s, each rank's mean step time over its last ≤100 steps) · newest right`);
}

// ---------------------------------------------------------------- rank panel

function renderRankPanel() {
  if (state.tab === "home") return;
  const rank = state.tab;
  const r = rankInfo(rank);
  const g = rankGpu(r || { rank });
  const gm = latestGpuMetrics().get(rank);
  const row = (state.rows || []).find((x) => x.rank === rank);
  const kpis = [
    ["host", hostOf(rank) ?? DASH],
    ["local rank", r && isNum(r.local_rank) ? r.local_rank : DASH],
    ["status", r ? r.status : DASH],
    ["last seen", null],
    ["last epoch", r && isNum(r.epoch) ? r.epoch : DASH],
    ["GPU util", fmtPct(g.util)],
    ["VRAM", isNum(g.vu) ? `${fmtBytes(g.vu)} / ${fmtBytes(g.vt)}` : DASH],
    ["throughput", gm && isNum(gm.throughput) ? `${formatNumber(gm.throughput * 1000)}/s` : DASH],
    ["batch share", gm && isNum(gm.chunk_ratio) ? fmtPct(gm.chunk_ratio * 100, 1) : DASH],
  ];
  if (state.stepRanks) {
    kpis.push(
      ["step", r && isNum(r.step) ? fmtInt(r.step) : DASH],
      ["step time", r ? fmtMs(r.step_ms) : DASH],
      ["slowest share", r && isNum(r.slowest_share) ? fmtPct(r.slowest_share * 100, 1) : DASH],
    );
  }
  const box = $("rank-kpis");
  box.dataset.rank = String(rank);
  box.replaceChildren(...kpis.map(([label, value]) => {
    const k = h("div", "kpi");
    const v = h("span", "kpi-value mono", value ?? "");
    if (label === "last seen") {
      v.classList.add("ago");
      v.dataset.at = r && isNum(r.last_seen) ? String(r.last_seen) : "";
      setText(v, r && isNum(r.last_seen) ? fmtAgo(serverNow() - r.last_seen) : DASH);
    }
    if (label === "status") {
      const dot = h("span", "dot");
      dot.dataset.status = r ? r.status : "unknown";
      v.prepend(dot);
    }
    if (label === "slowest share" && row && row.marks.includes("straggler")) v.classList.add("warn-text");
    k.append(h("span", "kpi-label", label), v);
    return k;
  }));
  setText($("rank-hardware"), (r && r.hardware) || "no hardware summary sent");

  // utilisation over time: epoch records' per-rank GPU entries + live samples
  const started = state.header && isNum(state.header.started_at) ? state.header.started_at : null;
  const pts = [];
  if (started !== null) {
    for (const rec of state.records) {
      const e = ((rec.resources && rec.resources.gpus) || []).find((x) => x.device_index === rank);
      if (e && isNum(rec.elapsed_secs)) {
        pts.push({ t: started + rec.elapsed_secs, util: e.util_percent, vu: e.vram_allocated_bytes, vt: e.vram_total_bytes });
      }
    }
  }
  for (const p of state.rankSeries.get(rank) || []) pts.push(p);
  pts.sort((a, b) => a.t - b.t);
  charts.rankUtil.setTitle(`Rank ${rank} · GPU utilisation and VRAM`);
  charts.rankUtil.setData(pts.map((p) => p.t), [
    { name: "GPU util", color: "#73bf69", values: pts.map((p) => (isNum(p.util) ? p.util : null)) },
    { name: "VRAM", color: "#ff9830", values: pts.map((p) => pct(p.vu, p.vt)) },
  ]);

  // step time of this rank against the mean of ranks (the straggler strip's samples)
  $("rank-step-card").hidden = !state.stepRanks;
  if (state.stepRanks) {
    const cols = strip.cols;
    charts.rankStep.setTitle(`Rank ${rank} · step time (mean of its last ≤100 steps)`);
    charts.rankStep.setData(cols.map((c) => c.t), [
      { name: `rank ${rank}`, color: "#ff9830", values: cols.map((c) => (c.ratio.has(rank) ? c.ratio.get(rank) * c.mean : null)) },
      { name: "mean of ranks", color: "#8b95a7", values: cols.map((c) => c.mean) },
    ]);
  }

  // per-epoch throughput and batch share
  const recs = state.records;
  const x = recs.map((rec) => rec.epoch);
  const entry = (rec) => (rec.gpu_metrics || []).find((e) => e.device_index === rank);
  const mean = (rec) => {
    const v = (rec.gpu_metrics || []).map((e) => e.throughput).filter(isNum);
    return v.length ? (1000 * v.reduce((a, b) => a + b, 0)) / v.length : null;
  };
  charts.rankThroughput.setData(x, [
    { name: `rank ${rank}`, color: "#5794f2", values: recs.map((rec) => { const e = entry(rec); return e && isNum(e.throughput) ? e.throughput * 1000 : null; }) },
    { name: "mean of ranks", color: "#8b95a7", values: recs.map(mean) },
  ]);
  charts.rankShare.setData(x, [
    { name: `rank ${rank}`, color: "#b877d9", values: recs.map((rec) => { const e = entry(rec); return e && isNum(e.chunk_ratio) ? e.chunk_ratio * 100 : null; }) },
    { name: "equal share", color: "#8b95a7", values: recs.map((rec) => { const n = (rec.gpu_metrics || []).length; return n ? 100 / n : null; }) },
  ]);
}

// ---------------------------------------------------------------- ticking figures

function renderTicking() {
  const hd = state.header;
  const now = serverNow();
  let elapsed = null;
  if (hd && isNum(hd.started_at)) {
    const live = hd.status === "training" || hd.status === "waiting";
    const end = live ? now : isNum(hd.updated_at) ? hd.updated_at : now;
    elapsed = Math.max(0, end - hd.started_at);
  }
  setText($("elapsed"), fmtDur(elapsed));
  const last = state.records[state.records.length - 1];
  let eta = DASH;
  if (hd && (hd.status === "complete" || hd.status === "failed")) eta = hd.status === "complete" ? "done" : DASH;
  else if (last && isNum(last.eta_secs)) {
    let left = last.eta_secs;
    if (hd && isNum(hd.started_at) && isNum(last.elapsed_secs)) {
      left -= Math.max(0, now - hd.started_at - last.elapsed_secs);
    }
    eta = left > 0 ? fmtDur(left) : "any moment";
  }
  setText($("eta"), eta);
  for (const e of document.querySelectorAll(".ago[data-at]")) {
    const at = Number(e.dataset.at);
    if (e.dataset.at && Number.isFinite(at)) setText(e, fmtAgo(now - at));
  }
  for (const e of document.querySelectorAll(".alert-time[data-at]")) {
    const at = Number(e.dataset.at);
    setText(e, e.dataset.at && Number.isFinite(at) ? fmtAgo(now - at) : "");
  }
}

// ---------------------------------------------------------------- hooks for tests/benchmarks

/**
 * Read-only views of what the page drew, for the browser tests and benchmarks (a test
 * reads a chart's data back from here, never from the API). `applyRanksNow` applies one
 * `ranks` payload and renders synchronously, as the benchmark of that cost needs.
 */
window.__rankboard = Object.freeze({
  stepChart: (name) => steps.snapshot(name),
  stepData: (name) => steps.data(name),
  stepCut: () => steps.cut,
  liveSteps: () => steps.liveSteps(),
  stepFetches: () => steps.fetches.slice(),
  firstDraw: () => steps.firstDraw,
  compareChart: () => compare.snapshot(),
  stripColumns: () => strip.cols.length,
  heatmapCells: () => heatmap.drawnCells || 0,
  applyRanksNow: (ranks) => {
    applyRanks(ranks);
    renderNow();
    heatmap.draw();
    strip.draw();
  },
});

// ---------------------------------------------------------------- boot

function fromHash() {
  const cmp = parseCompareHash(location.hash);
  if (cmp) {
    openCompare(cmp);
    return true;
  }
  const want = runFromHash();
  if (want && want !== state.run) openRun(want, true);
  else if (want && state.mode === "compare") openRun(want, true);
  return false;
}

function boot() {
  makeCharts();
  $("run-picker").addEventListener("change", (e) => openRun(e.target.value, true));
  $("tab-home").addEventListener("click", () => selectTab("home"));
  $("hardware").addEventListener("click", () => $("hardware").classList.toggle("expanded"));
  $("compare-btn").addEventListener("click", () => {
    if (state.mode === "compare") {
      closeCompare();
      return;
    }
    const runs = state.run ? [state.run] : [];
    openCompare({ runs, metric: "loss", x: steps.hasSteps && !state.records.length ? "step" : "epoch" });
  });
  window.addEventListener("hashchange", fromHash);
  window.addEventListener("focus", refreshRuns);
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) refreshRuns();
  });
  setInterval(renderTicking, 1000);
  setInterval(() => {
    if (!document.hidden) refreshRuns();
  }, 10000);
  // while there is no run at all, look more often
  setInterval(() => {
    if (state.run === null && state.mode === "run" && !document.hidden) refreshRuns();
  }, 2000);
  fromHash();
  refreshRuns();
}

boot();
