// rankboard page model: what the views read, derived from the store (rank rows with their
// marks, host groups, cluster "now" resources, metric names). Pure functions, no DOM.

import { isNum } from "./fmt.js";
import { rankHealth } from "./gpuhealth.js";
import { extremesByMedian, medianOf } from "./slowness.js";
import { BIG, rankGpu } from "./store.js";

export function rankInfo(store, rank) {
  return store.rankMap.get(rank) || null;
}

export function hostOf(store, rank) {
  const r = rankInfo(store, rank);
  if (r && r.host) return r.host;
  return store.hostOfRank.get(rank) ?? null;
}

export function lastRecord(store) {
  return store.records[store.records.length - 1];
}

/** device_index -> the latest epoch's gpu_metrics entry. */
export function latestGpuMetrics(store) {
  const last = lastRecord(store);
  const map = new Map();
  for (const g of (last && last.gpu_metrics) || []) map.set(g.device_index, g);
  return map;
}

/** Fastest / slowest rank by the latest epoch's time per sample (1/throughput), against the
 * median rank (slowness.js): none when no rank stands out. */
function extremes(gm) {
  const list = [...gm.values()].filter((g) => isNum(g.throughput) && g.throughput > 0)
    .map((g) => ({ id: g.device_index, time: 1 / g.throughput }));
  return extremesByMedian(list);
}

/**
 * A rank is marked a straggler when it was the slowest in a share of recent steps far
 * above the 1/world_size an even cluster gives: at least 3/N (at least 5 %, at most 75 %),
 * once 20 steps have closed.
 */
export function stragglerThreshold(n) {
  return Math.min(0.75, Math.max(3 / Math.max(1, n), 0.05));
}

export function worldSize(store) {
  const hd = store.header;
  return hd && isNum(hd.world_size) ? hd.world_size : store.knownRanks.size;
}

export function isBig(store) {
  const w = store.header && isNum(store.header.world_size) ? store.header.world_size : 0;
  return Math.max(w, store.knownRanks.size) > BIG;
}

/**
 * One row model per known rank (the table, the picker and the heatmap read these);
 * `lastStep`: the newest closed step (marks need 20).
 */
export function rankRows(store, lastStep) {
  const ranks = [...store.knownRanks].sort((a, b) => a - b);
  const gm = latestGpuMetrics(store);
  const { fast, slow } = extremes(gm);
  const n = worldSize(store);
  const thr = stragglerThreshold(n);
  const enough = lastStep !== null && lastStep >= 20;
  // the median rank's step time: a hang in some ranks' windows does not move it
  const medianMs = medianOf(store.ranks.map((r) => r.step_ms));
  // a rank's gpu_xid alert keeps its XID tag after the one sample that carried the code
  const xidAlerts = new Map();
  for (const a of (store.header && store.header.alerts) || []) {
    if (a && a.kind === "gpu_xid" && isNum(a.rank)) xidAlerts.set(a.rank, [a]);
  }
  return ranks.map((rank) => {
    const r = rankInfo(store, rank);
    const g = rankGpu(r || { rank });
    const m = gm.get(rank);
    const marks = [];
    const share = r && isNum(r.slowest_share) ? r.slowest_share : null;
    const straggler = enough && n > 1 && share !== null && share >= thr;
    if (rank === fast) marks.push("fastest");
    // one slow signal per rank: a straggler is not also "slowest"
    if (rank === slow && !straggler) marks.push("slowest");
    if (straggler) marks.push("straggler");
    const stepMs = r && isNum(r.step_ms) ? r.step_ms : null;
    return {
      rank, host: hostOf(store, rank), localRank: r ? r.local_rank : null, status: r ? r.status : "unknown",
      lastSeen: r ? r.last_seen : null, epoch: r ? r.epoch : null, step: r ? r.step : null,
      util: g.util, vu: g.vu, vt: g.vt,
      throughput: m && isNum(m.throughput) ? m.throughput : null,
      share: m ? m.chunk_ratio : null, stepMs,
      dataMs: r && isNum(r.data_ms) ? r.data_ms : null,
      stepRatio: stepMs !== null && medianMs ? stepMs / medianMs : null,
      slowShare: share, marks,
      health: rankHealth(r ? r.resources : null, xidAlerts.get(rank) || null),
      error: r && r.error && typeof r.error.type === "string" ? r.error.type : null, // 8.2
    };
  });
}

/** Hosts in topology order, ranks by local rank; ranks without a host in a last group. */
export function hostGroups(store, rows) {
  const hd = store.header;
  const groups = [];
  const placed = new Set();
  for (const hst of (hd && hd.hosts) || []) {
    const ranks = (hst.ranks || []).filter(isNum);
    for (const r of ranks) placed.add(r);
    if (ranks.length) groups.push({ host: hst.host, ranks });
  }
  const rest = rows.map((r) => r.rank).filter((r) => !placed.has(r));
  if (rest.length) groups.push({ host: "no host", ranks: rest });
  return groups;
}

/** Cluster "now" figures from every rank's latest sample (PROTOCOL 2.3 rules). */
export function currentResources(store) {
  const hostsCpu = new Map();
  const hostsRam = new Map();
  let usum = 0;
  let un = 0;
  let vu = 0;
  let vt = 0;
  const sorted = store.ranks.slice().sort((a, b) => (a.local_rank ?? 0) - (b.local_rank ?? 0));
  for (const r of sorted) {
    const s = r.resources;
    if (!s) continue;
    if (r.host) {
      if (isNum(s.cpu_percent) && !hostsCpu.has(r.host)) hostsCpu.set(r.host, s.cpu_percent);
      if (isNum(s.ram_used_bytes) && isNum(s.ram_total_bytes) && !hostsRam.has(r.host)) {
        hostsRam.set(r.host, [s.ram_used_bytes, s.ram_total_bytes]);
      }
    }
    if (isNum(s.gpu_util_percent)) {
      usum += s.gpu_util_percent;
      un++;
    }
    if (isNum(s.vram_allocated_bytes)) vu += s.vram_allocated_bytes;
    if (isNum(s.vram_total_bytes)) vt += s.vram_total_bytes;
  }
  const cpus = [...hostsCpu.values()];
  let ru = 0;
  let rt = 0;
  for (const [u, t] of hostsRam.values()) {
    ru += u;
    rt += t;
  }
  const out = {
    cpu_percent: cpus.length ? cpus.reduce((a, b) => a + b, 0) / cpus.length : null,
    ram_used_bytes: rt ? ru : null,
    ram_total_bytes: rt || null,
    gpu_util_percent: un ? usum / un : null,
    vram_allocated_bytes: vt ? vu : null,
    vram_total_bytes: vt || null,
  };
  const last = lastRecord(store);
  const fallback = (last && last.resources) || {};
  for (const k of Object.keys(out)) if (out[k] === null && isNum(fallback[k])) out[k] = fallback[k];
  return out;
}

/** Metric names in first-seen order, "loss" first. */
export function metricNames(store) {
  const names = [];
  const seen = new Set();
  for (const r of store.records) {
    for (const k of Object.keys(r.metrics || {})) {
      if (!seen.has(k)) {
        seen.add(k);
        names.push(k);
      }
    }
  }
  const i = names.indexOf("loss");
  if (i > 0) {
    names.splice(i, 1);
    names.unshift("loss");
  }
  return names;
}

export function median(vals) {
  if (!vals.length) return null;
  const s = vals.slice().sort((a, b) => a - b);
  return s[s.length >> 1];
}
