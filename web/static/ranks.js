// rankboard rank views that must stay small at 1,024 ranks: the sortable, paginated rank
// table, the rank picker (search, worst first) that replaces rank tabs on big runs, and the
// alert list grouped by kind. Only one page of rows, and at most LIST_MAX picker entries,
// are ever in the DOM.

import { alertMessage, alertState, resolvedText } from "./alertstate.js";
import { serverNow } from "./api.js";
import { SLOW_AT } from "./slowness.js";
import { bidi, button, h, statusDot } from "./dom.js";
import {
  DASH, fmtAgo, fmtBytes, fmtInt, fmtMs, fmtPct, fmtThroughput, isNum, numOrNull, pct,
} from "./fmt.js";
import { GPU_ALERT_HINTS, GPU_ALERT_LEVEL, GPU_ALERT_TEXT } from "./gpuhealth.js";

const PAGE = 12;
const LIST_MAX = 60;

const SEVERITY = { error: 0, stale: 1, ok: 2, unknown: 2, finished: 3 };

/**
 * How bad a rank looks, for "worst first": status (error, stale, ok, finished), then
 * slowness (step time, else lower throughput, else lower GPU utilisation). Lower is worse.
 */
export function worstKey(row) {
  const sev = SEVERITY[row.status] ?? 2;
  let slow = 0;
  if (isNum(row.stepMs)) slow = -row.stepMs;
  else if (isNum(row.throughput)) slow = row.throughput;
  else if (isNum(row.util)) slow = row.util;
  return [sev, slow];
}

export function compareWorst(a, b) {
  const [sa, wa] = worstKey(a);
  const [sb, wb] = worstKey(b);
  return sa - sb || wa - wb || a.rank - b.rank;
}

function miniBar(value, warnHigh) {
  const wrap = h("span", "minibar");
  const fill = h("span", "minibar-fill");
  const v = isNum(value) ? Math.max(0, Math.min(100, value)) : 0;
  fill.style.width = `${v}%`;
  if (warnHigh && v >= 90) fill.dataset.level = "high";
  wrap.append(fill);
  return wrap;
}

const num = numOrNull;

/** A rank's GPU health as tags (text and a title each), or a quiet "ok" / dash. */
export function healthTags(health) {
  const wrap = h("span", "health-tags");
  wrap.dataset.health = health.level;
  if (!health.tags.length) {
    const t = h("span", `health-tag health-${health.level}`, health.level === "ok" ? "ok" : DASH);
    t.title = health.title;
    wrap.append(t);
    return wrap;
  }
  for (const tag of health.tags) {
    const t = h("span", `health-tag health-${tag.level}`, tag.text);
    t.dataset.tag = tag.key;
    t.title = tag.title;
    wrap.append(t);
  }
  return wrap;
}

/** Column definitions: key, header, sort value, cell builder, when shown. */
const COLUMNS = [
  { key: "rank", label: "rank", sort: (r) => r.rank, cell: (r, t) => {
    const td = h("td", "mono");
    td.append(button("link", `rank ${r.rank}`, () => t.opts.onOpen(r.rank)));
    return td;
  } },
  { key: "host", label: "host", sort: (r) => r.host ?? "", cell: (r) => {
    const td = h("td", "host", r.host ?? DASH);
    if (r.host) td.title = r.host;
    return td;
  } },
  { key: "local", label: "local", title: "local rank: the rank's index on its host (LOCAL_RANK)", sort: (r) => num(r.localRank), cell: (r) => h("td", "mono", isNum(r.localRank) ? r.localRank : DASH) },
  { key: "status", label: "status", title: "sort: stale and failing first, then slowest", sort: null, cell: (r) => {
    const td = h("td");
    const s = h("span", "status-cell");
    s.append(statusDot(r.status), h("span", null, r.status ?? DASH));
    if (r.error) s.title = `failed: ${r.error}`; // 8.2: the exception's type (an attribute: text)
    td.append(s);
    return td;
  } },
  { key: "seen", label: "last seen", sort: (r) => num(r.lastSeen), cell: (r) => {
    const td = h("td", "mono muted ago", isNum(r.lastSeen) ? fmtAgo(serverNow() - r.lastSeen) : DASH);
    td.dataset.at = isNum(r.lastSeen) ? String(r.lastSeen) : "";
    return td;
  } },
  { key: "epoch", label: "epoch", when: "epochs", sort: (r) => num(r.epoch), cell: (r) => h("td", "mono", isNum(r.epoch) ? r.epoch : DASH) },
  { key: "step", label: "step", when: "steps", num: true, sort: (r) => num(r.step), cell: (r) => h("td", "num mono", isNum(r.step) ? fmtInt(r.step) : DASH) },
  { key: "util", label: "GPU util", num: true, sort: (r) => num(r.util), cell: (r) => {
    const td = h("td", "num");
    td.append(miniBar(r.util, false), h("span", "mono", fmtPct(r.util)));
    return td;
  } },
  { key: "vram", label: "VRAM", sort: (r) => pct(r.vu, r.vt), cell: (r) => {
    const td = h("td");
    const v = h("span", "vram-cell");
    // two halves that each keep together: a narrow table wraps after the "/" (never "80.0 / GiB")
    const fig = h("span", "mono");
    if (isNum(r.vu)) fig.append(h("span", "nowrap", `${fmtBytes(r.vu)} /`), " ", h("span", "nowrap", fmtBytes(r.vt)));
    else fig.textContent = DASH;
    v.append(miniBar(pct(r.vu, r.vt), true), fig);
    td.append(v);
    return td;
  } },
  { key: "health", label: "GPU health", when: "health", title: "sort by GPU health, worst first (XID, ECC, row remap; then throttling, PCIe, NVLink)", sort: (r) => (r.health.level === "none" ? null : r.health.score), cell: (r) => {
    const td = h("td", "health-cell");
    td.append(healthTags(r.health));
    return td;
  } },
  { key: "throughput", label: "throughput", when: "epochs", num: true, sort: (r) => num(r.throughput), cell: (r) => h("td", "num mono", fmtThroughput(r.throughput)) },
  { key: "stepMs", label: "step time", when: "steps", num: true, sort: (r) => num(r.stepMs), cell: (r) => {
    const td = h("td", "num mono", fmtMs(r.stepMs));
    if (isNum(r.stepRatio) && r.stepRatio >= SLOW_AT) td.classList.add("warn-text");
    if (isNum(r.stepRatio)) td.title = `${r.stepRatio.toFixed(2)}× the median rank's`;
    return td;
  } },
  { key: "dataMs", label: "data wait", title: "ms a step this rank waited for its batch (mean of its last ≤100 steps)", when: "steps", num: true, sort: (r) => num(r.dataMs), cell: (r) => h("td", "num mono", fmtMs(r.dataMs)) },
  { key: "slowShare", label: "slowest share", title: "fraction of the last ≤1000 closed steps in which this rank was the slowest", when: "steps", num: true, sort: (r) => num(r.slowShare), cell: (r) => {
    const td = h("td", "num mono", isNum(r.slowShare) ? fmtPct(r.slowShare * 100, 1) : DASH);
    if (r.marks.includes("straggler")) td.classList.add("warn-text");
    return td;
  } },
  { key: "share", label: "batch share", when: "epochs", num: true, sort: (r) => num(r.share), cell: (r) => h("td", "num mono", isNum(r.share) ? fmtPct(r.share * 100, 1) : DASH) },
  { key: "marks", label: "", sort: null, nosort: true, cell: (r) => {
    const td = h("td", "marks");
    const text = { fastest: "fastest", slowest: "slowest", straggler: "straggler" };
    for (const m of r.marks) {
      const b = h("span", `badge badge-${m === "fastest" ? "fast" : "slow"}`, text[m] || m);
      b.dataset.mark = m;
      td.append(b);
    }
    return td;
  } },
];

export class RankTable {
  constructor(table, pager, opts) {
    this.table = table;
    this.pager = pager;
    this.opts = opts;
    this.sort = null; // {key, dir} or null = worst first / rank order
    this.page = 0;
    this.rows = [];
    this._headKey = null;
  }

  reset() {
    this.sort = null;
    this.page = 0;
    this._headKey = null;
  }

  /** `rows`: row models; `flags`: {epochs, steps, big, health} (health: some rank reports
   * GPU health fields, so the column has something to say). */
  update(rows, flags) {
    this.flags = flags;
    const cols = COLUMNS.filter((c) => !c.when || flags[c.when]);
    this._head(cols);
    const sorted = rows.slice();
    const s = this.sort;
    if (s) {
      const col = COLUMNS.find((c) => c.key === s.key);
      sorted.sort((a, b) => {
        const va = col.sort(a);
        const vb = col.sort(b);
        if (va === null && vb === null) return a.rank - b.rank;
        if (va === null) return 1; // absent values last either way
        if (vb === null) return -1;
        const c = typeof va === "string" ? va.localeCompare(vb) : va - vb;
        return (s.dir === "asc" ? c : -c) || a.rank - b.rank;
      });
    } else if (flags.big) {
      sorted.sort(compareWorst);
    } else {
      // small runs: failing and stale ranks first, otherwise rank order (rows stay put)
      sorted.sort((a, b) => (SEVERITY[a.status] ?? 2) - (SEVERITY[b.status] ?? 2) || a.rank - b.rank);
    }
    this.rows = sorted;
    const size = flags.big ? PAGE : Infinity;
    const pages = Math.max(1, Math.ceil(sorted.length / size));
    this.page = Math.min(this.page, pages - 1);
    const from = flags.big ? this.page * size : 0;
    const shown = flags.big ? sorted.slice(from, from + size) : sorted;
    const trs = shown.map((r) => {
      const tr = h("tr", "rank-row");
      tr.dataset.rank = String(r.rank);
      tr.dataset.status = r.status || "unknown";
      for (const c of cols) {
        const td = c.cell(r, this);
        td.dataset.col = c.key; // the narrow-screen rules of views.css hide some by key
        tr.append(td);
      }
      return tr;
    });
    if (!trs.length) {
      const tr = h("tr");
      const td = h("td", "muted empty-row", "no ranks yet");
      td.colSpan = cols.length;
      tr.append(td);
      trs.push(tr);
    }
    this.table.tBodies[0].replaceChildren(...trs);
    this._pager(sorted.length, from, shown.length, pages, flags.big);
  }

  _head(cols) {
    const key = `${cols.map((c) => c.key).join(",")}|${this.sort ? `${this.sort.key}:${this.sort.dir}` : ""}`;
    if (key === this._headKey) return;
    this._headKey = key;
    const tr = h("tr");
    for (const c of cols) {
      const th = h("th", c.num ? "num" : null);
      th.dataset.col = c.key;
      if (c.nosort) {
        tr.append(th);
        continue;
      }
      const active = this.sort ? this.sort.key === c.key : c.key === "status";
      const arrow = active ? (this.sort ? (this.sort.dir === "asc" ? " ▲" : " ▼") : " ●") : "";
      const b = button("th-sort", `${c.label}${arrow}`, () => this._sortBy(c));
      b.dataset.sort = c.key;
      b.title = c.title || `sort by ${c.label}`;
      if (active) b.setAttribute("aria-pressed", "true");
      th.append(b);
      tr.append(th);
    }
    this.table.tHead.replaceChildren(tr);
  }

  _sortBy(col) {
    if (col.key === "status" || col.sort === null) this.sort = null;
    else if (this.sort && this.sort.key === col.key) this.sort = { key: col.key, dir: this.sort.dir === "asc" ? "desc" : "asc" };
    else this.sort = { key: col.key, dir: col.key === "rank" || col.key === "host" ? "asc" : "desc" };
    this.page = 0;
    this._headKey = null;
    this.opts.onChange();
  }

  _pager(total, from, count, pages, big) {
    const p = this.pager;
    if (!big || pages <= 1) {
      p.hidden = true;
      p.replaceChildren();
      return;
    }
    p.hidden = false;
    const prev = button("btn btn-small", "‹ prev", () => {
      this.page = Math.max(0, this.page - 1);
      this.opts.onChange();
    });
    prev.disabled = this.page === 0;
    prev.dataset.action = "prev-page";
    const next = button("btn btn-small", "next ›", () => {
      this.page = Math.min(pages - 1, this.page + 1);
      this.opts.onChange();
    });
    next.disabled = this.page >= pages - 1;
    next.dataset.action = "next-page";
    const what = this.sort ? `sorted by ${COLUMNS.find((c) => c.key === this.sort.key).label}` : "worst first";
    p.replaceChildren(prev, h("span", "pager-text mono", `${fmtInt(from + 1)}–${fmtInt(from + count)} of ${fmtInt(total)} · ${what}`), next);
  }
}

// ------------------------------------------------------------------- rank picker

export class RankPicker {
  constructor(host, opts) {
    this.opts = opts;
    this.items = [];
    this.selected = null;
    this.worstFirst = true;
    const wrap = h("div", "rank-picker");
    wrap.dataset.testid = "rank-picker";
    this.btn = button("tab rank-picker-btn", "", () => this.toggle());
    this.btn.id = "rank-picker-btn";
    this.btn.setAttribute("aria-haspopup", "listbox");
    this.btn.setAttribute("aria-expanded", "false");
    this.pop = h("div", "rank-pop");
    this.pop.hidden = true;
    const bar = h("div", "rank-pop-bar");
    this.search = h("input", "rank-search");
    this.search.type = "search";
    this.search.id = "rank-search";
    this.search.placeholder = "rank number or host…";
    this.search.setAttribute("aria-label", "find a rank");
    this.search.addEventListener("input", () => this._list());
    this.search.addEventListener("keydown", (e) => {
      if (e.key === "Enter") {
        const first = this.list.querySelector("[data-rank]");
        if (first) this._pick(Number(first.dataset.rank));
      } else if (e.key === "Escape") {
        this.close();
      }
    });
    this.worstBtn = button("tool-btn", "worst first", () => {
      this.worstFirst = !this.worstFirst;
      this.worstBtn.setAttribute("aria-pressed", String(this.worstFirst));
      this._list();
    });
    this.worstBtn.dataset.action = "worst-first";
    this.worstBtn.setAttribute("aria-pressed", "true");
    bar.append(this.search, this.worstBtn);
    this.list = h("div", "rank-list");
    this.list.setAttribute("role", "listbox");
    this.foot = h("div", "rank-pop-foot muted");
    this.pop.append(bar, this.list, this.foot);
    wrap.append(this.btn, this.pop);
    host.append(wrap);
    this.el = wrap;
    document.addEventListener("pointerdown", (e) => {
      if (!this.pop.hidden && !wrap.contains(e.target)) this.close();
    });
    window.addEventListener("scroll", () => {
      if (!this.pop.hidden) this.close();
    }, { passive: true });
    this._label();
  }

  /** `items`: row models ({rank, host, status, stepMs, throughput, util}). */
  update(items, selected) {
    this.items = items;
    this.selected = selected;
    this._label();
    if (!this.pop.hidden) this._list();
  }

  _label() {
    const n = this.items.length;
    const bad = this.items.filter((r) => r.status === "stale" || r.status === "error").length;
    this.btn.replaceChildren(
      h("span", "dot"),
      h("span", "tab-text", this.selected !== null ? `rank ${this.selected}` : `ranks (${fmtInt(n)})`),
      h("span", "caret", "▾"),
    );
    this.btn.firstChild.dataset.status = bad ? "stale" : "ok";
    this.btn.classList.toggle("active", this.selected !== null);
    this.btn.title = `${fmtInt(n)} ranks${bad ? `, ${fmtInt(bad)} stale or failing` : ""}: find one`;
  }

  toggle() {
    if (this.pop.hidden) this.open();
    else this.close();
  }

  open() {
    // fixed, so the tab bar's horizontal scroll does not clip it
    const r = this.btn.getBoundingClientRect();
    this.pop.style.top = `${Math.round(r.bottom + 2)}px`;
    this.pop.style.left = `${Math.round(Math.max(8, Math.min(r.left, window.innerWidth - 396)))}px`;
    this.pop.hidden = false;
    this.btn.setAttribute("aria-expanded", "true");
    this._list();
    this.search.focus();
  }

  close() {
    this.pop.hidden = true;
    this.btn.setAttribute("aria-expanded", "false");
  }

  _matches() {
    const q = this.search.value.trim().toLowerCase().replace(/^(rank|r)\s*/, "");
    let items = this.items;
    if (q) {
      const n = /^\d+$/.test(q) ? Number(q) : null;
      items = items.filter((r) => (n !== null && String(r.rank).startsWith(q)) || (r.host && r.host.toLowerCase().includes(q)));
      if (n !== null) items.sort((a, b) => (a.rank === n ? -1 : b.rank === n ? 1 : 0));
    }
    if (this.worstFirst && !q) items = items.slice().sort(compareWorst);
    else if (!q) items = items.slice().sort((a, b) => a.rank - b.rank);
    return items;
  }

  _list() {
    const items = this._matches();
    const shown = items.slice(0, LIST_MAX).map((r) => {
      const b = button("rank-item", null, () => this._pick(r.rank));
      b.dataset.rank = String(r.rank);
      b.setAttribute("role", "option");
      const fig = isNum(r.stepMs) ? fmtMs(r.stepMs) : isNum(r.throughput) ? fmtThroughput(r.throughput) : fmtPct(r.util);
      b.append(statusDot(r.status), h("span", "rank-item-rank mono", `rank ${r.rank}`),
        h("span", "rank-item-host", r.host ?? DASH), h("span", "rank-item-fig mono", fig));
      if (r.rank === this.selected) b.classList.add("active");
      return b;
    });
    this.list.replaceChildren(...shown);
    const more = items.length - shown.length;
    this.foot.textContent = items.length === 0 ? "no rank matches"
      : more > 0 ? `${fmtInt(more)} more: refine the search` : `${fmtInt(items.length)} rank${items.length === 1 ? "" : "s"}`;
  }

  _pick(rank) {
    this.close();
    this.search.value = "";
    this.opts.onPick(rank);
  }
}

// ------------------------------------------------------------------------ alerts

const ALERT_TEXT = {
  stale: "stale rank", stalled: "stalled rank", rank_error: "rank error", nonfinite_loss: "non-finite loss", ...GPU_ALERT_TEXT,
};
/** What to do about an alert kind: the list's tooltip. */
const ALERT_HINTS = {
  stale: "The rank sent nothing for the broker's --stale-after seconds: its process, host or network may be gone.",
  rank_error: "The rank finished with an error: see that rank's own log.",
  nonfinite_loss: "The loss became NaN or infinite: check the learning rate, the data and mixed-precision scaling.",
  stalled: "The rank's process was alive but its training loop did not move: see the stall view's stacks.",
  ...GPU_ALERT_HINTS,
};
const GROUP_AT = 4; // a kind with this many alerts or more is one line until expanded
const EXPANDED_MAX = 100;

function groupLine(kind, list, states) {
  const n = list.length;
  const over = list.filter((a) => states.get(a).over).length;
  const still = n - over;
  const tail = over ? ` (${fmtInt(over)} resolved)` : "";
  if (kind === "stale" || kind === "stalled") {
    if (!still) return `${fmtInt(n)} rank${n === 1 ? " was" : "s were"} ${kind} · all resolved`;
    return `${fmtInt(still)} rank${still === 1 ? "" : "s"} ${kind}${tail}`;
  }
  if (kind === "rank_error") return `${fmtInt(n)} ranks failed`;
  if (kind === "nonfinite_loss") return `${fmtInt(n)} non-finite losses`;
  if (kind in GPU_ALERT_TEXT) return `${fmtInt(n)} ranks: ${GPU_ALERT_TEXT[kind]}${tail} (latest: ${bidi(list[0].message ?? "")})`;
  return `${fmtInt(n)} alerts${tail}`;
}

function alertItem(a, state) {
  const item = h("div", "alert");
  item.dataset.kind = String(a.kind ?? "");
  if (a.rank !== null && a.rank !== undefined) item.dataset.rank = String(a.rank);
  item.classList.toggle("recovered", state.over);
  item.dataset.state = state.over ? "resolved" : "active";
  const at = h("span", "alert-time");
  at.dataset.at = String(a.at ?? "");
  at.textContent = isNum(a.at) ? `${state.over ? "raised " : ""}${fmtAgo(serverNow() - a.at)}` : "";
  const kind = h("span", "alert-kind", ALERT_TEXT[a.kind] || String(a.kind ?? "alert"));
  const hint = ALERT_HINTS[a.kind];
  if (hint) {
    kind.title = hint;
    item.title = hint;
  }
  if (GPU_ALERT_LEVEL[a.kind]) item.dataset.level = GPU_ALERT_LEVEL[a.kind];
  const msg = h("span", "alert-msg", alertMessage(a));
  if (msg.textContent !== (a.message ?? "")) msg.title = String(a.message);
  item.append(
    kind,
    h("span", "alert-rank", a.rank === null || a.rank === undefined ? "run" : `rank ${a.rank}`),
    msg,
    h("span", "alert-at", resolvedText(state)),
    at,
  );
  return item;
}

/** Kinds that answer "why", listed above the rest whatever their age (issue 43 item 3: the
 * collective verdict sank below newer repeats of `stalled`): which rank a hang waits for,
 * then the errors, the first of them first (the first failure, PROTOCOL 8.2). */
const ANSWERS = ["collective_behind", "collective_mismatch", "rank_error"];

function alertOrder(x, y) {
  const ax = ANSWERS.indexOf(x.kind);
  const ay = ANSWERS.indexOf(y.kind);
  const px = ax < 0 ? ANSWERS.length : ax;
  const py = ay < 0 ? ANSWERS.length : ay;
  if (px !== py) return px - py;
  if (x.kind === "rank_error" && y.kind === "rank_error") return (x.at || 0) - (y.at || 0);
  return (y.at || 0) - (x.at || 0);
}

/**
 * Alerts newest first, the answers (ANSWERS) above them, grouped by kind: a kind with few alerts lists them; one with many is
 * one line ("1,024 ranks stale") that expands (`expanded`: the set of expanded kinds).
 */
export function renderAlerts(box, alerts, rankStatus, expanded, onToggle, run = null) {
  box.hidden = alerts.length === 0;
  const states = new Map(alerts.map((a) => [a, alertState(a, rankStatus, run)]));
  // every alert over: a history, not a red banner (a finished healthy run must not alarm)
  box.dataset.state = alerts.length && alerts.every((a) => states.get(a).over) ? "resolved" : "active";
  const byKind = new Map();
  for (const a of alerts.slice().sort(alertOrder)) {
    const k = String(a.kind ?? "");
    if (!byKind.has(k)) byKind.set(k, []);
    byKind.get(k).push(a);
  }
  const out = [];
  for (const [kind, list] of byKind) {
    if (list.length < GROUP_AT) {
      for (const a of list) out.push(alertItem(a, states.get(a)));
      continue;
    }
    const g = h("div", "alert alert-group");
    g.dataset.kind = kind;
    g.dataset.count = String(list.length);
    const open = expanded.has(kind);
    const latest = list[0];
    const at = h("span", "alert-time");
    at.dataset.at = String(latest.at ?? "");
    at.textContent = isNum(latest.at) ? fmtAgo(serverNow() - latest.at) : "";
    const t = button("link alert-toggle", open ? "hide" : "show all", () => onToggle(kind));
    t.dataset.action = "toggle-alerts";
    t.setAttribute("aria-expanded", String(open));
    const gk = h("span", "alert-kind", ALERT_TEXT[kind] || kind || "alert");
    if (ALERT_HINTS[kind]) gk.title = ALERT_HINTS[kind];
    if (GPU_ALERT_LEVEL[kind]) g.dataset.level = GPU_ALERT_LEVEL[kind];
    g.append(gk,
      h("span", "alert-msg alert-summary", groupLine(kind, list, states)), t, at);
    g.dataset.state = list.every((a) => states.get(a).over) ? "resolved" : "active";
    g.classList.toggle("recovered", g.dataset.state === "resolved");
    out.push(g);
    if (open) {
      const inner = h("div", "alert-group-list");
      inner.append(...list.slice(0, EXPANDED_MAX).map((a) => alertItem(a, states.get(a))));
      if (list.length > EXPANDED_MAX) inner.append(h("div", "alert muted", `and ${fmtInt(list.length - EXPANDED_MAX)} more`));
      out.push(inner);
    }
  }
  box.replaceChildren(...out);
}
