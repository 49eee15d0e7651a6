// rankboard run header: name, status, epoch progress, step counter, hardware line,
// configuration, model graph, which panels the run shows, and the ticking elapsed / ETA /
// "ago" figures. Reads the store; text from the job only through textContent, the model
// graph only ever as an <img>.

import { enc, serverNow } from "./api.js";
import { $, bidi, h, setText } from "./dom.js";
import { DASH, fmtAgo, fmtDur, fmtInt, isNum } from "./fmt.js";

const STATUS_TEXT = { waiting: "waiting", training: "training", complete: "complete", failed: "failed" };

export class HeaderView {
  /**
   * `page`: {store, steps, graphSrc?, reportHref?}. `graphSrc()` (optional) is the model
   * graph's image URL (a saved report's data: URI); `reportHref(run)` (optional) the
   * "download report" link (null hides it). Default: this web's routes.
   */
  constructor(page) {
    this.page = page;
    this.graphKey = null;
  }

  /** A new run: no graph yet. */
  reset() {
    this.graphKey = null;
    $("graph-card").hidden = true;
    $("graph").replaceChildren(h("p", "muted", "no model graph sent"));
    setText($("graph-label"), "");
    $("graph-open").hidden = true;
  }

  render() {
    const store = this.page.store;
    const hd = store.header;
    const run = store.run ?? "";
    const label = hd && hd.label ? hd.label : run;
    setText($("run-name"), label || DASH);
    $("run-name").title = label;
    setText($("run-id"), hd && hd.label ? run : "");
    const hash = hd && hd.hash ? String(hd.hash) : "";
    $("run-hash").hidden = !hash;
    setText($("run-hash"), hash ? `#${hash.slice(0, 10)}` : "");
    $("run-hash").title = hash ? `model hash ${hash}` : "";
    const status = (hd && hd.status) || "waiting";
    $("status").dataset.status = status;
    $("run-view").dataset.status = status;
    setText($("status-text"), STATUS_TEXT[status] || status);

    // progress
    const done = store.records.length;
    const total = hd && isNum(hd.total_epochs) && hd.total_epochs > 0 ? hd.total_epochs : null;
    setText($("epoch-count"), `${done}/${total ?? "?"}`);
    const bar = $("progress-bar");
    const frac = total ? Math.min(1, done / total) : null;
    bar.classList.toggle("indeterminate", frac === null && status === "training");
    bar.style.width = frac === null ? (status === "training" ? "30%" : "0%") : `${(frac * 100).toFixed(1)}%`;
    setText($("progress-pct"), frac === null ? "" : `${Math.floor(frac * 100)}%`);
    document.title = `${label || "rankboard"} · ${done}/${total ?? "?"} · rankboard`;

    // hardware: the exact string of the contract, one line, click to wrap
    const hw = $("hardware");
    const hwText = (hd && hd.hardware) || "";
    setText(hw, hwText);
    hw.title = hwText;
    hw.hidden = !hwText;

    this._metadata();
    this._graph();
    this._reportLink(run);
  }

  /** The "download report" link: the run as one self-contained HTML file (report.html). */
  _reportLink(run) {
    const link = document.getElementById("report-link");
    if (!link) return;
    const page = this.page;
    const href = page.reportHref ? page.reportHref(run) : run ? `/api/runs/${enc(run)}/report.html` : null;
    link.hidden = !href;
    if (href && link.getAttribute("href") !== href) link.href = href;
  }

  _metadata() {
    const pre = $("metadata");
    const hd = this.page.store.header;
    const md = hd ? hd.metadata : null;
    setText(pre, md === null || md === undefined ? "no metadata sent"
      : typeof md === "string" ? md : JSON.stringify(md, null, 2));
    pre.classList.toggle("muted", md === null || md === undefined);
  }

  _graph() {
    const store = this.page.store;
    const hd = store.header;
    const has = !!(hd && hd.has_svg);
    const key = has ? `${store.run}\u0000${hd.hash ?? ""}` : null;
    if (key === this.graphKey) return;
    this.graphKey = key;
    const box = $("graph");
    const open = $("graph-open");
    setText($("graph-label"), has && hd.label ? hd.label : "");
    $("graph-card").hidden = !has; // a run without a graph has no empty card for it
    if (!has) {
      box.replaceChildren(h("p", "muted", "no model graph sent"));
      open.hidden = true;
      return;
    }
    const src = this.page.graphSrc ? this.page.graphSrc()
      : `/api/runs/${enc(store.run)}/graph.svg?v=${enc(hd.hash || String(Date.now()))}`;
    if (!src) {
      box.replaceChildren(h("p", "muted", "no model graph sent"));
      open.hidden = true;
      return;
    }
    const img = h("img");
    img.alt = `model graph${hd.label ? ` of ${bidi(hd.label)}` : ""}`;
    img.decoding = "async";
    img.src = src;
    box.replaceChildren(img);
    open.href = src;
    open.hidden = false;
  }

  /** Which panels a run shows: epoch panels only once it has an epoch when it logs steps. */
  layout() {
    const { store, steps } = this.page;
    const hd = store.header;
    const stepish = steps.hasSteps || store.stepRanks || !!(hd && hd.step_metrics && hd.step_metrics.length);
    const epochless = store.records.length === 0 && stepish;
    const panel = $("panel-home");
    panel.dataset.layout = epochless ? "steps" : stepish ? "both" : "epochs";
    // a step run's epoch charts wait for its second epoch: one epoch is one dot on an axis
    // of -1..1 (the epoch log shows it meanwhile)
    const oneDot = stepish && store.records.length < 2;
    for (const e of document.querySelectorAll(".epoch-panel")) {
      e.hidden = epochless || (oneDot && e.id !== "log-card");
    }
    $("straggler-card").hidden = !store.stepRanks;
    // beside "Resources now" whenever the epoch charts are not there (not only before the
    // first epoch: with one epoch, "Resources now" sat alone beside an empty two-thirds)
    const besideNow = epochless || oneDot;
    $("straggler-card").classList.toggle("span-8", besideNow);
    $("straggler-card").classList.toggle("span-12", !besideNow);
    $("config-card").classList.toggle("span-5", !epochless);
    $("config-card").classList.toggle("span-12", epochless);
    const total = hd && isNum(hd.total_epochs) && hd.total_epochs > 0;
    $("epoch-progress").hidden = epochless && !total;
    $("step-stat").hidden = !steps.hasSteps;
    if (steps.hasSteps) {
      setText($("step-count"), fmtInt(steps.lastStep));
      const rate = steps.stepsPerSecond();
      setText($("step-rate"), isNum(rate) && rate > 0 ? `${rate.toFixed(1)}/s` : "");
    }
    this._stepProgress();
  }

  /** The run's total steps when it is a step run that knows them (8.5), else null. */
  _totalSteps() {
    const hd = this.page.store.header;
    const total = hd && isNum(hd.total_steps) && hd.total_steps > 0 ? hd.total_steps : null;
    return total !== null && this.page.steps.hasSteps ? total : null;
  }

  /** A step run with `total_steps` (8.5): the progress stat counts steps, "STEP s/total",
   *  instead of an epoch count that stays at 0/1 for the run's whole life. */
  _stepProgress() {
    const total = this._totalSteps();
    const label = document.querySelector("#epoch-progress .stat-label");
    const box = $("epoch-progress");
    box.dataset.unit = total === null ? "epoch" : "step";
    if (label) setText(label, total === null ? "epoch" : "step");
    if (total === null) return;
    const steps = this.page.steps;
    const done = Math.min(total, steps.lastStep + 1); // steps 0..total-1 (the ETA's count)
    box.hidden = false;
    $("step-stat").hidden = true; // the progress stat says it, with the rate
    setText($("epoch-count"), `${fmtInt(done)}/${fmtInt(total)}`);
    const frac = Math.min(1, done / total);
    const bar = $("progress-bar");
    bar.classList.remove("indeterminate");
    bar.style.width = `${(frac * 100).toFixed(1)}%`;
    const rate = steps.stepsPerSecond();
    const pct = `${Math.floor(frac * 100)}%`;
    setText($("progress-pct"), isNum(rate) && rate > 0 ? `${pct} · ${rate.toFixed(1)}/s` : pct);
    const hd = this.page.store.header;
    const name = (hd && hd.label) || this.page.store.run || "rankboard";
    document.title = `${name} · step ${done}/${total} · rankboard`;
  }

  /** Seconds left of a step run (8.5), or null: the header's `eta_secs` moved on to the
   *  steps this page has seen since (its steps stream runs ahead of the header). */
  _stepEta() {
    const total = this._totalSteps();
    const hd = this.page.store.header;
    if (total === null || !isNum(hd.eta_secs)) return null;
    const left = Math.max(0, total - 1 - this.page.steps.lastStep);
    const then = isNum(hd.steps_done) ? total - 1 - hd.steps_done : 0;
    return then > 0 ? left * (hd.eta_secs / then) : hd.eta_secs;
  }

  /** The figures that move with the clock (every second, and after each render). */
  tick() {
    const store = this.page.store;
    const hd = store.header;
    const now = serverNow();
    let elapsed = null;
    if (hd && isNum(hd.started_at)) {
      const live = hd.status === "training" || hd.status === "waiting";
      const end = live ? now : isNum(hd.updated_at) ? hd.updated_at : now;
      elapsed = Math.max(0, end - hd.started_at);
    }
    setText($("elapsed"), fmtDur(elapsed));
    const last = store.records[store.records.length - 1];
    let eta = DASH;
    if (hd && (hd.status === "complete" || hd.status === "failed")) eta = hd.status === "complete" ? "done" : DASH;
    else if (this._stepEta() !== null) {
      const left = this._stepEta();
      eta = left > 0 ? fmtDur(left) : "any moment";
    } else if (last && isNum(last.eta_secs)) {
      let left = last.eta_secs;
      if (hd && isNum(hd.started_at) && isNum(last.elapsed_secs)) {
        left -= Math.max(0, now - hd.started_at - last.elapsed_secs);
      }
      eta = left > 0 ? fmtDur(left) : "any moment";
    }
    setText($("eta"), eta);
    for (const e of document.querySelectorAll(".ago[data-at]")) {
      const at = Number(e.dataset.at);
      if (e.dataset.at && Number.isFinite(at)) setText(e, fmtAgo(now - at));
    }
    for (const e of document.querySelectorAll(".alert-time[data-at]")) {
      const at = Number(e.dataset.at);
      setText(e, e.dataset.at && Number.isFinite(at) ? fmtAgo(now - at) : "");
    }
  }
}
