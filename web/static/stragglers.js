// rankboard straggler board: the ranks most often the slowest (chips), and the strip of
// each rank's (or host's) step time relative to the median rank over time. The strip keeps its own
// columns, one per `ranks` update (the store's stepTimes hook feeds it).

import { serverNow } from "./api.js";
import { dataFig, renderDataCause } from "./datawait.js";
import { $, button, h, setText } from "./dom.js";
import { fmtAgo, fmtInt, fmtMs, fmtPct, formatClock, isNum } from "./fmt.js";
import { StragglerStrip } from "./heatmap.js";
import { hostGroups, stragglerThreshold, worldSize } from "./model.js";

export class Stragglers {
  /** `page`: {store, selectTab}. */
  constructor(page) {
    this.page = page;
    this.strip = new StragglerStrip($("straggler-strip"), {
      onPick: (rank) => page.selectTab(rank), ago: (t) => fmtAgo(serverNow() - t),
    });
  }

  reset() {
    this.strip.reset();
    this.openedAt = serverNow(); // the strip starts here: the web keeps no history of it
  }

  /** Whether every column drawn so far has every rank within 5 % of the median: a
   * synchronous job's ranks step together (each waits for the slowest in its collectives),
   * so an even strip says "lockstep", not "no straggler". */
  lockstep() {
    const cols = this.strip.cols;
    if (!cols.length) return false;
    return cols.every((c) => [...c.ratio.values()].every((v) => v > 0.95 && v < 1.05));
  }

  /** One strip column: every rank's mean step time at server time `t`. */
  push(t, stepMs) {
    this.strip.push(t, stepMs);
  }

  /** "most often slowest: rank N (x% of recent steps)", for the step charts' hover. */
  text() {
    const rows = this.page.store.rows || [];
    let best = null;
    for (const r of rows) if (isNum(r.slowShare) && (!best || r.slowShare > best.slowShare)) best = r;
    return best && best.slowShare > 0 ? `most often slowest: rank ${best.rank} (${fmtPct(best.slowShare * 100, 0)} of recent steps)` : null;
  }

  render(rows) {
    const store = this.page.store;
    if (!store.stepRanks) return;
    const n = worldSize(store);
    const thr = stragglerThreshold(n);
    setText($("straggler-sub"), `slowest rank per closed step over the last ≤1000 steps · even share 1/${fmtInt(n)} = ${fmtPct(100 / Math.max(1, n), 1)} · marked at ≥ ${fmtPct(thr * 100, 0)}`);
    const marked = rows.filter((r) => r.marks.includes("straggler")).sort((a, b) => b.slowShare - a.slowShare);
    const top = marked.length ? marked : rows.filter((r) => isNum(r.slowShare)).sort((a, b) => b.slowShare - a.slowShare).slice(0, 1);
    const chips = top.slice(0, 6).map((r) => {
      const chip = button(`straggler-chip${r.marks.includes("straggler") ? " marked" : ""}`, null, () => this.page.selectTab(r.rank));
      chip.dataset.rank = String(r.rank);
      if (r.marks.includes("straggler")) chip.dataset.mark = "straggler";
      chip.append(h("span", "chip-rank mono", `rank ${r.rank}`), h("span", "chip-host", r.host ?? ""),
        h("span", "chip-fig mono", `slowest in ${fmtPct((r.slowShare || 0) * 100, 0)} of steps`),
        h("span", "chip-fig mono muted", isNum(r.stepRatio) ? `${fmtMs(r.stepMs)} · ${r.stepRatio.toFixed(2)}× median` : fmtMs(r.stepMs)));
      if (dataFig(r.dataMs)) chip.append(h("span", "chip-fig chip-data mono muted", dataFig(r.dataMs)));
      return chip;
    });
    if (marked.length > 6) chips.push(h("span", "muted", `and ${fmtInt(marked.length - 6)} more marked`));
    if (!marked.length) chips.unshift(h("span", "muted straggler-none", "no straggler: the slowest rank changes from step to step"));
    $("straggler-marks").replaceChildren(...chips);
    renderDataCause($("data-cause"), store.header); // 7.1: the cause, above the board
    const groups = hostGroups(store, rows);
    const perRank = rows.length <= 48;
    const stripRows = perRank
      ? groups.flatMap((g) => g.ranks.map((r) => ({ label: `rank ${r}`, host: g.host, ranks: [r] })))
      : groups.map((g) => ({ label: g.host, host: g.host, ranks: g.ranks }));
    this.strip.setRows(stripRows);
    const since = isNum(this.openedAt) ? ` · since this page opened at ${formatClock(this.openedAt)}` : "";
    const even = this.lockstep() ? " · even: the ranks step in lockstep (each waits for the slowest inside its collectives), so the step time names no rank; the data wait and the slowest-rank share above do" : "";
    setText($("strip-what"), `${perRank ? "one row per rank" : `one row per host (its slowest rank) · ${fmtInt(groups.length)} hosts`} · one column per ranks update (~1/s, each rank's mean step time over its last ≤100 steps) · newest right${since}${even}`);
  }
}
