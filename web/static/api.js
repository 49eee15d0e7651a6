// rankboard's JSON API client and the server clock it learns from each answer's Date header.
// No DOM.

export const enc = (s) => encodeURIComponent(s);

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
