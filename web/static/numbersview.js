// rankboard numbers that go wrong (PROTOCOL 8.3), as the trouble card says them: the first
// non-finite value of a metric and the rank that had it first ("loss is nan at step 41,200
// on rank 13 first (3 ranks)"), and a replica that disagrees with the others ("grad_norm on
// rank 7 disagrees with the other 63 ranks since step 40,112 (12 steps): silent data
// corruption? node-c"); and the steps the step charts mark.
//
// Read from the run header's `nonfinite` and `replica_divergence`; the value's word (nan,
// inf, -inf) and the full counts are in the matching alerts' messages, which the broker
// wrote. Everything is returned as text: callers put it in the DOM through textContent
// only (metric names and hosts come from ranks).

import { fmtInt } from "./fmt.js";

/** Lines shown at most (the header holds up to 64 entries of each kind). */
const MAX_LINES = 6;

function alertsOf(header, kind) {
  const list = header && Array.isArray(header.alerts) ? header.alerts : [];
  return list.filter((a) => a && a.kind === kind && typeof a.message === "string");
}

/** The alert message of a first non-finite entry: its value's word and its rank count. */
function nonfiniteFacts(header, e) {
  const head = `${e.metric} is `;
  const at = ` at step ${e.step}: first non-finite `;
  for (const a of alertsOf(header, "nonfinite")) {
    const m = a.message;
    if (!m.startsWith(head)) continue;
    const i = m.indexOf(at, head.length);
    if (i < 0) continue;
    const word = m.slice(head.length, i);
    const n = /\((\d+) ranks?\)$/.exec(m);
    return { word, count: n ? Number(n[1]) : null };
  }
  return { word: "non-finite", count: null };
}

/** The ranks that had a value at a divergence's first step (from rank's alert), or null. */
function replicaCount(header, e) {
  const head = `${e.metric} = `;
  const at = ` at step ${e.first_step}, `;
  for (const a of alertsOf(header, "replica_divergence")) {
    if (a.rank !== (e.ranks || [])[0]) continue;
    const m = a.message;
    if (!m.startsWith(head) || m.indexOf(at) < 0) continue;
    const n = /(?:the majority of|no majority among) (\d+) ranks/.exec(m);
    if (n) return Number(n[1]);
  }
  return null;
}

function rankList(ranks) {
  return ranks.length <= 3 ? ranks.join(", ") : `${ranks.slice(0, 3).join(", ")} and ${ranks.length - 3} more`;
}

/**
 * The trouble card's lines: [{kind: "nonfinite" | "replica_divergence", text, host,
 * metric, step}], first non-finite values first (oldest first), then divergences.
 * `hostOf(rank)` -> host name or null.
 */
export function numbersLines(header, hostOf) {
  const out = [];
  const nonfinite = header && Array.isArray(header.nonfinite) ? header.nonfinite : [];
  for (const e of nonfinite) {
    if (!e || typeof e.metric !== "string" || !Number.isInteger(e.step)) continue;
    const { word, count } = nonfiniteFacts(header, e);
    const n = count ?? (Array.isArray(e.ranks) ? e.ranks.length : 1);
    const host = e.host || (Number.isInteger(e.rank) ? hostOf(e.rank) : null);
    out.push({
      kind: "nonfinite", metric: e.metric, step: e.step, host,
      text: `${e.metric} is ${word} at step ${fmtInt(e.step)} on rank ${e.rank} first (${fmtInt(n)} ${n === 1 ? "rank" : "ranks"})`,
    });
  }
  const more = header && Number.isInteger(header.nonfinite_more) ? header.nonfinite_more : 0;
  const lines = out.slice(0, MAX_LINES);
  if (out.length > MAX_LINES || more > 0) {
    const rest = out.length - lines.length + more;
    lines.push({ kind: "nonfinite", metric: null, step: null, host: null, text: `and ${fmtInt(rest)} more metrics with a non-finite value` });
  }
  const divergence = header && Array.isArray(header.replica_divergence) ? header.replica_divergence : [];
  const world = header && Number.isInteger(header.world_size) ? header.world_size : null;
  for (const e of divergence.slice(0, MAX_LINES)) {
    if (!e || typeof e.metric !== "string" || !Number.isInteger(e.first_step)) continue;
    const ranks = Array.isArray(e.ranks) ? e.ranks.filter((r) => Number.isInteger(r)) : [];
    const steps = Number.isInteger(e.count) ? e.count : 1;
    const since = `since step ${fmtInt(e.first_step)} (${fmtInt(steps)} ${steps === 1 ? "step" : "steps"})`;
    const hosts = [...new Set(ranks.map((r) => hostOf(r)).filter((x) => x))];
    const where = hosts.length ? ` ${hosts.slice(0, 3).join(", ")}${hosts.length > 3 ? "…" : ""}` : "";
    const n = replicaCount(header, e) ?? world;
    let text;
    if (e.majority === null || e.majority === undefined) {
      text = `${e.metric}: no majority among ${n !== null ? fmtInt(n) : "the"} ranks ${since}: silent data corruption?${where}`;
    } else {
      const others = n !== null ? n - ranks.length : null;
      const one = ranks.length === 1;
      text = `${e.metric} on ${one ? "rank" : "ranks"} ${rankList(ranks)} ${one ? "disagrees" : "disagree"} with the other ${others !== null ? fmtInt(others) : ""}${others !== null ? " " : ""}ranks ${since}: silent data corruption?${where}`;
    }
    lines.push({ kind: "replica_divergence", metric: e.metric, step: e.first_step, host: hosts[0] || null, text });
  }
  return lines;
}

/**
 * The steps a step chart marks: metric -> [{step, text}] (a first non-finite value, the
 * first step a replica disagreed).
 */
export function numberMarkers(header) {
  const out = new Map();
  const add = (metric, step, text) => {
    if (typeof metric !== "string" || !Number.isInteger(step)) return;
    if (!out.has(metric)) out.set(metric, []);
    out.get(metric).push({ step, text });
  };
  for (const e of (header && Array.isArray(header.nonfinite) ? header.nonfinite : [])) {
    if (e) add(e.metric, e.step, `first non-finite: rank ${e.rank}`);
  }
  for (const e of (header && Array.isArray(header.replica_divergence) ? header.replica_divergence : [])) {
    if (e) add(e.metric, e.first_step, `replicas disagree: rank ${(e.ranks || []).join(", ")}`);
  }
  return out;
}
