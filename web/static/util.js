// rankboard page helpers shared by the dashboard's modules: formatting, DOM building (text
// only ever through textContent), the JSON API and the server clock.

import { formatNumber } from "./charts.js";

export const DASH = "—";
export const isNum = (v) => typeof v === "number" && Number.isFinite(v);

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

/** An element with a class and text content (never HTML). */
export function h(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

/** Set an element's text only when it changed (a same-text write still invalidates style). */
export function setText(el, text) {
  const t = text === null || text === undefined ? "" : String(text);
  if (el.textContent !== t) el.textContent = t;
}

/** A `<button type="button">`. */
export function button(cls, text, onClick) {
  const b = h("button", cls, text);
  b.type = "button";
  if (onClick) b.addEventListener("click", onClick);
  return b;
}

export const $ = (id) => document.getElementById(id);
export const enc = (s) => encodeURIComponent(s);

// ---------------------------------------------------------------- server clock

// Times from the server are unix seconds of its clock; the ticking elapsed/ETA/"ago"
// figures use the offset learned from the Date header so a skewed laptop clock is harmless.
let clockOffset = 0;
let clockKnown = false;
export const serverNow = () => Date.now() / 1000 + clockOffset;

function learnClock(resp) {
  const d = Date.parse(resp.headers.get("Date") || "");
  if (!Number.isFinite(d)) return;
  const off = d / 1000 + 0.5 - Date.now() / 1000; // Date has 1 s resolution
  if (!clockKnown || Math.abs(off - clockOffset) > 2) {
    clockOffset = Math.abs(off) < 1.5 ? 0 : off;
    clockKnown = true;
  }
}

/** GET a JSON route of this origin; rejects with `err.status` on a non-2xx answer. */
export async function api(path, signal) {
  const resp = await fetch(path, { credentials: "same-origin", cache: "no-store", signal });
  learnClock(resp);
  if (!resp.ok) {
    const err = new Error(`${resp.status} ${path}`);
    err.status = resp.status;
    throw err;
  }
  return resp.json();
}

/** Stable colour for a status dot. */
export function statusDot(status) {
  const s = h("span", "dot");
  s.dataset.status = status || "unknown";
  return s;
}
