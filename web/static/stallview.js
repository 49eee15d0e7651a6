// rankboard stall view: a run in trouble says so at the top of the page, without a click.
// While any rank is stalled (PROTOCOL 3) it lists the stalled ranks and the groups of
// `GET /api/runs/<run>/stacks` ("1,023 ranks in all_reduce ← backward ← train_step"), each
// with its shared main-thread stack innermost first and the source lines; a rank's own dump
// with all its threads; the answers to the run's latest request; and a profile as its
// heaviest stacks (profileview.js). Buttons ask the run or one rank for a dump or a 5 s
// profile (POST /stacks); a read-only web (`<body data-read-only="true">`) gets none.
//
// It owns its data fetch, as steps.js does: /stacks is read when the run opens, when an SSE
// `stacks` event says dumps arrived, and when the set of stalled ranks changes, at most
// once a second (a burst of events costs one fetch). Every string from a rank (function,
// file, code, thread name) goes into the DOM through textContent only (dom.js `h`).

import { api, enc, postJson, serverNow } from "./api.js";
import { lastVerdictText, verdictText } from "./collectives.js";
import { $, button, h } from "./dom.js";
import { fmtAgo, fmtDur, fmtInt, isNum } from "./fmt.js";
import { hostOf } from "./model.js";
import { numbersLines } from "./numbersview.js";
import { profilePair } from "./profileview.js";
import { stragglerOf } from "./slowness.js";

/** At most one /stacks read this often (ms). */
const MIN_FETCH_MS = 1000;
/** Rank chips shown per group before "+N more". */
const MAX_CHIPS = 48;
/** Functions named in a group's one-line summary. */
const SUMMARY_DEPTH = 3;
/** After an accepted request the buttons wait this long (ms): the web's 429 rule is 1 s. */
const HOLD_MS = 1100;
/** The profile the buttons ask for. */
const PROFILE = { seconds: 5, hz: 100 };

/** The innermost `n` function names of a frame list (outermost first, as on the wire). */
export function innermost(frames, n = SUMMARY_DEPTH) {
  const fns = (frames || []).slice().reverse().map((f) => String(f.function));
  return fns.slice(0, n).join(" ← ") + (fns.length > n ? " ← …" : "");
}

/** "1,023 ranks in all_reduce ← backward ← train_step" / "rank 417 in __next__ ← …". */
export function groupLine(group) {
  const ranks = group.ranks || [];
  const who = ranks.length === 1 ? `rank ${ranks[0]}` : `${fmtInt(ranks.length)} ranks`;
  return `${who} in ${innermost(group.frames) || "?"}`;
}

/** A group's identity: its ranks and its shared stack (a stall group and an answer alike). */
function groupSig(g) {
  return `${(g.ranks || []).join(",")}|${(g.frames || []).map((f) => `${f.file}:${f.line}:${f.function}`).join(";")}`;
}

/** "a/b/c/d.py" -> "c/d.py" (the whole path in the title). */
function shortFile(file) {
  const parts = String(file).split("/");
  return parts.length > 2 ? parts.slice(-2).join("/") : String(file);
}

/** A frame list, innermost first: function, file:line, and the source line. */
function frameList(frames) {
  const list = h("ol", "frames");
  for (const f of (frames || []).slice().reverse()) {
    const li = h("li", "frame");
    const head = h("div", "frame-head");
    head.append(h("span", "frame-fn mono", f.function));
    const where = h("span", "frame-where mono", `${shortFile(f.file)}:${f.line}`);
    where.title = `${f.file}:${f.line}`;
    head.append(where);
    li.append(head);
    if (f.code) li.append(h("code", "frame-code mono", f.code));
    list.append(li);
  }
  return list;
}

/**
 * In a hang, the rank the others wait for (issue 43 item 1: a profile during a stall showed
 * two waiting ranks, not the hung one): the collective verdict's first `behind` or `absent`
 * rank, else the lowest rank of the odd stall group (fewest ranks) when the stall dumps
 * split into groups; null when nothing says.
 */
export function waitedFor(collectives, stallGroups) {
  for (const g of (collectives && collectives.groups) || []) {
    const behind = (g.behind || []).map((b) => b.rank).filter(isNum);
    if (behind.length) return Math.min(...behind);
    const absent = (g.absent || []).filter(isNum);
    if (absent.length) return Math.min(...absent);
  }
  if (stallGroups.length < 2) return null;
  const odd = stallGroups.reduce((best, g) => (!best || g.ranks.length < best.ranks.length ? g : best), null);
  return odd && odd.ranks.length ? Math.min(...odd.ranks) : null;
}

export class StallView {
  /** `page`: {store, selectTab}. */
  constructor(page) {
    this.page = page;
    this.box = $("stall-view");
    this.readOnly = document.body.dataset.readOnly !== "false";
    this.focus = null; // the rank clicked in a group (its own dump is shown)
    this.closed = null; // the open tab's rank whose dump the user closed
    this.lastFetch = 0;
    this.inFlight = false;
    this.timer = null;
    this.stalledKey = "";
    this.message = "";
    this.fetches = 0; // /stacks reads and SSE `stacks` events seen (tests read both)
    this.events = 0;
    this.held = false; // a request is on its way, or was accepted less than HOLD_MS ago
    this.drawn = null; // what the last render drew from (skip a render that would not differ)
    this.opened = new Map(); // <details> key -> open, as the user left it
    this.collectives = null; // GET /collectives (PROTOCOL 7.2), read with /stacks
  }

  /** A new run: forget the last one's dumps and read this one's. */
  reset() {
    clearTimeout(this.timer);
    this.timer = null;
    this.focus = null;
    this.closed = null;
    this.held = false;
    this.stalledKey = "";
    this.message = "";
    this.lastFetch = 0;
    this.drawn = null;
    this.opened = new Map();
    this.collectives = null;
    this.box.replaceChildren();
    this.box.hidden = true;
    this.refresh();
  }

  /** SSE `stacks` event: dumps arrived; read /stacks (rate-limited). */
  onStacks() {
    this.events += 1;
    this.refresh();
  }

  /** The ranks array changed: a different set of stalled ranks means different groups. */
  onRanks() {
    const key = this.page.store.stalledRanks().join(",");
    if (key !== this.stalledKey) {
      this.stalledKey = key;
      this.refresh();
    }
  }

  /** Read /stacks now, or once MIN_FETCH_MS has passed since the last read. */
  refresh() {
    if (this.timer !== null) return; // one is due already
    const wait = Math.max(0, this.lastFetch + MIN_FETCH_MS - Date.now());
    if (this.inFlight || wait > 0) {
      this.timer = setTimeout(() => {
        this.timer = null;
        this.refresh();
      }, this.inFlight ? MIN_FETCH_MS : wait);
      return;
    }
    const store = this.page.store;
    const run = store.run;
    const gen = store.gen;
    if (run === null) return;
    this.inFlight = true;
    this.lastFetch = Date.now();
    this.fetches += 1;
    api(`/api/runs/${enc(run)}/stacks`)
      .then((view) => {
        if (view && gen === store.gen) store.setStacks(view);
      })
      .catch(() => {})
      .finally(() => {
        this.inFlight = false;
      });
    // the collective verdict comes with the same events (7.2); drawn when it arrives
    api(`/api/runs/${enc(run)}/collectives`)
      .then((view) => {
        if (view && gen === store.gen) {
          this.collectives = view;
          this.render();
        }
      })
      .catch(() => {});
  }

  /** POST /stacks for the run (`ranks` null) or some ranks. */
  request(kind, ranks) {
    const store = this.page.store;
    const body = { kind, ranks };
    if (kind === "profile") Object.assign(body, PROFILE);
    this.message = kind === "profile" ? `profiling for ${PROFILE.seconds} s…` : "asking for stacks…";
    this.held = true; // no second request while this one is on its way
    this.render();
    postJson(`/api/runs/${enc(store.run)}/stacks`, body).then((r) => {
      const answer = r.data;
      // the web accepts one request per run a second (429): the buttons wait that long
      setTimeout(() => {
        this.held = false;
        this.render();
      }, r.status === 202 ? HOLD_MS : 0);
      if (r.status === 202) {
        const who = ranks ? `rank ${ranks.join(", ")}` : "every rank";
        this.message = `${kind === "profile" ? "profile" : "dump"} requested from ${who}`;
        // the answers come as SSE `stacks` events; a profile takes its seconds
        if (kind === "profile") setTimeout(() => this.refresh(), (PROFILE.seconds + 1.5) * 1000);
      } else {
        this.message = `request refused (${r.status}): ${answer.error || r.statusText}`;
      }
      this.render();
    }).catch(() => {
      this.held = false;
      this.message = "request failed: the dashboard is unreachable";
      this.render();
    });
  }

  /** Show `rank`'s own dump (a second click on it: hide it again). */
  setFocus(rank) {
    this.focus = this.shownRank() === rank ? null : rank;
    this.closed = this.focus === null ? rank : null;
    this.render();
  }

  /** The rank whose own dump and buttons are shown: the one clicked in a group, else the
   * rank whose tab is open (so any rank can be asked, stalled or not); null: none. */
  shownRank() {
    if (this.focus !== null) return this.focus;
    const tab = this.page.store.tab;
    return typeof tab === "number" && tab !== this.closed ? tab : null;
  }

  /** Why no request can be answered now (an ended run's ranks have all finished: the web
   * answers 409), or null. */
  endedReason() {
    const header = this.page.store.header;
    const status = header && header.status;
    return status === "complete" || status === "failed"
      ? `the run has ended (${status}): no rank is running to answer` : null;
  }

  _buttons(ranks, what) {
    const bar = h("span", "stall-actions");
    if (this.readOnly) return bar;
    const dump = button("btn btn-small", "dump stacks", () => this.request("stacks", ranks));
    dump.dataset.testid = `dump-${what}`;
    const prof = button("btn btn-small", `profile ${PROFILE.seconds} s`, () => this.request("profile", ranks));
    prof.dataset.testid = `profile-${what}`;
    const ended = this.endedReason();
    dump.disabled = prof.disabled = this.held || ended !== null;
    if (ended !== null) dump.title = prof.title = ended;
    bar.append(dump, prof);
    return bar;
  }

  /** A `<details>` that stays as the user left it across renders (`key`: what it shows). */
  _details(cls, key, openByDefault) {
    const d = h("details", cls);
    d.open = this.opened.has(key) ? this.opened.get(key) : openByDefault;
    const set = d.open;
    // setting `open` fires a toggle too (later, as a task): that one is ours, not the user's,
    // and must not pin a default that a later render would change
    d.addEventListener("toggle", () => {
      if (d.open !== set || this.opened.has(key)) this.opened.set(key, d.open);
    });
    return d;
  }

  render() {
    const store = this.page.store;
    const view = store.stacks || { dumps: [], groups: [] };
    const stalled = store.stalledRanks();
    const stallGroups = view.groups.filter((g) => g.reason === "stall");
    const requestGroups = view.groups.filter((g) => g.reason === "request");
    const latest = requestGroups.length ? requestGroups[0].request_id : null;
    const profiles = view.dumps.filter((d) => d.reason === "request" && Array.isArray(d.profile) && d.profile.length);
    const latestProfileId = profiles.reduce((best, d) => (!best || d.taken_at > best.taken_at ? d : best), null);
    const shownProfiles = latestProfileId ? profiles.filter((d) => d.request_id === latestProfileId.request_id) : [];
    const stepMs = new Map(store.ranks.filter((r) => isNum(r.step_ms)).map((r) => [r.rank, r.step_ms]));
    // a `ranks` event a second redraws nothing unless what this view shows changed (the
    // profiled ranks' step times label the profiles and choose the median one)
    const timing = shownProfiles.map((d) => (stepMs.has(d.rank) ? stepMs.get(d.rank).toFixed(1) : "")).join(",");
    const verdict = verdictText(this.collectives && this.collectives.groups);
    // once no group is listed now, the answer to the last hang (8.5), with its time
    const last = verdict.length ? null : lastVerdictText(store.header && store.header.collectives_last);
    // 8.3: the first non-finite value and replicas that disagree, from the header
    const numbers = numbersLines(store.header, (r) => hostOf(store, r));
    const key = [view, stalled.join(","), this.focus, this.closed, this.message, this.held, store.run,
      this.endedReason(),
      store.tab, timing, verdict.join("\n"), stragglerOf(store.rows), last && [last.title, ...last.lines].join("\n"),
      numbers.map((l) => l.text).join("\n")];
    if (this.drawn && key.every((v, i) => v === this.drawn[i])) return;
    this.drawn = key;
    const trouble = stalled.length > 0 || stallGroups.length > 0 || verdict.length > 0 || numbers.length > 0;
    const anything = trouble || last || requestGroups.length || shownProfiles.length || this.shownRank() !== null || this.message;
    this.box.hidden = !anything && this.readOnly;
    this.box.dataset.state = trouble ? "stalled" : "ok";
    if (this.box.hidden) return;

    const out = [];
    const head = h("div", "stall-head");
    const title = h("h3", "card-title stall-title");
    if (trouble) {
      const n = new Set([...stalled, ...stallGroups.flatMap((g) => g.ranks)]).size;
      const numbersOnly = !n && !verdict.length;
      title.append(h("span", "stall-badge", n ? "stalled" : numbersOnly ? "numbers" : "collectives"));
      title.append(h("span", null, n ? ` ${fmtInt(n)} ${n === 1 ? "rank" : "ranks"} not stepping` : numbersOnly ? " values gone wrong" : " a collective waits"));
    } else {
      title.append(h("span", null, "Stacks"));
      title.append(h("span", "card-sub", "no rank stalled"));
    }
    head.append(title, this._buttons(null, "run"));
    out.push(head);
    if (verdict.length) {
      // the collective verdict leads (7.2): which rank the others wait for
      const box = h("div", "collective-verdict");
      box.dataset.testid = "collective-verdict";
      for (const line of verdict) box.append(h("p", "verdict-line", line));
      out.push(box);
    }
    if (last) out.push(lastVerdictBox(last));
    if (numbers.length) {
      // 8.3: which rank had the first NaN, which replica disagrees (text only: names are a rank's)
      const box = h("div", "numbers-trouble");
      box.dataset.testid = "numbers-trouble";
      for (const line of numbers) {
        const p = h("p", "verdict-line", line.text);
        p.dataset.kind = line.kind;
        box.append(p);
      }
      out.push(box);
    }
    if (this.message) out.push(h("p", "stall-message muted", this.message));
    else if (!this.readOnly && this.endedReason()) {
      const note = h("p", "stall-message muted", `requests for stacks: ${this.endedReason()}`);
      note.dataset.testid = "stall-ended";
      out.push(note);
    }

    const byRank = new Map();
    for (const d of view.dumps) {
      if (!byRank.has(d.rank)) byRank.set(d.rank, []);
      byRank.get(d.rank).push(d);
    }
    // an answer that stands where the stall dumps stand says nothing new: one line, not
    // the same groups twice
    const stallSigs = new Set(stallGroups.map(groupSig));
    const fresh = requestGroups.filter((g) => !stallSigs.has(groupSig(g)));
    const agree = requestGroups.filter((g) => stallSigs.has(groupSig(g)));
    if (agree.length) {
      const n = agree.reduce((k, g) => k + g.ranks.length, 0);
      out.push(h("p", "stall-agree muted", `the requested dump: ${fmtInt(n)} rank${n === 1 ? "" : "s"} still where the groups above show`));
    }
    const groups = [...stallGroups, ...fresh];
    // one shared stack open without a click (two open were ~900 px in the demo, pushing the
    // step charts below the fold): the odd one out, the group of fewest ranks, which in a hang
    // is where the rank the others wait for stands
    const odd = groups.reduce((best, g) => (!best || g.ranks.length < best.ranks.length ? g : best), null);
    groups.forEach((g) => out.push(this._group(g, g === odd, byRank, g.reason === "request" ? latest : null)));
    const focus = this.shownRank();
    if (focus !== null) out.push(this._rank(focus, byRank.get(focus) || []));
    if (shownProfiles.length) {
      const sec = h("div", "stall-profiles");
      sec.append(h("h4", "stall-sub", "profile: heaviest stacks of the training thread"));
      sec.append(profilePair(shownProfiles, this.shownRank(), stepMs, stragglerOf(store.rows),
        waitedFor(this.collectives, stallGroups)));
      out.push(sec);
    }
    this.box.replaceChildren(...out);
  }

  _group(g, open, byRank, requestId) {
    const box = h("div", "stall-group");
    box.dataset.testid = "stall-group";
    box.dataset.reason = g.reason;
    const line = h("div", "stall-group-line");
    line.append(h("span", "group-count mono", fmtInt(g.ranks.length)));
    line.append(h("span", "group-text", groupLine(g)));
    if (requestId) line.append(h("span", "card-sub", "answers to the requested dump"));
    else {
      const idle = g.ranks.map((r) => (byRank.get(r) || []).find((d) => d.reason === "stall"))
        .filter((d) => d && isNum(d.idle_s)).map((d) => d.idle_s);
      if (idle.length) line.append(h("span", "card-sub", `idle ${fmtDur(Math.max(...idle))}`));
    }
    box.append(line);
    const chips = h("div", "group-ranks");
    for (const r of g.ranks.slice(0, MAX_CHIPS)) {
      const chip = button("rank-chip mono", String(r), () => this.setFocus(r));
      chip.classList.toggle("active", r === this.shownRank());
      chip.title = `rank ${r}: its own dump, every thread`;
      chips.append(chip);
    }
    if (g.ranks.length > MAX_CHIPS) chips.append(h("span", "muted", ` +${fmtInt(g.ranks.length - MAX_CHIPS)} more`));
    box.append(chips);
    // the shared stack: open without a click (the first groups), as the user left it after
    const stack = this._details("group-stack", `g:${g.reason}:${innermost(g.frames, 99)}`, open);
    stack.append(h("summary", "muted", `shared stack, innermost first (${(g.frames || []).length} frames)`));
    stack.append(frameList(g.frames));
    box.append(stack);
    return box;
  }

  _rank(rank, dumps) {
    const box = h("div", "stall-rank");
    box.dataset.testid = "stall-rank";
    const head = h("div", "stall-head");
    // the ranks array's host, else the header's topology (the header is replayed on every
    // SSE connection; a ranks event can fall between the page's snapshot and its stream)
    const where = hostOf(this.page.store, rank);
    const host = where ? ` · ${where}` : "";
    head.append(h("h4", "stall-sub", `rank ${rank}${host}`));
    head.append(this._buttons([rank], "rank"));
    head.append(button("btn btn-small", "close", () => this.setFocus(rank)));
    box.append(head);
    const withThreads = dumps.filter((d) => Array.isArray(d.threads) && d.threads.length);
    if (!withThreads.length) box.append(h("p", "muted", "no dump of this rank yet"));
    for (const d of withThreads) {
      const what = d.reason === "stall" ? `stall dump, idle ${fmtDur(d.idle_s)}` : "answer to a requested dump";
      const line = h("p", "muted", `${what} · taken `);
      const at = h("span", "ago", fmtAgo(serverNow() - d.taken_at));
      at.dataset.at = String(d.taken_at);
      line.append(at);
      box.append(line);
      for (const t of d.threads) {
        const thread = this._details("stall-thread", `t:${rank}:${d.reason}:${t.name}`, !!t.main);
        const sum = h("summary", null);
        sum.append(h("span", "thread-name mono", t.name));
        if (t.main) sum.append(h("span", "stall-badge main", "training thread"));
        sum.append(h("span", "card-sub", innermost(t.frames, 2)));
        thread.append(sum, frameList(t.frames));
        box.append(thread);
      }
    }
    return box;
  }
}

/** The header's `collectives_last` as a box: its time, then its sentences (text only). */
export function lastVerdictBox(last) {
  const box = h("div", "collective-verdict collective-last");
  box.dataset.testid = "collective-last";
  box.append(h("h4", "stall-sub", last.title));
  for (const line of last.lines) box.append(h("p", "verdict-line", line));
  return box;
}
