// rankboard saved report (report.html): the dashboard page fed from the JSON embedded in the
// file instead of the live stream. The same store and views as dashboard.js; web/report.py
// inlines this module and everything it imports into the file (no network: the step charts'
// series come from the embedded /steps buckets, the model graph is a data: image, links to
// the web's routes are hidden). Text from the run only ever goes in through textContent.

import { freezeClock } from "./api.js";
import { AttemptView } from "./attemptview.js";
import { lastVerdictText, verdictText } from "./collectives.js";
import { $, h, setText } from "./dom.js";
import { FailureView } from "./failureview.js";
import { fmtInt, isNum } from "./fmt.js";
import { onFrame } from "./frame.js";
import { HeaderView } from "./headerview.js";
import { numbersLines } from "./numbersview.js";
import { Overview } from "./overview.js";
import { RankPanel } from "./rankpanel.js";
import { RanksView } from "./ranksview.js";
import { ResourcesView } from "./resourcesview.js";
import { StepView } from "./steps.js";
import { Store } from "./store.js";
import { Stragglers } from "./stragglers.js";
import { Tabs } from "./tabs.js";

// ---------------------------------------------------------------- embedded series

/**
 * `/steps` answered from the embedded buckets (N = 2000 per series, exact lo/hi): the
 * buckets overlapping [start, end], merged down to `points` when there are more (count-
 * weighted mean, min of lo, max of hi). Zoom works within the embedded resolution; the
 * last closed step is kept exactly for the KPIs.
 */
export function embeddedSeries(data, metric, start, end, points) {
  const last = data.last && data.last[metric];
  if (start !== null && start === end && Array.isArray(last) && last[0] <= start && start <= last[1]) {
    return { metric, start, end, buckets: [last] };
  }
  const all = (data.series && data.series[metric]) || [];
  let sel = all.filter((b) => (start === null || b[1] >= start) && (end === null || b[0] <= end));
  if (points >= 1 && sel.length > points) sel = mergeBuckets(sel, points);
  return { metric, start, end, buckets: sel };
}

const lo = (a, b) => (a === null ? b : b === null ? a : Math.min(a, b));
const hi = (a, b) => (a === null ? b : b === null ? a : Math.max(a, b));

function mergeBuckets(rows, points) {
  const out = [];
  const size = Math.ceil(rows.length / points);
  for (let i = 0; i < rows.length; i += size) {
    const part = rows.slice(i, i + size);
    let sum = 0;
    let weight = 0;
    let count = 0;
    let l = null;
    let u = null;
    let rmin = null;
    let rmax = null;
    for (const b of part) {
      count += b[7];
      if (isNum(b[2])) {
        sum += b[2] * b[7];
        weight += b[7];
      }
      l = lo(l, b[3]);
      u = hi(u, b[4]);
      rmin = lo(rmin, b[5]);
      rmax = hi(rmax, b[6]);
    }
    out.push([part[0][0], part[part.length - 1][1], weight ? sum / weight : null, l, u, rmin, rmax, count]);
  }
  return out;
}

// ---------------------------------------------------------------- attempts (8.1)

/** The embedded superseded records of attempt `attempt` (web/report.py `"superseded"`:
 * [{attempt, series: {name: buckets}, epochs: [records]}] for the latest 8 attempts that
 * have any; only their superseded part), or null when the file holds none of it. */
function embeddedAttempt(data, attempt) {
  const all = data && Array.isArray(data.superseded) ? data.superseded : [];
  return all.find((a) => a && a.attempt === attempt) || null;
}

/** `/steps?...&attempt=K` answered from the embedded series (steps in [start, end]). */
export function embeddedAttemptSeries(data, metric, attempt, start, end, points) {
  const one = embeddedAttempt(data, attempt);
  if (!one) return { metric, start, end, buckets: [] };
  return embeddedSeries({ series: one.series || {} }, metric, start, end, points);
}

/** `/history?attempt=K` answered from the embedded epochs (unpacked at boot). */
export function embeddedAttemptRecords(data, attempt) {
  const one = embeddedAttempt(data, attempt);
  return one && Array.isArray(one.epochs) ? one.epochs : [];
}

/** The attempts whose superseded `part` ("series" or "epochs") the file embeds, as
 * [{attempt, start: null}] (what is embedded is the superseded part alone). */
function embeddedAttempts(data, part) {
  const all = data && Array.isArray(data.superseded) ? data.superseded : [];
  return all.filter((a) => a && Number.isInteger(a.attempt) && a[part] && Object.keys(a[part]).length)
    .map((a) => ({ attempt: a.attempt, start: null }));
}

/** Every embedded epoch record in the order web/report.py's one Packer wrote them (the
 * snapshot's, then each attempt's superseded ones), so a column that repeats the previous
 * table's is read from the right one. */
function packedInOrder(data, snap) {
  const out = Array.isArray(snap.records) ? [...snap.records] : [];
  for (const a of Array.isArray(data.superseded) ? data.superseded : []) {
    if (a && Array.isArray(a.epochs)) out.push(...a.epochs);
  }
  return out;
}

// ---------------------------------------------------------------- packed records

/** A column of a packed per-GPU table (web/report.py `_column`): constant, arithmetic, or the values. */
function column(col, n) {
  if (Array.isArray(col)) return col;
  const out = new Array(n);
  if (col && "c" in col) out.fill(col.c);
  else for (let i = 0; i < n; i++) out[i] = col.a + i * col.d;
  return out;
}

/**
 * Epoch records as PROTOCOL 4 has them: their per-GPU tables (web/report.py `Packer`)
 * unpacked in record order (a column `{"p": 1}` is the previous table's of that key).
 */
export function unpackRecords(records) {
  const prev = new Map();
  const table = (path, t) => {
    if (!t || typeof t !== "object" || Array.isArray(t) || !("$table" in t)) return t;
    const n = t.$table;
    const cols = t.keys.map((k, i) => {
      const c = t.cols[i];
      const vals = c && !Array.isArray(c) && c.p ? prev.get(`${path}\u0000${k}`) || new Array(n).fill(null) : column(c, n);
      prev.set(`${path}\u0000${k}`, vals);
      return vals;
    });
    const rows = new Array(n);
    for (let i = 0; i < n; i++) {
      const row = {};
      for (let j = 0; j < t.keys.length; j++) row[t.keys[j]] = cols[j][i];
      rows[i] = row;
    }
    return rows;
  };
  for (const rec of records) {
    if (!rec || typeof rec !== "object") continue;
    if (rec.gpu_metrics) rec.gpu_metrics = table("gpu_metrics", rec.gpu_metrics);
    if (rec.resources && rec.resources.gpus) rec.resources.gpus = table("gpus", rec.resources.gpus);
  }
  return records;
}

// ---------------------------------------------------------------- stall groups

function rankList(ranks) {
  const parts = [];
  for (let i = 0; i < ranks.length; i++) {
    let j = i;
    while (j + 1 < ranks.length && ranks[j + 1] === ranks[j] + 1) j++;
    parts.push(j > i ? `${ranks[i]}–${ranks[j]}` : String(ranks[i]));
    i = j;
  }
  return parts.join(", ");
}

/** The run's grouped stack dumps (GET .../stacks `groups`), innermost frame first. */
function stallCard(stacks) {
  const groups = stacks && Array.isArray(stacks.groups) ? stacks.groups : [];
  if (!groups.length) return null;
  const card = h("div", "card span-12");
  card.id = "stall-card";
  card.dataset.testid = "stall-groups";
  card.append(h("h3", "card-title", "Stall groups"));
  for (const g of groups) {
    const ranks = Array.isArray(g.ranks) ? g.ranks : [];
    const box = h("div", "stall-group");
    const head = h("div", "stall-head");
    head.append(h("span", "stall-ranks mono", `${fmtInt(ranks.length)} rank${ranks.length === 1 ? "" : "s"}: ${rankList(ranks)}`),
      h("span", "muted", String(g.reason ?? "")));
    const frames = Array.isArray(g.frames) ? g.frames.slice().reverse() : [];
    const text = frames.map((f) => {
      const where = `${f.file ?? "?"}:${f.line ?? "?"} in ${f.function ?? "?"}`;
      return f.code ? `${where}\n    ${f.code}` : where;
    }).join("\n");
    box.append(head, h("pre", "stall-frames mono", text || "no frames"));
    card.append(box);
  }
  return card;
}

// ---------------------------------------------------------------- the page

function boot() {
  const data = JSON.parse($("rankboard-data").textContent);
  const theme = /(?:^#|&)theme=(light|dark)/.exec(location.hash);
  const light = theme ? theme[1] === "light" : window.matchMedia("(prefers-color-scheme: light)").matches;
  document.documentElement.dataset.theme = light ? "light" : "dark";
  const tbtn = $("theme-btn");
  setText(tbtn, light ? "dark" : "light");
  tbtn.addEventListener("click", () => {
    // the charts read their colours once; a reload (of this very file) redraws them all
    location.hash = `theme=${light ? "dark" : "light"}`;
    location.reload();
  });
  if (isNum(data.generated_at)) freezeClock(data.generated_at);

  const store = new Store();
  const dirty = new Set();
  let queued = false;
  const page = {
    store,
    graphSrc: () => data.graph || null,
    reportHref: () => null,
    invalidate(...parts) {
      for (const p of parts) dirty.add(p);
      if (queued) return;
      queued = true;
      onFrame("report", render);
    },
    selectTab: (tab) => page.tabs.select(tab),
  };
  function render() {
    queued = false;
    const parts = new Set(dirty);
    dirty.clear();
    try {
      if (parts.has("header")) {
        page.header.render();
        page.failure.render(); // 8.2: the report leads with the first failure too
      }
      if (parts.has("records")) {
        page.overview.records();
        page.resources.render();
      }
      if (parts.has("records") || parts.has("ranks") || parts.has("header") || parts.has("steps")) {
        page.header.layout();
        page.overview.kpis();
      }
      if (parts.has("records") || parts.has("header") || parts.has("steps") || parts.has("ranks")) page.attempts.render(); // 8.1
      if (parts.has("records") || parts.has("ranks") || parts.has("header")) page.ranks.render();
      if (parts.has("records") || parts.has("ranks") || parts.has("tab")) page.rankPanel.render();
      page.header.tick();
    } catch (err) {
      console.warn("rankboard: render failed", err);
    }
  }
  store.subscribe((...parts) => page.invalidate(...parts));

  page.steps = new StepView($("step-section"), {
    straggler: () => page.stragglers.text(),
    onChange: () => page.invalidate("steps"),
    series: (metric, start, end, points) => Promise.resolve(embeddedSeries(data, metric, start, end, points)),
    attemptSeries: (metric, attempt, start, end, points) => Promise.resolve(embeddedAttemptSeries(data, metric, attempt, start, end, points)),
    superseded: () => embeddedAttempts(data, "series"),
    csvHref: () => null,
  });
  page.header = new HeaderView(page);
  page.overview = new Overview(page);
  page.resources = new ResourcesView(page, { fetch: false });
  page.rankPanel = new RankPanel(page);
  page.tabs = new Tabs(page);
  page.stragglers = new Stragglers(page);
  page.ranks = new RanksView(page);
  page.failure = new FailureView(page);
  // 8.1: the cost line, and the epoch chart's restarts and superseded epochs (embedded)
  page.attempts = new AttemptView(page, {
    history: (k) => Promise.resolve(embeddedAttemptRecords(data, k)),
    superseded: () => embeddedAttempts(data, "epochs"),
  });

  const run = String(data.run ?? "");
  const snap = data.snapshot || {};
  unpackRecords(packedInOrder(data, snap)); // (in place; 8.1: the superseded epochs too)
  store.reset(run);
  page.steps.reset(run);
  $("run-view").hidden = false;
  $("tab-home").addEventListener("click", () => page.selectTab("home"));
  $("hardware").addEventListener("click", () => $("hardware").classList.toggle("expanded"));
  store.loadSnapshot(snap);
  page.resources.set(data.resources); // the series over time the web held (null: export)
  page.steps.onHeader(store.header, true); // the embedded series end at steps_done
  // one straggler strip column: every rank's step time as the report was made
  const stepMs = new Map();
  for (const r of store.ranks) if (isNum(r.step_ms)) stepMs.set(r.rank, r.step_ms);
  if (stepMs.size) page.stragglers.push(isNum(data.generated_at) ? data.generated_at : 0, stepMs);
  page.selectTab("home");

  const stalls = stallCard(data.stacks);
  if (stalls) $("panel-home").prepend(stalls);
  const verdict = verdictText(data.collectives);
  if (verdict.length) { // the collective verdict (7.2) leads, above the stall groups
    const card = h("div", "card span-12 collective-verdict");
    card.dataset.testid = "collective-verdict";
    card.append(h("h3", "card-title", "Collectives: who the others wait for"));
    for (const line of verdict) card.append(h("p", "verdict-line", line));
    $("panel-home").prepend(card);
  } else {
    const last = lastVerdictText(snap.collectives_last); // 8.5: the answer to the last hang
    if (last) {
      const card = h("div", "card span-12 collective-verdict collective-last");
      card.dataset.testid = "collective-last";
      card.append(h("h3", "card-title", `Collectives: ${last.title}`));
      for (const line of last.lines) card.append(h("p", "verdict-line", line));
      $("panel-home").prepend(card);
    }
  }
  const numbers = numbersLines(store.header, (r) => store.hostOfRank.get(r) ?? null);
  if (numbers.length) { // 8.3: the first non-finite rank, replicas that disagree
    const card = h("div", "card span-12 numbers-trouble");
    card.dataset.testid = "numbers-trouble";
    card.append(h("h3", "card-title", "Numbers gone wrong"));
    for (const line of numbers) card.append(h("p", "verdict-line", line.text));
    $("panel-home").prepend(card);
  }
  setText($("report-run"), run);
  const made = isNum(data.generated_at) ? new Date(data.generated_at * 1000) : null;
  setText($("report-made"), `made ${made ? `${made.toISOString().replace("T", " ").slice(0, 19)} UTC` : "at an unknown time"} by rankboard ${data.version ?? "?"} · a saved copy of run ${run}; it loads nothing`);
  page.invalidate("header", "records", "ranks", "steps");

  window.__rankboard = Object.freeze({
    report: true,
    stepChart: (name) => page.steps.snapshot(name),
    stepData: (name) => page.steps.data(name),
    epochChart: () => page.overview.metrics.snapshot(), // 8.1
    zoom: (range) => page.steps.zoom(range),
    heatmapCells: () => page.overview.heatmap.drawnCells || 0,
    charts: () => [...document.querySelectorAll("canvas")].filter((c) => c.width > 0 && c.offsetParent !== null).length,
  });
}

boot();
