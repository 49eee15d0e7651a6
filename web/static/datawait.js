// rankboard data wait (PROTOCOL 7.1): the one line above the straggler board that names
// why a rank (or the job) is slow when the input pipeline is the cause, and each rank's
// data_ms as the board and the rank table show it. Pure text (textContent only): rank
// numbers and figures come from the header and the ranks array.

import { isNum } from "./fmt.js";

/** Whole ms, halves up (as the broker's alert message rounds). */
export function roundMs(x) {
  return Math.floor(x + 0.5);
}

/** The median of the values (the mean of the two middle ones for an even count); null: none. */
export function median(values) {
  const v = values.filter(isNum).sort((a, b) => a - b);
  if (!v.length) return null;
  const mid = v.length >> 1;
  return v.length % 2 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
}

/** The cause line, or null when there is none: the first data straggler ("rank 417 waits
 * 310 ms a step for data, median 12 ms: input-bound on that rank", the median of the
 * other ranks' data_ms), else the whole job when `data_share` >= 0.25 ("the whole job waits
 * for data: 35 % of each step"). `ranks`: the ranks array. */
export function dataCause(header, ranks) {
  const list = (header && header.data_stragglers) || [];
  const top = list[0];
  if (top && isNum(top.rank) && isNum(top.data_ms)) {
    const m = median((ranks || []).filter((r) => r && r.rank !== top.rank).map((r) => r.data_ms));
    if (m !== null) {
      return `rank ${top.rank} waits ${roundMs(top.data_ms)} ms a step for data, median ${roundMs(m)} ms: input-bound on that rank`;
    }
  }
  const share = header ? header.data_share : null;
  // a share past 1 means waits longer than the steps they are part of (a rank's clock or
  // its data_ms is wrong, issue 38: 1e307 read "Infinity %"): said as more than the step
  if (isNum(share) && share > 1) return "the whole job waits for data: more than its whole step (check the ranks' data_ms)";
  if (isNum(share) && share >= 0.25) return `the whole job waits for data: ${Math.round(share * 100)} % of each step`;
  return null;
}

/** Show the cause line in `el` (hidden when there is none). */
export function renderDataCause(el, header, ranks) {
  if (!el) return;
  const text = dataCause(header, ranks);
  el.hidden = text === null;
  if (el.textContent !== (text || "")) el.textContent = text || "";
}

/** A rank's data_ms as a short figure ("data 310 ms"), or null when it has none. */
export function dataFig(dataMs) {
  return isNum(dataMs) ? `data ${dataMs < 10 ? dataMs.toFixed(1) : roundMs(dataMs)} ms` : null;
}
