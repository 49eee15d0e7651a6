// rankboard line chart: several series over one x array (epochs, or unix seconds), with
// null gaps, EMA smoothing, a log toggle and drag-to-zoom on x; on the chart kit.

import { colorAt, ema, niceTicks, timeTicks, yTicks } from "./axes.js";
import { ChartKit, drawMarker, strokeWithGaps } from "./chartkit.js";
import { h } from "./dom.js";
import { formatClock, formatNumber, numOrNull } from "./fmt.js";

/**
 * A line chart in a card.
 *
 * ```js
 * const c = new LineChart(host, {title: "Loss", chartId: "metrics", log: true, smoothing: true});
 * c.setData([0, 1, 2], [{name: "loss", values: [1.2, 0.9, null]}]);
 * ```
 * Options (beside the kit's): xType ("linear" | "time"), xInteger, xLabel, yMin/yMax
 * (fixed bounds; data may widen them).
 */
export class LineChart extends ChartKit {
  constructor(host, opts = {}) {
    super(host, {
      xType: "linear", xInteger: false, yFormat: formatNumber, height: 240, legend: true, png: true, ...opts,
    });
    this.x = [];
    this.zoom = null; // [x0, x1] or null
    this.ghosts = []; // (8.1) [{name, color, x, values}]: superseded records, drawn faint
    this.markers = []; // (8.1) [{step, text, color?, hover?}]: a dashed line at x = step
    this.drawnMarkers = [];
  }

  /** (8.1) Series of their own x drawn faint beside the data (an attempt's superseded
   * epochs): [{name, color, x, values}]. */
  setGhosts(ghosts) {
    this.ghosts = (Array.isArray(ghosts) ? ghosts : []).map((g) => ({
      name: g.name, color: g.color, x: g.x.slice(), values: g.values.map(numOrNull),
    }));
    this.render();
  }

  /** (8.1) x values to mark with a dashed line and a short text; `hover` is shown in the
   * tooltip at that x. [{step, text, color?, hover?}] */
  setMarkers(markers) {
    const list = Array.isArray(markers) ? markers : [];
    const sig = list.map((m) => `${m.step}:${m.text}:${m.hover || ""}`).join("\n");
    if (sig === this._markerSig) return;
    this._markerSig = sig;
    this.markers = list;
    this.render();
  }

  /** Replace the data. `x` ascending numbers; each series {name, values, color?}. */
  setData(x, series) {
    this.x = x.slice();
    const known = new Set(this.series.map((s) => s.name));
    const changed = series.length !== this.series.length || series.some((s) => !known.has(s.name));
    this.series = series.map((s, i) => ({
      name: s.name,
      color: s.color || colorAt(i),
      values: s.values.map(numOrNull),
      unit: s.unit,
    }));
    if (this.solo !== null && !this.series.some((s) => s.name === this.solo)) this.solo = null;
    if (changed) this._buildLegend();
    this.render();
  }

  resetZoom() {
    this.zoom = null;
    this.resetBtn.hidden = true;
    this.render();
  }

  _unzoom() {
    this.resetZoom();
  }

  _zoomPx(p0, p1, g) {
    const toX = (p) => g.x0 + ((p - g.L) / g.pw) * (g.x1 - g.x0);
    const a = toX(p0);
    const b = toX(p1);
    if (b > a) {
      this.zoom = [a, b];
      this.resetBtn.hidden = false;
    }
  }

  _xFormat(v) {
    if (this.opts.xType === "time") return formatClock(v, true);
    return formatNumber(v);
  }

  _positiveRange() {
    let lo = Infinity;
    let hi = -Infinity;
    for (const s of this._visibleSeries()) {
      for (const v of s.values) {
        if (v === null) continue;
        if (v <= 0) return null;
        if (v < lo) lo = v;
        if (v > hi) hi = v;
      }
    }
    return Number.isFinite(lo) ? [lo, hi] : null;
  }

  _draw() {
    const { ctx, w, h: ht, theme } = this._canvas(50);
    const x = this.x;
    const vis = this._visibleSeries();
    const hasData = x.length > 0 && this.series.some((s) => s.values.some((v) => v !== null));
    this.empty.hidden = hasData;
    this._geom = null;
    if (!hasData) return;

    // x domain (an attempt's superseded epochs may reach past the line's last)
    const ghostEnd = Math.max(-Infinity, ...this.ghosts.map((g) => (g.x.length ? g.x[g.x.length - 1] : -Infinity)));
    let x0 = this.zoom ? this.zoom[0] : x[0];
    let x1 = this.zoom ? this.zoom[1] : Math.max(x[x.length - 1], ghostEnd);
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
    for (const g of this.ghosts) {
      g.x.forEach((gx, i) => {
        const v = g.values[i];
        if (v === null || gx < x0 || gx > x1 || (logScale && v <= 0)) return;
        if (v < lo) lo = v;
        if (v > hi) hi = v;
      });
    }
    const { yMin, yMax } = this.opts;
    if (!logScale) {
      if (yMin !== undefined) lo = Math.min(lo, yMin);
      if (yMax !== undefined) hi = Math.max(hi, yMax);
    }
    if (!Number.isFinite(lo)) {
      lo = logScale ? 1 : 0;
      hi = logScale ? 10 : 1;
    }

    const T = 8;
    const B = 22;
    const R = 12;
    const yt = yTicks(lo, hi, logScale, ht - T - B, 7);
    if (!logScale) {
      if (yMin !== undefined && lo >= yMin) {
        yt.lo = Math.max(yt.lo, yMin);
        yt.ticks = yt.ticks.filter((t) => t >= yt.lo);
      }
      if (yMax !== undefined && hi <= yMax) {
        yt.hi = Math.min(yt.hi, yMax);
        yt.ticks = yt.ticks.filter((t) => t <= yt.hi);
      }
    }
    const { labels, L } = this._yLabels(ctx, yt);
    const pw = Math.max(10, w - L - R);
    const ph = Math.max(10, ht - T - B);
    const sy = ChartKit.yScale(yt, logScale, T, ph);
    const sx = (v) => L + ((v - x0) / (x1 - x0)) * pw;
    this._geom = { L, T, pw, ph, x0, x1, sx, sy };

    ChartKit.drawYGrid(ctx, theme, yt.ticks, labels, sy, L, T, pw, ph);
    const time = this.opts.xType === "time";
    const xCount = Math.max(2, Math.floor(pw / 80));
    const xt = time ? timeTicks(x0, x1, xCount) : niceTicks(x0, x1, xCount, this.opts.xInteger);
    ChartKit.drawXAxis(ctx, theme, {
      ticks: xt.ticks, format: (t) => (time ? formatClock(t, xt.step < 60) : formatNumber(t)),
      x0, x1, eps: (x1 - x0) * 1e-9, L, T, pw, ph, w, name: this.opts.xLabel,
    });

    // series
    ctx.save();
    ctx.beginPath();
    ctx.rect(L, T - 1, pw, ph + 2);
    ctx.clip();
    const pointsInView = i1 - i0 + 1;
    const dots = pointsInView <= Math.max(2, pw / 14);
    for (const g of this.ghosts) {
      const vals = logScale ? g.values.map((v) => (v !== null && v > 0 ? v : null)) : g.values;
      this._line(ctx, g.x, vals, 0, g.x.length - 1, sx, sy, g.color, 1.2, 0.35, false);
    }
    for (const d of draws) {
      if (this.smooth > 0) this._line(ctx, x, d.raw, i0, i1, sx, sy, d.s.color, 1, 0.25, false);
      this._line(ctx, x, d.sm, i0, i1, sx, sy, d.s.color, 1.75, 1, dots);
    }
    ctx.restore();
    this.drawnMarkers = this._drawMarkers(ctx, x0, x1, sx, T, pw, ph, L);

    // crosshair
    if (this.hover !== null && this.hover >= i0 && this.hover <= i1) {
      const px = Math.round(sx(x[this.hover])) + 0.5;
      ChartKit.drawCrosshair(ctx, theme, px, T, ph);
      for (const d of draws) {
        const v = d.sm[this.hover];
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
    this._drawSelection(ctx, theme, L, T, pw, ph);
    this._draws = draws;
  }

  /** The markers within [x0, x1]: a dashed line each, its text at the top (canvas text). */
  _drawMarkers(ctx, x0, x1, sx, T, pw, ph, L) {
    const out = [];
    for (const m of this.markers) {
      if (!(m.step >= x0 && m.step <= x1)) continue;
      const px = Math.round(sx(m.step)) + 0.5;
      out.push(drawMarker(ctx, m, px, L, T, pw, ph));
    }
    return out;
  }

  /** What the last draw showed, for tests: the x values, the faint series and the markers. */
  snapshot() {
    return {
      x: this.x.slice(),
      series: this.series.map((s) => ({ name: s.name, values: s.values.slice() })),
      ghosts: this.ghosts.map((g) => ({ name: g.name, x: g.x.slice(), values: g.values.slice() })),
      markers: this.drawnMarkers.slice(),
      plot: this._geom ? { left: this._geom.L, top: this._geom.T, width: this._geom.pw, height: this._geom.ph } : null,
    };
  }

  _line(ctx, x, vals, i0, i1, sx, sy, color, width, alpha, dots) {
    ctx.strokeStyle = color;
    ctx.fillStyle = color;
    ctx.lineWidth = width;
    ctx.globalAlpha = alpha;
    ctx.lineJoin = "round";
    ctx.lineCap = "round";
    const lo = Math.max(0, i0 - 1);
    const hi = Math.min(x.length - 1, i1 + 1);
    strokeWithGaps(ctx, vals, lo, hi, (i) => sx(x[i]), sy);
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

  /** The index of the x nearest css x `px`, inside the view. */
  _hoverAt(px) {
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

  _tipRows(idx) {
    if (!this._draws) return null;
    const rows = [h("div", "tip-x", `${this.opts.xLabel ? `${this.opts.xLabel} ` : ""}${this._xFormat(this.x[idx])}`)];
    for (const d of this._draws) rows.push(ChartKit.tipRow(d.s.color, d.s.name, this.opts.yFormat(d.s.values[idx])));
    for (const g of this.ghosts) { // (8.1) a superseded value at this x
      const i = g.x.indexOf(this.x[idx]);
      if (i >= 0 && g.values[i] !== null) rows.push(ChartKit.tipRow(g.color, g.name, this.opts.yFormat(g.values[i])));
    }
    for (const m of this.markers) {
      if (m.hover && m.step === this.x[idx]) {
        const row = h("div", "tip-sub tip-marker", `${m.text}: ${m.hover}`);
        row.dataset.marker = String(m.text);
        rows.push(row);
      }
    }
    return rows;
  }
}
