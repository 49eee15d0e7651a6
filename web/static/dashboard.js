// rankboard dashboard page: one run at a time, fed by the JSON API and one EventSource.
//
// Data flow: GET /api/runs (picker) -> GET /api/runs/<run> (header, ranks, records) and
// EventSource /api/runs/<run>/events (run / epoch / ranks / complete). Records are kept in
// a map keyed by epoch, so the replay after a reconnect (or the overlap between the JSON
// snapshot and the stream) never duplicates a point. All text from a training job goes into
// the DOM through textContent; the model graph is only ever an <img>.

import { LineChart, colorAt, formatNumber } from "./charts.js";

// ---------------------------------------------------------------- formatting helpers

const DASH = "—";
const isNum = (v) => typeof v === "number" && Number.isFinite(v);

function fmtLoss(v) {
  if (!isNum(v)) return DASH;
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(3);
  return String(+v.toPrecision(5));
}

function fmtPct(v, digits = 0) {
  return isNum(v) ? `${v.toFixed(digits)}%` : DASH;
}

function fmtBytes(v) {
  if (!isNum(v)) return DASH;
  const gib = v / 2 ** 30;
  if (gib >= 100) return `${gib.toFixed(0)} GiB`;
  if (gib >= 1) return `${gib.toFixed(1)} GiB`;
  return `${(v / 2 ** 20).toFixed(0)} MiB`;
}

function fmtDur(s) {
  if (!isNum(s) || s < 0) return DASH;
  if (s < 10) return `${s.toFixed(1)}s`;
  if (s < 60) return `${Math.round(s)}s`;
  const m = Math.floor(s / 60);
  if (s < 3600) return `${m}m ${String(Math.floor(s % 60)).padStart(2, "0")}s`;
  const h = Math.floor(s / 3600);
  if (s < 86400) return `${h}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

function fmtAgo(s) {
  if (!isNum(s)) return DASH;
  if (s < 1.5) return "now";
  return `${fmtDur(Math.max(0, s)).replace(/\.\ds$/, "s")} ago`;
}

/** samples per ms (the wire unit) -> "12.3k/s". */
function fmtThroughput(perMs) {
  return isNum(perMs) ? `${formatNumber(perMs * 1000)}/s` : DASH;
}

function pct(used, total) {
  return isNum(used) && isNum(total) && total > 0 ? (100 * used) / total : null;
}

function h(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

const $ = (id) => document.getElementById(id);
const enc = (run) => encodeURIComponent(run);

// ---------------------------------------------------------------- server clock

// Times from the server are unix seconds of its clock; the ticking elapsed/ETA/"ago"
// figures use the offset learned from the Date header so a skewed laptop clock is harmless.
let clockOffset = 0;
let clockKnown = false;
const serverNow = () => Date.now() / 1000 + clockOffset;

function learnClock(resp) {
  const d = Date.parse(resp.headers.get("Date") || "");
  if (!Number.isFinite(d)) return;
  const off = d / 1000 + 0.5 - Date.now() / 1000; // Date has 1 s resolution
  if (!clockKnown || Math.abs(off - clockOffset) > 2) {
    clockOffset = Math.abs(off) < 1.5 ? 0 : off;
    clockKnown = true;
  }
}

async function api(path) {
  const resp = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  learnClock(resp);
  if (!resp.ok) {
    const err = new Error(`${resp.status} ${path}`);
    err.status = resp.status;
    throw err;
  }
  return resp.json();
}

// ---------------------------------------------------------------- state

const state = {
  gen: 0, // bumps on every run switch; stale async results compare and bail out
  run: null,
  runs: [],
  es: null,
  header: null,
  records: [], // ascending epoch
  byEpoch: new Map(),
  ranks: [],
  rankSeries: new Map(), // rank -> [{t, util, vu, vt}] sampled from `ranks` events
  rankSeen: new Map(), // rank -> last_seen already sampled
  knownRanks: new Set(),
  tab: "home",
  graphKey: null,
  picked: false, // the user chose a run (do not auto-follow the newest)
};

const dirty = new Set();
let renderQueued = false;

function invalidate(...parts) {
  for (const p of parts) dirty.add(p);
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    const parts2 = new Set(dirty);
    dirty.clear();
    try {
      if (parts2.has("header")) {
        renderHeader();
        updatePickerEntry();
      }
      if (parts2.has("records")) renderRecords();
      if (parts2.has("records") || parts2.has("ranks") || parts2.has("header")) renderRanks();
      if (parts2.has("records") || parts2.has("ranks") || parts2.has("tab")) renderRankPanel();
      renderTicking();
    } catch (err) {
      console.warn("rankboard: render failed", err); // never let one bad value kill the page
    }
  });
}

// ---------------------------------------------------------------- charts

const charts = {};

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
  charts.rankThroughput = new LineChart($("rank-throughput-card"), {
    title: "Throughput (samples/s)", chartId: "rank-throughput", xLabel: "epoch", xInteger: true,
    log: true, smoothing: true, yFormat: formatNumber, height: 220, filename: "rank-throughput",
    emptyText: "no epochs yet",
  });
  charts.rankShare = new LineChart($("rank-share-card"), {
    title: "Batch share", chartId: "rank-share", xLabel: "epoch", xInteger: true,
    yMin: 0, yFormat: pctFmt, height: 220, filename: "rank-share", emptyText: "no epochs yet",
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
  $("run-view").hidden = empty;
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
  state.rankSeries = new Map();
  state.rankSeen = new Map();
  state.knownRanks = new Set();
  state.tab = "home";
  state.graphKey = null;
  $("rank-tabs").replaceChildren();
  $("graph").replaceChildren(h("p", "muted", "no model graph sent"));
  for (const c of Object.values(charts)) c.resetZoom();
}

function openRun(run, picked) {
  if (run === state.run && state.es) return;
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
    applyHeader(data);
    if (Array.isArray(data.records)) for (const r of data.records) addRecord(r);
    if (Array.isArray(data.ranks)) applyRanks(data.ranks);
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
    if (gen === state.gen) setConn("live", "live");
  });
  on("run", applyHeader);
  on("epoch", addRecord);
  on("ranks", applyRanks);
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
  $("conn-text").textContent = text;
}

// ---------------------------------------------------------------- applying data

function applyHeader(hd) {
  if (!hd || typeof hd !== "object") return;
  state.header = {
    run: hd.run, status: hd.status, world_size: hd.world_size, total_epochs: hd.total_epochs,
    label: hd.label, hash: hd.hash, port: hd.port, metadata: hd.metadata, hardware: hd.hardware,
    has_svg: hd.has_svg, hosts: hd.hosts, alerts: hd.alerts, started_at: hd.started_at,
    updated_at: hd.updated_at,
  };
  for (const host of hd.hosts || []) for (const r of host.ranks || []) noteRank(r);
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
    if (opt) opt.textContent = runLabel(entry);
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

function applyRanks(ranks) {
  if (!Array.isArray(ranks)) return;
  state.ranks = ranks.slice().sort((a, b) => a.rank - b.rank);
  for (const r of state.ranks) {
    noteRank(r.rank);
    sampleRank(r);
  }
  invalidate("ranks");
}

/** Append a rank's latest resources to its client-side series, once per new frame time. */
function sampleRank(r) {
  const res = r.resources;
  if (!res || !isNum(r.last_seen)) return;
  if (state.rankSeen.get(r.rank) === r.last_seen) return;
  state.rankSeen.set(r.rank, r.last_seen);
  const { util, vu, vt } = rankGpu(r);
  if (!isNum(util) && !isNum(vu)) return;
  let series = state.rankSeries.get(r.rank);
  if (!series) state.rankSeries.set(r.rank, (series = []));
  series.push({ t: r.last_seen, util: isNum(util) ? util : null, vu, vt });
  if (series.length > 5000) series.splice(0, series.length - 5000);
}

function noteRank(rank) {
  if (!isNum(rank) || state.knownRanks.has(rank)) return;
  state.knownRanks.add(rank);
  invalidate("ranks");
}

// ---------------------------------------------------------------- header rendering

const STATUS_TEXT = { waiting: "waiting", training: "training", complete: "complete", failed: "failed" };

function renderHeader() {
  const hd = state.header;
  const run = state.run ?? "";
  const label = hd && hd.label ? hd.label : run;
  $("run-name").textContent = label || DASH;
  $("run-name").title = label;
  $("run-id").textContent = hd && hd.label ? run : "";
  const hash = hd && hd.hash ? String(hd.hash) : "";
  $("run-hash").hidden = !hash;
  $("run-hash").textContent = hash ? `#${hash.slice(0, 10)}` : "";
  $("run-hash").title = hash ? `model hash ${hash}` : "";
  const status = (hd && hd.status) || "waiting";
  $("status").dataset.status = status;
  $("run-view").dataset.status = status;
  $("status-text").textContent = STATUS_TEXT[status] || status;

  // progress
  const done = state.records.length;
  const total = hd && isNum(hd.total_epochs) && hd.total_epochs > 0 ? hd.total_epochs : null;
  $("epoch-count").textContent = `${done}/${total ?? "?"}`;
  const bar = $("progress-bar");
  const frac = total ? Math.min(1, done / total) : null;
  bar.classList.toggle("indeterminate", frac === null && status === "training");
  bar.style.width = frac === null ? (status === "training" ? "30%" : "0%") : `${(frac * 100).toFixed(1)}%`;
  $("progress-pct").textContent = frac === null ? "" : `${Math.floor(frac * 100)}%`;
  document.title = `${label || "rankboard"} · ${done}/${total ?? "?"} · rankboard`;

  // hardware: the exact string of the contract, one line, click to wrap
  const hw = $("hardware");
  const hwText = (hd && hd.hardware) || "";
  hw.textContent = hwText;
  hw.title = hwText;
  hw.hidden = !hwText;

  renderMetadata();
  renderGraph();
}

const ALERT_TEXT = { stale: "stale rank", rank_error: "rank error", nonfinite_loss: "non-finite loss" };

function renderAlerts() {
  const box = $("alerts");
  const alerts = (state.header && state.header.alerts) || [];
  box.hidden = alerts.length === 0;
  const rankStatus = new Map(state.ranks.map((r) => [r.rank, r.status]));
  const items = alerts.slice().sort((a, b) => (b.at || 0) - (a.at || 0)).map((a) => {
    const item = h("div", "alert");
    item.dataset.kind = String(a.kind ?? "");
    if (a.rank !== null && a.rank !== undefined) item.dataset.rank = String(a.rank);
    const recovered = a.kind === "stale" && rankStatus.get(a.rank) === "ok";
    item.classList.toggle("recovered", recovered);
    item.append(
      h("span", "alert-kind", ALERT_TEXT[a.kind] || String(a.kind ?? "alert")),
      h("span", "alert-rank", a.rank === null || a.rank === undefined ? "run" : `rank ${a.rank}`),
      h("span", "alert-msg", a.message ?? ""),
      h("span", "alert-at", recovered ? "recovered" : ""),
    );
    const at = h("span", "alert-time");
    at.dataset.at = String(a.at ?? "");
    item.append(at);
    return item;
  });
  box.replaceChildren(...items);
}

function renderMetadata() {
  const pre = $("metadata");
  const md = state.header ? state.header.metadata : null;
  if (md === null || md === undefined) pre.textContent = "no metadata sent";
  else if (typeof md === "string") pre.textContent = md;
  else pre.textContent = JSON.stringify(md, null, 2);
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
  $("graph-label").textContent = has && hd.label ? hd.label : "";
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
  renderKpis();
}

function renderLog(names) {
  const table = $("log-table");
  const head = h("tr");
  head.append(h("th", null, "epoch"), h("th", "num", "duration"));
  for (const n of names) {
    const th = h("th", "num metric-col", n);
    th.title = n;
    head.append(th);
  }
  head.append(h("th", null, "missing ranks"));
  table.tHead.replaceChildren(head);
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
    const td = h("td", miss.length ? "missing" : "muted", miss.length ? miss.join(", ") : DASH);
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
  table.tBodies[0].replaceChildren(...rows);
}

function renderKpis() {
  const recs = state.records;
  const last = recs[recs.length - 1];
  const prev = recs[recs.length - 2];
  const loss = last && last.metrics ? last.metrics.loss : null;
  $("kpi-loss").textContent = fmtLoss(loss);
  $("kpi-loss").classList.toggle("bad", !!last && last.metrics && "loss" in last.metrics && !isNum(loss));
  const d = $("kpi-loss-delta");
  const pl = prev && prev.metrics ? prev.metrics.loss : null;
  if (isNum(loss) && isNum(pl)) {
    const diff = loss - pl;
    d.textContent = `${diff <= 0 ? "▼" : "▲"} ${fmtLoss(Math.abs(diff))} vs previous`;
    d.dataset.trend = diff <= 0 ? "good" : "bad";
  } else {
    d.textContent = last ? `epoch ${last.epoch}` : "";
    d.dataset.trend = "";
  }
  $("kpi-epoch-time").textContent = last ? fmtDur(last.duration_secs) : DASH;
  const lastFive = recs.slice(-5).map((r) => r.duration_secs).filter(isNum);
  $("kpi-epoch-time-sub").textContent = lastFive.length
    ? `mean of last ${lastFive.length}: ${fmtDur(lastFive.reduce((a, b) => a + b, 0) / lastFive.length)}`
    : "";
  const tp = last ? (last.gpu_metrics || []).map((g) => g.throughput).filter(isNum) : [];
  $("kpi-throughput").textContent = tp.length ? formatNumber(tp.reduce((a, b) => a + b, 0) * 1000) : DASH;
}

// ---------------------------------------------------------------- ranks rendering

function rankInfo(rank) {
  return state.ranks.find((r) => r.rank === rank) || null;
}

function hostOf(rank) {
  const r = rankInfo(rank);
  if (r && r.host) return r.host;
  for (const hst of (state.header && state.header.hosts) || []) {
    if ((hst.ranks || []).includes(rank)) return hst.host;
  }
  return null;
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
    temp: own.temperature_c,
    power: own.power_w,
  };
}

function statusDot(status) {
  const s = h("span", "dot");
  s.dataset.status = status || "unknown";
  return s;
}

/** A small inline bar; `warnHigh` paints it red above 90 % (VRAM, not utilisation). */
function miniBar(value, warnHigh) {
  const wrap = h("span", "minibar");
  const fill = h("span", "minibar-fill");
  const v = isNum(value) ? Math.max(0, Math.min(100, value)) : 0;
  fill.style.width = `${v}%`;
  if (warnHigh && v >= 90) fill.dataset.level = "high";
  wrap.append(fill);
  return wrap;
}

function renderRanks() {
  const ranks = [...state.knownRanks].sort((a, b) => a - b);
  renderTabs(ranks);
  const gm = latestGpuMetrics();
  const { fast, slow } = extremes(gm);
  const hd = state.header;
  const world = hd && isNum(hd.world_size) ? hd.world_size : null;

  // table
  const rows = ranks.map((rank) => {
    const r = rankInfo(rank);
    const g = rankGpu(r || { rank });
    const m = gm.get(rank);
    const tr = h("tr", "rank-row");
    tr.dataset.rank = String(rank);
    const st = h("td");
    const stIn = h("span", "status-cell");
    stIn.append(statusDot(r ? r.status : null), h("span", null, r ? r.status : DASH));
    st.append(stIn);
    const seen = h("td", "mono muted ago");
    seen.dataset.at = r && isNum(r.last_seen) ? String(r.last_seen) : "";
    const vram = h("td");
    const vIn = h("span", "vram-cell");
    const vp = pct(g.vu, g.vt);
    vIn.append(miniBar(vp, true), h("span", "mono", isNum(g.vu) ? `${fmtBytes(g.vu)} / ${fmtBytes(g.vt)}` : DASH));
    vram.append(vIn);
    const util = h("td", "num");
    util.append(miniBar(g.util, false), h("span", "mono", fmtPct(g.util)));
    const marks = h("td", "marks");
    if (rank === fast) {
      const b = h("span", "badge badge-fast", "fastest");
      b.dataset.mark = "fastest";
      marks.append(b);
    }
    if (rank === slow) {
      const b = h("span", "badge badge-slow", "slowest");
      b.dataset.mark = "slowest";
      marks.append(b);
    }
    const rankCell = h("td", "mono");
    const link = h("button", "link", `rank ${rank}`);
    link.type = "button";
    link.addEventListener("click", () => selectTab(rank));
    rankCell.append(link);
    tr.append(
      rankCell,
      h("td", "host", hostOf(rank) ?? DASH),
      h("td", "mono", r && isNum(r.local_rank) ? r.local_rank : DASH),
      st,
      seen,
      h("td", "mono", r && isNum(r.epoch) ? r.epoch : DASH),
      util,
      vram,
      h("td", "num mono", fmtThroughput(m ? m.throughput : null)),
      h("td", "num mono", m && isNum(m.chunk_ratio) ? fmtPct(m.chunk_ratio * 100, 1) : DASH),
      marks,
    );
    return tr;
  });
  if (!rows.length) {
    const tr = h("tr");
    const td = h("td", "muted empty-row", "no ranks yet");
    td.colSpan = 11;
    tr.append(td);
    rows.push(tr);
  }
  $("rank-table").tBodies[0].replaceChildren(...rows);

  const hosts = (hd && hd.hosts) || [];
  $("ranks-sub").textContent = `${hosts.length} host${hosts.length === 1 ? "" : "s"} · ${ranks.length}${world ? ` of ${world}` : ""} rank${(world ?? ranks.length) === 1 ? "" : "s"}`;

  // health KPI and header count
  const counts = {};
  for (const r of state.ranks) counts[r.status] = (counts[r.status] || 0) + 1;
  const ok = counts.ok || 0;
  const denom = world ?? state.ranks.length;
  $("kpi-ranks").textContent = denom ? `${ok}/${denom}` : DASH;
  $("kpi-ranks").classList.toggle("bad", !!(counts.stale || counts.error));
  const sub = ["stale", "error", "finished"].filter((k) => counts[k]).map((k) => `${counts[k]} ${k}`);
  $("kpi-ranks-sub").textContent = sub.length ? sub.join(" · ") : denom ? "all reporting" : "";
  const live = !hd || hd.status === "training" || hd.status === "waiting";
  $("rank-count").textContent = !denom ? DASH : live ? `${ok}/${denom} live` : `${denom}`;

  renderResourceBars();
  renderAlerts();
}

function renderTabs(ranks) {
  const box = $("rank-tabs");
  const existing = new Map([...box.children].map((b) => [Number(b.dataset.rank), b]));
  let prev = null;
  for (const rank of ranks) {
    let b = existing.get(rank);
    if (!b) {
      b = h("button", "tab rank-tab");
      b.type = "button";
      b.dataset.rank = String(rank);
      b.id = `tab-rank-${rank}`;
      b.setAttribute("aria-selected", "false");
      b.append(h("span", "dot"), h("span", "tab-text", `rank ${rank}`));
      b.addEventListener("click", () => selectTab(rank));
      if (prev) prev.after(b);
      else box.prepend(b);
    }
    const r = rankInfo(rank);
    b.firstChild.dataset.status = r ? r.status : "unknown";
    const host = hostOf(rank);
    b.title = host ? `rank ${rank} on ${host}` : `rank ${rank}`;
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
  if (!home) {
    charts.rankUtil.resetZoom();
    charts.rankThroughput.resetZoom();
    charts.rankShare.resetZoom();
  }
  invalidate("tab");
}

/** Cluster "now" figures from every rank's latest sample (PROTOCOL 2.3 rules). */
function currentResources() {
  const hostsCpu = new Map();
  const hostsRam = new Map();
  const utils = [];
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
    if (isNum(s.gpu_util_percent)) utils.push(s.gpu_util_percent);
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
    gpu_util_percent: utils.length ? utils.reduce((a, b) => a + b, 0) / utils.length : null,
    vram_allocated_bytes: vt ? vu : null,
    vram_total_bytes: vt || null,
  };
  const last = state.records[state.records.length - 1];
  const fallback = (last && last.resources) || {};
  for (const k of Object.keys(out)) if (out[k] === null && isNum(fallback[k])) out[k] = fallback[k];
  return out;
}

function renderResourceBars() {
  const r = currentResources();
  const bars = [
    ["cpu", "CPU", r.cpu_percent, fmtPct(r.cpu_percent)],
    ["ram", "RAM", pct(r.ram_used_bytes, r.ram_total_bytes),
      isNum(r.ram_used_bytes) ? `${fmtBytes(r.ram_used_bytes)} / ${fmtBytes(r.ram_total_bytes)}` : DASH],
    ["gpu", "GPU util", r.gpu_util_percent, fmtPct(r.gpu_util_percent)],
    ["vram", "VRAM", pct(r.vram_allocated_bytes, r.vram_total_bytes),
      isNum(r.vram_allocated_bytes) ? `${fmtBytes(r.vram_allocated_bytes)} / ${fmtBytes(r.vram_total_bytes)}` : DASH],
  ];
  const rows = bars.map(([key, label, value, text]) => {
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
  $("resource-bars").replaceChildren(...rows);

  // one tile per GPU: utilisation as the fill, VRAM as text
  const tiles = state.ranks.filter((x) => x.resources).map((x) => {
    const g = rankGpu(x);
    if (!isNum(g.util) && !isNum(g.vu)) return null;
    const t = h("button", "gpu-tile");
    t.type = "button";
    t.dataset.rank = String(x.rank);
    t.title = `rank ${x.rank}${x.host ? ` on ${x.host}` : ""}${g.name ? ` · ${g.name}` : ""}`;
    const fill = h("span", "gpu-tile-fill");
    fill.style.height = `${isNum(g.util) ? Math.max(0, Math.min(100, g.util)) : 0}%`;
    t.append(fill, h("span", "gpu-tile-rank", `r${x.rank}`), h("span", "gpu-tile-val mono", fmtPct(g.util)));
    t.addEventListener("click", () => selectTab(x.rank));
    return t;
  }).filter(Boolean);
  const minis = $("gpu-minis");
  if (tiles.length) {
    const title = h("div", "gpu-minis-title", "GPU utilisation per rank");
    const grid = h("div", "gpu-grid");
    grid.append(...tiles.slice(0, 128));
    minis.replaceChildren(title, grid);
  } else {
    minis.replaceChildren();
  }
}

// ---------------------------------------------------------------- rank panel

function renderRankPanel() {
  if (state.tab === "home") return;
  const rank = state.tab;
  const r = rankInfo(rank);
  const g = rankGpu(r || { rank });
  const gm = latestGpuMetrics().get(rank);
  const kpis = [
    ["host", hostOf(rank) ?? DASH],
    ["local rank", r && isNum(r.local_rank) ? r.local_rank : DASH],
    ["status", r ? r.status : DASH],
    ["last seen", null],
    ["last epoch", r && isNum(r.epoch) ? r.epoch : DASH],
    ["GPU util", fmtPct(g.util)],
    ["VRAM", isNum(g.vu) ? `${fmtBytes(g.vu)} / ${fmtBytes(g.vt)}` : DASH],
    ["throughput", fmtThroughput(gm ? gm.throughput : null)],
    ["batch share", gm && isNum(gm.chunk_ratio) ? fmtPct(gm.chunk_ratio * 100, 1) : DASH],
  ];
  const box = $("rank-kpis");
  box.dataset.rank = String(rank);
  box.replaceChildren(...kpis.map(([label, value]) => {
    const k = h("div", "kpi");
    const v = h("span", "kpi-value mono", value ?? "");
    if (label === "last seen") {
      v.classList.add("ago");
      v.dataset.at = r && isNum(r.last_seen) ? String(r.last_seen) : "";
      v.textContent = r && isNum(r.last_seen) ? fmtAgo(serverNow() - r.last_seen) : DASH;
    }
    if (label === "status") {
      v.prepend(statusDot(r ? r.status : null));
    }
    k.append(h("span", "kpi-label", label), v);
    return k;
  }));
  $("rank-hardware").textContent = (r && r.hardware) || "no hardware summary sent";

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
  $("elapsed").textContent = fmtDur(elapsed);
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
  $("eta").textContent = eta;
  for (const e of document.querySelectorAll(".ago[data-at]")) {
    const at = Number(e.dataset.at);
    if (e.dataset.at && Number.isFinite(at)) e.textContent = fmtAgo(now - at);
  }
  for (const e of document.querySelectorAll(".alert-time[data-at]")) {
    const at = Number(e.dataset.at);
    e.textContent = e.dataset.at && Number.isFinite(at) ? fmtAgo(now - at) : "";
  }
}

// ---------------------------------------------------------------- boot

function boot() {
  makeCharts();
  $("run-picker").addEventListener("change", (e) => openRun(e.target.value, true));
  $("tab-home").addEventListener("click", () => selectTab("home"));
  $("hardware").addEventListener("click", () => $("hardware").classList.toggle("expanded"));
  window.addEventListener("hashchange", () => {
    const want = runFromHash();
    if (want && want !== state.run) openRun(want, true);
  });
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
    if (state.run === null && !document.hidden) refreshRuns();
  }, 2000);
  refreshRuns();
}

boot();
