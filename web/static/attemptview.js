// rankboard attempts on the page (PROTOCOL 8.1), beside what steps.js draws on the step charts:
// the header's line of what restarts cost ("attempt 3 · 1,200 steps re-run ≈ 41 GPU-hours"),
// the epoch chart's restart markers and each attempt's superseded epochs drawn faint (fetched
// with /history?attempt=K, or a saved report's embedded ones), and the straggler strip that
// starts afresh with each attempt (its columns were the old processes' step times).
// The rules are attempts.js's; text from a run reaches the DOM only through textContent.

import { api, enc } from "./api.js";
import {
  attemptsOf, causeText, currentAttempt, GHOST_ATTEMPTS, RESTART_COLOR, restartCost, restartMarkers, supersededRanges,
} from "./attempts.js";
import { colorAt } from "./axes.js";
import { h, setText } from "./dom.js";
import { isNum } from "./fmt.js";
import { median, metricNames } from "./model.js";

export class AttemptView {
  /**
   * `page`: {store, steps, overview, stragglers}; `hooks.history(attempt)` (optional) ->
   * Promise<epoch records of that attempt> (a saved report's embedded ones; default GET
   * /history?attempt=K); `hooks.superseded()` (optional) -> [{attempt, start}] known besides
   * the header's.
   */
  constructor(page, hooks = {}) {
    this.page = page;
    this.hooks = hooks;
    this.reset();
  }

  /** A new run. */
  reset() {
    this.gen = (this.gen || 0) + 1;
    this.attempt = null;
    this.ghostKey = null;
    this.ghosts = []; // [{attempt, records}]
    this.drawnSig = null;
    this.fetches = [];
    const metrics = this.page.overview && this.page.overview.metrics;
    if (metrics) {
      metrics.setGhosts([]);
      metrics.setMarkers([]);
    }
  }

  /** The header's cost line: created beside the run's name (the live page and the report
   * share the markup; nothing to add to either template). */
  _line() {
    let el = document.getElementById("attempt-line");
    if (!el) {
      el = h("span", "attempt-line mono");
      el.id = "attempt-line";
      el.dataset.testid = "attempt-line";
      el.hidden = true;
      const row = document.querySelector(".run-title-row");
      if (!row) return null;
      row.append(el);
    }
    return el;
  }

  /** The line's median step time (ms): the step time chart's, else the ranks' step times. */
  _stepMs() {
    const ms = this.page.steps.medianStepMs();
    if (isNum(ms)) return ms;
    const ranks = this.page.store.ranks.map((r) => r.step_ms).filter(isNum);
    return ranks.length ? median(ranks) : null;
  }

  render() {
    const { store, overview } = this.page;
    const hd = store.header;
    if (!hd) return;
    const cur = currentAttempt(hd);
    if (this.attempt !== null && cur > this.attempt && this.page.stragglers) {
      this.page.stragglers.reset(); // its columns were the previous attempt's processes
    }
    this.attempt = cur;
    const el = this._line();
    if (el) {
      const text = restartCost(hd, this._stepMs());
      el.hidden = text === null;
      setText(el, text || "");
      el.title = text ? "superseded steps × the line's median step time × the world size of the attempt that ran them" : "";
    }
    overview.metrics.setMarkers(this._epochMarkers(hd));
    this._ghosts();
  }

  /** The epoch chart's restart markers: the header's, and a rewind the store saw live that
   * the header does not say yet (its figures may trail the records). */
  _epochMarkers(hd) {
    const out = restartMarkers(hd, "epoch");
    const named = new Set(out.map((m) => m.text));
    for (const w of this.page.store.epochRewinds) {
      const text = `restart ${w.next}`;
      if (!Number.isInteger(w.next) || named.has(text)) continue;
      named.add(text);
      const prev = attemptsOf(hd).find((a) => a.attempt === w.next - 1);
      out.push({ step: w.start, text, color: RESTART_COLOR, hover: causeText(w.next - 1, prev ? prev.cause : null) });
    }
    return out;
  }

  /** The superseded epochs to draw: the header's ranges, the rewinds the store saw, and
   * those the `superseded` hook knows of (a saved report's embedded epochs). */
  _ranges() {
    const by = new Map();
    const known = this.hooks.superseded ? this.hooks.superseded() : [];
    for (const r of [...supersededRanges(this.page.store.header, "epoch"), ...this.page.store.epochRewinds, ...known]) {
      const was = by.get(r.attempt);
      if (!was || (r.start !== null && (was.start === null || r.start < was.start))) by.set(r.attempt, { ...r });
    }
    return [...by.values()].sort((a, b) => a.attempt - b.attempt).slice(-GHOST_ATTEMPTS);
  }

  async _ghosts() {
    const store = this.page.store;
    const hd = store.header || {};
    const ranges = this._ranges();
    const sup = (Array.isArray(hd.attempts) ? hd.attempts : []).map((a) => a && a.superseded_epochs).join(",");
    const key = `${ranges.map((r) => `${r.attempt}:${r.start}`).join(",")}|${sup}`;
    if (key !== this.ghostKey) {
      this.ghostKey = key;
      const gen = ++this.gen;
      const got = await Promise.all(ranges.map(async (r) => {
        try {
          const recs = await this._history(r.attempt);
          return { attempt: r.attempt, records: (Array.isArray(recs) ? recs : []).filter((x) => x && isNum(x.epoch) && (r.start === null || x.epoch >= r.start)) };
        } catch {
          return null; // an attempt no longer listed: nothing faint for it
        }
      }));
      if (gen !== this.gen) return;
      this.ghosts = got.filter((g) => g && g.records.length);
      this.ghostsVersion = (this.ghostsVersion || 0) + 1;
    }
    this._drawGhosts();
  }

  _history(attempt) {
    if (this.hooks.history) return this.hooks.history(attempt);
    const url = `/api/runs/${enc(this.page.store.run)}/history?attempt=${attempt}`;
    this.fetches.push(url);
    return api(url);
  }

  /** Each metric of each attempt's superseded epochs, faint in the metric's colour. */
  _drawGhosts() {
    const names = metricNames(this.page.store);
    // drawn again only when the fetched records or the metric names changed (this runs on
    // every render of the header, the records and the steps)
    const sig = `${this.ghostsVersion || 0}\u0000${names.join("\u0000")}`;
    if (sig === this.drawnSig) return;
    this.drawnSig = sig;
    const out = [];
    for (const g of this.ghosts) {
      const recs = g.records.slice().sort((a, b) => a.epoch - b.epoch);
      names.forEach((n, i) => {
        const values = recs.map((r) => (r.metrics ? r.metrics[n] : null));
        if (!values.some(isNum)) return;
        out.push({ name: `${n} · attempt ${g.attempt + 1} (superseded)`, color: colorAt(i), x: recs.map((r) => r.epoch), values });
      });
    }
    this.page.overview.metrics.setGhosts(out);
  }
}

