// rankboard "Cluster resources": the run's CPU, RAM, GPU utilisation and VRAM over time, a
// time series of the ranks' samples (GET /api/runs/<run>/resources, web/resourcetimeline.py),
// read when the run opens and again at most every REFRESH_MS while its ranks update. Where
// the web holds no such series (a report made by `rankboard export`, a web started after the
// run ended) the chart falls back to the epoch records' resources, one point per epoch.

import { api, enc } from "./api.js";
import { $ } from "./dom.js";
import { fmtPctAxis, pct } from "./fmt.js";
import { LineChart } from "./linechart.js";

/** The series is read again at most this often (ms) while the run's ranks update. */
const REFRESH_MS = 5000;
const COLOURS = { cpu: "#5794f2", ram: "#b877d9", gpu: "#73bf69", vram: "#ff9830" };

export class ResourcesView {
  /** `page`: {store}; `opts.fetch`: false where there is no web to ask (a saved report). */
  constructor(page, opts = {}) {
    this.page = page;
    this.fetchable = opts.fetch !== false;
    this.card = $("resources-card");
    this.timeChart = null;
    this.epochChart = null;
    this.kind = null; // "time" | "epoch" | null: what the card shows
    this.run = null;
    this.points = [];
    this.fetchedAt = -Infinity;
    this.inFlight = null;
    this.finalRead = false;
    this.fetches = 0;
    this.card.hidden = true;
  }

  /** A new run: forget the last one's series and read this one's. */
  reset(run) {
    if (this.inFlight) this.inFlight.abort();
    this.inFlight = null;
    this.run = run;
    this.points = [];
    this.fetchedAt = -Infinity;
    this.finalRead = false;
    this.render();
    this.refresh();
  }

  /** The series as the web answered it (`{every_s, columns, points}`), e.g. embedded. */
  set(data) {
    this.points = data && Array.isArray(data.points) ? data.points : [];
    this.render();
  }

  /** A ranks update (about once a second while the run trains) or a status change: read the
   * series again, at most every REFRESH_MS, and once more when the run has ended. */
  refresh() {
    if (!this.fetchable || !this.run || this.inFlight) return;
    const hd = this.page.store.header;
    const ended = !!hd && (hd.status === "complete" || hd.status === "failed");
    const now = performance.now();
    if (ended ? this.finalRead : now - this.fetchedAt < REFRESH_MS) return;
    this.fetchedAt = now;
    if (ended) this.finalRead = true;
    const run = this.run;
    const ctl = new AbortController();
    this.inFlight = ctl;
    api(`/api/runs/${enc(run)}/resources`, ctl.signal)
      .then((data) => {
        if (run !== this.run) return;
        this.fetches++;
        this.set(data);
      })
      .catch(() => {}) // the next update asks again
      .finally(() => {
        if (this.inFlight === ctl) this.inFlight = null;
      });
  }

  /** Draw the series over time, else the epochs' resources, else hide the card. */
  render() {
    const pts = this.points;
    if (pts.length >= 2) {
      this._show("time");
      const col = (i) => pts.map((p) => p[i]);
      this.timeChart.setData(col(0), [
        { name: "CPU", color: COLOURS.cpu, values: col(1) },
        { name: "RAM", color: COLOURS.ram, values: col(2) },
        { name: "GPU util", color: COLOURS.gpu, values: col(3) },
        { name: "VRAM", color: COLOURS.vram, values: col(4) },
      ]);
      return;
    }
    const recs = this.page.store.records.filter((r) => r.resources);
    if (recs.length >= 2) {
      this._show("epoch");
      const res = (r) => r.resources || {};
      this.epochChart.setData(recs.map((r) => r.epoch), [
        { name: "CPU", color: COLOURS.cpu, values: recs.map((r) => res(r).cpu_percent) },
        { name: "RAM", color: COLOURS.ram, values: recs.map((r) => pct(res(r).ram_used_bytes, res(r).ram_total_bytes)) },
        { name: "GPU util", color: COLOURS.gpu, values: recs.map((r) => res(r).gpu_util_percent) },
        { name: "VRAM", color: COLOURS.vram, values: recs.map((r) => pct(res(r).vram_allocated_bytes, res(r).vram_total_bytes)) },
      ]);
      return;
    }
    this._show(null);
  }

  /** One chart in the card at a time (each builds its own DOM in the card when made). */
  _show(kind) {
    this.card.hidden = kind === null;
    if (kind === this.kind) return;
    this.kind = kind;
    this.card.replaceChildren();
    this.timeChart = this.epochChart = null;
    const common = { title: "Cluster resources", chartId: "resources", yMin: 0, yMax: 100,
      yFormat: fmtPctAxis, height: 220, filename: "resources" };
    if (kind === "time") this.timeChart = new LineChart(this.card, { ...common, xType: "time", xLabel: "time" });
    if (kind === "epoch") this.epochChart = new LineChart(this.card, { ...common, xLabel: "epoch", xInteger: true });
  }

  resetZoom() {
    for (const c of [this.timeChart, this.epochChart]) if (c) c.resetZoom();
  }
}
