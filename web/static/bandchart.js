// rankboard step charts: series of step buckets (buckets.js) drawn per device pixel, on
// the chart kit.
//
// Drawing bins the buckets into one column per device pixel and draws, per column:
//   * a light band from the smallest rank value to the largest (rank_min..rank_max),
//   * where a column holds more than one step, a line from the smallest to the largest
//     per-step mean (lo..hi), so a one-step spike among a million is always visible,
//   * the mean line through the columns' means (log scale and EMA smoothing apply to it).
// Zoom is by drag on x; the owner (StepView) refetches the range at full resolution.
//
// Names from a training job reach the DOM only through textContent.

import { colorAt, elapsedTicks, ema, niceTicks, timeTicks, yTicks } from "./axes.js";
import { nanMax, nanMin } from "./buckets.js";
import { ChartKit, drawMarker, strokeWithGaps } from "./chartkit.js";
import { h } from "./dom.js";
import { fmtElapsed, fmtInt, formatClock, formatNumber } from "./fmt.js";

/** Identity x axis over steps. */
export const STEP_AXIS = { kind: "step", label: "step", map: (s) => s, inv: (x) => x };

/**
 * A chart of one or more bucket series.
 *
 * Options (beside the kit's): band (draw the rank spread; default true), onZoom([s0, s1] |
 * null) (drag/reset; without it the chart zooms itself), slowest(first, last) -> text |
 * null (hover), onDraw(chart), xLabel, yMin.
 */
/** A step chart turns to a log axis by itself when its largest value is this many times its
 * median (`_autoLog`). */
const OUTLIER_RATIO = 50;

export class BandChart extends ChartKit {
  constructor(host, opts = {}) {
    super(host, {
      yFormat: formatNumber, height: 220, band: true, cardClass: "band-chart", status: true,
      lazy: true, emptyText: "waiting for steps…", smoothTitle: "EMA smoothing of the mean line", ...opts,
    });
    this.axis = STEP_AXIS;
    this.view = null; // [s0, s1] in steps, or null (everything)
    this.draws = 0;
    this.last = null;
  }

  /** Columns available for data, in device pixels (what `points` should be). */
  plotColumns() {
    const w = (this._size && this._size.w) || Math.floor(this.body.getBoundingClientRect().width) || 600;
    const dpr = window.devicePixelRatio || 1;
    return Math.max(50, Math.min(10000, Math.round((w - 60) * dpr)));
  }

  /** `series`: [{name, color?, data: Buckets}]. */
  setSeries(series) {
    const names = series.map((s) => `${s.name}\u0001${s.label || ""}`).join("\u0000");
    // `faint` (8.1): an attempt's superseded records, drawn as a thin pale line beside the line
    this.series = series.map((s, i) => ({ name: s.name, label: s.label, color: s.color || colorAt(i), data: s.data, faint: !!s.faint }));
    if (this.solo !== null && !this.series.some((s) => s.name === this.solo)) this.solo = null;
    if (this.legendEl && names !== this._names) this._buildLegend();
    this._names = names;
    this.render();
  }

  /** (8.3) Steps to mark with a dashed line and a short text: [{step, text}]; (8.1) a
   * marker may have its `color` and a `hover` text the tooltip shows at its step. */
  setMarkers(markers) {
    const list = Array.isArray(markers) ? markers : [];
    const sig = list.map((m) => `${m.step}:${m.text}:${m.color || ""}:${m.hover || ""}`).join("\n");
    if (sig === this._markerSig) return;
    this._markerSig = sig;
    this.markers = list;
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

  _unzoom() {
    this._zoom(null);
  }

  _zoomPx(p0, p1, g) {
    const toX = (p) => g.X0 + ((p - g.L) / g.pw) * (g.X1 - g.X0);
    const s0 = Math.max(0, Math.floor(this.axis.inv(toX(p0))));
    const s1 = Math.ceil(this.axis.inv(toX(p1)));
    if (s1 > s0) this._zoom([s0, s1]);
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

  _positiveRange() {
    let lo = Infinity;
    let hi = -Infinity;
    for (const s of this._visibleSeries()) {
      const d = s.data;
      for (let i = 0; i < d.n; i++) {
        const m = d.mean[i];
        if (Number.isNaN(m)) continue;
        if (m <= 0) return null;
        if (m < lo) lo = m;
        if (m > hi) hi = m;
      }
    }
    return Number.isFinite(lo) ? [lo, hi] : null;
  }

  /**
   * ChartKit's rule (two decades between the smallest and the largest value), or a few steps
   * far above the rest: a stall or a checkpoint's step at 50x the median would flatten every
   * other step against the axis's floor (TensorBoard leaves such outliers out of its
   * scaling; a log axis keeps them in view and the rest readable).
   */
  _autoLog(r) {
    if (super._autoLog(r)) return true;
    const med = this._medianMean();
    return med > 0 && r[1] / med > OUTLIER_RATIO;
  }

  /** The median of the visible series' means, from at most ~1,024 evenly spaced points. */
  _medianMean() {
    const vals = [];
    for (const s of this._visibleSeries()) {
      const d = s.data;
      const stride = Math.max(1, Math.floor(d.n / 1024));
      for (let i = 0; i < d.n; i += stride) {
        const m = d.mean[i];
        if (!Number.isNaN(m)) vals.push(m);
      }
    }
    if (!vals.length) return NaN;
    vals.sort((x, y) => x - y);
    return vals[vals.length >> 1];
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
    const { ctx, w, h: ht, dpr, theme } = this._canvas(60);
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
    const T = 8;
    const B = 22;
    const R = 10;
    const ph = Math.max(10, ht - T - B);
    const logScale = this._effectiveLog();
    if (this.logBtn) this.logBtn.setAttribute("aria-pressed", String(logScale));
    const [ylo, yhi] = this._yDomain(a, b, logScale);
    const yt = yTicks(ylo, yhi, logScale, ph, 6);
    const { labels, L } = this._yLabels(ctx, yt);
    const pw = Math.max(10, w - L - R);
    const cols = Math.max(10, Math.round(pw * dpr));
    const bins = this._bin(a, b, cols);

    const sy = ChartKit.yScale(yt, logScale, T, ph);
    const okY = logScale ? (v) => v > 0 : (v) => !Number.isNaN(v);
    const cx = (c) => L + (c + 0.5) / dpr;
    this._geom = { L, T, pw, ph, a, b, X0, X1, cols, dpr, sy };

    ChartKit.drawYGrid(ctx, theme, yt.ticks, labels, sy, L, T, pw, ph);
    this._xAxis(ctx, theme, L, T, pw, ph, X0, X1, w);

    ctx.save();
    ctx.beginPath();
    ctx.rect(L, T - 1, pw, ph + 2);
    ctx.clip();
    for (const bin of bins) {
      const color = bin.s.color;
      if (bin.s.faint) {
        this._faint(ctx, bin, cols, cx, sy, okY, color);
        continue;
      }
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
      const { idx, vals, sm } = this._meanLine(bin, cols, okY);
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
      // non-finite means: a red tick at the top
      ctx.globalAlpha = 1;
      ctx.fillStyle = "#f2495c";
      for (let c = 0; c < cols; c++) {
        if (bin.bad[c]) ctx.fillRect(cx(c) - 1.5, T, 3, 6);
      }
    }
    ctx.restore();
    ctx.globalAlpha = 1;
    const marked = this._drawMarkers(ctx, a, b, X0, X1, L, T, pw, ph);

    if (this.hover !== null && this.hover >= 0 && this.hover < cols) {
      ChartKit.drawCrosshair(ctx, theme, Math.round(cx(this.hover)) + 0.5, T, ph);
    }
    this._drawSelection(ctx, theme, L, T, pw, ph);
    this.last = { bins, yt, logScale, marked };
    this.drawnAt = performance.now();
    if (this.opts.onDraw) this.opts.onDraw(this);
  }

  /** (8.1) An attempt's superseded records: its mean line only, thin and pale, no band. */
  _faint(ctx, bin, cols, cx, sy, okY, color) {
    const { idx, sm } = this._meanLine(bin, cols, okY);
    this._path(ctx, idx, sm, cx, sy, color, 1.2, 0.35);
  }

  /** A series' drawable mean points: the columns (`idx`), their means (`vals`) and those
   * smoothed as asked (`sm`); kept on the bin for the hover's readout. */
  _meanLine(bin, cols, okY) {
    const idx = [];
    const vals = [];
    for (let c = 0; c < cols; c++) {
      if (bin.has[c] && okY(bin.mean[c])) {
        idx.push(c);
        vals.push(bin.mean[c]);
      }
    }
    const sm = this.smooth > 0 ? ema(vals, this.smooth) : vals;
    bin.smoothed = sm;
    bin.idx = idx;
    return { idx, vals, sm };
  }

  _path(ctx, idx, vals, cx, sy, color, width, alpha) {
    ctx.strokeStyle = color;
    ctx.lineWidth = width;
    ctx.globalAlpha = alpha;
    ctx.lineJoin = "round";
    ctx.lineCap = "round";
    strokeWithGaps(ctx, vals, 0, idx.length - 1, (i) => cx(idx[i]), sy);
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

  _xFmt(X, step) {
    const k = this.axis.kind;
    if (k === "time") return formatClock(X, step === undefined || step < 60);
    if (k === "elapsed") return fmtElapsed(X);
    return formatNumber(X);
  }

  _xAxis(ctx, theme, L, T, pw, ph, X0, X1, w) {
    const count = Math.max(2, Math.floor(pw / 90));
    const k = this.axis.kind;
    let ticks;
    let step;
    if (k === "time") ({ ticks, step } = timeTicks(X0, X1, count));
    else if (k === "elapsed") ({ ticks, step } = elapsedTicks(X0, X1, count));
    else ({ ticks, step } = niceTicks(X0, X1, count, true));
    ChartKit.drawXAxis(ctx, theme, {
      ticks, format: (t) => this._xFmt(t, step), x0: X0, x1: X1, eps: 0, L, T, pw, ph, w,
      name: this.opts.xLabel || this.axis.label,
    });
  }

  // ------------------------------------------------------------------ pointer

  _col(px) {
    const g = this._geom;
    if (!g) return null;
    return Math.floor((px - g.L) * g.dpr);
  }

  /** The nearest column with data within ~12 css px of css x `px`. */
  _hoverAt(px) {
    const c = this._col(px);
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

  _tipRows(c) {
    if (!this.last) return null;
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
          ? `${label} ${fmtInt(first)}`
          : `${label}s ${fmtInt(first)}–${fmtInt(last)} (${fmtInt(bin.steps[c])})`;
        if (this.axis.kind === "time" || this.axis.kind === "elapsed") {
          head += ` · ${this._xFmt(this.axis.map((first + last) / 2))}`;
        }
        rows.push(h("div", "tip-x", head));
      }
      rows.push(ChartKit.tipRow(bin.s.color, bin.s.name, bin.bad[c] && Number.isNaN(bin.mean[c]) ? "non-finite" : fmt(bin.mean[c])));
      const sub = [];
      if (bin.steps[c] > 1 && !Number.isNaN(bin.lo[c])) sub.push(`means ${fmt(bin.lo[c])} … ${fmt(bin.hi[c])}`);
      if (this.opts.band && !Number.isNaN(bin.rmin[c])) sub.push(`ranks ${fmt(bin.rmin[c])} … ${fmt(bin.rmax[c])}`);
      if (bin.bad[c]) sub.push("non-finite mean in range");
      for (const s of sub) rows.push(h("div", "tip-sub", s));
    }
    // (8.1) a marker's hover (why the previous attempt ended) at the columns it stands in
    let first = Infinity;
    let last = -Infinity;
    for (const bin of this.last.bins) {
      if (!bin.has[c]) continue;
      first = Math.min(first, bin.first[c]);
      last = Math.max(last, bin.last[c]);
    }
    for (const m of this.markers || []) {
      if (m.hover && m.step >= first && m.step <= last) {
        const row = h("div", "tip-sub tip-marker", `${m.text}: ${m.hover}`);
        row.dataset.marker = String(m.text);
        rows.push(row);
      }
    }
    if (this.opts.slowest && this.last.bins.length) {
      const bin = this.last.bins.find((bb) => bb.has[c]);
      if (bin) {
        const s = this.opts.slowest(bin.first[c], bin.last[c]);
        if (s) rows.push(h("div", "tip-sub", s));
      }
    }
    return rows;
  }

  /** The markers within [a, b]: a dashed red line at each, its text at the top (canvas
   * text, never HTML). Returns what was drawn: [{step, text, x}]. */
  _drawMarkers(ctx, a, b, X0, X1, L, T, pw, ph) {
    const out = [];
    const ax = this.axis;
    for (const m of this.markers || []) {
      if (!(m.step >= a && m.step <= b)) continue;
      const X = ax.map(m.step);
      if (!Number.isFinite(X)) continue;
      const x = Math.round(L + ((X - X0) / (X1 - X0 || 1)) * pw) + 0.5;
      out.push(drawMarker(ctx, m, x, L, T, pw, ph));
    }
    return out;
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
      markers: this.last.marked || [],
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
        return { name: bin.s.name, faint: bin.s.faint, columns: cols };
      }),
    };
  }
}
