// rankboard step charts: series of step buckets drawn per device pixel.
//
// A series is a run of buckets [first_step, last_step, mean, lo, hi, rank_min, rank_max,
// count] (the `/steps` shape, PROTOCOL 4), kept in typed arrays (`Buckets`). Drawing bins the
// buckets into one column per device pixel and draws, per column:
//   * a light band from the smallest rank value to the largest (rank_min..rank_max),
//   * where a column holds more than one step, a line from the smallest to the largest
//     per-step mean (lo..hi), so a one-step spike among a million is always visible,
//   * the mean line through the columns' means (log scale and EMA smoothing apply to it).
// Zoom is by drag on x; the owner (StepView) refetches the range at full resolution.
//
// Names from a training job reach the DOM only through textContent.

import {
  buildLegend, chartControls, chartTheme, colorAt, drawYGrid, ema, el, formatClock,
  formatNumber, logTicks, niceTicks, syncLegend, timeTicks,
} from "./charts.js";
import { cancelFrame, onFrame } from "./frame.js";

const isNum = (v) => typeof v === "number" && Number.isFinite(v);
const fin = (v) => (isNum(v) ? v : NaN);

/** Bucket columns in growable typed arrays; absent values are NaN. */
export class Buckets {
  constructor(cap = 64) {
    this.n = 0;
    this._alloc(cap);
  }

  _alloc(cap) {
    const old = this.n ? this : null;
    const f = () => new Float64Array(cap);
    const cols = { s0: f(), s1: f(), mean: f(), lo: f(), hi: f(), rmin: f(), rmax: f(), cnt: f() };
    const bad = new Uint8Array(cap);
    if (old) {
      for (const k of Object.keys(cols)) cols[k].set(this[k].subarray(0, this.n));
      bad.set(this.bad.subarray(0, this.n));
    }
    Object.assign(this, cols);
    this.bad = bad;
    this.cap = cap;
  }

  get length() {
    return this.n;
  }

  /** Append one bucket (steps ascending); `bad`: the mean is non-finite. */
  push(s0, s1, mean, lo, hi, rmin, rmax, cnt, bad = false) {
    if (this.n === this.cap) this._alloc(this.cap * 2);
    const i = this.n++;
    this.s0[i] = s0;
    this.s1[i] = s1;
    this.mean[i] = mean;
    this.lo[i] = lo;
    this.hi[i] = hi;
    this.rmin[i] = rmin;
    this.rmax[i] = rmax;
    this.cnt[i] = cnt;
    this.bad[i] = bad ? 1 : 0;
  }

  /** From the API's `buckets` array. */
  static fromApi(rows) {
    const b = new Buckets(Math.max(16, rows.length));
    for (const r of rows) {
      if (!Array.isArray(r) || r.length < 8) continue;
      b.push(r[0], r[1], fin(r[2]), fin(r[3]), fin(r[4]), fin(r[5]), fin(r[6]), r[7], r[2] === null);
    }
    return b;
  }

  get first() {
    return this.n ? this.s0[0] : null;
  }

  get last() {
    return this.n ? this.s1[this.n - 1] : null;
  }

  /** Index of the first bucket whose last step is >= `step` (binary search). */
  lowerBound(step) {
    let a = 0;
    let b = this.n;
    while (a < b) {
      const m = (a + b) >> 1;
      if (this.s1[m] < step) a = m + 1;
      else b = m;
    }
    return a;
  }

  /** Merge neighbours pairwise (extremes exact, means count-weighted): half the buckets. */
  compact() {
    const n = this.n;
    let j = 0;
    for (let i = 0; i < n; i += 2, j++) {
      if (i + 1 >= n) {
        this._copy(i, j);
        continue;
      }
      const c0 = this.cnt[i];
      const c1 = this.cnt[i + 1];
      const m0 = this.mean[i];
      const m1 = this.mean[i + 1];
      let mean;
      if (Number.isNaN(m0)) mean = m1;
      else if (Number.isNaN(m1)) mean = m0;
      else mean = (m0 * c0 + m1 * c1) / (c0 + c1);
      this.s0[j] = this.s0[i];
      this.s1[j] = this.s1[i + 1];
      this.mean[j] = mean;
      this.lo[j] = nanMin(this.lo[i], this.lo[i + 1]);
      this.hi[j] = nanMax(this.hi[i], this.hi[i + 1]);
      this.rmin[j] = nanMin(this.rmin[i], this.rmin[i + 1]);
      this.rmax[j] = nanMax(this.rmax[i], this.rmax[i + 1]);
      this.cnt[j] = c0 + c1;
      this.bad[j] = this.bad[i] | this.bad[i + 1];
    }
    this.n = j;
  }

  _copy(i, j) {
    for (const k of ["s0", "s1", "mean", "lo", "hi", "rmin", "rmax", "cnt", "bad"]) this[k][j] = this[k][i];
  }

  /** Append every bucket of `other` whose first step is above our last. */
  appendFrom(other) {
    const last = this.last;
    for (let i = 0; i < other.n; i++) {
      if (last !== null && other.s0[i] <= last) continue;
      this.push(other.s0[i], other.s1[i], other.mean[i], other.lo[i], other.hi[i],
        other.rmin[i], other.rmax[i], other.cnt[i], other.bad[i] === 1);
    }
  }
}

function nanMin(a, b) {
  if (Number.isNaN(a)) return b;
  if (Number.isNaN(b)) return a;
  return a < b ? a : b;
}

function nanMax(a, b) {
  if (Number.isNaN(a)) return b;
  if (Number.isNaN(b)) return a;
  return a > b ? a : b;
}

/** "1h 02m" style durations for an elapsed-time axis. */
function fmtElapsed(s) {
  if (!isNum(s)) return "—";
  const neg = s < 0;
  s = Math.abs(s);
  let out;
  if (s < 60) out = `${+s.toFixed(s < 10 ? 1 : 0)}s`;
  else if (s < 3600) out = `${Math.floor(s / 60)}m${s % 60 >= 1 ? ` ${String(Math.round(s % 60)).padStart(2, "0")}s` : ""}`;
  else if (s < 86400) out = `${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  else out = `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
  return neg ? `-${out}` : out;
}

const ELAPSED_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800,
  21600, 43200, 86400, 172800, 432000, 864000];

function elapsedTicks(lo, hi, count) {
  const want = (hi - lo) / Math.max(1, count);
  const step = ELAPSED_STEPS.find((s) => s >= want) || Math.ceil(want / 86400) * 86400;
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi && ticks.length < 200; v += step) ticks.push(v);
  return { ticks, step };
}

/** Identity x axis over steps. */
export const STEP_AXIS = { kind: "step", label: "step", map: (s) => s, inv: (x) => x };

/**
 * A chart of one or more bucket series.
 *
 * Options: title, chartId, yFormat, height, log (log toggle), smoothing (EMA slider),
 * legend (a legend with solo), band (draw the rank spread; default true), emptyText,
 * onZoom([s0, s1] | null) (drag/reset; without it the chart zooms itself),
 * slowest(step) -> rank | null (hover), xLabel.
 */
export class BandChart {
  constructor(host, opts = {}) {
    this.opts = { yFormat: formatNumber, height: 220, band: true, ...opts };
    this.series = [];
    this.axis = STEP_AXIS;
    this.view = null; // [s0, s1] in steps, or null (everything)
    this.logScale = null;
    this.smooth = 0;
    this.solo = null;
    this.hover = null; // device column
    this.drag = null;
    this.visible = true;
    this.draws = 0;
    this._build(host);
  }

  _build(host) {
    const o = this.opts;
    const card = el("div", "chart band-chart");
    if (o.chartId) card.dataset.chartCard = o.chartId;
    const head = el("div", "chart-head");
    this.titleEl = el("h3", "chart-title", o.title || "");
    head.append(this.titleEl);
    const { tools, logBtn, resetBtn: reset } = chartControls(o, {
      onSmooth: (weight) => { this.smooth = weight; this.render(); },
      onLog: () => { this.logScale = !this._effectiveLog(); this.render(); },
      onReset: () => this._zoom(null),
      smoothTitle: "EMA smoothing of the mean line",
    });
    this.status = el("span", "chart-status");
    tools.prepend(this.status);
    if (logBtn) this.logBtn = logBtn;
    this.resetBtn = reset;
    tools.append(reset);
    head.append(tools);
    card.append(head);
    if (o.legend) {
      this.legendEl = el("div", "chart-legend");
      card.append(this.legendEl);
    }
    const body = el("div", "chart-body");
    body.style.height = `${o.height}px`;
    this.canvas = el("canvas");
    if (o.chartId) this.canvas.dataset.chart = o.chartId;
    this.canvas.setAttribute("role", "img");
    this.canvas.setAttribute("aria-label", o.title || "chart");
    this.tip = el("div", "chart-tip");
    this.tip.hidden = true;
    this.empty = el("div", "chart-empty", o.emptyText || "waiting for steps…");
    body.append(this.canvas, this.tip, this.empty);
    this.body = body;
    card.append(body);
    host.append(card);
    this.card = card;
    this._bindPointer();
    this._w = 0;
    this._ro = new ResizeObserver((entries) => {
      const r = entries[entries.length - 1].contentRect;
      this._size = { w: Math.floor(r.width), h: Math.floor(r.height) };
      if (this._size.w !== this._w) this.render();
    });
    this._ro.observe(body);
    // charts scrolled out of view do not draw; they draw when they come back
    this._io = new IntersectionObserver((entries) => {
      for (const e of entries) this.visible = e.isIntersecting;
      if (this.visible && this._stale) this.render();
    });
    this._io.observe(body);
  }

  /** Columns available for data, in device pixels (what `points` should be). */
  plotColumns() {
    const w = (this._size && this._size.w) || Math.floor(this.body.getBoundingClientRect().width) || 600;
    const dpr = window.devicePixelRatio || 1;
    return Math.max(50, Math.min(10000, Math.round((w - 60) * dpr)));
  }

  setTitle(t) {
    this.opts.title = t;
    this.titleEl.textContent = t;
    this.canvas.setAttribute("aria-label", t);
  }

  /** `series`: [{name, color?, data: Buckets}]. */
  setSeries(series) {
    const names = series.map((s) => s.name).join("\u0000");
    this.series = series.map((s, i) => ({ name: s.name, color: s.color || colorAt(i), data: s.data }));
    if (this.solo !== null && !this.series.some((s) => s.name === this.solo)) this.solo = null;
    if (this.legendEl && names !== this._names) this._buildLegend();
    this._names = names;
    this.render();
  }

  setAxis(axis) {
    this.axis = axis || STEP_AXIS;
    this.render();
  }

  setView(range) {
    this.view = range;
    this.resetBtn.hidden = range === null;
    this.render();
  }

  setStatus(text) {
    this.status.textContent = text || "";
  }

  _zoom(range) {
    if (this.opts.onZoom) this.opts.onZoom(range);
    else this.setView(range);
  }

  _buildLegend() {
    buildLegend(this);
  }

  _syncLegend() {
    syncLegend(this);
  }

  _visibleSeries() {
    return this.series.filter((s) => this.solo === null || s.name === this.solo);
  }

  /** Coalesced redraw (one per animation frame); skipped while scrolled out of view. */
  render() {
    onFrame(this, () => this.drawNow());
  }

  drawNow() {
    if (!this.visible && this._drewOnce) {
      this._stale = true;
      return;
    }
    this._stale = false;
    this._drewOnce = true;
    this._draw();
  }

  _extent() {
    let a = Infinity;
    let b = -Infinity;
    for (const s of this._visibleSeries()) {
      if (!s.data.n) continue;
      a = Math.min(a, s.data.first);
      b = Math.max(b, s.data.last);
    }
    return Number.isFinite(a) ? [a, b] : null;
  }

  _effectiveLog() {
    if (!this.opts.log) return false;
    if (this.logScale !== null) return this.logScale;
    let lo = Infinity;
    let hi = -Infinity;
    for (const s of this._visibleSeries()) {
      const d = s.data;
      for (let i = 0; i < d.n; i++) {
        const m = d.mean[i];
        if (Number.isNaN(m)) continue;
        if (m <= 0) return false;
        if (m < lo) lo = m;
        if (m > hi) hi = m;
      }
    }
    return Number.isFinite(lo) && hi / lo > 200;
  }

  /** Bin every visible series into `cols` columns over steps [a, b]. */
  _bin(a, b, cols) {
    const ax = this.axis;
    const X0 = ax.map(a);
    const X1 = ax.map(b);
    const span = X1 - X0 || 1;
    const out = [];
    for (const s of this._visibleSeries()) {
      const d = s.data;
      const sum = new Float64Array(cols);
      const cnt = new Float64Array(cols);
      const steps = new Float64Array(cols);
      const lo = new Float64Array(cols).fill(NaN);
      const hi = new Float64Array(cols).fill(NaN);
      const rmin = new Float64Array(cols).fill(NaN);
      const rmax = new Float64Array(cols).fill(NaN);
      const first = new Float64Array(cols).fill(NaN);
      const last = new Float64Array(cols).fill(NaN);
      const bad = new Uint8Array(cols);
      const has = new Uint8Array(cols);
      const identity = ax.kind === "step" || ax.kind === "epoch";
      for (let i = d.lowerBound(a); i < d.n; i++) {
        const s0 = d.s0[i];
        if (s0 > b) break;
        const mid = (s0 + d.s1[i]) / 2;
        const X = identity ? mid : ax.map(mid);
        let c = Math.floor(((X - X0) / span) * cols);
        if (c < 0) c = 0;
        else if (c >= cols) c = cols - 1;
        has[c] = 1;
        const k = d.cnt[i];
        const m = d.mean[i];
        if (!Number.isNaN(m)) {
          sum[c] += m * k;
          cnt[c] += k;
        }
        steps[c] += k;
        if (d.bad[i]) bad[c] = 1;
        if (Number.isNaN(first[c])) first[c] = s0;
        last[c] = d.s1[i];
        lo[c] = nanMin(lo[c], d.lo[i]);
        hi[c] = nanMax(hi[c], d.hi[i]);
        rmin[c] = nanMin(rmin[c], d.rmin[i]);
        rmax[c] = nanMax(rmax[c], d.rmax[i]);
      }
      const mean = new Float64Array(cols).fill(NaN);
      for (let c = 0; c < cols; c++) if (cnt[c] > 0) mean[c] = sum[c] / cnt[c];
      out.push({ s, mean, lo, hi, rmin, rmax, first, last, bad, has, steps });
    }
    return out;
  }

  _draw() {
    this.draws++;
    // the size the ResizeObserver saw (reading layout here would force it every draw)
    const rect = this._size && this._size.w > 0 ? { width: this._size.w, height: this._size.h }
      : this.body.getBoundingClientRect();
    const w = Math.max(60, Math.floor(rect.width));
    const h = Math.max(60, Math.floor(rect.height));
    this._w = w;
    const dpr = window.devicePixelRatio || 1;
    const cv = this.canvas;
    if (cv.width !== Math.round(w * dpr) || cv.height !== Math.round(h * dpr)) {
      cv.width = Math.round(w * dpr);
      cv.height = Math.round(h * dpr);
      cv.style.width = `${w}px`;
      cv.style.height = `${h}px`;
    }
    const ctx = cv.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    const theme = this._theme || (this._theme = chartTheme(this.card));
    ctx.fillStyle = theme.bg;
    ctx.fillRect(0, 0, w, h);
    const ext = this._extent();
    this.empty.hidden = ext !== null;
    this._geom = null;
    this.last = null;
    if (ext === null) return;

    let [a, b] = this.view || ext;
    if (b <= a) {
      a -= 1;
      b += 1;
    }
    const ax = this.axis;
    let X0 = ax.map(a);
    let X1 = ax.map(b);
    if (!(X1 > X0)) {
      X0 -= 1;
      X1 += 1;
    }
    ctx.font = theme.font;
    // first pass at a provisional width to learn the y labels' width, then the real one
    const T = 8;
    const B = 22;
    const R = 10;
    const ph = Math.max(10, h - T - B);
    const logScale = this._effectiveLog();
    if (this.logBtn) this.logBtn.setAttribute("aria-pressed", String(logScale));
    const yd = this._yDomain(a, b, logScale);
    const yt = this._yTicks(yd, logScale, ph);
    const yLabels = yt.ticks.map((t) => this.opts.yFormat(t));
    const labelW = Math.max(0, ...yLabels.map((s) => ctx.measureText(s).width));
    const L = Math.ceil(labelW) + 12;
    const pw = Math.max(10, w - L - R);
    const cols = Math.max(10, Math.round(pw * dpr));
    const bins = this._bin(a, b, cols);

    const ylo = logScale ? Math.log10(yt.lo) : yt.lo;
    const yhi = logScale ? Math.log10(yt.hi) : yt.hi;
    const sy = (v) => T + ph - (((logScale ? Math.log10(v) : v) - ylo) / (yhi - ylo || 1)) * ph;
    const okY = logScale ? (v) => v > 0 : (v) => !Number.isNaN(v);
    const cx = (c) => L + (c + 0.5) / dpr;
    this._geom = { L, T, pw, ph, a, b, X0, X1, cols, dpr, sy };

    drawYGrid(ctx, theme, yt.ticks, yLabels, sy, L, T, pw, ph);
    this._xTicks(ctx, theme, L, T, pw, ph, X0, X1, w);

    ctx.save();
    ctx.beginPath();
    ctx.rect(L, T - 1, pw, ph + 2);
    ctx.clip();
    for (const bin of bins) {
      const color = bin.s.color;
      // rank spread band
      if (this.opts.band) {
        ctx.fillStyle = color;
        ctx.globalAlpha = 0.13;
        ctx.beginPath();
        const top = [];
        for (let c = 0; c < cols; c++) {
          if (bin.has[c] && okY(bin.rmax[c]) && okY(bin.rmin[c])) top.push(c);
        }
        if (top.length) {
          top.forEach((c, i) => (i ? ctx.lineTo(cx(c), sy(bin.rmax[c])) : ctx.moveTo(cx(c), sy(bin.rmax[c]))));
          for (let i = top.length - 1; i >= 0; i--) ctx.lineTo(cx(top[i]), sy(bin.rmin[top[i]]));
          ctx.closePath();
          ctx.fill();
        }
      }
      // lo..hi envelope where a column holds several steps
      ctx.globalAlpha = 0.55;
      ctx.strokeStyle = color;
      ctx.lineWidth = Math.max(1 / dpr, 1);
      ctx.beginPath();
      for (let c = 0; c < cols; c++) {
        if (!bin.has[c] || bin.steps[c] < 2) continue;
        const lo = bin.lo[c];
        const hi = bin.hi[c];
        if (!okY(lo) || !okY(hi)) continue;
        const x = cx(c);
        const y0 = sy(lo);
        let y1 = sy(hi);
        if (y0 - y1 < 1) y1 = y0 - 1;
        ctx.moveTo(x, y0);
        ctx.lineTo(x, y1);
      }
      ctx.stroke();
      // mean line (smoothed when asked; the raw line stays faint under it)
      const idx = [];
      const vals = [];
      for (let c = 0; c < cols; c++) {
        if (bin.has[c] && okY(bin.mean[c])) {
          idx.push(c);
          vals.push(bin.mean[c]);
        }
      }
      const sm = this.smooth > 0 ? ema(vals, this.smooth) : vals;
      if (this.smooth > 0) this._path(ctx, idx, vals, cx, sy, color, 1, 0.3);
      this._path(ctx, idx, sm, cx, sy, color, 1.6, 1);
      if (idx.length <= Math.max(2, pw / 12)) {
        ctx.fillStyle = color;
        ctx.globalAlpha = 1;
        idx.forEach((c, i) => {
          ctx.beginPath();
          ctx.arc(cx(c), sy(sm[i]), 2.2, 0, Math.PI * 2);
          ctx.fill();
        });
      }
      bin.smoothed = sm;
      bin.idx = idx;
      // non-finite means: a red tick at the top
      ctx.globalAlpha = 1;
      ctx.fillStyle = "#f2495c";
      for (let c = 0; c < cols; c++) {
        if (bin.bad[c]) ctx.fillRect(cx(c) - 1.5, T, 3, 6);
      }
    }
    ctx.restore();
    ctx.globalAlpha = 1;

    if (this.hover !== null && this.hover >= 0 && this.hover < cols) {
      const px = Math.round(cx(this.hover)) + 0.5;
      ctx.strokeStyle = theme.cross;
      ctx.setLineDash([4, 3]);
      ctx.beginPath();
      ctx.moveTo(px, T);
      ctx.lineTo(px, T + ph);
      ctx.stroke();
      ctx.setLineDash([]);
    }
    if (this.drag) {
      const lo = Math.max(L, Math.min(this.drag.x0px, this.drag.x1px));
      const hi = Math.min(L + pw, Math.max(this.drag.x0px, this.drag.x1px));
      ctx.fillStyle = theme.sel;
      ctx.fillRect(lo, T, hi - lo, ph);
    }
    this.last = { bins, yt, logScale };
    this.drawnAt = performance.now();
    if (this.opts.onDraw) this.opts.onDraw(this);
  }

  _path(ctx, idx, vals, cx, sy, color, width, alpha) {
    ctx.strokeStyle = color;
    ctx.lineWidth = width;
    ctx.globalAlpha = alpha;
    ctx.lineJoin = "round";
    ctx.lineCap = "round";
    ctx.beginPath();
    let pen = false;
    for (let i = 0; i < idx.length; i++) {
      const v = vals[i];
      if (v === null || Number.isNaN(v)) {
        pen = false;
        continue;
      }
      const x = cx(idx[i]);
      const y = sy(v);
      if (pen) ctx.lineTo(x, y);
      else ctx.moveTo(x, y);
      pen = true;
    }
    ctx.stroke();
    ctx.globalAlpha = 1;
  }

  /** y range of everything drawn over steps [a, b] (means, lo..hi, and the band). */
  _yDomain(a, b, logScale) {
    let lo = Infinity;
    let hi = -Infinity;
    const band = this.opts.band;
    for (const s of this._visibleSeries()) {
      const d = s.data;
      for (let i = d.lowerBound(a); i < d.n && d.s0[i] <= b; i++) {
        const vs = band ? [d.mean[i], d.lo[i], d.hi[i], d.rmin[i], d.rmax[i]] : [d.mean[i], d.lo[i], d.hi[i]];
        for (const v of vs) {
          if (Number.isNaN(v) || (logScale && v <= 0)) continue;
          if (v < lo) lo = v;
          if (v > hi) hi = v;
        }
      }
    }
    if (!Number.isFinite(lo)) return logScale ? [1, 10] : [0, 1];
    if (this.opts.yMin !== undefined && !logScale) lo = Math.min(lo, this.opts.yMin);
    return [lo, hi];
  }

  _yTicks([lo, hi], logScale, ph) {
    if (logScale) {
      const yt = logTicks(lo, hi);
      if (yt.ticks.length > Math.max(3, ph / 18)) {
        yt.ticks = yt.ticks.filter((t) => Math.abs(Math.log10(t) - Math.round(Math.log10(t))) < 1e-9);
      }
      return yt;
    }
    return niceTicks(lo, hi, Math.max(3, Math.min(6, Math.floor(ph / 40))));
  }

  _xFmt(X, step) {
    const k = this.axis.kind;
    if (k === "time") return formatClock(X, step === undefined || step < 60);
    if (k === "elapsed") return fmtElapsed(X);
    return formatNumber(X);
  }

  _xTicks(ctx, theme, L, T, pw, ph, X0, X1, w) {
    const count = Math.max(2, Math.floor(pw / 90));
    const k = this.axis.kind;
    let ticks;
    let step;
    if (k === "time") ({ ticks, step } = timeTicks(X0, X1, count));
    else if (k === "elapsed") ({ ticks, step } = elapsedTicks(X0, X1, count));
    else ({ ticks, step } = niceTicks(X0, X1, count, true));
    const sx = (X) => L + ((X - X0) / (X1 - X0)) * pw;
    ctx.strokeStyle = theme.grid;
    ctx.fillStyle = theme.axis;
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    let lastRight = -Infinity;
    for (const t of ticks) {
      if (t < X0 || t > X1) continue;
      const px = Math.round(sx(t)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(px, T);
      ctx.lineTo(px, T + ph);
      ctx.stroke();
      const label = this._xFmt(t, step);
      const lw = ctx.measureText(label).width;
      if (px - lw / 2 > lastRight + 6 && px + lw / 2 <= w) {
        ctx.fillText(label, px, T + ph + 6);
        lastRight = px + lw / 2;
      }
    }
    const label = this.opts.xLabel || this.axis.label;
    if (label) {
      ctx.textAlign = "right";
      ctx.textBaseline = "bottom";
      ctx.globalAlpha = 0.7;
      ctx.fillText(label, L + pw, T + ph - 2);
      ctx.globalAlpha = 1;
    }
  }

  // ------------------------------------------------------------------ pointer

  _col(px) {
    const g = this._geom;
    if (!g) return null;
    return Math.floor((px - g.L) * g.dpr);
  }

  /** The nearest column with data within ~12 css px of device column `c`. */
  _nearest(c) {
    if (!this.last || c === null) return null;
    const g = this._geom;
    const reach = Math.round(12 * g.dpr);
    for (let d = 0; d <= reach; d++) {
      for (const cc of d ? [c - d, c + d] : [c]) {
        if (cc < 0 || cc >= g.cols) continue;
        if (this.last.bins.some((bin) => bin.has[cc])) return cc;
      }
    }
    return null;
  }

  _bindPointer() {
    const cv = this.canvas;
    const local = (e) => {
      const r = cv.getBoundingClientRect();
      return { px: e.clientX - r.left, py: e.clientY - r.top };
    };
    cv.addEventListener("pointermove", (e) => {
      const { px, py } = local(e);
      if (this.drag) this.drag.x1px = px;
      const c = this._nearest(this._col(px));
      if (c !== this.hover || this.drag) {
        this.hover = c;
        this.render();
      }
      this._tipAt(c, px, py);
    });
    cv.addEventListener("pointerleave", () => {
      this.hover = null;
      this.tip.hidden = true;
      this.render();
    });
    cv.addEventListener("pointerdown", (e) => {
      if (e.button !== 0 || !this._geom) return;
      const { px } = local(e);
      const g = this._geom;
      if (px < g.L || px > g.L + g.pw) return;
      this.drag = { x0px: px, x1px: px };
      cv.setPointerCapture(e.pointerId);
    });
    const end = (e) => {
      if (!this.drag) return;
      const g = this._geom;
      const d = this.drag;
      this.drag = null;
      if (cv.hasPointerCapture(e.pointerId)) cv.releasePointerCapture(e.pointerId);
      if (g && Math.abs(d.x1px - d.x0px) > 6) {
        const toX = (p) => g.X0 + ((Math.min(g.L + g.pw, Math.max(g.L, p)) - g.L) / g.pw) * (g.X1 - g.X0);
        const s0 = Math.max(0, Math.floor(this.axis.inv(toX(Math.min(d.x0px, d.x1px)))));
        const s1 = Math.ceil(this.axis.inv(toX(Math.max(d.x0px, d.x1px))));
        if (s1 > s0) this._zoom([s0, s1]);
      }
      this.render();
    };
    cv.addEventListener("pointerup", end);
    cv.addEventListener("pointercancel", end);
    cv.addEventListener("dblclick", () => this._zoom(null));
  }

  _tipAt(c, px, py) {
    if (c === null || !this.last || this.drag) {
      this.tip.hidden = true;
      return;
    }
    const fmt = this.opts.yFormat;
    const rows = [];
    let head = null;
    for (const bin of this.last.bins) {
      if (!bin.has[c]) continue;
      const first = bin.first[c];
      const last = bin.last[c];
      if (head === null) {
        const label = this.axis.kind === "epoch" ? "epoch" : "step";
        head = first === last
          ? `${label} ${formatStep(first)}`
          : `${label}s ${formatStep(first)}–${formatStep(last)} (${formatStep(bin.steps[c])})`;
        if (this.axis.kind === "time" || this.axis.kind === "elapsed") {
          head += ` · ${this._xFmt(this.axis.map((first + last) / 2))}`;
        }
        rows.push(el("div", "tip-x", head));
      }
      const row = el("div", "tip-row");
      const sw = el("span", "swatch");
      sw.style.background = bin.s.color;
      row.append(sw, el("span", "tip-name", bin.s.name), el("span", "tip-val", bin.bad[c] && Number.isNaN(bin.mean[c]) ? "non-finite" : fmt(bin.mean[c])));
      rows.push(row);
      const sub = [];
      if (bin.steps[c] > 1 && !Number.isNaN(bin.lo[c])) sub.push(`means ${fmt(bin.lo[c])} … ${fmt(bin.hi[c])}`);
      if (this.opts.band && !Number.isNaN(bin.rmin[c])) sub.push(`ranks ${fmt(bin.rmin[c])} … ${fmt(bin.rmax[c])}`);
      if (bin.bad[c]) sub.push("non-finite mean in range");
      for (const s of sub) rows.push(el("div", "tip-sub", s));
    }
    if (this.opts.slowest && this.last.bins.length) {
      const bin = this.last.bins.find((bb) => bb.has[c]);
      if (bin) {
        const s = this.opts.slowest(bin.first[c], bin.last[c]);
        if (s) rows.push(el("div", "tip-sub", s));
      }
    }
    this.tip.replaceChildren(...rows);
    this.tip.hidden = rows.length === 0;
    const bw = this.body.clientWidth;
    const tw = this.tip.offsetWidth;
    let left = px + 14;
    if (left + tw > bw - 4) left = px - tw - 14;
    this.tip.style.left = `${Math.max(4, left)}px`;
    this.tip.style.top = `${Math.max(4, Math.min(py - 10, this.body.clientHeight - this.tip.offsetHeight - 4))}px`;
  }

  /**
   * What the last draw showed, for tests and benchmarks: the step range, and per series
   * the drawn columns (only those with data) as [first, last, mean, lo, hi, rank_min,
   * rank_max, steps] plus the canvas y of each column's hi.
   */
  snapshot() {
    if (!this.last) return null;
    const g = this._geom;
    return {
      range: [g.a, g.b], columns: g.cols, axis: this.axis.kind, view: this.view,
      plot: { left: g.L, top: g.T, width: g.pw, height: g.ph, dpr: g.dpr },
      series: this.last.bins.map((bin) => {
        const cols = [];
        for (let c = 0; c < bin.has.length; c++) {
          if (!bin.has[c]) continue;
          const n = (v) => (Number.isNaN(v) ? null : v);
          cols.push([bin.first[c], bin.last[c], n(bin.mean[c]), n(bin.lo[c]), n(bin.hi[c]),
            n(bin.rmin[c]), n(bin.rmax[c]), bin.steps[c], c,
            Number.isNaN(bin.hi[c]) ? null : g.sy(bin.hi[c])]);
        }
        return { name: bin.s.name, columns: cols };
      }),
    };
  }

  destroy() {
    this._ro.disconnect();
    this._io.disconnect();
    cancelFrame(this);
    this.card.remove();
  }
}

const INT = new Intl.NumberFormat("en-US");
export function formatStep(v) {
  return isNum(v) ? INT.format(v) : "—";
}
