// rankboard's JSON API client and the server clock it learns from each answer's Date header.
// No DOM.

export const enc = (s) => encodeURIComponent(s);

// Times from the server are unix seconds of its clock; the ticking elapsed/ETA/"ago"
// figures use the offset learned from the Date header so a skewed laptop clock is harmless.
let clockOffset = 0;
let clockKnown = false;
let frozenAt = null;
export const serverNow = () => (frozenAt !== null ? frozenAt : Date.now() / 1000 + clockOffset);

/** Stop the clock at unix time `t` (a saved report reads "elapsed" and "ago" as of when it was made). */
export function freezeClock(t) {
  frozenAt = Number.isFinite(t) ? t : null;
}

function learnClock(resp) {
  const d = Date.parse(resp.headers.get("Date") || "");
  if (!Number.isFinite(d)) return;
  const off = d / 1000 + 0.5 - Date.now() / 1000; // Date has 1 s resolution
  if (!clockKnown || Math.abs(off - clockOffset) > 2) {
    clockOffset = Math.abs(off) < 1.5 ? 0 : off;
    clockKnown = true;
  }
}

async function get(path, signal) {
  const resp = await fetch(path, { credentials: "same-origin", cache: "no-store", signal });
  learnClock(resp);
  if (!resp.ok) {
    const err = new Error(`${resp.status} ${path}`);
    err.status = resp.status;
    throw err;
  }
  return resp;
}

/** GET a JSON route of this origin; rejects with `err.status` on a non-2xx answer. */
export async function api(path, signal) {
  return (await get(path, signal)).json();
}

/** POST `body` as JSON to a route of this origin: `{ status, data }` whatever the status
 * (`data`: the answer's JSON, `{}` when it has none); rejects only when the web is
 * unreachable. */
export async function postJson(path, body) {
  const resp = await fetch(path, {
    method: "POST", credentials: "same-origin", cache: "no-store",
    headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  learnClock(resp);
  return { status: resp.status, statusText: resp.statusText, data: await resp.json().catch(() => ({})) };
}

/** `api`, with the answer's headers: `{ data, headers }`. */
export async function apiWithHeaders(path, signal) {
  const resp = await get(path, signal);
  return { data: await resp.json(), headers: resp.headers };
}
