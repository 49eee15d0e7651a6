// rankboard rank panel: one rank's KPIs, hardware, and its charts (GPU utilisation and
// VRAM over time, step time against the mean of ranks, per-epoch throughput and batch
// share against the mean / equal share). Reads the store; text only through textContent.

import { serverNow } from "./api.js";
import { $, h, setText } from "./dom.js";
import {
  DASH, fmtAgo, fmtBytes, fmtInt, fmtMs, fmtPct, fmtPctAxis, formatNumber, isNum, pct,
} from "./fmt.js";
import { LineChart } from "./linechart.js";
import { hostOf, latestGpuMetrics, rankInfo } from "./model.js";
import { rankGpu } from "./store.js";

export class RankPanel {
  /** `page`: {store, stragglers}. */
  constructor(page) {
    this.page = page;
    this.util = new LineChart($("rank-util-card"), {
      title: "GPU utilisation and VRAM", chartId: "rank-util", xType: "time",
      yMin: 0, yMax: 100, yFormat: fmtPctAxis, height: 240, filename: "rank-util",
      emptyText: "no GPU samples from this rank yet",
    });
    this.step = new LineChart($("rank-step-card"), {
      title: "Step time", chartId: "rank-step", xType: "time", yMin: 0,
      yFormat: fmtMs, height: 200, filename: "rank-step", emptyText: "no step time from this rank yet",
    });
    this.throughput = new LineChart($("rank-throughput-card"), {
      title: "Throughput (samples/s)", chartId: "rank-throughput", xLabel: "epoch", xInteger: true,
      log: true, smoothing: true, yFormat: formatNumber, height: 220, filename: "rank-throughput",
      emptyText: "no epochs yet",
    });
    this.share = new LineChart($("rank-share-card"), {
      title: "Batch share", chartId: "rank-share", xLabel: "epoch", xInteger: true,
      yMin: 0, yFormat: fmtPctAxis, height: 220, filename: "rank-share", emptyText: "no epochs yet",
    });
  }

  resetZoom() {
    this.util.resetZoom();
    this.step.resetZoom();
    this.throughput.resetZoom();
    this.share.resetZoom();
  }

  render() {
    const store = this.page.store;
    if (store.tab === "home") return;
    const rank = store.tab;
    this._kpis(rank);
    this._util(rank);
    this._stepTime(rank);
    this._epochs(rank);
  }

  _kpis(rank) {
    const store = this.page.store;
    const r = rankInfo(store, rank);
    const g = rankGpu(r || { rank });
    const gm = latestGpuMetrics(store).get(rank);
    const row = (store.rows || []).find((x) => x.rank === rank);
    const kpis = [
      ["host", hostOf(store, rank) ?? DASH],
      ["local rank", r && isNum(r.local_rank) ? r.local_rank : DASH],
      ["status", r ? r.status : DASH],
      ["last seen", null],
      ["last epoch", r && isNum(r.epoch) ? r.epoch : DASH],
      ["GPU util", fmtPct(g.util)],
      ["VRAM", isNum(g.vu) ? `${fmtBytes(g.vu)} / ${fmtBytes(g.vt)}` : DASH],
      ["throughput", gm && isNum(gm.throughput) ? `${formatNumber(gm.throughput * 1000)}/s` : DASH],
      ["batch share", gm && isNum(gm.chunk_ratio) ? fmtPct(gm.chunk_ratio * 100, 1) : DASH],
    ];
    if (store.stepRanks) {
      kpis.push(
        ["step", r && isNum(r.step) ? fmtInt(r.step) : DASH],
        ["step time", r ? fmtMs(r.step_ms) : DASH],
        ["slowest share", r && isNum(r.slowest_share) ? fmtPct(r.slowest_share * 100, 1) : DASH],
      );
    }
    const box = $("rank-kpis");
    box.dataset.rank = String(rank);
    box.replaceChildren(...kpis.map(([label, value]) => {
      const k = h("div", "kpi");
      const v = h("span", "kpi-value mono", value ?? "");
      if (label === "last seen") {
        v.classList.add("ago");
        v.dataset.at = r && isNum(r.last_seen) ? String(r.last_seen) : "";
        setText(v, r && isNum(r.last_seen) ? fmtAgo(serverNow() - r.last_seen) : DASH);
      }
      if (label === "status") {
        const dot = h("span", "dot");
        dot.dataset.status = r ? r.status : "unknown";
        v.prepend(dot);
      }
      if (label === "slowest share" && row && row.marks.includes("straggler")) v.classList.add("warn-text");
      k.append(h("span", "kpi-label", label), v);
      return k;
    }));
    setText($("rank-hardware"), (r && r.hardware) || "no hardware summary sent");
  }

  /** Utilisation over time: epoch records' per-rank GPU entries + live samples. */
  _util(rank) {
    const store = this.page.store;
    const started = store.header && isNum(store.header.started_at) ? store.header.started_at : null;
    const pts = [];
    if (started !== null) {
      for (const rec of store.records) {
        const e = ((rec.resources && rec.resources.gpus) || []).find((x) => x.device_index === rank);
        if (e && isNum(rec.elapsed_secs)) {
          pts.push({ t: started + rec.elapsed_secs, util: e.util_percent, vu: e.vram_allocated_bytes, vt: e.vram_total_bytes });
        }
      }
    }
    for (const p of store.rankSeries.get(rank) || []) pts.push(p);
    pts.sort((a, b) => a.t - b.t);
    this.util.setTitle(`Rank ${rank} · GPU utilisation and VRAM`);
    this.util.setData(pts.map((p) => p.t), [
      { name: "GPU util", color: "#73bf69", values: pts.map((p) => (isNum(p.util) ? p.util : null)) },
      { name: "VRAM", color: "#ff9830", values: pts.map((p) => pct(p.vu, p.vt)) },
    ]);
  }

  /** Step time of this rank against the mean of ranks (the straggler strip's samples). */
  _stepTime(rank) {
    const store = this.page.store;
    $("rank-step-card").hidden = !store.stepRanks;
    if (!store.stepRanks) return;
    const cols = this.page.stragglers.strip.cols;
    this.step.setTitle(`Rank ${rank} · step time (mean of its last ≤100 steps)`);
    this.step.setData(cols.map((c) => c.t), [
      { name: `rank ${rank}`, color: "#ff9830", values: cols.map((c) => (c.ratio.has(rank) ? c.ratio.get(rank) * c.mean : null)) },
      { name: "mean of ranks", color: "#8b95a7", values: cols.map((c) => c.mean) },
    ]);
  }

  /** Per-epoch throughput and batch share. */
  _epochs(rank) {
    const recs = this.page.store.records;
    const x = recs.map((rec) => rec.epoch);
    const entry = (rec) => (rec.gpu_metrics || []).find((e) => e.device_index === rank);
    const mean = (rec) => {
      const v = (rec.gpu_metrics || []).map((e) => e.throughput).filter(isNum);
      return v.length ? (1000 * v.reduce((a, b) => a + b, 0)) / v.length : null;
    };
    this.throughput.setData(x, [
      { name: `rank ${rank}`, color: "#5794f2", values: recs.map((rec) => { const e = entry(rec); return e && isNum(e.throughput) ? e.throughput * 1000 : null; }) },
      { name: "mean of ranks", color: "#8b95a7", values: recs.map(mean) },
    ]);
    this.share.setData(x, [
      { name: `rank ${rank}`, color: "#b877d9", values: recs.map((rec) => { const e = entry(rec); return e && isNum(e.chunk_ratio) ? e.chunk_ratio * 100 : null; }) },
      { name: "equal share", color: "#8b95a7", values: recs.map((rec) => { const n = (rec.gpu_metrics || []).length; return n ? 100 / n : null; }) },
    ]);
  }
}
