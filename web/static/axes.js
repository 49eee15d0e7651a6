// rankboard chart axes: the arithmetic every chart shares (series colours, "nice" linear,
// log, clock and elapsed-time ticks, EMA smoothing). No DOM.

const PALETTE = [
  "#5794f2", "#73bf69", "#f2cc0c", "#ff9830", "#f2495c",
  "#b877d9", "#8ab8ff", "#fade2a", "#37872d", "#c4162a",
  "#56a64b", "#e0b400", "#1f60c4", "#8f3bb8", "#fa6400",
];

/** The colour of series `i` (stable across charts so "loss" always looks the same). */
export function colorAt(i) {
  return PALETTE[((i % PALETTE.length) + PALETTE.length) % PALETTE.length];
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

const ELAPSED_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800,
  21600, 43200, 86400, 172800, 432000, 864000];

export function elapsedTicks(lo, hi, count) {
  const want = (hi - lo) / Math.max(1, count);
  const step = ELAPSED_STEPS.find((s) => s >= want) || Math.ceil(want / 86400) * 86400;
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi && ticks.length < 200; v += step) ticks.push(v);
  return { ticks, step };
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

/** y ticks for a plot `ph` px tall: log decades (thinned to whole decades when crowded) or
 * about one nice linear tick per 40 px, at most `most`. */
export function yTicks(lo, hi, logScale, ph, most) {
  if (logScale) {
    const yt = logTicks(lo, hi);
    if (yt.ticks.length > Math.max(3, ph / 18)) {
      yt.ticks = yt.ticks.filter((t) => Math.abs(Math.log10(t) - Math.round(Math.log10(t))) < 1e-9);
    }
    return yt;
  }
  return niceTicks(lo, hi, Math.max(3, Math.min(most, Math.floor(ph / 40))));
}
