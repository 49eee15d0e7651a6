// rankboard per-rank pictures for big runs, each one canvas however many ranks:
//
// * HostHeatmap: one cell per rank, ranks grouped by host (blocks that wrap like words),
//   one section per figure (GPU utilisation, throughput). Hover names rank, host and value;
//   a click opens the rank.
// * StragglerStrip: ranks (or, for big runs, hosts) x recent samples, coloured by a rank's
//   step time relative to the median rank at that moment, so a slow rank is a line.
//
// Text from a training job (host names) only reaches the DOM through textContent.

import { fitCanvas } from "./chartkit.js";
import { cssVar, h } from "./dom.js";
import { isNum } from "./fmt.js";
import { deferOffscreen, drewNow, onFrame } from "./frame.js";
import { medianOf } from "./slowness.js";


/** Linear interpolation over colour stops [[t, [r, g, b]], ...]; t in [0, 1]. */
function ramp(stops, t) {
  if (!(t > 0)) return stops[0][1];
  if (t >= 1) return stops[stops.length - 1][1];
  for (let i = 1; i < stops.length; i++) {
    const [t1, c1] = stops[i];
    if (t <= t1) {
      const [t0, c0] = stops[i - 1];
      const f = (t - t0) / (t1 - t0);
      return [0, 1, 2].map((k) => Math.round(c0[k] + (c1[k] - c0[k]) * f));
    }
  }
  return stops[stops.length - 1][1];
}

const rgb = (c) => `rgb(${c[0]},${c[1]},${c[2]})`;

const LUTS = new Map();
/** The CSS colour of t in [0, 1] on `stops`, from 65 precomputed steps. */
function shade(stops, t) {
  let lut = LUTS.get(stops);
  if (!lut) {
    lut = Array.from({ length: 65 }, (_, i) => rgb(ramp(stops, i / 64)));
    LUTS.set(stops, lut);
  }
  const k = t > 0 ? (t < 1 ? Math.round(t * 64) : 64) : 0;
  return lut[k];
}

/** Low (bad) to high (good): a muted red, amber, then green. */
export const GOOD_HIGH = [
  [0, [122, 36, 52]], [0.35, [156, 100, 32]], [0.7, [52, 112, 64]], [1, [115, 191, 105]],
];
/** A ratio to the mean: faster is blue, equal is the panel, slower goes amber to red. */
const SLOW_STOPS = [[0, [32, 42, 58]], [0.25, [150, 128, 22]], [0.6, [255, 152, 48]], [1, [242, 73, 92]]];
const FAST_STOPS = [[0, [32, 42, 58]], [1, [47, 95, 143]]];

/** The strip's colour for a step time ratio (rank / median rank); null: no figure. */
export function ratioColor(r) {
  if (!isNum(r)) return null;
  if (r >= 1) return ramp(SLOW_STOPS, (r - 1) / 0.5);
  return ramp(FAST_STOPS, (1 - r) / 0.5);
}

/** Size from a ResizeObserver (no layout reads in draws) and on-screen state. */
function watch(obj, body) {
  obj._ro = new ResizeObserver((entries) => {
    const w = Math.floor(entries[entries.length - 1].contentRect.width);
    obj._cw = w;
    if (w !== obj._w) obj.render();
  });
  obj._ro.observe(body);
  obj._io = new IntersectionObserver((entries) => {
    for (const e of entries) obj._visible = e.isIntersecting;
    if (obj._visible && obj._stale) obj.render();
  });
  obj._io.observe(body);
}

/** Draw `obj` on the next animation frame; out of view, at most once per OFFSCREEN_MS (and
 * once more that long after a skipped draw: frame.js's deferOffscreen). `watch` draws it at
 * once when it scrolls back. */
function drawOnFrame(obj) {
  onFrame(obj, () => {
    if (deferOffscreen(obj, obj._visible !== false)) return;
    drewNow(obj);
    obj.draw();
  });
}

function widthOf(obj) {
  return obj._cw > 0 ? obj._cw : Math.floor(obj.body.getBoundingClientRect().width);
}

function placeTip(tip, body, px, py) {
  const bw = body.clientWidth;
  const tw = tip.offsetWidth;
  let left = px + 14;
  if (left + tw > bw - 4) left = px - tw - 14;
  tip.style.left = `${Math.max(4, left)}px`;
  tip.style.top = `${Math.max(4, py + 12)}px`;
}

// ------------------------------------------------------------------------- heatmap

/**
 * ```js
 * const hm = new HostHeatmap(host, {onPick: (rank) => open(rank)});
 * hm.setData(groups, layers, flags);
 * ```
 * `groups`: `[{host, ranks: [int]}]` in topology order; `layers`: `[{key, label, format(v, rank),
 * value(rank) -> number|null, scale(v) -> t in [0,1], legend: [loText, hiText]}]`, or for
 * categories `colorOf(v) -> CSS colour` and `keys: [[label, colour|null], ...]` (a legend of
 * swatches; null is the no-figure grey) instead of `scale` and `legend`;
 * `flags(rank)`: "stale" | "error" | null (outlined cells).
 */
export class HostHeatmap {
  constructor(host, opts = {}) {
    this.opts = opts;
    this.groups = [];
    this.layers = [];
    this.flags = () => null;
    this.cells = null; // Float32Array [x, y, size, layer, rank] per cell, for hit tests
    this.hover = null;
    const body = h("div", "heatmap-body");
    this.canvas = h("canvas");
    this.canvas.dataset.chart = opts.chartId || "heatmap";
    this.canvas.setAttribute("role", "img");
    this.canvas.setAttribute("aria-label", opts.title || "per-rank heatmap");
    this.tip = h("div", "chart-tip");
    this.tip.hidden = true;
    body.append(this.canvas, this.tip);
    host.append(body);
    this.body = body;
    this._w = 0;
    this.canvas.addEventListener("pointermove", (e) => this._move(e));
    this.canvas.addEventListener("pointerleave", () => {
      this.tip.hidden = true;
      this.hover = null;
    });
    this.canvas.addEventListener("click", (e) => {
      const hit = this._hit(e);
      if (hit && this.opts.onPick) this.opts.onPick(hit.rank);
    });
    watch(this, body);
  }

  setData(groups, layers, flags) {
    this.groups = groups;
    this.layers = layers;
    this.flags = flags || (() => null);
    this.render();
  }

  render() {
    drawOnFrame(this);
  }

  /** Cell size: the largest that keeps one section within about 130 px. */
  _cellSize(w, n) {
    for (const c of [16, 13, 11, 9, 7, 5, 4]) {
      const perRow = Math.max(1, Math.floor(w / c));
      const rows = Math.ceil((n * 1.15) / perRow);
      if (rows * (c + 2) <= 130) return c;
    }
    return 4;
  }

  /** Host blocks flowed like words over width `w`: [x, y, rank, ...] and the height. */
  _flow(w, c) {
    const gap = Math.max(3, Math.round(c * 0.6));
    const rowGap = Math.max(2, Math.round(c * 0.2));
    const pos = [];
    let x = 0;
    let y = 0;
    for (const g of this.groups) {
      const len = g.ranks.length;
      if (x > 0 && x + Math.min(len * c, w) > w) {
        x = 0;
        y += c + rowGap;
      }
      for (let i = 0; i < len; i++) {
        if (x + c > w) {
          x = 0;
          y += c + rowGap;
        }
        pos.push(x, y, g.ranks[i]);
        x += c;
      }
      x += gap;
    }
    return { pos, height: pos.length ? y + c : 0 };
  }

  draw() {
    const w = Math.max(100, widthOf(this));
    this._w = w;
    const n = this.groups.reduce((a, g) => a + g.ranks.length, 0);
    // two figures side by side when there is room, else one above the other
    const nl = Math.max(1, this.layers.length);
    const side = nl > 1 && w >= 800;
    const colGap = 28;
    const sw = side ? Math.floor((w - colGap * (nl - 1)) / nl) : w;
    const c = this._cellSize(sw, n);
    const { pos, height } = this._flow(sw, c);
    const head = 18;
    const sectionH = head + height + 8;
    const total = side ? sectionH : nl * sectionH;
    const ctx = fitCanvas(this.canvas, w, Math.max(20, total));
    const bg = this._bg || (this._bg = cssVar(this.body, "--panel", "#141821"));
    const text = this._fg || (this._fg = cssVar(this.body, "--muted", "#8b95a7"));
    const none = this._none || (this._none = cssVar(this.body, "--border", "#242b38"));
    ctx.fillStyle = bg;
    ctx.fillRect(0, 0, w, total);
    ctx.font = cssVar(this.body, "--chart-font", "11px system-ui, sans-serif");
    ctx.textBaseline = "middle";
    const cells = new Float32Array((pos.length / 3) * nl * 5);
    let k = 0;
    const inner = c >= 7 ? c - 1 : c; // a 1 px seam between cells when they are big enough
    this.layers.forEach((layer, li) => {
      const left = side ? li * (sw + colGap) : 0;
      const top = side ? 0 : li * sectionH;
      ctx.fillStyle = text;
      ctx.textAlign = "left";
      ctx.fillText(layer.label, left, top + head / 2);
      if (layer.keys) this._keys(ctx, layer.keys, left + sw, top + head / 2, text, none);
      else this._ramp(ctx, layer, left + sw, top + head / 2, text);
      const y0 = top + head;
      for (let i = 0; i < pos.length; i += 3) {
        const px = left + pos[i];
        const py = y0 + pos[i + 1];
        const rank = pos[i + 2];
        const v = layer.value(rank);
        ctx.fillStyle = !isNum(v) ? none : layer.colorOf ? layer.colorOf(v) || none : shade(layer.stops || GOOD_HIGH, layer.scale(v));
        ctx.fillRect(px, py, inner, inner);
        const flag = this.flags(rank);
        if (flag) {
          ctx.strokeStyle = flag === "error" ? "#f2495c" : "#ff9830";
          ctx.lineWidth = c >= 9 ? 2 : 1;
          const o = ctx.lineWidth / 2;
          ctx.strokeRect(px + o, py + o, inner - 2 * o, inner - 2 * o);
        }
        cells[k++] = px;
        cells[k++] = py;
        cells[k++] = inner;
        cells[k++] = li;
        cells[k++] = rank;
      }
    });
    this.cells = cells.subarray(0, k);
    this.drawnCells = k / 5;
  }

  /** A colour ramp legend, "lo ▮▮▮▮ hi", ending at `right`. */
  _ramp(ctx, layer, right, y, text) {
    const [lo, hi] = layer.legend || ["", ""];
    const lw = 48;
    const hiW = ctx.measureText(hi).width;
    const lx = right - hiW - 6 - lw;
    for (let i = 0; i < lw; i++) {
      ctx.fillStyle = rgb(ramp(layer.stops || GOOD_HIGH, i / (lw - 1)));
      ctx.fillRect(lx + i, y - 4, 1, 8);
    }
    ctx.fillStyle = text;
    ctx.textAlign = "right";
    ctx.fillText(lo, lx - 6, y);
    ctx.textAlign = "left";
    ctx.fillText(hi, lx + lw + 6, y);
  }

  /** A legend of discrete colours, "▮ label ▮ label", ending at `right` (colour null: the
   * no-figure grey). */
  _keys(ctx, keys, right, y, text, none) {
    ctx.textAlign = "left";
    let x = right;
    const items = keys.map(([label, colour]) => [label, colour, ctx.measureText(label).width]);
    for (const [, , w] of items) x -= 8 + 4 + w + 12;
    for (const [label, colour, w] of items) {
      ctx.fillStyle = colour || none;
      ctx.fillRect(Math.round(x), Math.round(y - 4), 8, 8); // whole pixels: a crisp swatch
      ctx.fillStyle = text;
      ctx.fillText(label, x + 12, y);
      x += 8 + 4 + w + 12;
    }
  }

  _hit(e) {
    if (!this.cells) return null;
    const r = this.canvas.getBoundingClientRect();
    const px = e.clientX - r.left;
    const py = e.clientY - r.top;
    const cs = this.cells;
    for (let i = 0; i < cs.length; i += 5) {
      const x = cs[i];
      const y = cs[i + 1];
      const s = cs[i + 2] + 1;
      if (px >= x && px < x + s && py >= y && py < y + s) {
        return { rank: cs[i + 4], layer: this.layers[cs[i + 3]], px, py };
      }
    }
    return null;
  }

  _move(e) {
    const hit = this._hit(e);
    if (!hit) {
      this.tip.hidden = true;
      this.canvas.style.cursor = "default";
      return;
    }
    this.canvas.style.cursor = "pointer";
    const host = this.opts.hostOf ? this.opts.hostOf(hit.rank) : null;
    const rows = [h("div", "tip-x", `rank ${hit.rank}${host ? ` · ${host}` : ""}`)];
    for (const layer of this.layers) {
      const row = h("div", "tip-row");
      row.append(h("span", "tip-name", layer.label), h("span", "tip-val", layer.format(layer.value(hit.rank), hit.rank)));
      rows.push(row);
    }
    const flag = this.flags(hit.rank);
    if (flag) rows.push(h("div", "tip-flag", flag));
    this.tip.replaceChildren(...rows);
    this.tip.hidden = false;
    placeTip(this.tip, this.body, hit.px, hit.py);
  }
}

// --------------------------------------------------------------------------- strip

/**
 * Ranks x recent samples of each rank's step time over the mean of all ranks at that
 * sample. `push(t, stepMs)` adds a column (`stepMs`: Map rank -> ms); `setRows(rows)` sets
 * the row layout: `[{label, host, ranks: [int]}]` (one rank per row for small runs, a host's
 * ranks per row for big ones; a row's colour is its slowest rank's).
 */
export class StragglerStrip {
  constructor(host, opts = {}) {
    this.opts = opts;
    this.max = opts.columns || 180;
    this.cols = []; // [{t, ratio: Map rank -> ratio}]
    this.rows = [];
    const body = h("div", "strip-body");
    this.canvas = h("canvas");
    this.canvas.dataset.chart = "straggler-strip";
    this.canvas.setAttribute("role", "img");
    this.canvas.setAttribute("aria-label", "step time per rank relative to the median rank, recent samples");
    this.tip = h("div", "chart-tip");
    this.tip.hidden = true;
    body.append(this.canvas, this.tip);
    host.append(body);
    this.body = body;
    this.off = h("canvas");
    this._w = 0;
    this.canvas.addEventListener("pointermove", (e) => this._move(e));
    this.canvas.addEventListener("pointerleave", () => {
      this.tip.hidden = true;
    });
    this.canvas.addEventListener("click", (e) => {
      const hit = this._hit(e);
      if (hit && isNum(hit.rank) && this.opts.onPick) this.opts.onPick(hit.rank);
    });
    watch(this, body);
  }

  reset() {
    this.cols = [];
    this.rows = [];
    this.render();
  }

  /** Set the row layout; a layout equal to the current one is a no-op. */
  setRows(rows) {
    const sig = rows.map((r) => `${r.label}\u0000${r.ranks.join(",")}`).join("\u0001");
    if (sig === this._sig) return;
    this._sig = sig;
    this.rows = rows;
    this.version = (this.version || 0) + 1;
    this.render();
  }

  /** A column's per-row figures [ratio, rank], computed once per row layout. */
  _colRows(col) {
    if (col.ver !== this.version) {
      col.ver = this.version;
      col.rows = this.rows.map((row) => this._cell(row, col));
    }
    return col.rows;
  }

  /** One sample: `stepMs` Map rank -> ms (ranks with none are left out). */
  push(t, stepMs) {
    // against the median rank (slowness.js), as every slow signal on the page
    const mean = medianOf(stepMs.values());
    if (mean === null) return;
    const ratio = new Map();
    for (const [rank, v] of stepMs) if (isNum(v) && v > 0) ratio.set(rank, v / mean);
    this.cols.push({ t, ratio, mean });
    if (this.cols.length > this.max) this.cols.splice(0, this.cols.length - this.max);
    this.render();
  }

  render() {
    drawOnFrame(this);
  }

  /** The row's figure in column `col`: its slowest rank's ratio, and that rank. */
  _cell(row, col) {
    let best = null;
    let rank = null;
    for (const r of row.ranks) {
      const v = col.ratio.get(r);
      if (v !== undefined && (best === null || v > best)) {
        best = v;
        rank = r;
      }
    }
    return [best, rank];
  }

  draw() {
    const w = Math.max(100, widthOf(this));
    this._w = w;
    const rows = this.rows;
    const nr = rows.length;
    const rowH = Math.max(1, Math.min(18, Math.floor(192 / Math.max(1, nr))));
    const labelW = nr <= 48 ? 84 : 0;
    const h = Math.max(24, nr * rowH);
    const ctx = fitCanvas(this.canvas, w, h);
    ctx.fillStyle = cssVar(this.body, "--panel", "#141821");
    ctx.fillRect(0, 0, w, h);
    // the window grows with the samples (one minute at first, then up to `max`)
    const nc = Math.min(this.max, Math.max(60, this.cols.length));
    this._nc = nc;
    this._geom = { rowH, labelW, w, h, cw: (w - labelW) / nc };
    if (!nr) return;
    // one pixel per (row, column) in an offscreen image, scaled up without smoothing
    const img = new ImageData(nc, nr);
    const d = img.data;
    const first = nc - this.cols.length;
    for (let ci = 0; ci < this.cols.length; ci++) {
      const vals = this._colRows(this.cols[ci]);
      for (let ri = 0; ri < nr; ri++) {
        const [v] = vals[ri];
        const c = ratioColor(v);
        if (!c) continue;
        const o = (ri * nc + first + ci) * 4;
        d[o] = c[0];
        d[o + 1] = c[1];
        d[o + 2] = c[2];
        d[o + 3] = 255;
      }
    }
    this.off.width = nc;
    this.off.height = nr;
    this.off.getContext("2d").putImageData(img, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(this.off, labelW, 0, w - labelW, nr * rowH);
    if (labelW) {
      ctx.font = cssVar(this.body, "--chart-font", "11px system-ui, sans-serif");
      ctx.fillStyle = cssVar(this.body, "--muted", "#8b95a7");
      ctx.textAlign = "right";
      ctx.textBaseline = "middle";
      if (rowH >= 10) {
        rows.forEach((row, i) => ctx.fillText(row.label, labelW - 6, i * rowH + rowH / 2));
      }
    }
    // host boundaries (rank rows of one host are adjacent)
    if (rowH >= 6) {
      ctx.fillStyle = cssVar(this.body, "--bg", "#0b0e14");
      for (let i = 1; i < nr; i++) {
        if (rows[i].host !== rows[i - 1].host) ctx.fillRect(labelW, i * rowH - 1, w - labelW, 1);
      }
    }
  }

  _hit(e) {
    const g = this._geom;
    if (!g || !this.rows.length) return null;
    const r = this.canvas.getBoundingClientRect();
    const px = e.clientX - r.left;
    const py = e.clientY - r.top;
    const ri = Math.floor(py / g.rowH);
    if (ri < 0 || ri >= this.rows.length || px < g.labelW) return null;
    const slot = Math.floor((px - g.labelW) / g.cw);
    const ci = slot - ((this._nc || this.max) - this.cols.length);
    const row = this.rows[ri];
    if (ci < 0 || ci >= this.cols.length) return { row, rank: row.ranks.length === 1 ? row.ranks[0] : null, px, py };
    const [v, rank] = this._colRows(this.cols[ci])[ri];
    return { row, rank, v, col: this.cols[ci], px, py };
  }

  _move(e) {
    const hit = this._hit(e);
    if (!hit) {
      this.tip.hidden = true;
      return;
    }
    const lines = [h("div", "tip-x", hit.row.label)];
    if (hit.col && isNum(hit.v)) {
      const row = h("div", "tip-row");
      const who = hit.row.ranks.length > 1 ? `slowest: rank ${hit.rank}` : "step time";
      row.append(h("span", "tip-name", who), h("span", "tip-val", `${hit.v.toFixed(2)}× median`));
      lines.push(row);
      const ago = this.opts.ago ? this.opts.ago(hit.col.t) : "";
      if (ago) lines.push(h("div", "tip-sub", ago));
    } else {
      lines.push(h("div", "tip-sub", "no step time"));
    }
    this.tip.replaceChildren(...lines);
    this.tip.hidden = false;
    placeTip(this.tip, this.body, hit.px, hit.py);
    this.canvas.style.cursor = isNum(hit.rank) ? "pointer" : "default";
  }
}
