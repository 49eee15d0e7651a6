// rankboard cluster view (#cluster, PROTOCOL 7.4): every run and every host at a glance, for
// the admins who run the brokers.
//
// Runs: GET /api/runs (every run, with the 7.4 counts) is held whole, because the status
// counts and the sorts are over every run; the filter, the search and the sort run here
// (a few milliseconds for thousands of runs) and only one page of rows is in the DOM.
// Hosts: GET /api/hosts, suspects first, one page of rows, each incident a link to its run.
// Both are polled while the view is shown and the tab visible; an answer whose text did
// not change is neither parsed nor drawn again. Every string from a job (run ids, labels,
// host names, alert kinds) goes into the DOM through textContent (dom.js h()), and links are
// built with encodeURIComponent, so a hostile name is only ever text.

import { enc, serverNow } from "./api.js";
import { button, h, setText } from "./dom.js";
import { DASH, fmtAgo, fmtInt, isNum } from "./fmt.js";

export const STATUSES = ["waiting", "training", "complete", "failed"];
const POLL_MS = 5000;
const RUN_ROWS = 100;
const HOST_ROWS = 50;
const INCIDENTS_SHOWN = 4;
/** Redraw unchanged runs this often, so their "… ago" times do not go stale. */
const AGES_MS = 30000;
const STATUS_RANK = { failed: 0, training: 1, waiting: 2, complete: 3 };

/** The sortable columns: key -> [header text, value of a run (numbers; null last)]. */
const SORTS = {
  started: ["started", (r) => (isNum(r.started_at) ? r.started_at : null)],
  updated: ["updated", (r) => (isNum(r.updated_at) ? r.updated_at : null)],
  world: ["world size", (r) => (isNum(r.world_size) ? r.world_size : null)],
  status: ["status", (r) => STATUS_RANK[r.status] ?? 9],
};

/** Does run `r` match the search `q` (already lower-cased): a substring of its id or label. */
export function matches(r, q) {
  if (!q) return true;
  if (String(r.run).toLowerCase().includes(q)) return true;
  return typeof r.label === "string" && r.label.toLowerCase().includes(q);
}

/** Runs per status, over every run. */
export function statusCounts(runs) {
  const counts = Object.fromEntries(STATUSES.map((s) => [s, 0]));
  for (const r of runs) if (r.status in counts) counts[r.status] += 1;
  return counts;
}

/**
 * The runs to list: those with a status in `statuses` (an empty set: every run) matching
 * `q`, sorted by `sort` (`{key, desc}`; ties keep the server's newest-first order).
 */
export function selectRuns(runs, statuses, q, sort) {
  const needle = (q || "").trim().toLowerCase();
  const kept = [];
  runs.forEach((r, i) => {
    if ((statuses.size === 0 || statuses.has(r.status)) && matches(r, needle)) kept.push([r, i]);
  });
  const value = (SORTS[sort.key] || SORTS.started)[1];
  const sign = sort.desc ? -1 : 1;
  kept.sort(([a, ia], [b, ib]) => {
    const va = value(a);
    const vb = value(b);
    if (va === vb) return ia - ib;
    if (va === null) return 1;
    if (vb === null) return -1;
    return va < vb ? -sign : sign;
  });
  return kept.map(([r]) => r);
}

const runLink = (run) => `#run=${enc(run)}`;

function ago(t) {
  return isNum(t) ? fmtAgo(serverNow() - t) : DASH;
}

function cell(text, cls) {
  return h("td", cls, text);
}

function countCell(n, level) {
  const td = h("td", "num mono", n ? fmtInt(n) : "");
  if (n) td.dataset.level = level;
  return td;
}

export class ClusterView {
  /** `section`: the view's element (empty; it builds everything inside it); `hooks`:
   * {onRuns(runs)} told each new /api/runs answer. */
  constructor(section, hooks = {}) {
    this.section = section;
    this.hooks = hooks;
    this.runs = [];
    this.hosts = [];
    this.runsText = null;
    this.hostsText = null;
    this.statuses = new Set();
    this.q = "";
    this.sort = { key: "started", desc: true };
    this.runPage = 0;
    this.hostPage = 0;
    this.timer = null;
    this.shown = false;
    this.firstDraw = null; // performance.now() when both tables first showed data
    this.draws = 0;
    this.drawnAt = 0;
    this.fetches = 0;
    this._build();
  }

  _build() {
    const runsCard = h("div", "card cluster-card");
    const head = h("div", "section-head");
    head.append(h("h2", "section-title", "Runs"));
    this.runsSub = h("span", "section-sub");
    head.append(this.runsSub);
    const tools = h("div", "section-tools");
    this.counts = h("div", "cluster-counts");
    this.counts.dataset.testid = "cluster-counts";
    this.search = h("input", "tool-input cluster-search");
    this.search.type = "search";
    this.search.placeholder = "search run id or label";
    this.search.setAttribute("aria-label", "search runs");
    this.search.dataset.testid = "cluster-search";
    this.search.addEventListener("input", () => {
      this.q = this.search.value;
      this.runPage = 0;
      this.renderRuns();
    });
    tools.append(this.counts, this.search);
    head.append(tools);
    this.runTable = h("table", "table cluster-table");
    this.runTable.dataset.testid = "cluster-runs";
    this.runHead = h("thead");
    this.runBody = h("tbody");
    this.runTable.append(this.runHead, this.runBody);
    const runWrap = h("div", "table-wrap");
    runWrap.append(this.runTable);
    this.runPager = h("div", "pager");
    runsCard.append(head, runWrap, this.runPager);

    const hostsCard = h("div", "card cluster-card");
    const hhead = h("div", "section-head");
    hhead.append(h("h2", "section-title", "Hosts"));
    this.hostsSub = h("span", "section-sub");
    hhead.append(this.hostsSub);
    this.hostTable = h("table", "table cluster-table");
    this.hostTable.dataset.testid = "cluster-hosts";
    const hrow = h("tr");
    for (const [t, cls] of [["host"], ["verdict"], ["runs", "num"], ["ranks", "num"], ["incidents"]]) {
      hrow.append(h("th", cls, t));
    }
    const hthead = h("thead");
    hthead.append(hrow);
    this.hostBody = h("tbody");
    this.hostTable.append(hthead, this.hostBody);
    const hostWrap = h("div", "table-wrap");
    hostWrap.append(this.hostTable);
    this.hostPager = h("div", "pager");
    hostsCard.append(hhead, hostWrap, this.hostPager);
    this.section.replaceChildren(runsCard, hostsCard);
    this._renderRunHead();
  }

  // ------------------------------------------------------------- showing and polling

  open() {
    this.section.hidden = false;
    this.shown = true;
    this.poll();
    if (this.timer === null) {
      this.timer = setInterval(() => {
        if (!document.hidden) this.poll();
      }, POLL_MS);
    }
  }

  close() {
    this.section.hidden = true;
    this.shown = false;
    if (this.timer !== null) clearInterval(this.timer);
    this.timer = null;
  }

  async _text(path) {
    const resp = await fetch(path, { credentials: "same-origin", cache: "no-store" });
    if (!resp.ok) throw new Error(`${resp.status} ${path}`);
    return resp.text();
  }

  /** Fetch both lists; parse and draw only what changed. */
  async poll() {
    this.fetches += 1;
    let runsText;
    let hostsText;
    try {
      [runsText, hostsText] = await Promise.all([this._text("/api/runs"), this._text("/api/hosts")]);
    } catch (err) {
      setText(this.runsSub, "cannot reach the dashboard");
      this.runsText = null; // the next answer is drawn even if unchanged, clearing this
      return;
    }
    if (!this.shown) return;
    if (runsText !== this.runsText) {
      const runs = JSON.parse(runsText);
      if (Array.isArray(runs)) {
        this.runsText = runsText;
        this.runs = runs;
        this.renderRuns();
        if (this.hooks.onRuns) this.hooks.onRuns(runs);
      }
    } else if (performance.now() - this.drawnAt > AGES_MS) {
      this.renderRuns(); // nothing changed, but "started/updated … ago" has aged
    }
    if (hostsText !== this.hostsText) {
      const hosts = JSON.parse(hostsText);
      if (Array.isArray(hosts)) {
        this.hostsText = hostsText;
        this.hosts = hosts;
        this.renderHosts();
      }
    }
    if (this.firstDraw === null && this.runsText !== null && this.hostsText !== null) {
      this.firstDraw = performance.now();
    }
  }

  // ------------------------------------------------------------------------ runs

  _renderRunHead() {
    const row = h("tr");
    const cols = [["status", "status"], ["run"], ["shard", null, "num"], ["world size", "world", "num"],
      ["epochs", null, "num"], ["step", null, "num"], ["stalled", null, "num"], ["stale", null, "num"],
      ["alerts", null, "num"], ["started", "started"], ["updated", "updated"]];
    for (const [text, key, cls] of cols) {
      const th = h("th", cls || null);
      if (key) {
        const on = this.sort.key === key;
        const b = button("th-sort", `${text}${on ? (this.sort.desc ? " ▼" : " ▲") : ""}`, () => {
          this.sort = { key, desc: this.sort.key === key ? !this.sort.desc : key !== "status" };
          this.runPage = 0;
          this._renderRunHead();
          this.renderRuns();
        });
        b.dataset.sort = key;
        th.setAttribute("aria-sort", on ? (this.sort.desc ? "descending" : "ascending") : "none");
        th.append(b);
      } else {
        th.textContent = text;
      }
      row.append(th);
    }
    this.runHead.replaceChildren(row);
  }

  _renderCounts() {
    const counts = statusCounts(this.runs);
    const chips = [];
    const all = button("tool-btn", `all ${fmtInt(this.runs.length)}`, () => {
      this.statuses.clear();
      this.runPage = 0;
      this.renderRuns();
    });
    all.dataset.status = "";
    all.setAttribute("aria-pressed", String(this.statuses.size === 0));
    chips.push(all);
    for (const s of STATUSES) {
      const b = button("tool-btn status-chip", `${s} ${fmtInt(counts[s])}`, () => {
        if (this.statuses.has(s)) this.statuses.delete(s);
        else this.statuses.add(s);
        this.runPage = 0;
        this.renderRuns();
      });
      b.dataset.status = s;
      b.setAttribute("aria-pressed", String(this.statuses.has(s)));
      chips.push(b);
    }
    this.counts.replaceChildren(...chips);
  }

  /** The runs table: counts, then one page of the filtered, sorted runs. */
  renderRuns() {
    this._renderCounts();
    const rows = selectRuns(this.runs, this.statuses, this.q, this.sort);
    const pages = Math.max(1, Math.ceil(rows.length / RUN_ROWS));
    this.runPage = Math.min(this.runPage, pages - 1);
    const first = this.runPage * RUN_ROWS;
    const page = rows.slice(first, first + RUN_ROWS);
    this.runBody.replaceChildren(...page.map((r) => this._runRow(r)));
    setText(this.runsSub, rows.length === this.runs.length
      ? `${fmtInt(this.runs.length)} runs`
      : `${fmtInt(rows.length)} of ${fmtInt(this.runs.length)} runs`);
    this._pager(this.runPager, this.runPage, pages, first, page.length, rows.length, (p) => {
      this.runPage = p;
      this.renderRuns();
    });
    this.draws += 1;
    this.drawnAt = performance.now();
  }

  _runRow(r) {
    const tr = h("tr");
    tr.dataset.run = r.run;
    const st = h("td");
    const dot = h("span", "run-dot");
    dot.dataset.status = r.status || "unknown";
    st.append(dot, h("span", "run-status", r.status || "?"));
    const name = h("td", "run-cell");
    const a = h("a", "run-link", r.label || r.run);
    a.href = runLink(r.run);
    name.append(a);
    if (r.label) name.append(h("span", "run-id mono", r.run));
    const total = isNum(r.total_epochs) && r.total_epochs > 0 ? fmtInt(r.total_epochs) : "?";
    tr.append(st, name, cell(fmtInt(r.shard ?? 0), "num mono"), cell(fmtInt(r.world_size), "num mono"),
      cell(`${fmtInt(r.epochs_done ?? 0)}/${total}`, "num mono"), cell(fmtInt(r.steps_done), "num mono"),
      countCell(r.ranks_stalled, "bad"), countCell(r.ranks_stale, "warn"), countCell(r.alerts, "warn"),
      cell(ago(r.started_at), "mono"), cell(ago(r.updated_at), "mono"));
    return tr;
  }

  _pager(el, page, pages, first, shown, total, go) {
    if (pages <= 1) {
      el.hidden = true;
      el.replaceChildren();
      return;
    }
    el.hidden = false;
    const prev = button("btn btn-small", "‹ prev", () => go(page - 1));
    prev.disabled = page === 0;
    const next = button("btn btn-small", "next ›", () => go(page + 1));
    next.disabled = page >= pages - 1;
    const where = h("span", "muted mono", `${fmtInt(first + 1)}–${fmtInt(first + shown)} of ${fmtInt(total)}`);
    el.replaceChildren(prev, where, next);
  }

  // ----------------------------------------------------------------------- hosts

  /** The hosts table: one page of hosts in the server's order (suspects first). */
  renderHosts() {
    const hosts = this.hosts;
    const pages = Math.max(1, Math.ceil(hosts.length / HOST_ROWS));
    this.hostPage = Math.min(this.hostPage, pages - 1);
    const first = this.hostPage * HOST_ROWS;
    const page = hosts.slice(first, first + HOST_ROWS);
    this.hostBody.replaceChildren(...page.map((x) => this._hostRow(x)));
    const suspects = hosts.reduce((n, x) => n + (x.suspect ? 1 : 0), 0);
    setText(this.hostsSub, `${fmtInt(hosts.length)} hosts · ${fmtInt(suspects)} suspect`);
    this._pager(this.hostPager, this.hostPage, pages, first, page.length, hosts.length, (p) => {
      this.hostPage = p;
      this.renderHosts();
    });
  }

  _hostRow(x) {
    const tr = h("tr");
    tr.dataset.host = x.host;
    if (x.suspect) tr.dataset.suspect = "true";
    const verdict = h("td", "host-verdict");
    if (x.suspect) {
      verdict.append(h("span", "suspect-tag", "suspect"));
      for (const why of x.reasons || []) verdict.append(h("span", "reason", why));
    } else {
      verdict.append(h("span", "muted", x.incidents && x.incidents.length ? "watch" : "ok"));
    }
    const runs = Array.isArray(x.runs) ? x.runs : [];
    const incidents = Array.isArray(x.incidents) ? x.incidents : [];
    const list = h("td", "incidents");
    for (const inc of incidents.slice(0, INCIDENTS_SHOWN)) {
      const a = h("a", "incident", `${inc.kind} · ${inc.run} · rank ${inc.rank}`);
      a.href = isNum(inc.rank) ? `${runLink(inc.run)}&rank=${inc.rank}` : runLink(inc.run);
      a.title = `${inc.kind} on rank ${inc.rank} of ${inc.run}, ${ago(inc.at)}`;
      a.dataset.kind = inc.kind;
      list.append(a);
    }
    if (incidents.length > INCIDENTS_SHOWN) {
      list.append(h("span", "muted", `+${fmtInt(incidents.length - INCIDENTS_SHOWN)} more`));
    }
    tr.append(cell(x.host, "host mono"), verdict, cell(fmtInt(runs.length), "num mono"),
      cell(fmtInt(x.ranks), "num mono"), list);
    return tr;
  }

  /** What the view shows, for the browser tests and the benchmark. */
  snapshot() {
    return {
      firstDraw: this.firstDraw,
      draws: this.draws,
      fetches: this.fetches,
      runs: this.runs.length,
      hosts: this.hosts.length,
      runRows: this.runBody.rows.length,
      hostRows: this.hostBody.rows.length,
    };
  }
}
