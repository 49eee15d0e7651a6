// rankboard collective verdict (PROTOCOL 7.2): the broker's groups of
// `GET /api/runs/<run>/collectives` as sentences, the first thing a trouble card says
// ("rank 2 has not entered gloo:all_reduce #2501 of group 0, where ranks 0–1 wait").
// The dashboard's stall view and the saved report both use it. Strings from ranks (op names,
// group ids) are returned as text; callers put them in the DOM through textContent only.

/** [0, 1, 2, 5] -> "0–2, 5". */
export function rankRanges(ranks) {
  const sorted = (ranks || []).filter((r) => Number.isInteger(r)).sort((a, b) => a - b);
  const parts = [];
  for (let i = 0; i < sorted.length; i++) {
    let j = i;
    while (j + 1 < sorted.length && sorted[j + 1] === sorted[j] + 1) j++;
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
  for (const m of Array.isArray(g.mismatched) ? g.mismatched : []) {
    lines.push(`rank ${m.rank} is in ${m.op || "?"} ${JSON.stringify(m.input_sizes ?? [])}, not ${what}${where}`);
  }
  const absent = Array.isArray(g.absent) ? g.absent : [];
  if (absent.length) {
    const [w, one] = who(absent);
    lines.push(`${w} sent no current collectives (absent from group ${g.pg})`);
  }
  if (!lines.length && waiting.length) lines.push(`${waitWho} ${waitOne ? "waits" : "wait"} in ${what}`);
  return lines;
}

/** Every listed group's sentences, in the broker's order (group 0 first). */
export function verdictText(groups) {
  return (Array.isArray(groups) ? groups : []).flatMap(verdictLines);
}
