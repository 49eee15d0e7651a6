// The page's one notion of "slow": a rank's time against the MEDIAN rank's. A mean is pulled
// by a hang (after a 12 s wait in all_reduce every other rank's window holds it, and a
// straggler at 181 ms read "0.86× mean"); the median rank is not. Every signal reads from
// here: the table's step-time ratio and its badges, the straggler chips, the strip, the
// profile's "(straggler)"/"(slowest)" label. A badge needs a difference: within SLOW_AT of
// the median no rank is "slowest" or "fastest", however the ranks happen to sort.

/** A rank this much slower than the median rank (or faster, 1/SLOW_AT) is marked. */
export const SLOW_AT = 1.1;

/** The true median of the positive finite numbers in `vals`; null when there are none. */
export function medianOf(vals) {
  const s = [];
  for (const v of vals) if (typeof v === "number" && Number.isFinite(v) && v > 0) s.push(v);
  if (!s.length) return null;
  s.sort((a, b) => a - b);
  const mid = s.length >> 1;
  return s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
}

/**
 * Fastest / slowest of `items` ([{id, time}], time: larger = slower) when either stands out
 * from the median by SLOW_AT; `{fast, slow}` ids or null. Two ranks at 110 ms each: none.
 */
export function extremesByMedian(items) {
  const med = medianOf(items.map((i) => i.time));
  if (med === null || items.length < 2) return { fast: null, slow: null };
  let fast = null;
  let slow = null;
  for (const i of items) {
    if (!(i.time > 0)) continue;
    if (!fast || i.time < fast.time) fast = i;
    if (!slow || i.time > slow.time) slow = i;
  }
  return {
    fast: fast && fast.time * SLOW_AT <= med ? fast.id : null,
    slow: slow && slow.time >= med * SLOW_AT ? slow.id : null,
  };
}

/** The rank the page calls the straggler among `rows` (marked, highest slowest share), or null. */
export function stragglerOf(rows) {
  let best = null;
  for (const r of rows || []) {
    if (r.marks && r.marks.includes("straggler") && (!best || r.slowShare > best.slowShare)) best = r;
  }
  return best ? best.rank : null;
}
