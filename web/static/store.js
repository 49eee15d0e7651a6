// rankboard page store: the state of the open run and the updates that change it, with no
// DOM and no network. Whatever feeds it (the live stream, or JSON embedded in a saved page)
// calls the same methods; views subscribe and are told which parts changed.
//
// Records are kept in a map keyed by epoch, so the replay after a reconnect (or the overlap
// between the JSON snapshot and the stream) never duplicates a point.
//
// Parts: "header", "records", "ranks", "steps", "tab", "stacks".

import { isNum } from "./fmt.js";

/** Above this many ranks a run is "big": picker instead of tabs, pages, heatmap, grouped alerts. */
export const BIG = 32;

/** Keys a big run's `ranks` event leaves out when unchanged (the page keeps its own). */
const KEPT_KEYS = ["hardware", "resources"];

const HEADER_KEYS = ["run", "status", "world_size", "total_epochs", "label", "hash", "port",
  "metadata", "hardware", "has_svg", "hosts", "alerts", "started_at", "updated_at",
  "steps_done", "step_metrics", "data_share", "data_stragglers", "failure"];
HEADER_KEYS.push("collectives_last"); // 8.5: the answer to the latest hang, kept
HEADER_KEYS.push("total_steps", "eta_secs"); // 8.5: a step run's end
HEADER_KEYS.push("nonfinite", "nonfinite_more", "replica_divergence"); // 8.3
HEADER_KEYS.push("attempt", "attempts"); // 8.1: a restarted job is one run

export class Store {
  constructor() {
    this.gen = 0; // bumps on every run switch; stale async results compare and bail out
    this.run = null;
    this.runs = [];
    this.picked = false; // the user chose a run (do not auto-follow the newest)
    this.mode = "run"; // "run" | "compare"
    this._listeners = [];
    /** Hooks for owners of data kept outside the store (the step view, the straggler strip). */
    this.hooks = { header: null, stepTimes: null };
    this._clear();
  }

  _clear() {
    this.header = null;
    this.records = []; // ascending epoch
    this.byEpoch = new Map();
    this.ranks = [];
    this.rankMap = new Map(); // rank -> ranks entry
    this.ranksSeq = null; // the run sequence number this.ranks are as of (null: unordered)
    this.unheld = new Map(); // rank -> the KEPT_KEYS no array has given this page yet
    this.hostOfRank = new Map(); // rank -> host (header topology)
    this.rankSeries = new Map(); // rank -> [{t, util, vu, vt}] sampled from `ranks` events
    this.rankSeen = new Map(); // rank -> last_seen already sampled
    this.knownRanks = new Set();
    this.tab = "home";
    this.expandedAlerts = new Set();
    this.stepRanks = false; // some rank has sent steps
    this.rows = null; // the rank row models last rendered (model.rankRows)
    this.stacks = null; // the last GET /stacks answer ({dumps, groups}); null: none yet
    this.epochRewinds = []; // (8.1) [{attempt, start, next}]: epochs attempt `next` superseded here
    this.attempt = null; // (8.1) the header's current attempt, once one said it
  }

  /** `fn(...parts)` after every update. */
  subscribe(fn) {
    this._listeners.push(fn);
  }

  changed(...parts) {
    for (const fn of this._listeners) fn(...parts);
  }

  /** Forget the open run and start `run` (a new generation). */
  reset(run) {
    this.gen += 1;
    this.run = run;
    this._clear();
  }

  /** The JSON snapshot of a run (`GET /api/runs/<run>`, or one embedded in a page). */
  loadSnapshot(data) {
    if (!data) return;
    this.applyHeader(data, false);
    if (Array.isArray(data.records)) for (const r of data.records) this.addRecord(r);
    if (Array.isArray(data.ranks)) this.applyRanks(data.ranks, false, 0);
  }

  /** A run header (`run` event or snapshot); `firstOfConnection` sets the steps cut. */
  applyHeader(hd, firstOfConnection) {
    if (!hd || typeof hd !== "object") return;
    // a connection orders its own ranks (event ids and its snapshot); a broker that
    // restarted may number them anew
    if (firstOfConnection) this.ranksSeq = null;
    const out = {};
    for (const k of HEADER_KEYS) out[k] = hd[k];
    this.header = out;
    // (8.1) a new attempt's ranks are those of its processes: an elastic job that came back
    // smaller leaves no row behind (the ranks array and the hosts name the new ones again)
    if (Number.isInteger(hd.attempt)) {
      if (this.attempt !== null && hd.attempt > this.attempt) this.knownRanks = new Set();
      this.attempt = hd.attempt;
    }
    this.hostOfRank = new Map();
    for (const host of Array.isArray(hd.hosts) ? hd.hosts : []) {
      for (const r of host.ranks || []) {
        this.hostOfRank.set(r, host.host);
        this.noteRank(r);
      }
    }
    if (this.hooks.header) this.hooks.header(out, firstOfConnection);
    this.changed("header", "ranks");
  }

  /** The run's status changed (`complete` event). */
  setStatus(status) {
    if (this.header && typeof status === "string") {
      this.header.status = status;
      this.changed("header");
    }
  }

  /** One epoch record (replaces a record of the same epoch). */
  addRecord(rec) {
    if (!rec || !isNum(rec.epoch)) return;
    this._rewindEpochs(rec);
    const had = this.byEpoch.has(rec.epoch);
    this.byEpoch.set(rec.epoch, rec);
    const recs = this.records;
    if (had) {
      const i = recs.findIndex((r) => r.epoch === rec.epoch);
      recs[i] = rec;
    } else if (!recs.length || recs[recs.length - 1].epoch < rec.epoch) {
      recs.push(rec);
    } else {
      recs.push(rec);
      recs.sort((a, b) => a.epoch - b.epoch);
    }
    for (const g of rec.gpu_metrics || []) this.noteRank(g.device_index);
    if (this.header && isNum(rec.total_epochs) && rec.total_epochs > 0) {
      this.header.total_epochs = rec.total_epochs;
    }
    if (this.header && this.header.status === "waiting") this.header.status = "training";
    this.changed("records", "header");
  }

  /**
   * (8.1) An epoch record from an attempt newer than a held record at or after its epoch (a
   * restarted job re-running epochs; also the line a reconnect replays after a rewind): drop
   * every held record from its epoch on, so the record is then appended. A record without
   * `attempt` (a broker before 8.1) replaces its epoch's as before; a held one without it
   * counts as attempt 0.
   */
  _rewindEpochs(rec) {
    if (!Number.isInteger(rec.attempt)) return;
    const recs = this.records;
    const att = (r) => (Number.isInteger(r.attempt) ? r.attempt : 0);
    let i = recs.length;
    while (i > 0 && recs[i - 1].epoch >= rec.epoch) i--;
    const dropped = recs.slice(i);
    if (!dropped.some((r) => att(r) < rec.attempt)) return;
    this.epochRewinds.push({ attempt: Math.max(...dropped.map(att)), start: rec.epoch, next: rec.attempt });
    recs.length = i;
    for (const r of dropped) this.byEpoch.delete(r.epoch);
  }

  /**
   * A `ranks` array, received at server time `now` (from the stream; the JSON snapshot
   * passes `sample` false: no step-time sample for the straggler strip). `seq`: the run
   * sequence number it is as of (a `ranks` event's id, the snapshot's ranks header); one
   * older than the ranks held is ignored (the snapshot answer a `ranks` event overtook).
   */
  applyRanks(ranks, sample, now, seq = null) {
    if (!Array.isArray(ranks)) return;
    if (Number.isFinite(seq)) {
      if (this.ranksSeq !== null && seq < this.ranksSeq) {
        this._fillUnheld(ranks);
        return;
      }
      this.ranksSeq = seq;
    }
    // a big run's `ranks` event carries an entry's hardware and resources only when they
    // changed (issue 32; web/ranksbound.py): an entry without the key keeps what this page
    // has, and its kept sample is not a new point of the rank's series. What the page never
    // had is noted (`unheld`): an older snapshot answer, overtaken by the stream, fills it.
    const before = this.rankMap;
    const kept = new Set();
    for (const r of ranks) {
      if (!r || typeof r !== "object") continue;
      const p = before.get(r.rank);
      const miss = this.unheld.get(r.rank);
      for (const k of KEPT_KEYS) {
        if (k in r) {
          if (miss) miss.delete(k);
          continue;
        }
        r[k] = p ? p[k] : null;
        if (k === "resources") kept.add(r.rank);
        if (!p || (miss && miss.has(k))) {
          if (!this.unheld.has(r.rank)) this.unheld.set(r.rank, new Set());
          this.unheld.get(r.rank).add(k);
        }
      }
      if (miss && !miss.size) this.unheld.delete(r.rank);
    }
    this.ranks = ranks.slice().sort((a, b) => a.rank - b.rank);
    this.rankMap = new Map();
    const cap = this.ranks.length > BIG ? 600 : 5000;
    const stepMs = new Map();
    let anyStep = false;
    for (const r of this.ranks) {
      this.rankMap.set(r.rank, r);
      this.noteRank(r.rank);
      if (!kept.has(r.rank)) this._sampleRank(r, cap);
      if (isNum(r.step)) anyStep = true;
      if (isNum(r.step_ms)) stepMs.set(r.rank, r.step_ms);
    }
    if (anyStep) this.stepRanks = true;
    if (sample && Number.isInteger(this.attempt) && this.attempt > 0) {
      // (8.1) past a restart a rank is the current attempt's when this live array or the
      // hosts name it: an answer overtaken by the restart brings no old rank back for good
      for (const r of [...this.knownRanks]) {
        if (!this.rankMap.has(r) && !this.hostOfRank.has(r)) this.knownRanks.delete(r);
      }
    }
    if (stepMs.size && sample && this.hooks.stepTimes) this.hooks.stepTimes(now, stepMs);
    this.changed("ranks");
  }

  /** From a `ranks` array older than the one held: only what the page never had. */
  _fillUnheld(ranks) {
    let filled = false;
    for (const r of ranks) {
      const miss = r && this.unheld.get(r.rank);
      const cur = miss && this.rankMap.get(r.rank);
      if (!cur) continue;
      for (const k of [...miss]) {
        if (k in r) {
          cur[k] = r[k];
          miss.delete(k);
          filled = true;
        }
      }
      if (!miss.size) this.unheld.delete(r.rank);
    }
    if (filled) this.changed("ranks");
  }

  /** Append a rank's latest resources to its client-side series, once per new frame time. */
  _sampleRank(r, cap) {
    const res = r.resources;
    if (!res || !isNum(r.last_seen)) return;
    if (this.rankSeen.get(r.rank) === r.last_seen) return;
    this.rankSeen.set(r.rank, r.last_seen);
    const { util, vu, vt } = rankGpu(r);
    if (!isNum(util) && !isNum(vu)) return;
    let series = this.rankSeries.get(r.rank);
    if (!series) this.rankSeries.set(r.rank, (series = []));
    series.push({ t: r.last_seen, util: isNum(util) ? util : null, vu, vt });
    if (series.length > cap) series.splice(0, series.length - cap);
  }

  /** A `GET /api/runs/<run>/stacks` answer (stallview.js fetches it). */
  setStacks(view) {
    if (!view || !Array.isArray(view.dumps) || !Array.isArray(view.groups)) return;
    this.stacks = view;
    this.changed("stacks");
  }

  /** The ranks whose latest `ranks` entry says `stalled`, ascending. */
  stalledRanks() {
    return this.ranks.filter((r) => r.status === "stalled").map((r) => r.rank);
  }

  noteRank(rank) {
    if (!isNum(rank) || this.knownRanks.has(rank)) return;
    this.knownRanks.add(rank);
    this.changed("ranks");
  }

  /** Open a rank's panel ("home": the overview). */
  setTab(tab) {
    this.tab = tab;
    this.changed("tab");
  }
}

/** A rank's GPU figures: the rank's own device when it reports several. */
export function rankGpu(r) {
  const res = (r && r.resources) || {};
  const own = (res.gpus || []).find((g) => g.device_index === r.rank) || (res.gpus || [])[0] || {};
  return {
    util: isNum(res.gpu_util_percent) ? res.gpu_util_percent : own.util_percent,
    vu: isNum(res.vram_allocated_bytes) ? res.vram_allocated_bytes : own.vram_allocated_bytes,
    vt: isNum(res.vram_total_bytes) ? res.vram_total_bytes : own.vram_total_bytes,
    name: own.name,
  };
}
