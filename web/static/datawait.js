// rankboard data wait (PROTOCOL 7.1): the one line above the straggler board that names
// why a rank (or the job) is slow when the input pipeline is the cause, and each rank's
// data_ms as the board and the rank table show it. Pure text (textContent only): rank
// numbers and figures come from the header (the median too: the broker's, issue 44).

import { fmtMs, isNum } from "./fmt.js";

/** Whole ms, halves up (as the broker's alert message rounds). */
export function roundMs(x) {
  return Math.floor(x + 0.5);
}

/** The cause line, or null when there is none: the first data straggler ("rank 417 waits
 * 310 ms a step for data, median 12 ms: input-bound on that rank", the median of the
 * other ranks' data_ms the broker compared it with: the entry's `median_ms`), else the whole
 * job when `data_share` >= 0.25 ("the whole job waits for data: 35 % of each step"). */
export function dataCause(header) {
  const list = (header && header.data_stragglers) || [];
  const top = list[0];
  if (top && isNum(top.rank) && isNum(top.data_ms) && isNum(top.median_ms)) {
    return `rank ${top.rank} waits ${roundMs(top.data_ms)} ms a step for data, median ${roundMs(top.median_ms)} ms: input-bound on that rank`;
  }
  const share = header ? header.data_share : null;
  // a share past 1 means waits longer than the steps they are part of (a rank's clock or
  // its data_ms is wrong, issue 38: 1e307 read "Infinity %"): said as more than the step
  if (isNum(share) && share > 1) return "the whole job waits for data: more than its whole step (check the ranks' data_ms)";
  if (isNum(share) && share >= 0.25) return `the whole job waits for data: ${Math.round(share * 100)} % of each step`;
  return null;
}

/** Show the cause line in `el` (hidden when there is none). */
export function renderDataCause(el, header) {
  if (!el) return;
  const text = dataCause(header);
  el.hidden = text === null;
  if (el.textContent !== (text || "")) el.textContent = text || "";
}

/** A rank's data_ms as a short figure ("data 310 ms"), or null when it has none: fmtMs, as
 * the rank table's "data wait" column shows it (one format for one figure, issue 44). */
export function dataFig(dataMs) {
  return isNum(dataMs) ? `data ${fmtMs(dataMs)}` : null;
}
