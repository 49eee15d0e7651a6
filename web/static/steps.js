// rankboard step charts of one run: the data side (PROTOCOL 4, "Step series" and `steps`
// events) behind the BandCharts.
//
// No gap, no duplicate: on the first `run` event of every SSE connection, its `steps_done`
// (D) is the cut. Every chart fetches `/steps?metric=..&end=D&points=<its width in device
// pixels>` (closed steps <= D) and the connection's `steps` events carry exactly the steps
// after D, appended as they come. A reconnect sets a new D: the charts refetch up to it and
// drop the live points they had (all <= the new D, so /steps serves them). Live records are
// applied once per animation frame, however many events arrived.
//
// Zoom (drag on any step chart) applies to every step chart: each refetches [s0, s1] at its
// width (full resolution when the range holds fewer steps than pixels); closed steps after
// what the fetch returned come from the recent live records.
//
// Wall-time axes: /steps buckets carry no time, so the page derives it. Live records have
// their exact `time`; for history, a bucket's time is reconstructed by integrating the
// `step_ms` series (each bucket adds mean step_ms x the steps it advances) backwards from the
// first live record's time, or, when no step has arrived live, from the run's updated_at.
// Exact where live, an estimate for history; the hover says which.
//
// Attempts (PROTOCOL 8.1): every chart draws the line (the latest attempt's record per step).
// A live record from an attempt newer than the one that closed what the page holds, at or
// below the last step held, is a rewind: the page drops what it holds from that step on and
// makes that step its cut (the history below it is refetched from /steps, the rest arrives
// live), then appends. Each attempt's superseded records are fetched with `&attempt=K` from
// the first step a later attempt closed, and drawn faint beside the line; each attempt's
// first step carries a "restart k" marker whose hover says why the previous attempt ended.

import { api, enc } from "./api.js";
import {
  causeText, GHOST_ATTEMPTS, heldAttempt, isRewind, medianStepMs, RESTART_COLOR, restartMarkers,
  supersededRanges,
} from "./attempts.js";
import { colorAt } from "./axes.js";
import { BandChart, STEP_AXIS } from "./bandchart.js";
import { Buckets } from "./buckets.js";
import { button, h, setText } from "./dom.js";
import { fmtInt, fmtMs, formatNumber, isNum } from "./fmt.js";
import { numberMarkers } from "./numbersview.js";
import { cancelFrame, onFrame } from "./frame.js";
import { Pairs, TimeMap } from "./timemap.js";

/** Series that are not metric names (PROTOCOL 4 `/steps?metric=`). */
const BUILTIN = [
  { key: "step_ms", title: "Step time", unit: "ms", fmt: (v) => fmtMs(v), pick: (r) => r.step_ms },
  { key: "samples_per_s", title: "Throughput · samples/s", fmt: formatNumber, pick: (r) => r.samples_per_s },
  { key: "tokens_per_s", title: "Throughput · tokens/s", fmt: formatNumber, pick: (r) => r.tokens_per_s },
];
/** Metric charts shown before the "more" fold. */
const FIRST_METRICS = 6;
/** Recent live records kept at full resolution (zoom tails, hover's slowest rank). */
const RECENT = 20000;
/** The live steps/s figure: over this many ms of batches, and none once this long passes
 * without one. */
const RATE_WINDOW_MS = 10000;

/** A metric that is a hyperparameter's schedule, not a measurement: the learning rate as the
 * demo, Lightning's LearningRateMonitor ("lr-AdamW/pg1") and the HF Trainer ("learning_rate")
 * name it, momentum, weight decay. Its chart never turns to a log axis by itself. */
const SCHEDULE = /(?:^|[^a-z])(?:lr|learning_rate|momentum|weight_decay)(?:[^a-z]|$)/i;

export function isSchedule(name) {
  return SCHEDULE.test(String(name));
}

export class StepView {
  /**
   * `section`: the element to fill; `hooks`: {straggler() -> text|null, onChange(view),
   * series(metric, start, end, points) -> Promise<{buckets}> (optional: where the series
   * come from; default GET /steps, a saved report answers from its embedded buckets),
   * csvHref(run) -> url|null (optional: the steps CSV link; null hides it)}.
   */
  constructor(section, hooks = {}) {
    this.section = section;
    this.hooks = hooks;
    this.charts = new Map(); // key -> entry
    this.order = [];
    this.xMode = "step";
    this.showAll = false;
    this._build();
    this.reset(null);
  }

  _build() {
    const head = h("div", "section-head");
    this.titleEl = h("h2", "section-title", "Steps");
    this.subEl = h("span", "section-sub mono");
    const tools = h("div", "section-tools");
    const lab = h("label", "inline-field");
    lab.append(h("span", "tool-label", "x axis"));
    const sel = h("select", "tool-select");
    sel.id = "step-x";
    sel.dataset.testid = "step-x";
    for (const [v, t] of [["step", "step"], ["time", "wall time"], ["elapsed", "time since start"]]) {
      const o = h("option", null, t);
      o.value = v;
      sel.append(o);
    }
    sel.addEventListener("change", () => this.setXMode(sel.value));
    lab.append(sel);
    this.xSelect = sel;
    this.resetBtn = button("tool-btn", "reset zoom", () => this.zoom(null));
    this.resetBtn.hidden = true;
    this.resetBtn.dataset.action = "steps-reset-zoom";
    this.csv = h("a", "btn btn-small", "steps CSV");
    this.csv.setAttribute("download", "");
    tools.append(this.resetBtn, lab, this.csv);
    head.append(this.titleEl, this.subEl, tools);
    this.grid = h("div", "step-grid");
    this.grid.dataset.testid = "step-charts";
    this.more = button("btn more-btn", "");
    this.more.hidden = true;
    this.more.addEventListener("click", () => {
      this.showAll = !this.showAll;
      this._layout();
    });
    this.section.append(head, this.grid, this.more);
  }

  /** Forget everything (a run switch). */
  reset(run) {
    this.run = run;
    this.gen = (this.gen || 0) + 1;
    for (const e of this.charts.values()) e.chart.destroy();
    this.charts = new Map();
    this.order = [];
    this.cut = null; // D of the current connection
    this.cutKnown = false;
    this.view = null;
    this.pending = [];
    cancelFrame(this);
    this.recent = []; // live records (ascending), at most RECENT
    this.slowest = new Map(); // step -> slowest_rank, recent live steps
    this.anchors = new Pairs(); // exact (step, time) of live records
    this.timeMap = null;
    this.lastStep = null;
    this.latest = null; // the newest closed step record seen live
    this.kpi = {}; // key -> value of the last closed step (fetched or live)
    this.header = null;
    this.extraMetrics = [];
    this.rate = []; // [performance.now(), step] of recent batches for a steps/s figure
    this.openedAt = performance.now(); // when this run was opened here (idleSeconds)
    this.fetches = [];
    this.showAll = false;
    this.resetBtn.hidden = true;
    this.section.hidden = true;
    this.firstDraw = null;
    this.heldAttempt = 0; // (8.1) the attempt that closed the last step held
    this.localRewinds = []; // (8.1) [{attempt, start, next}] seen live, before the header says
    this.ghostKey = null;
    this.rewinds = 0;
    if (run !== null) {
      const href = this.hooks.csvHref ? this.hooks.csvHref(run) : `/api/runs/${enc(run)}/steps.csv`;
      this.csv.hidden = !href;
      if (href) this.csv.href = href;
    }
    setText(this.subEl, "");
  }

  get hasSteps() {
    return this.lastStep !== null;
  }

  // ------------------------------------------------------------------ charts

  _metricKeys() {
    const names = new Set((this.header && this.header.step_metrics) || []);
    for (const k of this.extraMetrics || []) names.add(k);
    const list = [...names].filter((n) => typeof n === "string").sort();
    const i = list.indexOf("loss");
    if (i > 0) {
      list.splice(i, 1);
      list.unshift("loss");
    }
    return list;
  }

  _ensureCharts() {
    const metrics = this._metricKeys();
    const keys = [...metrics.map((m) => `m:${m}`), ...BUILTIN.map((b) => `b:${b.key}`)];
    let changed = false;
    keys.forEach((key, i) => {
      if (this.charts.has(key)) return;
      changed = true;
      const isMetric = key.startsWith("m:");
      const name = key.slice(2);
      const spec = isMetric ? null : BUILTIN.find((b) => b.key === name);
      const host = h("div", "step-cell");
      host.dataset.stepChart = name;
      const chart = new BandChart(host, {
        title: isMetric ? name : spec.title,
        chartId: `step-${isMetric ? "metric" : name}`,
        log: true, smoothing: true, height: 160,
        // a warmup + cosine learning rate spans decades by design: on a log axis it read as
        // a cliff to 1e-9 at its end; it stays linear unless the user asks (issue 43 item 5)
        autoLog: !(isMetric && isSchedule(name)),
        yFormat: spec ? spec.fmt : formatNumber,
        emptyText: isMetric ? "waiting for steps…" : "not reported",
        onZoom: (r) => this.zoom(r),
        slowest: (a, b) => this._slowestText(a, b),
        onDraw: (c) => this._drew(key, c),
      });
      chart.canvas.dataset.metric = name;
      const entry = {
        key, name, metric: name, isMetric, host, chart, color: colorAt(isMetric ? metrics.indexOf(name) : 10 + i),
        pick: isMetric ? (r) => (r.metrics ? r.metrics[name] : undefined) : spec.pick,
        base: new Buckets(), all: new Buckets(), zoomed: null, hasData: false, loaded: false,
        ghosts: [], // (8.1) [{attempt, data: Buckets}]: superseded records, drawn faint
      };
      this.charts.set(key, entry);
      if (this.cutKnown) this._fetchBase(entry);
      if (this.cutKnown && this.ghostKey !== null) this._fetchGhosts(entry);
      entry.chart.setMarkers(this._markersFor(entry));
    });
    if (changed) {
      this.order = keys.filter((k) => this.charts.has(k));
      this._layout();
    }
  }

  _layout() {
    const metrics = this.order.filter((k) => this.charts.get(k).isMetric);
    const hiddenMetrics = this.showAll ? [] : metrics.slice(FIRST_METRICS);
    const nodes = [];
    for (const key of this.order) {
      const e = this.charts.get(key);
      const shown = e.hasData || e.isMetric;
      e.host.hidden = !shown || hiddenMetrics.includes(key);
      nodes.push(e.host);
    }
    // builtins right after the first metrics, so step time and throughput stay above the fold
    const first = nodes.filter((n, i) => this.charts.get(this.order[i]).isMetric && !hiddenMetrics.includes(this.order[i]));
    const builtins = nodes.filter((n, i) => !this.charts.get(this.order[i]).isMetric);
    const rest = nodes.filter((n, i) => hiddenMetrics.includes(this.order[i]));
    this.grid.replaceChildren(...first, ...builtins, ...rest);
    const more = metrics.length - FIRST_METRICS;
    this.more.hidden = more <= 0;
    setText(this.more, this.showAll ? "fewer step metrics" : `${more} more step metric${more === 1 ? "" : "s"}`);
    for (const e of this.charts.values()) if (!e.host.hidden) e.chart.render();
  }

  _drew(key, chart) {
    if (key === "m:loss" && this.firstDraw === null && this.cutKnown) {
      const e = this.charts.get(key);
      if (e.loaded && chart.last && chart.last.bins.length) {
        const g = chart._geom;
        this.firstDraw = { at: performance.now(), range: [g.a, g.b], base: e.base.n };
      }
    }
  }

  // ------------------------------------------------------------------ data in

  /** A `run` event or the JSON snapshot's header. `first`: the first of a connection. */
  onHeader(hd, first) {
    if (!hd) return;
    this.header = hd;
    if (first) {
      this.cut = isNum(hd.steps_done) ? hd.steps_done : null;
      this.cutKnown = true;
      this.gen++;
      this.heldAttempt = heldAttempt(hd, "step");
      this.localRewinds = [];
      this.ghostKey = null;
      // every live point we had is <= the new cut: /steps serves it now
      this.recent = [];
      this.pending = [];
      for (const e of this.charts.values()) {
        e.loaded = false;
        this._fetchBase(e);
      }
      if (this.cut !== null) this._fetchKpis();
    }
    if (isNum(hd.steps_done) && (this.lastStep === null || hd.steps_done > this.lastStep)) {
      this.lastStep = hd.steps_done;
    }
    if (this.lastStep !== null || (hd.step_metrics && hd.step_metrics.length)) {
      this.section.hidden = false;
      this._ensureCharts();
    }
    this._markNumbers(hd);
    if (this.cutKnown) this._ghostsChanged();
    this._sub();
  }

  /** (8.3) Each metric's chart marks its first non-finite step and first divergence. */
  _markNumbers(hd) {
    for (const e of this.charts.values()) e.chart.setMarkers(this._markersFor(e));
  }

  /** A chart's markers: (8.3) a metric's first non-finite step and divergence, and (8.1) the
   * restart markers of every chart (from the header; a rewind seen live before the header
   * says it is marked meanwhile). */
  _markersFor(e) {
    const hd = this.header;
    const out = e.isMetric ? [...(numberMarkers(hd).get(e.name) || [])] : [];
    const restarts = restartMarkers(hd, "step");
    const named = new Set(restarts.map((m) => m.text));
    for (const w of this.localRewinds || []) {
      const text = `restart ${w.next}`;
      if (named.has(text)) continue;
      const prev = hd && Array.isArray(hd.attempts) ? hd.attempts.find((a) => a && a.attempt === w.next - 1) : null;
      restarts.push({ step: w.start, text, color: RESTART_COLOR, hover: causeText(w.next - 1, prev ? prev.cause : null) });
    }
    return out.concat(restarts);
  }

  // ------------------------------------------------------------------ attempts (8.1)

  /** The superseded ranges to draw faint: the header's, the rewinds seen live that the
   * header does not say yet, and those the `superseded` hook knows of (a saved report's
   * embedded series, whose header may predate them by the second a header may lag); the
   * lowest start per attempt. */
  _ghostRanges() {
    const by = new Map();
    const known = this.hooks.superseded ? this.hooks.superseded() : [];
    for (const r of [...supersededRanges(this.header, "step"), ...(this.localRewinds || []), ...known]) {
      const was = by.get(r.attempt);
      if (!was || (r.start !== null && (was.start === null || r.start < was.start))) by.set(r.attempt, { attempt: r.attempt, start: r.start });
    }
    return [...by.values()].sort((a, b) => a.attempt - b.attempt).slice(-GHOST_ATTEMPTS);
  }

  /** Refetch every chart's faint series when what is superseded changed. */
  _ghostsChanged() {
    const hd = this.header || {};
    const sup = (Array.isArray(hd.attempts) ? hd.attempts : []).map((a) => a && `${a.superseded_steps}`).join(",");
    const key = `${this._ghostRanges().map((r) => `${r.attempt}:${r.start}`).join(",")}|${sup}|${this.rewinds}`;
    if (key === this.ghostKey) return;
    this.ghostKey = key;
    for (const e of this.charts.values()) {
      e.chart.setMarkers(this._markersFor(e));
      this._fetchGhosts(e);
    }
  }

  /** One chart's superseded series (GET /steps?...&attempt=K from the first step a later
   * attempt closed; within the zoomed range when zoomed, at its full resolution), drawn
   * faint. An attempt the run no longer lists (404) draws nothing. */
  async _fetchGhosts(e) {
    const gen = this.gen;
    e.ghostGen = (e.ghostGen || 0) + 1;
    const mine = e.ghostGen;
    const ranges = this._ghostRanges();
    if (!ranges.length) {
      if (e.ghosts.length) {
        e.ghosts = [];
        this._redraw(e);
      }
      return;
    }
    const points = e.chart.plotColumns();
    const [lo, hi] = this.view || [null, null];
    const out = await Promise.all(ranges.map(async (r) => {
      const start = r.start === null ? lo : lo === null ? r.start : Math.max(r.start, lo);
      if (start !== null && hi !== null && start > hi) return null;
      try {
        const d = await this._attemptSeries(e.metric, r.attempt, start, hi, points);
        return { attempt: r.attempt, data: Buckets.fromApi(Array.isArray(d && d.buckets) ? d.buckets : []) };
      } catch {
        return null; // an attempt no longer listed, or a busy web: the line is what matters
      }
    }));
    if (gen !== this.gen || mine !== e.ghostGen || this.charts.get(e.key) !== e) return;
    e.ghosts = out.filter((g) => g && g.data.n);
    this._redraw(e);
  }

  /** Attempt K's own closed records of one series in [start, end] (null: unbounded)
   * (PROTOCOL 8.1 `/steps?...&attempt=K`), or a saved report's embedded ones (the
   * `attemptSeries` hook). */
  _attemptSeries(metric, attempt, start, end, points) {
    if (this.hooks.attemptSeries) return this.hooks.attemptSeries(metric, attempt, start, end, points);
    if (this.hooks.series) return Promise.resolve({ buckets: [] }); // a source without attempts
    const range = `${start === null ? "" : `&start=${start}`}${end === null ? "" : `&end=${end}`}`;
    return api(`/api/runs/${enc(this.run)}/steps?metric=${enc(metric)}${range}&points=${points}&attempt=${attempt}`);
  }

  /** The last step the page holds (live, else the connection's cut), or null. */
  _heldLast() {
    return this.recent.length ? this.recent[this.recent.length - 1].step : this.cut;
  }

  /**
   * (8.1) A newer attempt closed `step`, at or below what the page holds: drop everything
   * from `step` on. The steps below it are the line still (refetched from /steps up to
   * step - 1, the new cut); from `step` on the new attempt's records arrive live.
   */
  _rewind(step, attempt) {
    this.rewinds++;
    this.localRewinds.push({ attempt: this.heldAttempt, start: step, next: attempt });
    this.cut = step > 0 ? step - 1 : null;
    this.gen++;
    this.recent = this.recent.filter((r) => r.step < step);
    for (const s of [...this.slowest.keys()]) if (s >= step) this.slowest.delete(s);
    while (this.anchors.n && this.anchors.s[this.anchors.n - 1] >= step) this.anchors.n--;
    this.lastStep = step > 0 ? step - 1 : null;
    this.latest = null;
    for (const e of this.charts.values()) {
      // what is certainly the line meanwhile: the buckets wholly below `step`
      const keep = new Buckets(e.all.n + 16);
      for (let i = 0; i < e.all.n && e.all.s1[i] < step; i++) {
        keep.push(e.all.s0[i], e.all.s1[i], e.all.mean[i], e.all.lo[i], e.all.hi[i], e.all.rmin[i], e.all.rmax[i], e.all.cnt[i], e.all.bad[i] === 1);
      }
      e.all = keep;
      e.zoomed = null;
      e.loaded = false;
      this._fetchBase(e);
    }
    if (this.hooks.onRewind) this.hooks.onRewind(step, attempt);
  }

  /** The median step time (ms) of the line the page holds (the header's cost line, 8.1). */
  medianStepMs() {
    const e = this.charts.get("b:step_ms");
    return e ? medianStepMs(e.all) : null;
  }

  /** A live `steps` event. */
  onSteps(data) {
    const recs = data && Array.isArray(data.steps) ? data.steps : null;
    if (!recs || !this.cutKnown) return;
    for (const r of recs) if (r && isNum(r.step)) this.pending.push(r);
    onFrame(this, () => this._flush());
  }

  _flush() {
    const recs = this.pending;
    this.pending = [];
    if (!recs.length) return;
    let newNames = null;
    let rewound = false;
    for (const r of recs) {
      if (isRewind(r.attempt, r.step, this.heldAttempt, this._heldLast())) {
        this._rewind(r.step, r.attempt);
        rewound = true;
      }
      if (Number.isInteger(r.attempt) && r.attempt > this.heldAttempt) this.heldAttempt = r.attempt;
      if (this.cut !== null && r.step <= this.cut) continue; // never twice
      const prev = this.recent.length ? this.recent[this.recent.length - 1].step : null;
      if (prev !== null && r.step <= prev) continue;
      this.recent.push(r);
      if (isNum(r.slowest_rank)) this.slowest.set(r.step, r.slowest_rank);
      if (isNum(r.time)) this.anchors.push(r.step, r.time);
      if (r.metrics) {
        for (const k of Object.keys(r.metrics)) {
          if (!this.charts.has(`m:${k}`)) (newNames || (newNames = [])).push(k);
        }
      }
      this.latest = r;
      if (this.lastStep === null || r.step > this.lastStep) this.lastStep = r.step;
      for (const e of this.charts.values()) this._appendLive(e, r);
    }
    if (this.recent.length > RECENT * 1.25) {
      const drop = this.recent.splice(0, this.recent.length - RECENT);
      for (const r of drop) this.slowest.delete(r.step);
    }
    if (this.anchors.n > 50000) this.anchors.thin();
    if (newNames) {
      this.extraMetrics = [...new Set([...(this.extraMetrics || []), ...newNames])];
    }
    if (this.lastStep !== null) this.section.hidden = false;
    this._ensureCharts();
    if (this.latest) {
      for (const e of this.charts.values()) {
        const v = e.pick(this.latest);
        this.kpi[e.name] = Array.isArray(v) ? v[0] : v;
      }
    }
    const now = performance.now();
    this.rate.push([now, this.lastStep]);
    while (this.rate.length > 2 && now - this.rate[0][0] > RATE_WINDOW_MS) this.rate.shift();
    if (this.xMode !== "step") this._rebuildTime();
    for (const e of this.charts.values()) this._redraw(e);
    if (rewound) this._ghostsChanged();
    this._sub();
    if (this.hooks.onChange) this.hooks.onChange(this);
  }

  /** One closed step record into a chart's overview (and its zoomed data, if in range). */
  _appendLive(e, r) {
    const v = e.pick(r);
    if (v === undefined || v === null) return;
    const [mean, lo, hi] = Array.isArray(v) ? v : [v, v, v];
    if (e.all.last !== null && r.step <= e.all.last) return;
    // lo/hi of one step are its mean (the per-step means); the band is the ranks' min..max
    e.all.pushStep(r.step, mean, lo, hi);
    if (!e.hasData) {
      e.hasData = true;
      this._layout();
    }
    const cap = 4 * e.chart.plotColumns();
    if (e.all.n > cap) e.all.compact();
    if (e.zoomed && this.view && r.step <= this.view[1] && (e.zoomed.last === null || r.step > e.zoomed.last)) {
      e.zoomed.pushStep(r.step, mean, lo, hi);
    }
  }

  _redraw(e) {
    if (e.host.hidden) return;
    const line = { name: e.name, color: e.color, data: this.view && e.zoomed ? e.zoomed : e.all };
    // (8.1) each attempt's superseded records, faint beside the line (the page counts from 1)
    const ghosts = (e.ghosts || []).map((g) => ({
      name: `${e.name} · attempt ${g.attempt + 1} (superseded)`, color: e.color, data: g.data, faint: true,
    }));
    e.chart.setSeries([line, ...ghosts]);
  }

  async _fetchBase(e) {
    const gen = this.gen;
    const run = this.run;
    const cut = this.cut;
    if (cut === null) {
      // nothing closed before this connection: everything comes live
      e.base = new Buckets();
      e.all = this._merge(e.base, e);
      e.loaded = true;
      this._redraw(e);
      return;
    }
    const points = e.chart.plotColumns();
    let data;
    try {
      data = await this._series(e.metric, null, cut, points);
    } catch (err) {
      if (gen !== this.gen || this.charts.get(e.key) !== e) return;
      // a busy or restarting web: the history is still owed, so ask again (the live steps
      // after the cut keep coming meanwhile); a saved report's series never fail
      e.chart.setStatus("could not load steps, retrying…");
      e.retries = (e.retries || 0) + 1;
      setTimeout(() => {
        if (gen === this.gen && !e.loaded && this.charts.get(e.key) === e) this._fetchBase(e);
      }, Math.min(10000, 500 * 2 ** Math.min(5, e.retries)));
      return;
    }
    if (gen !== this.gen || !data || !Array.isArray(data.buckets)) return;
    e.retries = 0;
    e.chart.setStatus("");
    e.base = Buckets.fromApi(data.buckets);
    e.all = this._merge(e.base, e);
    e.loaded = true;
    if (e.base.n && !e.hasData) {
      e.hasData = true;
      this._layout();
    }
    if (e.key === "b:step_ms") this._rebuildTime();
    if (this.view) this._fetchZoom(e, this.view);
    this._redraw(e);
    // (8.1) the header's cost line reads the line's median step time
    if (e.key === "b:step_ms" && this.hooks.onChange) this.hooks.onChange(this);
  }

  /** The fetched history plus the live records after the cut. */
  _merge(base, e) {
    const all = new Buckets(base.n + this.recent.length + 16);
    all.appendFrom(base);
    for (const r of this.recent) this._pushRecord(all, e, r);
    const cap = 4 * e.chart.plotColumns();
    while (all.n > cap) all.compact();
    return all;
  }

  _pushRecord(b, e, r) {
    const v = e.pick(r);
    if (v === undefined || v === null) return;
    const [mean, lo, hi] = Array.isArray(v) ? v : [v, v, v];
    if (b.last !== null && r.step <= b.last) return;
    b.pushStep(r.step, mean, lo, hi);
  }

  async _fetchKpis() {
    const gen = this.gen;
    const cut = this.cut;
    await Promise.all(["loss", "step_ms", "samples_per_s", "tokens_per_s"].map(async (m) => {
      try {
        const d = await this._series(m, cut, cut, 1);
        if (gen !== this.gen || this.latest) return;
        const b = d && Array.isArray(d.buckets) ? d.buckets[0] : null;
        this.kpi[m] = b ? b[2] : null;
      } catch {
        /* a KPI is not worth an error */
      }
    }));
    if (gen === this.gen && this.hooks.onChange) this.hooks.onChange(this);
  }

  /**
   * One step series (PROTOCOL 4 `/steps`): from the `series` hook when there is one (a saved
   * report's embedded buckets), else GET /steps. `start`/`end` null: unbounded.
   */
  _series(metric, start, end, points) {
    if (this.hooks.series) return this.hooks.series(metric, start, end, points);
    const range = `${start === null ? "" : `&start=${start}`}${end === null ? "" : `&end=${end}`}`;
    const url = `/api/runs/${enc(this.run)}/steps?metric=${enc(metric)}${range}&points=${points}`;
    if (points > 1) this.fetches.push(url);
    return api(url);
  }

  // ------------------------------------------------------------------ zoom

  zoom(range) {
    this.view = range;
    this.resetBtn.hidden = range === null;
    for (const e of this.charts.values()) {
      e.zoomed = null;
      e.chart.setView(range);
      if (range) this._fetchZoom(e, range);
      else this._redraw(e);
      this._fetchGhosts(e); // (8.1) at the view's resolution
    }
    if (this.hooks.onChange) this.hooks.onChange(this);
  }

  async _fetchZoom(e, range) {
    const gen = this.gen;
    const [s0, s1] = range;
    e.chart.setStatus("loading…");
    e.zoomGen = (e.zoomGen || 0) + 1;
    const zg = e.zoomGen;
    const points = e.chart.plotColumns();
    let data;
    try {
      data = await this._series(e.metric, s0, s1, points);
    } catch {
      if (gen === this.gen && zg === e.zoomGen) e.chart.setStatus("could not load range");
      return;
    }
    if (gen !== this.gen || zg !== e.zoomGen || this.view !== range) return;
    e.chart.setStatus("");
    const z = Buckets.fromApi(Array.isArray(data && data.buckets) ? data.buckets : []);
    // closed steps the fetch did not return yet come from the live records
    for (const r of this.recent) if (r.step >= s0 && r.step <= s1) this._pushRecord(z, e, r);
    e.zoomed = z;
    this._redraw(e);
  }

  // ------------------------------------------------------------------ x axis

  setXMode(mode) {
    this.xMode = mode;
    this.xSelect.value = mode;
    this._rebuildTime();
  }

  _rebuildTime() {
    let axis = STEP_AXIS;
    if (this.xMode !== "step") {
      const map = this._timeMap();
      const start = this.header && isNum(this.header.started_at) ? this.header.started_at : 0;
      if (this.xMode === "time") {
        axis = { kind: "time", label: "", map: (s) => map.at(s), inv: (t) => map.inv(t) };
      } else {
        axis = { kind: "elapsed", label: "since start", map: (s) => map.at(s) - start, inv: (x) => map.inv(x + start) };
      }
    }
    this.axis = axis;
    for (const e of this.charts.values()) e.chart.setAxis(axis);
  }

  /** step -> time from the step_ms history (integrated) and the exact live times. */
  _timeMap() {
    const e = this.charts.get("b:step_ms");
    const base = e ? e.base : new Buckets();
    const steps = [];
    const times = [];
    if (base.n) {
      const rel = new Float64Array(base.n);
      let acc = 0;
      for (let i = 0; i < base.n; i++) {
        const ms = Number.isNaN(base.mean[i]) ? 0 : base.mean[i];
        const adv = i ? base.s1[i] - base.s1[i - 1] : 0;
        acc += (ms / 1000) * adv;
        rel[i] = acc;
      }
      // the time of the history's last step: from the first live record when there is
      // one (its time less its own step time per step between them), else updated_at
      const lastStep = base.s1[base.n - 1];
      let anchorTime;
      if (this.anchors.n) {
        const ms = this.recent.length && this.recent[0].step_ms ? this.recent[0].step_ms[0] : null;
        const lastMs = Number.isNaN(base.mean[base.n - 1]) ? 0 : base.mean[base.n - 1];
        const per = (isNum(ms) ? ms : lastMs) / 1000;
        anchorTime = this.anchors.v[0] - per * (this.anchors.s[0] - lastStep);
      } else {
        const hd = this.header || {};
        anchorTime = isNum(hd.updated_at) ? hd.updated_at : Date.now() / 1000;
      }
      const offset = anchorTime - rel[base.n - 1];
      for (let i = 0; i < base.n; i++) {
        steps.push(base.s1[i]);
        times.push(rel[i] + offset);
      }
    }
    const a = this.anchors;
    for (let i = 0; i < a.n; i++) {
      if (steps.length && a.s[i] <= steps[steps.length - 1]) continue;
      const t = steps.length ? Math.max(a.v[i], times[times.length - 1]) : a.v[i];
      steps.push(a.s[i]);
      times.push(t);
    }
    if (!steps.length) {
      const hd = this.header || {};
      steps.push(0);
      times.push(isNum(hd.started_at) ? hd.started_at : 0);
    }
    this.timeMap = new TimeMap(steps, times);
    return this.timeMap;
  }

  // ------------------------------------------------------------------ text

  _slowestText(first, last) {
    if (first === last && this.slowest.has(first)) return `slowest rank: ${this.slowest.get(first)}`;
    const s = this.hooks.straggler ? this.hooks.straggler() : null;
    return s || null;
  }

  /** Steps per second over the last ~10 s of live batches (null before two, and once no
   * batch came for 10 s: a stalled or finished run has no current rate). */
  stepsPerSecond() {
    if (this.rate.length < 2) return null;
    const [t0, s0] = this.rate[0];
    const [t1, s1] = this.rate[this.rate.length - 1];
    if (performance.now() - t1 > RATE_WINDOW_MS) return null;
    return t1 > t0 && isNum(s0) && isNum(s1) ? ((s1 - s0) * 1000) / (t1 - t0) : null;
  }

  /** Seconds since a step last closed live here, or since the run was opened here when
   * none has: how old the step KPIs are (issue 43 item 3: a hang kept "1,224 samples/s"). */
  idleSeconds() {
    const t = this.rate.length ? this.rate[this.rate.length - 1][0] : this.openedAt;
    return (performance.now() - t) / 1000;
  }

  _sub() {
    if (this.lastStep === null) {
      setText(this.subEl, "no step closed yet");
      return;
    }
    const rate = this.stepsPerSecond();
    setText(this.subEl, `step ${fmtInt(this.lastStep)}${isNum(rate) && rate > 0 ? ` · ${rate.toFixed(1)} steps/s` : ""}`);
  }

  /** What tests and benchmarks read: a chart's last draw (by metric name). */
  snapshot(name) {
    for (const e of this.charts.values()) {
      if (e.name === name) {
        const s = e.chart.snapshot();
        return s && { ...s, cut: this.cut, base: e.base.n, live: this.recent.length, loaded: e.loaded };
      }
    }
    return null;
  }

  /**
   * The buckets a chart holds now (the overview, or the zoomed range): [first, last,
   * count] each, so a test can check that no step is missing or held twice.
   */
  data(name) {
    for (const e of this.charts.values()) {
      if (e.name !== name) continue;
      const d = this.view && e.zoomed ? e.zoomed : e.all;
      const out = [];
      for (let i = 0; i < d.n; i++) out.push([d.s0[i], d.s1[i], d.cnt[i]]);
      return out;
    }
    return null;
  }

  /** Every step the page holds for `name` beyond the fetched history (the live records). */
  liveSteps() {
    return this.recent.map((r) => r.step);
  }
}

