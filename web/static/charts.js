// rankboard charts: one small, dependency-free canvas line chart.
//
// Why our own: the page must work air-gapped under a strict CSP (no CDN, no eval, no
// inline styles), and a training dashboard needs only a few things done well: several
// series with null gaps, readable "nice" ticks, a hover crosshair, legend solo, log
// scale, EMA smoothing, drag-to-zoom on x and a crisp high-DPI canvas.
//
// Every piece of text that may come from a training job (series names, values) goes
// into the DOM through textContent, never innerHTML.

import { cancelFrame, onFrame } from "./frame.js";

const PALETTE = [
  "#5794f2", "#73bf69", "#f2cc0c", "#ff9830", "#f2495c",
  "#b877d9", "#8ab8ff", "#fade2a", "#37872d", "#c4162a",
  "#56a64b", "#e0b400", "#1f60c4", "#8f3bb8", "#fa6400",
];

/** The colour of series `i` (stable across charts so "loss" always looks the same). */
export function colorAt(i) {
  return PALETTE[((i % PALETTE.length) + PALETTE.length) % PALETTE.length];
}

/** A finite number or null: the chart's notion of "a value". */
function num(v) {
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

/** Heckbert's "nice number": 1, 2, 5 or 10 times a power of ten near `x`. */
function niceNum(x, round) {
  const exp = Math.floor(Math.log10(x));
  const f = x / 10 ** exp;
  let nf;
  if (round) nf = f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10;
  else nf = f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10;
  return nf * 10 ** exp;
}

/** About `count` nice linear ticks covering [lo, hi]; returns {lo, hi, step, ticks}. */
export function niceTicks(lo, hi, count, integer = false) {
  if (!(hi > lo)) {
    const pad = Math.abs(lo) > 0 ? Math.abs(lo) * 0.1 : 1;
    lo -= pad;
    hi += pad;
  }
  const range = niceNum(hi - lo, false);
  let step = niceNum(range / Math.max(1, count - 1), true);
  if (integer) step = Math.max(1, Math.round(step));
  const nlo = Math.floor(lo / step + 1e-9) * step;
  const nhi = Math.ceil(hi / step - 1e-9) * step;
  const ticks = [];
  for (let v = nlo, i = 0; v <= nhi + step * 1e-6 && i < 200; v = nlo + ++i * step) {
    ticks.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  }
  return { lo: nlo, hi: nhi, step, ticks };
}

/** Ticks for a log10 axis over [lo, hi] (both > 0). */
export function logTicks(lo, hi) {
  const a = Math.floor(Math.log10(lo));
  const b = Math.ceil(Math.log10(hi));
  const ticks = [];
  const decades = b - a;
  const mult = decades <= 2 ? [1, 2, 5] : [1];
  const every = decades > 8 ? Math.ceil(decades / 8) : 1;
  for (let e = a; e <= b; e++) {
    if ((e - a) % every) continue;
    for (const m of mult) ticks.push(m * 10 ** e);
  }
  return { lo: 10 ** a, hi: 10 ** b, ticks };
}

const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200,
  10800, 21600, 43200, 86400];

/** Ticks for a unix-seconds axis: steps of whole seconds, minutes, hours. */
export function timeTicks(lo, hi, count) {
  const want = (hi - lo) / Math.max(1, count);
  let step = TIME_STEPS.find((s) => s >= want) || Math.ceil(want / 86400) * 86400;
  const tz = new Date(lo * 1000).getTimezoneOffset() * 60;
  const first = Math.ceil((lo - tz) / step) * step + tz;
  const ticks = [];
  for (let v = first; v <= hi && ticks.length < 200; v += step) ticks.push(v);
  return { lo, hi, step, ticks };
}

const pad2 = (n) => String(n).padStart(2, "0");

/** "HH:MM" or "HH:MM:SS" for a unix time in seconds (local time). */
export function formatClock(t, seconds = true) {
  const d = new Date(t * 1000);
  const hm = `${pad2(d.getHours())}:${pad2(d.getMinutes())}`;
  return seconds ? `${hm}:${pad2(d.getSeconds())}` : hm;
}

/** A compact number: 3 significant digits, k/M/G suffixes, exponent when tiny. */
export function formatNumber(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "—";
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e9) return `${+(v / 1e9).toPrecision(3)}G`;
  if (a >= 1e6) return `${+(v / 1e6).toPrecision(3)}M`;
  if (a >= 1e4) return `${+(v / 1e3).toPrecision(3)}k`;
  if (a >= 1) return String(+v.toPrecision(4));
  if (a >= 1e-3) return String(+v.toPrecision(3));
  const [mant, exp] = v.toExponential(1).split("e");
  return `${+mant}e${exp}`;
}

/**
 * TensorBoard's debiased exponential moving average. Nulls stay gaps; the average runs
 * over the values around them, so smoothing never invents points.
 */
export function ema(values, weight) {
  if (!(weight > 0)) return values.slice();
  const out = new Array(values.length);
  let last = 0;
  let n = 0;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v === null) {
      out[i] = null;
      continue;
    }
    last = last * weight + (1 - weight) * v;
    n++;
    out[i] = last / (1 - weight ** n);
  }
  return out;
}

export function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

/** Read a CSS custom property of `node`, with a fallback. */
export function cssVar(node, name, fallback) {
  const v = getComputedStyle(node).getPropertyValue(name).trim();
  return v || fallback;
}

/**
 * A line chart in a card.
 *
 * ```js
 * const c = new LineChart(host, {title: "Loss", chartId: "metrics", log: true, smoothing: true});
 * c.setData([0, 1, 2], [{name: "loss", values: [1.2, 0.9, null]}]);
 * ```
 * Options: title, chartId (data-chart attribute), xType ("linear" | "time"), xInteger,
 * xLabel, yFormat(v) -> string, yMin/yMax (fixed bounds; data may widen them), log (show
 * the log-scale toggle), smoothing (show the EMA slider), height (CSS px), filename.
 */
/**
 * The controls every chart's header carries: EMA smoothing (``o.smoothing``), a log y axis
 * (``o.log``) and a reset-zoom button (hidden until a zoom), wired to the chart's callbacks.
 * Returns the tools container (smoothing and log appended; the caller appends the reset
 * button where it wants it) and the elements the chart keeps.
 */
export function chartControls(o, { onSmooth, onLog, onReset, smoothTitle = "EMA smoothing" }) {
  const tools = el("div", "chart-tools");
  let smoothInput = null;
  let logBtn = null;
  if (o.smoothing) {
    const lab = el("label", "chart-smooth");
    lab.title = smoothTitle;
    lab.append(el("span", "tool-label", "smooth"));
    const range = el("input");
    range.type = "range";
    range.min = "0";
    range.max = "0.99";
    range.step = "0.01";
    range.value = "0";
    range.setAttribute("aria-label", "smoothing");
    const val = el("span", "tool-value", "0.00");
    range.addEventListener("input", () => {
      const weight = Number(range.value);
      val.textContent = weight.toFixed(2);
      onSmooth(weight);
    });
    lab.append(range, val);
    tools.append(lab);
    smoothInput = range;
  }
  if (o.log) {
    const b = el("button", "tool-btn", "log");
    b.type = "button";
    b.title = "logarithmic y axis";
    b.setAttribute("aria-pressed", "false");
    b.dataset.action = "log";
    b.addEventListener("click", onLog);
    tools.append(b);
    logBtn = b;
  }
  const resetBtn = el("button", "tool-btn", "reset zoom");
  resetBtn.type = "button";
  resetBtn.hidden = true;
  resetBtn.dataset.action = "reset-zoom";
  resetBtn.addEventListener("click", onReset);
  return { tools, smoothInput, logBtn, resetBtn };
}

/** A chart's colours and font, read once from its card's CSS variables. */
export function chartTheme(card) {
  return {
    bg: cssVar(card, "--chart-bg", "#141821"),
    grid: cssVar(card, "--chart-grid", "rgba(255,255,255,0.07)"),
    axis: cssVar(card, "--chart-axis", "#8b95a7"),
    cross: cssVar(card, "--chart-cross", "rgba(255,255,255,0.35)"),
    sel: cssVar(card, "--chart-select", "rgba(87,148,242,0.18)"),
    font: cssVar(card, "--chart-font", "11px system-ui, sans-serif"),
  };
}

/** Horizontal grid lines and their labels at the y ticks inside the plot area. */
export function drawYGrid(ctx, theme, ticks, labels, sy, L, T, pw, ph) {
  ctx.strokeStyle = theme.grid;
  ctx.lineWidth = 1;
  ctx.fillStyle = theme.axis;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  ticks.forEach((t, k) => {
    const py = Math.round(sy(t)) + 0.5;
    if (py < T - 1 || py > T + ph + 1) return;
    ctx.beginPath();
    ctx.moveTo(L, py);
    ctx.lineTo(L + pw, py);
    ctx.stroke();
    ctx.fillText(labels[k], L - 6, py);
  });
}

/**
 * A chart's legend: one button per series (``chart.series``: ``{name, color}``) in
 * ``chart.legendEl``; a click shows only that series (``chart.solo``), a second click all.
 */
export function buildLegend(chart) {
  chart.legendEl.replaceChildren();
  for (const s of chart.series) {
    const b = el("button", "legend-item");
    b.type = "button";
    b.dataset.series = s.name;
    b.title = "click to show only this series; click again to show all";
    const sw = el("span", "swatch");
    sw.style.background = s.color;
    b.append(sw, el("span", "legend-name", s.name));
    b.addEventListener("click", () => {
      chart.solo = chart.solo === s.name ? null : s.name;
      syncLegend(chart);
      chart.render();
    });
    chart.legendEl.append(b);
  }
  syncLegend(chart);
}

/** Mark the legend's buttons after ``chart.solo`` changed. */
export function syncLegend(chart) {
  for (const b of chart.legendEl.children) {
    b.classList.toggle("off", chart.solo !== null && b.dataset.series !== chart.solo);
    b.setAttribute("aria-pressed", String(chart.solo === b.dataset.series));
  }
}

export class LineChart {
  constructor(host, opts = {}) {
    this.opts = { xType: "linear", xInteger: false, yFormat: formatNumber, height: 240, ...opts };
    this.x = [];
    this.series = [];
    this.solo = null; // name of the soloed series, or null
    this.logScale = null; // null: automatic (log when positive data spans decades)
    this.smooth = 0;
    this.zoom = null; // [x0, x1] or null
    this.hoverIdx = null;
    this.drag = null; // {x0px, x1px}
    this._build(host);
  }

  _build(host) {
    const o = this.opts;
    const card = el("div", "chart");
    if (o.chartId) card.dataset.chartCard = o.chartId;
    const head = el("div", "chart-head");
    this.titleEl = el("h3", "chart-title", o.title || "");
    head.append(this.titleEl);
    const { tools, smoothInput, logBtn, resetBtn: reset } = chartControls(o, {
      onSmooth: (weight) => { this.smooth = weight; this.render(); },
      onLog: () => { this.logScale = !this._effectiveLog(); this.render(); },
      onReset: () => this.resetZoom(),
    });
    if (smoothInput) this.smoothInput = smoothInput;
    if (logBtn) this.logBtn = logBtn;
    this.resetBtn = reset;
    const png = el("button", "tool-btn", "PNG");
    png.type = "button";
    png.title = "download this chart as PNG";
    png.dataset.action = "png";
    png.addEventListener("click", () => this.downloadPng());
    tools.append(reset, png);
    head.append(tools);

    this.legendEl = el("div", "chart-legend");
    const body = el("div", "chart-body");
    body.style.height = `${o.height}px`;
    this.canvas = el("canvas");
    if (o.chartId) this.canvas.dataset.chart = o.chartId;
    this.canvas.setAttribute("role", "img");
    this.canvas.setAttribute("aria-label", o.title || "chart");
    this.tip = el("div", "chart-tip");
    this.tip.hidden = true;
    this.empty = el("div", "chart-empty", o.emptyText || "waiting for data…");
    body.append(this.canvas, this.tip, this.empty);
    this.body = body;
    card.append(head, this.legendEl, body);
    host.append(card);
    this.card = card;

    this._bindPointer();
    this._ro = new ResizeObserver((entries) => {
      const r = entries[entries.length - 1].contentRect;
      this._size = { w: Math.floor(r.width), h: Math.floor(r.height) };
      this.render();
    });
    this._ro.observe(body);
  }

  /** Replace the data. `x` ascending numbers; each series {name, values, color?}. */
  setData(x, series) {
    this.x = x.slice();
    const known = new Set(this.series.map((s) => s.name));
    const changed = series.length !== this.series.length || series.some((s) => !known.has(s.name));
    this.series = series.map((s, i) => ({
      name: s.name,
      color: s.color || colorAt(i),
      values: s.values.map(num),
      unit: s.unit,
    }));
    if (this.solo !== null && !this.series.some((s) => s.name === this.solo)) this.solo = null;
    if (changed) this._buildLegend();
    this.render();
  }

  /** Change the card title (e.g. when a rank panel switches ranks). */
  setTitle(title) {
    this.opts.title = title;
    this.titleEl.textContent = title;
    this.canvas.setAttribute("aria-label", title);
  }

  resetZoom() {
    this.zoom = null;
    this.resetBtn.hidden = true;
    this.render();
  }

  _buildLegend() {
    buildLegend(this);
  }

  _syncLegend() {
    syncLegend(this);
  }

  _visible() {
    return this.series.filter((s) => this.solo === null || s.name === this.solo);
  }

  /** Coalesce redraws into one animation frame (shared with the rest of the page). */
  render() {
    onFrame(this, () => this._draw());
  }

  _xFormat(v) {
    if (this.opts.xType === "time") return formatClock(v, true);
    return formatNumber(v);
  }

  _layout() {
    if (this._size && this._size.w > 0) {
      return { w: Math.max(50, this._size.w), h: Math.max(50, this._size.h) };
    }
    const rect = this.body.getBoundingClientRect();
    const w = Math.max(50, Math.floor(rect.width));
    const h = Math.max(50, Math.floor(rect.height));
    return { w, h };
  }

  _draw() {
    const { w, h } = this._layout();
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

    const x = this.x;
    const vis = this._visible();
    const hasData = x.length > 0 && this.series.some((s) => s.values.some((v) => v !== null));
    this.empty.hidden = hasData;
    this._geom = null;
    if (!hasData) return;

    // x domain
    let x0 = this.zoom ? this.zoom[0] : x[0];
    let x1 = this.zoom ? this.zoom[1] : x[x.length - 1];
    if (x1 <= x0) {
      const pad = this.opts.xType === "time" ? 30 : 1;
      x0 -= pad;
      x1 += pad;
    }
    // indices in view
    let i0 = 0;
    while (i0 < x.length && x[i0] < x0) i0++;
    let i1 = x.length - 1;
    while (i1 >= 0 && x[i1] > x1) i1--;

    // displayed values (smoothed) and raw values
    const logScale = this._effectiveLog();
    if (this.logBtn) {
      this.logBtn.setAttribute("aria-pressed", String(logScale));
      this.logBtn.title = this.logScale === null
        ? `logarithmic y axis (automatic: ${logScale ? "on" : "off"})`
        : "logarithmic y axis";
    }
    const draws = vis.map((s) => {
      const raw = logScale ? s.values.map((v) => (v !== null && v > 0 ? v : null)) : s.values;
      const sm = this.smooth > 0 ? ema(raw, this.smooth) : raw;
      return { s, raw, sm };
    });

    // y domain over what is in view (raw too, so the faint raw line fits)
    let lo = Infinity;
    let hi = -Infinity;
    for (const d of draws) {
      for (let i = i0; i <= i1; i++) {
        for (const v of [d.raw[i], d.sm[i]]) {
          if (v === null) continue;
          if (v < lo) lo = v;
          if (v > hi) hi = v;
        }
      }
    }
    if (!logScale) {
      if (this.opts.yMin !== undefined) lo = Math.min(lo, this.opts.yMin);
      if (this.opts.yMax !== undefined) hi = Math.max(hi, this.opts.yMax);
    }
    if (!Number.isFinite(lo)) {
      lo = logScale ? 1 : 0;
      hi = logScale ? 10 : 1;
    }

    ctx.font = theme.font;
    const plotH0 = h - 8 - 22;
    let yt;
    if (logScale) {
      yt = logTicks(lo, hi);
      if (yt.ticks.length > Math.max(3, plotH0 / 18)) {
        yt.ticks = yt.ticks.filter((t) => Math.abs(Math.log10(t) - Math.round(Math.log10(t))) < 1e-9);
      }
    } else {
      yt = niceTicks(lo, hi, Math.max(3, Math.min(7, Math.floor(plotH0 / 40))));
      if (this.opts.yMin !== undefined && lo >= this.opts.yMin) {
        yt.lo = Math.max(yt.lo, this.opts.yMin);
        yt.ticks = yt.ticks.filter((t) => t >= yt.lo);
      }
      if (this.opts.yMax !== undefined && hi <= this.opts.yMax) {
        yt.hi = Math.min(yt.hi, this.opts.yMax);
        yt.ticks = yt.ticks.filter((t) => t <= yt.hi);
      }
    }
    const yLabels = yt.ticks.map((t) => this.opts.yFormat(t));
    const labelW = Math.max(0, ...yLabels.map((s) => ctx.measureText(s).width));
    const L = Math.ceil(labelW) + 12;
    const R = 12;
    const T = 8;
    const B = 22;
    const pw = Math.max(10, w - L - R);
    const ph = Math.max(10, h - T - B);

    const ylo = logScale ? Math.log10(yt.lo) : yt.lo;
    const yhi = logScale ? Math.log10(yt.hi) : yt.hi;
    const sy = (v) => {
      const t = logScale ? Math.log10(v) : v;
      return T + ph - ((t - ylo) / (yhi - ylo || 1)) * ph;
    };
    const sx = (v) => L + ((v - x0) / (x1 - x0)) * pw;
    this._geom = { L, T, pw, ph, x0, x1, sx, sy };

    drawYGrid(ctx, theme, yt.ticks, yLabels, sy, L, T, pw, ph);
    // x ticks
    const xCount = Math.max(2, Math.floor(pw / 80));
    const xt = this.opts.xType === "time"
      ? timeTicks(x0, x1, xCount)
      : niceTicks(x0, x1, xCount, this.opts.xInteger);
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const span = x1 - x0;
    let lastRight = -Infinity;
    for (const t of xt.ticks) {
      if (t < x0 - span * 1e-9 || t > x1 + span * 1e-9) continue;
      const px = Math.round(sx(t)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(px, T);
      ctx.lineTo(px, T + ph);
      ctx.stroke();
      const label = this.opts.xType === "time"
        ? formatClock(t, xt.step < 60)
        : formatNumber(t);
      const lw = ctx.measureText(label).width;
      if (px - lw / 2 > lastRight + 6 && px + lw / 2 <= w) {
        ctx.fillText(label, px, T + ph + 6);
        lastRight = px + lw / 2;
      }
    }
    if (this.opts.xLabel) {
      ctx.textAlign = "right";
      ctx.textBaseline = "bottom";
      ctx.fillStyle = theme.axis;
      ctx.globalAlpha = 0.7;
      ctx.fillText(this.opts.xLabel, L + pw, T + ph - 2);
      ctx.globalAlpha = 1;
    }

    // series
    ctx.save();
    ctx.beginPath();
    ctx.rect(L, T - 1, pw, ph + 2);
    ctx.clip();
    const pointsInView = i1 - i0 + 1;
    const dots = pointsInView <= Math.max(2, pw / 14);
    for (const d of draws) {
      if (this.smooth > 0) this._line(ctx, x, d.raw, i0, i1, sx, sy, d.s.color, 1, 0.25, false);
      this._line(ctx, x, d.sm, i0, i1, sx, sy, d.s.color, 1.75, 1, dots);
    }
    ctx.restore();

    // crosshair
    if (this.hoverIdx !== null && this.hoverIdx >= i0 && this.hoverIdx <= i1) {
      const px = Math.round(sx(x[this.hoverIdx])) + 0.5;
      ctx.strokeStyle = theme.cross;
      ctx.setLineDash([4, 3]);
      ctx.beginPath();
      ctx.moveTo(px, T);
      ctx.lineTo(px, T + ph);
      ctx.stroke();
      ctx.setLineDash([]);
      for (const d of draws) {
        const v = d.sm[this.hoverIdx];
        if (v === null) continue;
        ctx.fillStyle = d.s.color;
        ctx.strokeStyle = theme.bg;
        ctx.lineWidth = 2;
        ctx.beginPath();
        ctx.arc(px, sy(v), 4, 0, Math.PI * 2);
        ctx.fill();
        ctx.stroke();
      }
    }
    // drag selection
    if (this.drag) {
      const a = Math.max(L, Math.min(this.drag.x0px, this.drag.x1px));
      const b = Math.min(L + pw, Math.max(this.drag.x0px, this.drag.x1px));
      ctx.fillStyle = theme.sel;
      ctx.fillRect(a, T, b - a, ph);
    }
    this._draws = draws;
  }

  _line(ctx, x, vals, i0, i1, sx, sy, color, width, alpha, dots) {
    ctx.strokeStyle = color;
    ctx.fillStyle = color;
    ctx.lineWidth = width;
    ctx.globalAlpha = alpha;
    ctx.lineJoin = "round";
    ctx.lineCap = "round";
    ctx.beginPath();
    let pen = false;
    const lo = Math.max(0, i0 - 1);
    const hi = Math.min(x.length - 1, i1 + 1);
    for (let i = lo; i <= hi; i++) {
      const v = vals[i];
      if (v === null) {
        pen = false;
        continue;
      }
      const px = sx(x[i]);
      const py = sy(v);
      if (pen) ctx.lineTo(px, py);
      else ctx.moveTo(px, py);
      pen = true;
    }
    ctx.stroke();
    // isolated points (gaps on both sides) and sparse data get a dot so they show
    for (let i = lo; i <= hi; i++) {
      const v = vals[i];
      if (v === null) continue;
      const alone = (i === 0 || vals[i - 1] === null) && (i === vals.length - 1 || vals[i + 1] === null);
      if (!alone && !dots) continue;
      ctx.beginPath();
      ctx.arc(sx(x[i]), sy(v), alone ? 2.5 : 2, 0, Math.PI * 2);
      ctx.fill();
    }
    ctx.globalAlpha = 1;
  }

  /**
   * The log toggle, or before the user touches it: log when every visible value is
   * positive and they span more than two decades (loss beside a learning rate).
   */
  _effectiveLog() {
    if (!this.opts.log) return false;
    if (this.logScale !== null) return this.logScale;
    let lo = Infinity;
    let hi = -Infinity;
    for (const s of this._visible()) {
      for (const v of s.values) {
        if (v === null) continue;
        if (v <= 0) return false;
        if (v < lo) lo = v;
        if (v > hi) hi = v;
      }
    }
    return Number.isFinite(lo) && hi / lo > 200;
  }

  _nearestIndex(px) {
    const g = this._geom;
    if (!g || !this.x.length) return null;
    const xv = g.x0 + ((px - g.L) / g.pw) * (g.x1 - g.x0);
    // binary search in ascending x
    let a = 0;
    let b = this.x.length - 1;
    while (b - a > 1) {
      const m = (a + b) >> 1;
      if (this.x[m] < xv) a = m;
      else b = m;
    }
    const best = Math.abs(this.x[a] - xv) <= Math.abs(this.x[b] - xv) ? a : b;
    if (this.x[best] < g.x0 || this.x[best] > g.x1) return null;
    return best;
  }

  _bindPointer() {
    const cv = this.canvas;
    const local = (e) => {
      const r = cv.getBoundingClientRect();
      return { px: e.clientX - r.left, py: e.clientY - r.top };
    };
    cv.addEventListener("pointermove", (e) => {
      const { px, py } = local(e);
      if (this.drag) {
        this.drag.x1px = px;
      }
      const idx = this._nearestIndex(px);
      if (idx !== this.hoverIdx || this.drag) {
        this.hoverIdx = idx;
        this.render();
      }
      this._showTip(idx, px, py);
    });
    cv.addEventListener("pointerleave", () => {
      this.hoverIdx = null;
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
        const toX = (p) => g.x0 + ((Math.min(g.L + g.pw, Math.max(g.L, p)) - g.L) / g.pw) * (g.x1 - g.x0);
        const a = toX(Math.min(d.x0px, d.x1px));
        const b = toX(Math.max(d.x0px, d.x1px));
        if (b > a) {
          this.zoom = [a, b];
          this.resetBtn.hidden = false;
        }
      }
      this.render();
    };
    cv.addEventListener("pointerup", end);
    cv.addEventListener("pointercancel", end);
    cv.addEventListener("dblclick", () => this.resetZoom());
  }

  _showTip(idx, px, py) {
    if (idx === null || !this._draws || this.drag) {
      this.tip.hidden = true;
      return;
    }
    const tip = this.tip;
    const rows = [el("div", "tip-x", `${this.opts.xLabel ? `${this.opts.xLabel} ` : ""}${this._xFormat(this.x[idx])}`)];
    for (const d of this._draws) {
      const row = el("div", "tip-row");
      const sw = el("span", "swatch");
      sw.style.background = d.s.color;
      const raw = d.s.values[idx];
      row.append(sw, el("span", "tip-name", d.s.name), el("span", "tip-val", this.opts.yFormat(raw)));
      rows.push(row);
    }
    tip.replaceChildren(...rows);
    tip.hidden = false;
    const bw = this.body.clientWidth;
    const tw = tip.offsetWidth;
    let left = px + 14;
    if (left + tw > bw - 4) left = px - tw - 14;
    tip.style.left = `${Math.max(4, left)}px`;
    tip.style.top = `${Math.max(4, Math.min(py - 10, this.body.clientHeight - tip.offsetHeight - 4))}px`;
  }

  /** Save the chart as PNG (title drawn in, so the file stands alone). */
  downloadPng() {
    const cv = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const head = Math.round(26 * dpr);
    const out = document.createElement("canvas");
    out.width = cv.width;
    out.height = cv.height + head;
    const ctx = out.getContext("2d");
    ctx.fillStyle = (this._theme && this._theme.bg) || "#141821";
    ctx.fillRect(0, 0, out.width, out.height);
    ctx.drawImage(cv, 0, head);
    ctx.scale(dpr, dpr);
    ctx.fillStyle = "#d8dee9";
    ctx.font = "600 13px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    const names = this._visible().map((s) => s.name).join(", ");
    ctx.fillText(`${this.opts.title || ""}${names ? `  —  ${names}` : ""}`, 10, 13);
    out.toBlob((blob) => {
      if (!blob) return;
      const url = URL.createObjectURL(blob);
      const a = document.createElement("a");
      a.href = url;
      a.download = `${this.opts.filename || this.opts.chartId || "chart"}.png`;
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    }, "image/png");
  }

  destroy() {
    this._ro.disconnect();
    cancelFrame(this);
    this.card.remove();
  }
}
