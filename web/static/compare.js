// rankboard run comparison: several runs, one metric, overlaid (one colour per run).
//
// The selection lives in the URL hash, so a link reproduces the view:
//   #compare=<run>,<run>,...&metric=<name>&x=epoch|step
// (run ids are [A-Za-z0-9._:-], so a comma separates them; the metric is URL-encoded).
// Epoch x: each run's /history; step x: each run's /steps?metric=..&points=<width>, and a
// drag-zoom refetches the range per run.

import { api, enc } from "./api.js";
import { colorAt } from "./axes.js";
import { BandChart, STEP_AXIS } from "./bandchart.js";
import { Buckets } from "./buckets.js";
import { button, h } from "./dom.js";
import { fmtInt, formatNumber, isNum } from "./fmt.js";

const STEP_BUILTINS = ["step_ms", "samples_per_s", "tokens_per_s"];
const EPOCH_AXIS = { kind: "epoch", label: "epoch", map: (s) => s, inv: (x) => x };
const REFRESH_MS = 10000;
/** PROTOCOL 2: a run id; anything else in a link is shown, never fetched. */
// PROTOCOL section 2 (rank_agent/protocol.py RUN_ID_PATTERN): the whole id, not dots only.
const RUN_ID = /^(?!\.+$)[A-Za-z0-9._:-]{1,128}$/;

/** Parse `#compare=...` (null when the hash is not a comparison). */
export function parseCompareHash(hash) {
  const m = /(?:^#|&)compare=([^&]*)/.exec(hash);
  if (!m) return null;
  const get = (k) => {
    const mm = new RegExp(`(?:^#|&)${k}=([^&]*)`).exec(hash);
    if (!mm) return null;
    try {
      return decodeURIComponent(mm[1]);
    } catch {
      return null;
    }
  };
  let runs;
  try {
    runs = decodeURIComponent(m[1]).split(",").filter(Boolean);
  } catch {
    runs = [];
  }
  const x = get("x") === "step" ? "step" : "epoch";
  return { runs: [...new Set(runs)], metric: get("metric") || "loss", x };
}

export function compareHash(sel) {
  return `#compare=${sel.runs.map(enc).join(",")}&metric=${enc(sel.metric)}&x=${sel.x}`;
}

export class CompareView {
  constructor(section, hooks) {
    this.section = section;
    this.hooks = hooks; // {runs() -> [{run, status, label, epochs_done}], close()}
    this.sel = { runs: [], metric: "loss", x: "epoch" };
    this.history = new Map(); // run -> records
    this.headers = new Map(); // run -> header (step_metrics)
    this.stepData = new Map(); // run -> Buckets of the current metric/range
    this.gen = 0;
    this.view = null;
    this._errors = []; // the runs the last epoch-axis load could not read
    this._drawnStepOnly = undefined; // the step runs the epoch chart left out (none drawn yet)
    this._build();
  }

  _build() {
    const card = h("div", "card compare-card");
    const head = h("div", "section-head");
    head.append(h("h2", "section-title", "Compare runs"));
    this.sub = h("span", "section-sub");
    const tools = h("div", "section-tools");
    const mlab = h("label", "inline-field");
    mlab.append(h("span", "tool-label", "metric"));
    this.metricSel = h("select", "tool-select");
    this.metricSel.id = "compare-metric";
    this.metricSel.addEventListener("change", () => this._set({ metric: this.metricSel.value }));
    mlab.append(this.metricSel);
    const xlab = h("label", "inline-field");
    xlab.append(h("span", "tool-label", "x axis"));
    this.xSel = h("select", "tool-select");
    this.xSel.id = "compare-x";
    for (const v of ["epoch", "step"]) {
      const o = h("option", null, v);
      o.value = v;
      this.xSel.append(o);
    }
    this.xSel.addEventListener("change", () => this._set({ x: this.xSel.value }));
    xlab.append(this.xSel);
    const back = button("btn btn-small", "back to run", () => this.hooks.close());
    back.id = "compare-close";
    tools.append(mlab, xlab, back);
    head.append(this.sub, tools);
    const body = h("div", "compare-body");
    const side = h("div", "compare-side");
    this.filter = h("input", "rank-search");
    this.filter.type = "search";
    this.filter.placeholder = "filter runs…";
    this.filter.setAttribute("aria-label", "filter runs");
    this.filter.addEventListener("input", () => this.renderRuns());
    this.list = h("div", "compare-runs");
    this.list.id = "compare-runs";
    side.append(this.filter, this.list);
    const main = h("div", "compare-main");
    this.chart = new BandChart(main, {
      title: "", chartId: "compare", legend: true, band: false, log: true, smoothing: true,
      height: 380, yFormat: formatNumber, emptyText: "pick runs to compare",
      onZoom: (r) => this._zoom(r),
    });
    body.append(side, main);
    card.append(head, body);
    this.section.append(card);
  }

  /** Show the view with a selection (from the hash or the compare button). */
  open(sel) {
    this.sel = { runs: sel.runs.slice(0, 24), metric: sel.metric || "loss", x: sel.x === "step" ? "step" : "epoch" };
    this.view = null;
    this.chart.setView(null);
    this.section.hidden = false;
    this.renderRuns();
    this.load();
    clearInterval(this._timer);
    this._timer = setInterval(() => {
      if (!document.hidden && !this.section.hidden) this.load(true);
    }, REFRESH_MS);
  }

  close() {
    this.section.hidden = true;
    clearInterval(this._timer);
    this.gen++;
  }

  _set(patch) {
    Object.assign(this.sel, patch);
    if (patch.x || patch.metric) {
      this.view = null;
      this.chart.setView(null);
    }
    history.replaceState(null, "", `${location.pathname}${location.search}${compareHash(this.sel)}`);
    this.renderRuns();
    this.load();
  }

  /** The page's run list arrived or changed: the list is drawn again, and the epoch chart
   * too when the list changes which chosen runs log steps (a link opened directly draws
   * before the page knows that). */
  runsChanged() {
    if (!this.section.hidden && this.sel.x === "epoch" && this._drawnStepOnly !== undefined
        && this.sel.runs.filter((run) => this._stepOnly(run)).join("\n") !== this._drawnStepOnly
        && !this._drawEpochs()) this._loadStatus(this._errors);
    this.renderRuns();
  }

  renderRuns() {
    this._relabel();
    const runs = this.hooks.runs();
    const q = this.filter.value.trim().toLowerCase();
    const chosen = new Set(this.sel.runs);
    const known = new Set(runs.map((r) => r.run));
    const all = [...runs, ...this.sel.runs.filter((r) => !known.has(r)).map((run) => ({ run, status: "unknown" }))];
    const rows = all.filter((r) => !q || chosen.has(r.run) || r.run.toLowerCase().includes(q) || (r.label || "").toLowerCase().includes(q))
      .slice(0, 200).map((r) => {
        const lab = h("label", "compare-run");
        lab.dataset.run = r.run;
        const cb = h("input");
        cb.type = "checkbox";
        cb.value = r.run;
        cb.checked = chosen.has(r.run);
        cb.addEventListener("change", () => {
          const list = this.sel.runs.filter((x) => x !== r.run);
          if (cb.checked) list.push(r.run);
          this._set({ runs: list });
        });
        const sw = h("span", "swatch");
        const i = this.sel.runs.indexOf(r.run);
        sw.style.background = i >= 0 ? colorAt(i) : "transparent";
        // the label, then the whole id on its own line: cut ids all look alike ("demo-2026…")
        const name = h("span", "compare-run-name", r.label || r.run);
        if (r.label) name.append(h("span", "compare-run-id mono muted", r.run));
        name.title = r.run;
        lab.append(cb, sw, name, h("span", "compare-run-meta muted", `${r.status ?? ""}${isNum(r.epochs_done) ? ` · ${r.epochs_done} ep` : ""}`));
        return lab;
      });
    this.list.replaceChildren(...rows);
    this.xSel.value = this.sel.x;
  }

  async load(refresh = false) {
    const gen = ++this.gen;
    this._drawnStepOnly = undefined; // (this load draws when its histories are in)
    const { runs, metric, x } = this.sel;
    this.sub.textContent = runs.length ? `${runs.length} run${runs.length === 1 ? "" : "s"} · ${metric} by ${x}` : "tick two or more runs";
    this.chart.setTitle(`${metric} by ${x}`);
    this.chart.setAxis(x === "epoch" ? EPOCH_AXIS : STEP_AXIS);
    const errors = runs.filter((run) => !RUN_ID.test(run));
    if (x === "epoch") {
      await Promise.all(runs.map(async (run) => {
        if ((this.history.has(run) && !refresh) || !RUN_ID.test(run)) return;
        try {
          this.history.set(run, await api(`/api/runs/${enc(run)}/history`));
        } catch (err) {
          errors.push(run);
        }
      }));
      if (gen !== this.gen) return;
      const names = new Set();
      for (const run of runs) for (const rec of this.history.get(run) || []) for (const k of Object.keys(rec.metrics || {})) names.add(k);
      this._metrics([...names]);
      this._errors = errors;
      if (this._drawEpochs()) return;
    } else {
      await Promise.all(runs.map(async (run) => {
        if (!RUN_ID.test(run)) return;
        try {
          if (!this.headers.has(run) || refresh) this.headers.set(run, await api(`/api/runs/${enc(run)}`));
        } catch {
          errors.push(run);
        }
      }));
      if (gen !== this.gen) return;
      const names = new Set();
      for (const run of runs) for (const k of (this.headers.get(run) || {}).step_metrics || []) names.add(k);
      this._metrics([...names], STEP_BUILTINS);
      await this._fetchSteps(gen);
    }
    if (gen === this.gen) this._loadStatus(errors);
  }

  _loadStatus(errors) {
    this.chart.setStatus(errors.length ? `could not load ${errors.length} run${errors.length === 1 ? "" : "s"}` : "");
  }

  async _fetchSteps(gen) {
    const { runs, metric } = this.sel;
    const points = this.chart.plotColumns();
    const range = this.view ? `&start=${this.view[0]}&end=${this.view[1]}` : "";
    const out = await Promise.all(runs.map(async (run) => {
      if (!RUN_ID.test(run)) return new Buckets();
      try {
        const d = await api(`/api/runs/${enc(run)}/steps?metric=${enc(metric)}&points=${points}${range}`);
        return Buckets.fromApi(Array.isArray(d && d.buckets) ? d.buckets : []);
      } catch {
        return new Buckets();
      }
    }));
    if (gen !== this.gen) return;
    this.chart.setSeries(runs.map((run, i) => ({ name: run, label: this._label(run), color: colorAt(i), data: out[i] })));
  }

  /** The name the legend gives `run`: its label as the run list has it (the id when it has
   * none, or when another chosen run has the same label, beside it), never a bare id where a
   * label exists (issue 43 item 5). */
  _label(run) {
    const all = this.hooks.runs();
    const labelOf = (id) => {
      const r = all.find((x) => x.run === id);
      return (r && r.label) || (this.headers.get(id) || {}).label || null;
    };
    const label = labelOf(run);
    if (!label) return run;
    const twins = this.sel.runs.filter((id) => id !== run && labelOf(id) === label);
    return twins.length ? `${label} (${run})` : label;
  }

  /** The run list arrived (or changed) after the chart was drawn: a link opened directly
   * draws before the page knows the runs' labels; the legend then takes them. */
  _relabel() {
    const series = this.chart && this.chart.series;
    if (!Array.isArray(series) || !series.length) return;
    if (series.every((s) => (s.label || s.name) === this._label(s.name))) return;
    this.chart.setSeries(series.map((s) => ({ ...s, label: this._label(s.name) })));
  }

  /** Draw the epoch axis from the histories held; true when the status line is the
   * step-run note. A step run has one epoch record at most: on the epoch axis it was a lone
   * dot that looked like data; it is left out, and the status says where it is (x axis:
   * step). Which runs log steps is the run list's to say, and a link opened directly draws
   * before that list arrives: `runsChanged` draws again when it does (`_drawnStepOnly`). */
  _drawEpochs() {
    const { runs, metric } = this.sel;
    const stepOnly = runs.filter((run) => this._stepOnly(run));
    this._drawnStepOnly = stepOnly.join("\n");
    this.chart.setSeries(runs.map((run, i) => ({ name: run, label: this._label(run), color: colorAt(i),
      data: stepOnly.includes(run) ? new Buckets() : this._epochBuckets(run, metric) })));
    if (stepOnly.length && !this._errors.length) {
      this.chart.setStatus(`${stepOnly.length} step run${stepOnly.length === 1 ? "" : "s"} (${stepOnly.map((r) => this._label(r)).join(", ")}): on the step axis only (x axis: step)`);
      return true;
    }
    return false;
  }

  /** Whether `run` logs steps and has fewer than two epoch records (one dot on x=epoch). */
  _stepOnly(run) {
    const r = this.hooks.runs().find((x) => x.run === run);
    const recs = this.history.get(run) || [];
    return recs.length < 2 && !!r && r.steps_done !== null && r.steps_done !== undefined;
  }

  _zoom(range) {
    this.view = range;
    this.chart.setView(range);
    if (this.sel.x === "step") this._fetchSteps(++this.gen);
  }

  _epochBuckets(run, metric) {
    const b = new Buckets();
    const recs = (this.history.get(run) || []).slice().sort((p, q) => p.epoch - q.epoch);
    for (const rec of recs) {
      if (!rec.metrics || !(metric in rec.metrics)) continue;
      b.pushStep(rec.epoch, rec.metrics[metric]);
    }
    return b;
  }

  _metrics(names, extra = []) {
    const list = names.filter((n) => typeof n === "string").sort();
    const i = list.indexOf("loss");
    if (i > 0) {
      list.splice(i, 1);
      list.unshift("loss");
    }
    const all = [...list, ...extra];
    if (!all.includes(this.sel.metric)) all.unshift(this.sel.metric); // a link's metric stays
    const opts = all.map((n) => {
      const o = h("option", null, n);
      o.value = n;
      return o;
    });
    this.metricSel.replaceChildren(...opts);
    this.metricSel.value = this.sel.metric;
  }

  /** For tests: what the chart shows. */
  snapshot() {
    const s = this.chart.snapshot();
    return s && { ...s, runs: this.sel.runs.slice(), metric: this.sel.metric, x: this.sel.x, count: fmtInt(this.sel.runs.length) };
  }
}
