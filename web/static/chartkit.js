// rankboard chart kit: what every canvas chart of the page shares, so the line chart
// (linechart.js) and the step band chart (bandchart.js) only say how they bin and draw.
//
// The kit owns the card (title, header controls: EMA smoothing, log toggle, reset zoom,
// PNG), the legend with solo, the high-DPI canvas and its theme, the y grid and x axis,
// the crosshair, the hover tooltip's placement, drag-to-zoom and the one-per-frame redraw.
//
// Why our own: the page must work air-gapped under a strict CSP (no CDN, no eval, no inline
// styles), and a training dashboard needs only a few things done well.
//
// A subclass implements:
//   _draw()                 draw everything (using the helpers below)
//   _positiveRange()        [lo, hi] of the visible values, or null when one is <= 0 / none
//   _hoverAt(px)            the hover key (index, column) at css x `px`, or null
//   _tipRows(hover)         the tooltip's rows (elements) for that key, or null
//   _zoomPx(p0, p1, geom)   a finished drag from css x p0 to p1 (p0 < p1)
//   _unzoom()               reset zoom / double click
// and may override _autoLog(r), whether its values call for a log axis by themselves.
//
// Every piece of text that may come from a training job (series names, values) goes into
// the DOM through textContent, never innerHTML.

import { h } from "./dom.js";
import { cancelFrame, deferOffscreen, drewNow, onFrame } from "./frame.js";

/** A chart's colours and font, read once from its card's CSS variables. */
function chartTheme(card) {
  const css = getComputedStyle(card);
  const v = (name, fallback) => css.getPropertyValue(name).trim() || fallback;
  return {
    bg: v("--chart-bg", "#141821"),
    grid: v("--chart-grid", "rgba(255,255,255,0.07)"),
    axis: v("--chart-axis", "#8b95a7"),
    cross: v("--chart-cross", "rgba(255,255,255,0.35)"),
    sel: v("--chart-select", "rgba(87,148,242,0.18)"),
    font: v("--chart-font", "11px system-ui, sans-serif"),
  };
}

/** Stroke one polyline through (xAt(i), yAt(vals[i])) for i in [lo, hi], lifting the pen
 * over null and NaN values (a gap in the data is a gap in the line). Both charts draw their
 * series with it. */
export function strokeWithGaps(ctx, vals, lo, hi, xAt, yAt) {
  ctx.beginPath();
  let pen = false;
  for (let i = lo; i <= hi; i++) {
    const v = vals[i];
    if (v === null || Number.isNaN(v)) {
      pen = false;
      continue;
    }
    const px = xAt(i);
    const py = yAt(v);
    if (pen) ctx.lineTo(px, py);
    else ctx.moveTo(px, py);
    pen = true;
  }
  ctx.stroke();
}

/** Size `canvas` to `w` x `h` css px at the device pixel ratio; its context, scaled to css px. */
/**
 * One marker on a chart's plot: a dashed line at pixel column `x` over the plot (left `L`,
 * top `T`, `pw` x `ph`), its text at the top (canvas text, never HTML), kept inside the plot.
 * Returns `{step, text, x, hover}`, what the chart's hover reads back. The step charts
 * (non-finite values, restarts) and the epoch chart (restarts) draw theirs through it.
 */
export function drawMarker(ctx, m, x, L, T, pw, ph) {
  const color = m.color || "#f2495c";
  ctx.save();
  ctx.strokeStyle = color;
  ctx.fillStyle = color;
  ctx.lineWidth = 1;
  ctx.setLineDash([3, 3]);
  ctx.beginPath();
  ctx.moveTo(x, T);
  ctx.lineTo(x, T + ph);
  ctx.stroke();
  ctx.setLineDash([]);
  ctx.font = "10px sans-serif";
  const text = String(m.text);
  const tw = ctx.measureText(text).width;
  ctx.fillText(text, x + 3 + tw > L + pw ? x - 3 - tw : x + 3, T + 10);
  ctx.restore();
  return { step: m.step, text, x, hover: m.hover || null };
}

export function fitCanvas(canvas, w, ht) {
  const dpr = window.devicePixelRatio || 1;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(ht * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(ht * dpr);
    canvas.style.width = `${w}px`;
    canvas.style.height = `${ht}px`;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  return ctx;
}

function toolButton(text, title, action, onClick) {
  const b = h("button", "tool-btn", text);
  b.type = "button";
  if (title) b.title = title;
  b.dataset.action = action;
  b.addEventListener("click", onClick);
  return b;
}

/**
 * Options every chart takes: title, chartId (data-chart attribute), height (css px),
 * emptyText, log (show the log toggle), smoothing (show the EMA slider), smoothTitle,
 * legend (a legend with solo), png (a PNG download button), filename, lazy (at most one draw a
 * second while out of view), cardClass, yFormat(v) -> string.
 */
export class ChartKit {
  constructor(host, opts) {
    this.opts = opts;
    this.series = []; // [{name, color, ...}]
    this.solo = null; // name of the soloed series, or null
    this.logScale = null; // null: automatic (log when positive data spans decades)
    this.smooth = 0;
    this.hover = null;
    this.drag = null; // {x0px, x1px}
    this.visible = true;
    this._geom = null;
    this._w = 0;
    this._build(host);
  }

  // ------------------------------------------------------------------ the card

  _build(host) {
    const o = this.opts;
    const card = h("div", o.cardClass ? `chart ${o.cardClass}` : "chart");
    if (o.chartId) card.dataset.chartCard = o.chartId;
    const head = h("div", "chart-head");
    this.titleEl = h("h3", "chart-title", o.title || "");
    head.append(this.titleEl, this._tools());
    card.append(head);
    if (o.legend) {
      this.legendEl = h("div", "chart-legend");
      card.append(this.legendEl);
    }
    const body = h("div", "chart-body");
    body.style.height = `${o.height}px`;
    this.canvas = h("canvas");
    if (o.chartId) this.canvas.dataset.chart = o.chartId;
    this.canvas.setAttribute("role", "img");
    this.canvas.setAttribute("aria-label", o.title || "chart");
    this.tip = h("div", "chart-tip");
    this.tip.hidden = true;
    this.empty = h("div", "chart-empty", o.emptyText || "waiting for data…");
    body.append(this.canvas, this.tip, this.empty);
    this.body = body;
    card.append(body);
    host.append(card);
    this.card = card;

    this._bindPointer();
    this._ro = new ResizeObserver((entries) => {
      const r = entries[entries.length - 1].contentRect;
      this._size = { w: Math.floor(r.width), h: Math.floor(r.height) };
      if (!o.lazy || this._size.w !== this._w) this.render();
    });
    this._ro.observe(body);
    if (o.lazy) {
      // charts scrolled out of view do not draw; they draw when they come back
      this._io = new IntersectionObserver((entries) => {
        for (const e of entries) this.visible = e.isIntersecting;
        if (this.visible && this._stale) this.render();
      });
      this._io.observe(body);
    }
  }

  /** The header controls: status text, smoothing, log, reset zoom, PNG. */
  _tools() {
    const o = this.opts;
    const tools = h("div", "chart-tools");
    if (o.status) {
      this.status = h("span", "chart-status");
      tools.append(this.status);
    }
    if (o.smoothing) {
      const lab = h("label", "chart-smooth");
      lab.title = o.smoothTitle || "EMA smoothing";
      lab.append(h("span", "tool-label", "smooth"));
      const range = h("input");
      range.type = "range";
      range.min = "0";
      range.max = "0.99";
      range.step = "0.01";
      range.value = "0";
      range.setAttribute("aria-label", "smoothing");
      const val = h("span", "tool-value", "0.00");
      range.addEventListener("input", () => {
        this.smooth = Number(range.value);
        val.textContent = this.smooth.toFixed(2);
        this.render();
      });
      lab.append(range, val);
      tools.append(lab);
      this.smoothInput = range;
    }
    if (o.log) {
      this.logBtn = toolButton("log", "logarithmic y axis", "log", () => {
        this.logScale = !this._effectiveLog();
        this.render();
      });
      this.logBtn.setAttribute("aria-pressed", "false");
      tools.append(this.logBtn);
    }
    this.resetBtn = toolButton("reset zoom", null, "reset-zoom", () => this._unzoom());
    this.resetBtn.hidden = true;
    tools.append(this.resetBtn);
    if (o.png) tools.append(toolButton("PNG", "download this chart as PNG", "png", () => this.downloadPng()));
    return tools;
  }

  /** Change the card title (e.g. when a rank panel switches ranks). */
  setTitle(title) {
    this.opts.title = title;
    this.titleEl.textContent = title;
    this.canvas.setAttribute("aria-label", title);
  }

  // ------------------------------------------------------------------ legend

  /** One button per series; a click shows only that series, a second click all. */
  _buildLegend() {
    this.legendEl.replaceChildren();
    for (const s of this.series) {
      const b = h("button", "legend-item");
      b.type = "button";
      b.dataset.series = s.name;
      b.title = "click to show only this series; click again to show all";
      const sw = h("span", "swatch");
      sw.style.background = s.color;
      // `label`: what a reader knows the series by (a run's label); the name is its key
      b.append(sw, h("span", "legend-name", s.label || s.name));
      if (s.label && s.label !== s.name) b.title = `${s.name}: ${b.title}`;
      b.addEventListener("click", () => {
        this.solo = this.solo === s.name ? null : s.name;
        this._syncLegend();
        this.render();
      });
      this.legendEl.append(b);
    }
    this._syncLegend();
  }

  _syncLegend() {
    for (const b of this.legendEl.children) {
      b.classList.toggle("off", this.solo !== null && b.dataset.series !== this.solo);
      b.setAttribute("aria-pressed", String(this.solo === b.dataset.series));
    }
  }

  _visibleSeries() {
    return this.series.filter((s) => this.solo === null || s.name === this.solo);
  }

  /**
   * The log toggle, or before the user touches it: log when every visible value is
   * positive and they span more than two decades (loss beside a learning rate).
   */
  _effectiveLog() {
    if (!this.opts.log) return false;
    if (this.logScale !== null) return this.logScale;
    if (this.opts.autoLog === false) return false; // a schedule reads as its schedule
    const r = this._positiveRange();
    return r !== null && this._autoLog(r);
  }

  /** Before the user touches the toggle, whether values in `r` ([lo, hi], all positive)
   * call for a log axis (a chart kind may add its own reason). */
  _autoLog(r) {
    return r[1] / r[0] > 200;
  }

  // ------------------------------------------------------------------ drawing

  /** Coalesced redraw (one per animation frame, shared with the rest of the page). */
  render() {
    onFrame(this, () => this.drawNow());
  }

  /**
   * Draw now; a lazy chart out of view draws at most once per OFFSCREEN_MS (and once more
   * that long after its last skipped draw): frame.js's deferOffscreen.
   */
  drawNow() {
    if (deferOffscreen(this, !this._io || this.visible)) return;
    drewNow(this);
    this._draw();
  }

  /**
   * Size the canvas to its box (at least `min` css px each way) for the device pixel
   * ratio and paint the background; returns {ctx, w, h, dpr, theme}.
   */
  _canvas(min) {
    // the size the ResizeObserver saw (reading layout here would force it every draw)
    const rect = this._size && this._size.w > 0 ? { width: this._size.w, height: this._size.h }
      : this.body.getBoundingClientRect();
    const w = Math.max(min, Math.floor(rect.width));
    const ht = Math.max(min, Math.floor(rect.height));
    this._w = w;
    const dpr = window.devicePixelRatio || 1;
    const ctx = fitCanvas(this.canvas, w, ht);
    const theme = this._theme || (this._theme = chartTheme(this.card));
    ctx.fillStyle = theme.bg;
    ctx.fillRect(0, 0, w, ht);
    ctx.font = theme.font;
    return { ctx, w, h: ht, dpr, theme };
  }

  /** The y labels of `yt` and the left margin they need. */
  _yLabels(ctx, yt) {
    const labels = yt.ticks.map((t) => this.opts.yFormat(t));
    const labelW = Math.max(0, ...labels.map((s) => ctx.measureText(s).width));
    return { labels, L: Math.ceil(labelW) + 12 };
  }

  /** The canvas y of value `v` on the y ticks `yt` (log10 when `logScale`). */
  static yScale(yt, logScale, T, ph) {
    const ylo = logScale ? Math.log10(yt.lo) : yt.lo;
    const yhi = logScale ? Math.log10(yt.hi) : yt.hi;
    return (v) => T + ph - (((logScale ? Math.log10(v) : v) - ylo) / (yhi - ylo || 1)) * ph;
  }

  /** Horizontal grid lines and their labels at the y ticks inside the plot area. */
  static drawYGrid(ctx, theme, ticks, labels, sy, L, T, pw, ph) {
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
   * Vertical grid lines at `ticks` in [x0 - eps, x1 + eps], their labels (skipped where
   * they would overlap) and the axis name at the plot's bottom right.
   */
  static drawXAxis(ctx, theme, { ticks, format, x0, x1, eps, L, T, pw, ph, w, name }) {
    const sx = (x) => L + ((x - x0) / (x1 - x0)) * pw;
    ctx.strokeStyle = theme.grid;
    ctx.fillStyle = theme.axis;
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    let lastRight = -Infinity;
    for (const t of ticks) {
      if (t < x0 - eps || t > x1 + eps) continue;
      const px = Math.round(sx(t)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(px, T);
      ctx.lineTo(px, T + ph);
      ctx.stroke();
      const label = format(t);
      const lw = ctx.measureText(label).width;
      if (px - lw / 2 > lastRight + 6 && px + lw / 2 <= w) {
        ctx.fillText(label, px, T + ph + 6);
        lastRight = px + lw / 2;
      }
    }
    if (name) {
      ctx.textAlign = "right";
      ctx.textBaseline = "bottom";
      ctx.globalAlpha = 0.7;
      ctx.fillText(name, L + pw, T + ph - 2);
      ctx.globalAlpha = 1;
    }
  }

  /** The dashed hover line at css x `px`. */
  static drawCrosshair(ctx, theme, px, T, ph) {
    ctx.strokeStyle = theme.cross;
    ctx.setLineDash([4, 3]);
    ctx.beginPath();
    ctx.moveTo(px, T);
    ctx.lineTo(px, T + ph);
    ctx.stroke();
    ctx.setLineDash([]);
  }

  /** The drag-to-zoom selection, clipped to the plot. */
  _drawSelection(ctx, theme, L, T, pw, ph) {
    if (!this.drag) return;
    const a = Math.max(L, Math.min(this.drag.x0px, this.drag.x1px));
    const b = Math.min(L + pw, Math.max(this.drag.x0px, this.drag.x1px));
    ctx.fillStyle = theme.sel;
    ctx.fillRect(a, T, b - a, ph);
  }

  // ------------------------------------------------------------------ pointer

  _bindPointer() {
    const cv = this.canvas;
    const local = (e) => {
      const r = cv.getBoundingClientRect();
      return { px: e.clientX - r.left, py: e.clientY - r.top };
    };
    cv.addEventListener("pointermove", (e) => {
      const { px, py } = local(e);
      if (this.drag) this.drag.x1px = px;
      const key = this._hoverAt(px);
      if (key !== this.hover || this.drag) {
        this.hover = key;
        this.render();
      }
      this._showTip(key, px, py);
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
        const clamp = (p) => Math.min(g.L + g.pw, Math.max(g.L, p));
        this._zoomPx(clamp(Math.min(d.x0px, d.x1px)), clamp(Math.max(d.x0px, d.x1px)), g);
      }
      this.render();
    };
    cv.addEventListener("pointerup", end);
    cv.addEventListener("pointercancel", end);
    cv.addEventListener("dblclick", () => this._unzoom());
  }

  /** Fill and place the tooltip beside the pointer, inside the chart body. */
  _showTip(key, px, py) {
    const rows = key === null || this.drag ? null : this._tipRows(key);
    const tip = this.tip;
    if (!rows || !rows.length) {
      tip.hidden = true;
      return;
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

  /** A tooltip row: a colour swatch, the series name and its value. */
  static tipRow(color, name, value) {
    const row = h("div", "tip-row");
    const sw = h("span", "swatch");
    sw.style.background = color;
    row.append(sw, h("span", "tip-name", name), h("span", "tip-val", value));
    return row;
  }

  // ------------------------------------------------------------------ export

  /** Save the chart as PNG (title drawn in, so the file stands alone). */
  downloadPng() {
    const cv = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const head = Math.round(26 * dpr);
    const out = h("canvas");
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
    const names = this._visibleSeries().map((s) => s.name).join(", ");
    ctx.fillText(`${this.opts.title || ""}${names ? `  —  ${names}` : ""}`, 10, 13);
    out.toBlob((blob) => {
      if (!blob) return;
      const url = URL.createObjectURL(blob);
      const a = h("a");
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
    if (this._io) this._io.disconnect();
    clearTimeout(this._staleTimer);
    cancelFrame(this);
    this.card.remove();
  }
}
