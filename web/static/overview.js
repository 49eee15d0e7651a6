// rankboard overview panel: the KPIs, the epoch metrics chart, the epoch log, and
// "resources now" (bars, one tile per GPU, or for a big run the host-grouped heatmap); the
// cluster resources over time are resourcesview.js's. Reads the store; text only through
// textContent.

import { colorAt } from "./axes.js";
import { $, bidi, button, h, setText } from "./dom.js";
import {
  DASH, fmtBytes, fmtDur, fmtInt, fmtLoss, fmtMs, fmtPct, formatNumber, isNum, pct,
} from "./fmt.js";
import { levelValue } from "./gpuhealth.js";
import { HostHeatmap } from "./heatmap.js";
import { LineChart } from "./linechart.js";
import { currentResources, hostGroups, hostOf, median, metricNames, rankInfo } from "./model.js";
import { rankGpu } from "./store.js";

/** The per-rank picture's health colours (canvas needs concrete colours): act on it, look
 * at it, healthy; a rank without GPU figures is the picture's no-figure grey. */
/** A step KPI with no step closed for this long (s) says how old it is (a hang, a crash). */
const STALE_STEP_S = 10;
const HEALTH_COLOURS = { 3: "#f2495c", 2: "#ff9830", 1: "#3f8a4f" };
const HEALTH_KEYS = [["XID · ECC · remap", HEALTH_COLOURS[3]], ["throttle · PCIe · NVLink", HEALTH_COLOURS[2]],
  ["ok", HEALTH_COLOURS[1]], ["no GPU", null]];

export class Overview {
  /** `page`: {store, steps, selectTab}. */
  constructor(page) {
    this.page = page;
    this.metrics = new LineChart($("metrics-card"), {
      title: "Training metrics", chartId: "metrics", xLabel: "epoch", xInteger: true,
      log: true, smoothing: true, yFormat: formatNumber, height: 280, filename: "metrics",
    });
    this.heatmap = new HostHeatmap($("heatmap"), {
      chartId: "rank-heatmap", title: "per-rank GPU utilisation and throughput",
      onPick: (rank) => page.selectTab(rank), hostOf: (rank) => hostOf(page.store, rank),
    });
    /** What the per-rank picture (heatmap, or the GPU tiles of a small run) is coloured by:
     * "load" (utilisation, throughput) or "health" (GPU health, PROTOCOL section 4). */
    this.colourBy = "load";
    this.colourChoice = this._colourChoice();
  }

  /** "colour by: load | health", shown beside the per-rank picture while some rank reports
   * GPU health. */
  _colourChoice() {
    const wrap = h("span", "colour-choice");
    wrap.dataset.testid = "colour-by";
    wrap.setAttribute("role", "group");
    wrap.setAttribute("aria-label", "colour the per-rank picture by");
    wrap.append(h("span", "colour-choice-label", "colour by"));
    for (const [key, text, title] of [
      ["load", "load", "GPU utilisation and throughput"],
      ["health", "health", "GPU health: red XID, ECC or row remap; amber throttling, PCIe or NVLink; green ok; grey no GPU"],
    ]) {
      const b = button("tool-btn", text, () => {
        this.colourBy = key;
        for (const x of wrap.querySelectorAll("button")) x.setAttribute("aria-pressed", String(x.dataset.colour === key));
        this.page.store.changed("ranks");
      });
      b.dataset.colour = key;
      b.title = title;
      b.setAttribute("aria-pressed", String(key === this.colourBy));
      wrap.append(b);
    }
    return wrap;
  }

  reset() {
    this.metrics.resetZoom();
  }

  /** The epoch metrics chart and the epoch log (cluster resources: resourcesview.js). */
  records() {
    const store = this.page.store;
    const recs = store.records;
    const x = recs.map((r) => r.epoch);
    const names = metricNames(store);
    this.metrics.setData(x, names.map((n, i) => ({
      name: n, color: colorAt(i), values: recs.map((r) => (r.metrics ? r.metrics[n] : null)),
    })));
    this._log(names);
  }

  _log(names) {
    const tbl = $("log-table");
    const head = h("tr");
    head.append(h("th", null, "epoch"), h("th", "num", "duration"));
    for (const n of names) {
      const th = h("th", "num metric-col", n);
      th.title = n;
      head.append(th);
    }
    head.append(h("th", null, "missing ranks"));
    tbl.tHead.replaceChildren(head);
    const rows = [];
    const recs = this.page.store.records;
    for (let i = recs.length - 1; i >= 0 && rows.length < 500; i--) {
      const r = recs[i];
      const tr = h("tr");
      tr.dataset.epoch = String(r.epoch);
      tr.append(h("td", "mono", r.epoch), h("td", "num mono", fmtDur(r.duration_secs)));
      for (const n of names) {
        const v = r.metrics ? r.metrics[n] : null;
        const td = h("td", "num mono", fmtLoss(v));
        if (n === "loss" && (v === null || v === undefined) && r.metrics && n in r.metrics) td.classList.add("bad");
        tr.append(td);
      }
      const miss = Array.isArray(r.missing_ranks) ? r.missing_ranks : [];
      const compact = miss.length > 12 ? `${miss.slice(0, 12).join(", ")} … (${fmtInt(miss.length)})` : miss.join(", ");
      const td = h("td", miss.length ? "missing" : "muted", miss.length ? compact : DASH);
      if (miss.length > 12) td.title = miss.join(", ");
      tr.append(td);
      rows.push(tr);
    }
    if (!rows.length) {
      const tr = h("tr");
      const td = h("td", "muted empty-row", "no epochs closed yet");
      td.colSpan = names.length + 3;
      tr.append(td);
      rows.push(tr);
    }
    tbl.tBodies[0].replaceChildren(...rows);
  }

  /** Loss, epoch (or step) time and throughput KPIs; health is the ranks view's. */
  kpis() {
    const { store, steps } = this.page;
    const recs = store.records;
    const last = recs[recs.length - 1];
    const prev = recs[recs.length - 2];
    const useSteps = steps.hasSteps;
    const d = $("kpi-loss-delta");
    if (useSteps) {
      const loss = steps.kpi.loss;
      setText($("kpi-loss-label"), "loss");
      setText($("kpi-loss"), fmtLoss(loss));
      $("kpi-loss").classList.toggle("bad", loss === null);
      setText(d, `step ${fmtInt(steps.lastStep)}${last && last.metrics && isNum(last.metrics.loss) ? ` · epoch ${last.epoch}: ${fmtLoss(last.metrics.loss)}` : ""}`);
      d.dataset.trend = "";
    } else {
      const loss = last && last.metrics ? last.metrics.loss : null;
      setText($("kpi-loss"), fmtLoss(loss));
      $("kpi-loss").classList.toggle("bad", !!last && last.metrics && "loss" in last.metrics && !isNum(loss));
      const pl = prev && prev.metrics ? prev.metrics.loss : null;
      if (isNum(loss) && isNum(pl)) {
        const diff = loss - pl;
        setText(d, `${diff <= 0 ? "▼" : "▲"} ${fmtLoss(Math.abs(diff))} vs previous`);
        d.dataset.trend = diff <= 0 ? "good" : "bad";
      } else {
        setText(d, last ? `epoch ${last.epoch}` : "");
        d.dataset.trend = "";
      }
    }
    // A step figure is the last step's: while the run steps it is live; once no step has
    // closed for STALE_STEP_S (a hang, a crash), or the run ended, it says how old it is.
    const st = store.header ? store.header.status : "";
    const ended = st === "complete" || st === "failed";
    const stalled = store.stalledRanks().length;
    const idle = useSteps ? steps.idleSeconds() : 0;
    const stale = useSteps && (ended || stalled > 0 || idle >= STALE_STEP_S);
    const asOf = !stale ? "" : ended ? `at step ${fmtInt(steps.lastStep)}, run ${st}`
      : stalled > 0 ? `at step ${fmtInt(steps.lastStep)} · ${fmtInt(stalled)} ${stalled === 1 ? "rank" : "ranks"} stalled`
        : `at step ${fmtInt(steps.lastStep)} · no step for ${fmtDur(idle)}`;
    for (const id of ["kpi-epoch-time", "kpi-throughput"]) $(id).classList.toggle("kpi-stale", stale && (id !== "kpi-epoch-time" || !last));
    if (useSteps && !last) {
      setText($("kpi-time-label"), "step time");
      setText($("kpi-epoch-time"), fmtMs(steps.kpi.step_ms));
      // a live rate only while the run trains: a finished run's last rate is not its speed
      const rate = ended || stale ? null : steps.stepsPerSecond();
      setText($("kpi-epoch-time-sub"), stale ? asOf : isNum(rate) && rate > 0 ? `${rate.toFixed(1)} steps/s` : "mean over ranks");
    } else {
      setText($("kpi-time-label"), "epoch time");
      setText($("kpi-epoch-time"), last ? fmtDur(last.duration_secs) : DASH);
      const lastFive = recs.slice(-5).map((r) => r.duration_secs).filter(isNum);
      $("kpi-epoch-time-sub").textContent = lastFive.length
        ? `mean of last ${lastFive.length}: ${fmtDur(lastFive.reduce((a, b) => a + b, 0) / lastFive.length)}`
        : "";
    }
    if (useSteps && isNum(steps.kpi.samples_per_s)) {
      setText($("kpi-throughput"), formatNumber(steps.kpi.samples_per_s));
      const tok = steps.kpi.tokens_per_s;
      setText($("kpi-throughput-sub"), stale ? `samples/s ${asOf}`
        : isNum(tok) ? `samples/s · ${formatNumber(tok)} tokens/s` : "samples/s, last step");
    } else {
      const tp = last ? (last.gpu_metrics || []).map((g) => g.throughput).filter(isNum) : [];
      setText($("kpi-throughput"), tp.length ? formatNumber(tp.reduce((a, b) => a + b, 0) * 1000) : DASH);
      setText($("kpi-throughput-sub"), "samples/s, all ranks");
    }
  }

  /** "Resources now": cluster bars, then GPU tiles (or the heatmap for a big run). */
  resourcesNow(rows, big) {
    const store = this.page.store;
    const r = currentResources(store);
    const bars = [
      ["cpu", "CPU", r.cpu_percent, fmtPct(r.cpu_percent)],
      ["ram", "RAM", pct(r.ram_used_bytes, r.ram_total_bytes),
        isNum(r.ram_used_bytes) ? `${fmtBytes(r.ram_used_bytes)} / ${fmtBytes(r.ram_total_bytes)}` : DASH],
      ["gpu", "GPU util", r.gpu_util_percent, fmtPct(r.gpu_util_percent)],
      ["vram", "VRAM", pct(r.vram_allocated_bytes, r.vram_total_bytes),
        isNum(r.vram_allocated_bytes) ? `${fmtBytes(r.vram_allocated_bytes)} / ${fmtBytes(r.vram_total_bytes)}` : DASH],
    ];
    const els = bars.map(([key, label, value, text]) => {
      const row = h("div", "bar-row");
      row.dataset.resource = key;
      const top = h("div", "bar-top");
      top.append(h("span", "bar-label", label), h("span", "bar-pct mono", isNum(value) ? fmtPct(value) : DASH));
      const track = h("div", "bar-track");
      const fill = h("div", "bar-fill");
      fill.dataset.resource = key;
      fill.style.width = `${isNum(value) ? Math.max(0, Math.min(100, value)) : 0}%`;
      if ((key === "vram" || key === "ram") && isNum(value) && value >= 95) fill.dataset.level = "high";
      track.append(fill);
      row.append(top, track, h("div", "bar-detail mono", key === "ram" || key === "vram" ? text : ""));
      return row;
    });
    // no rank sent a sample: four dashes read as "loading"; say what is missing and why
    const sampled = store.ranks.some((x) => x && x.resources);
    if (!sampled) {
      const st = store.header ? store.header.status : "";
      const ended = st === "complete" || st === "failed";
      const note = h("p", "muted resources-none", ended
        ? "no resource samples: this run's ranks sent none (the agent samples CPU, RAM and GPU after agent.start_sampling())"
        : "no resource samples yet (the agent samples CPU, RAM and GPU after agent.start_sampling())");
      note.dataset.testid = "resources-none";
      els.unshift(note);
    }
    $("resource-bars").replaceChildren(...els);

    const minis = $("gpu-minis");
    $("heat-card").hidden = !big;
    const withHealth = rows.some((x) => x.health.level !== "none");
    const health = withHealth && this.colourBy === "health";
    this.colourChoice.hidden = !withHealth;
    if (big) {
      const title = $("heat-card").querySelector(".card-title");
      if (title && this.colourChoice.parentNode !== title) title.append(this.colourChoice);
      minis.replaceChildren(h("div", "gpu-minis-title", `per-rank GPU ${health ? "health" : "utilisation"}: see the heatmap below`));
      this._heatmap(rows, health);
      return;
    }
    // one tile per GPU: utilisation as the fill, VRAM as text; or coloured by GPU health
    const tiles = rows.filter((x) => isNum(x.util) || isNum(x.vu) || x.health.level !== "none").map((x) => {
      const t = button("gpu-tile", null, () => this.page.selectTab(x.rank));
      t.dataset.rank = String(x.rank);
      t.dataset.health = x.health.level;
      const name = rankGpu(rankInfo(store, x.rank) || { rank: x.rank }).name;
      t.title = `rank ${x.rank}${x.host ? ` on ${bidi(x.host)}` : ""}${name ? ` · ${name}` : ""}${health ? `\n${x.health.title}` : ""}`;
      const fill = h("span", "gpu-tile-fill");
      fill.style.height = health ? "100%" : `${isNum(x.util) ? Math.max(0, Math.min(100, x.util)) : 0}%`;
      const val = health ? (x.health.tags.length ? x.health.tags[0].text : x.health.level === "ok" ? "ok" : DASH) : fmtPct(x.util);
      t.append(fill, h("span", "gpu-tile-rank", `r${x.rank}`), h("span", "gpu-tile-val mono", val));
      return t;
    });
    if (tiles.length) {
      const grid = h("div", "gpu-grid");
      grid.dataset.colour = health ? "health" : "load";
      grid.append(...tiles);
      const title = h("div", "gpu-minis-title", health ? "GPU health per rank" : "GPU utilisation per rank");
      title.append(this.colourChoice);
      minis.replaceChildren(title, grid);
    } else {
      minis.replaceChildren();
    }
  }

  _heatmap(rows, health) {
    const store = this.page.store;
    const byRank = new Map(rows.map((r) => [r.rank, r]));
    const groups = hostGroups(store, rows);
    const flags = (rank) => {
      const st = byRank.get(rank)?.status;
      return st === "stale" || st === "error" ? st : null;
    };
    if (health) {
      const of = (rank) => byRank.get(rank)?.health ?? null;
      this.heatmap.setData(groups, [{
        key: "health", label: "GPU health", keys: HEALTH_KEYS,
        value: (rank) => levelValue(of(rank)?.level ?? "none"),
        colorOf: (v) => HEALTH_COLOURS[v] ?? null,
        format: (v, rank) => {
          const hl = of(rank);
          if (!hl || hl.level === "none") return "no GPU figures";
          return hl.tags.length ? hl.text : "ok";
        },
      }], flags);
      return;
    }
    const layers = [{
      key: "util", label: "GPU utilisation", legend: ["0%", "100%"],
      value: (rank) => byRank.get(rank)?.util ?? null, scale: (v) => v / 100, format: (v) => fmtPct(v),
    }];
    const epochs = store.records.length > 0;
    const tp = rows.map((r) => (epochs ? r.throughput : isNum(r.stepMs) && r.stepMs > 0 ? 1000 / r.stepMs : null));
    const tpOf = new Map(rows.map((r, i) => [r.rank, tp[i]]));
    const med = median(tp.filter(isNum));
    if (med) {
      layers.push({
        key: "throughput",
        label: epochs ? "throughput (samples/s, last epoch)" : "step rate (1 / the rank's step time)",
        legend: ["≤50% of median", "≥110%"],
        value: (rank) => tpOf.get(rank) ?? null,
        scale: (v) => (v / med - 0.5) / 0.6,
        format: (v) => (isNum(v) ? (epochs ? `${formatNumber(v * 1000)}/s` : `${formatNumber(v)} steps/s`) : DASH),
      });
    }
    this.heatmap.setData(groups, layers, flags);
  }
}
