// rankboard's shared number and time formats: what more than one view shows (charts,
// tables, KPIs and tooltips format a loss, a percentage, bytes, a duration or a time through
// here, so "1.2k" means the same everywhere). A figure only one view shows is formatted in
// that view's module (a data wait in datawait.js, a profile's share in profileview.js,
// axis ticks in chartkit.js). No DOM.

export const DASH = "—";
export const isNum = (v) => typeof v === "number" && Number.isFinite(v);
/** A finite number, or null. */
export const numOrNull = (v) => (isNum(v) ? v : null);

export function fmtLoss(v) {
  if (!isNum(v)) return DASH;
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(3);
  return String(+v.toPrecision(5));
}

export function fmtPct(v, digits = 0) {
  return isNum(v) ? `${v.toFixed(digits)}%` : DASH;
}

export function fmtBytes(v) {
  if (!isNum(v)) return DASH;
  const gib = v / 2 ** 30;
  if (gib >= 100) return `${gib.toFixed(0)} GiB`;
  if (gib >= 1) return `${gib.toFixed(1)} GiB`;
  return `${(v / 2 ** 20).toFixed(0)} MiB`;
}

export function fmtDur(s) {
  if (!isNum(s) || s < 0) return DASH;
  if (s < 10) return `${s.toFixed(1)}s`;
  if (s < 60) return `${Math.round(s)}s`;
  const m = Math.floor(s / 60);
  if (s < 3600) return `${m}m ${String(Math.floor(s % 60)).padStart(2, "0")}s`;
  const h = Math.floor(s / 3600);
  if (s < 86400) return `${h}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function fmtAgo(s) {
  if (!isNum(s)) return DASH;
  if (s < 1.5) return "now";
  return `${fmtDur(Math.max(0, s)).replace(/\.\ds$/, "s")} ago`;
}

/** milliseconds -> "412 ms" / "1.32 s". */
export function fmtMs(ms) {
  if (!isNum(ms)) return DASH;
  if (ms >= 1000) return `${+(ms / 1000).toPrecision(3)} s`;
  return `${+ms.toPrecision(3)} ms`;
}

/** samples per ms (the wire unit) -> "12.3k/s". */
export function fmtThroughput(perMs) {
  return isNum(perMs) ? `${formatNumber(perMs * 1000)}/s` : DASH;
}

const INT = new Intl.NumberFormat("en-US");
/** 1024 -> "1,024". */
export function fmtInt(v) {
  return isNum(v) ? INT.format(v) : DASH;
}

export function pct(used, total) {
  return isNum(used) && isNum(total) && total > 0 ? (100 * used) / total : null;
}

/** A compact number: 3 significant digits, k/M/G suffixes, exponent when tiny. */
export function formatNumber(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return DASH;
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

const pad2 = (n) => String(n).padStart(2, "0");

/** "HH:MM" or "HH:MM:SS" for a unix time in seconds (local time). */
export function formatClock(t, seconds = true) {
  const d = new Date(t * 1000);
  const hm = `${pad2(d.getHours())}:${pad2(d.getMinutes())}`;
  return seconds ? `${hm}:${pad2(d.getSeconds())}` : hm;
}

/** "1h 02m" style durations for an elapsed-time axis. */
export function fmtElapsed(s) {
  if (!isNum(s)) return DASH;
  const neg = s < 0;
  s = Math.abs(s);
  let out;
  if (s < 60) out = `${+s.toFixed(s < 10 ? 1 : 0)}s`;
  else if (s < 3600) out = `${Math.floor(s / 60)}m${s % 60 >= 1 ? ` ${String(Math.round(s % 60)).padStart(2, "0")}s` : ""}`;
  else if (s < 86400) out = `${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  else out = `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
  return neg ? `-${out}` : out;
}

/** A percent axis label: one decimal below 10 % ("2.5%"), none above ("85%"). */
export function fmtPctAxis(v) {
  return isNum(v) ? `${+v.toFixed(Math.abs(v) < 10 ? 1 : 0)}%` : DASH;
}
