// rankboard collective verdict (PROTOCOL 7.2): the broker's groups of
// `GET /api/runs/<run>/collectives` as sentences, the first thing a trouble card says
// ("rank 2 has not entered gloo:all_reduce #2501 of group 0, where ranks 0–1 wait").
// The dashboard's stall view and the saved report both use it. Strings from ranks (op names,
// group ids) are returned as text; callers put them in the DOM through textContent only.

/** Ranges a rank list names before it says how many more ranks it leaves out. */
const RANGES_SHOWN = 16;

/** [0, 1, 2, 5] -> "0–2, 5"; past RANGES_SHOWN ranges, "… and N more ranks". */
export function rankRanges(ranks) {
  const sorted = (ranks || []).filter((r) => Number.isInteger(r)).sort((a, b) => a - b);
  const parts = [];
  for (let i = 0; i < sorted.length; i++) {
    let j = i;
    while (j + 1 < sorted.length && sorted[j + 1] === sorted[j] + 1) j++;
    if (parts.length === RANGES_SHOWN) {
      return `${parts.join(", ")} … and ${(sorted.length - i).toLocaleString("en-US")} more`;
    }
    parts.push(j > i ? `${sorted[i]}–${sorted[j]}` : String(sorted[i]));
    i = j;
  }
  return parts.join(", ");
}

/** "rank 2" / "ranks 0–1" (with the verb's number: [noun, singular]). */
function who(ranks) {
  return [`${ranks.length === 1 ? "rank" : "ranks"} ${rankRanges(ranks)}`, ranks.length === 1];
}

/** One listed group as sentences, most telling first. */
export function verdictLines(group) {
  const g = group || {};
  const what = `${g.op || "collective"} #${g.seq} of group ${g.pg}`;
  const waiting = Array.isArray(g.waiting) ? g.waiting : [];
  const [waitWho, waitOne] = who(waiting);
  const where = waiting.length ? `, where ${waitWho} ${waitOne ? "waits" : "wait"}` : "";
  const lines = [];
  const behind = (Array.isArray(g.behind) ? g.behind : []).map((b) => b.rank);
  if (behind.length) {
    const [w, one] = who(behind);
    lines.push(`${w} ${one ? "has" : "have"} not entered ${what}${where}`);
  }
  // ranks in the same other collective share one sentence (a 1,000-rank mismatch drew one
  // line a rank); the first of them keeps the sentence's place
  const others = new Map();
  for (const m of Array.isArray(g.mismatched) ? g.mismatched : []) {
    const key = `${m.op || "?"} ${JSON.stringify(m.input_sizes ?? [])}`;
    if (!others.has(key)) others.set(key, []);
    others.get(key).push(m.rank);
  }
  for (const [key, ranks] of others) {
    const [w, one] = who(ranks);
    lines.push(`${w} ${one ? "is" : "are"} in ${key}, not ${what}${where}`);
  }
  const absent = Array.isArray(g.absent) ? g.absent : [];
  if (absent.length) {
    const [w, one] = who(absent);
    lines.push(`${w} sent no current collectives (absent from group ${g.pg})`);
  }
  if (!lines.length && waiting.length) lines.push(`${waitWho} ${waitOne ? "waits" : "wait"} in ${what}`);
  return lines;
}

/** The most sentences a verdict shows: about a screen (issue 38, item 7: a 1,000-rank
 * mismatch with every rank's sizes its own drew 7,992 lines). */
export const VERDICT_LINES = 12;

/** Every listed group's sentences, in the broker's order (group 0 first); past
 * VERDICT_LINES the first ones and a last line saying how many more there are. */
export function verdictText(groups) {
  const lines = (Array.isArray(groups) ? groups : []).flatMap(verdictLines);
  if (lines.length <= VERDICT_LINES) return lines;
  const rest = lines.length - (VERDICT_LINES - 1);
  return [...lines.slice(0, VERDICT_LINES - 1),
    `… and ${rest.toLocaleString("en-US")} more sentences like these (all of them: GET /api/runs/<run>/collectives)`];
}

/** "2026-12-06 03:12:45" (local time) for a unix time in seconds. */
function stamp(t) {
  const d = new Date(t * 1000);
  const p = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
}

/**
 * The header's `collectives_last` (PROTOCOL 8.5: the latest verdict that named a rank, kept
 * after its frames stop being current and across restarts) as `{title, lines}`, or null when
 * there is none. `title` carries its time; `lines` are its groups' sentences, plus one per
 * group whose rank lists were cut (`counts` holds the full lengths).
 */
export function lastVerdictText(last) {
  if (!last || typeof last !== "object" || !Array.isArray(last.groups) || !last.groups.length) return null;
  const at = typeof last.at === "number" && Number.isFinite(last.at) ? stamp(last.at) : "at an unknown time";
  const lines = verdictText(last.groups);
  for (const g of last.groups) {
    const c = g && g.counts;
    if (!c || typeof c !== "object") continue;
    const cut = ["waiting", "behind", "absent", "mismatched"]
      .filter((k) => Number.isInteger(c[k]) && Array.isArray(g[k]) && c[k] > g[k].length)
      .map((k) => `${c[k].toLocaleString("en-US")} ${k}`);
    if (cut.length) lines.push(`group ${g.pg}: ${cut.join(", ")} in all (the lowest 1,024 of each are named)`);
  }
  return { title: `last collective verdict, ${at}`, lines };
}
