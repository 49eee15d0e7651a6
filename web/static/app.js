// rankboard page controller: which run (or comparison, or the cluster view) is open. The
// run list and its picker, the URL hash (#run=…[&rank=N] / #compare=… / #cluster), following
// the newest run when nobody chose one, and opening a run: reset the store and the views,
// then start its Stream.

import { api, enc } from "./api.js";
import { compareHash, parseCompareHash } from "./compare.js";
import { $, bidi, h, setText } from "./dom.js";
import { isNum } from "./fmt.js";

function runLabel(r) {
  const total = isNum(r.total_epochs) && r.total_epochs > 0 ? r.total_epochs : "?";
  const name = r.label ? `${bidi(r.label)} (${r.run})` : r.run;
  return `${name} · ${r.status} · ${r.epochs_done ?? 0}/${total}`;
}

function runFromHash() {
  const m = /(?:^#|&)run=([^&]*)/.exec(location.hash);
  if (!m) return null;
  try {
    return decodeURIComponent(m[1]);
  } catch {
    return null;
  }
}

/** `&rank=N` of a `#run=` hash (a cluster view incident links to its rank), or null. */
function rankFromHash() {
  const m = /&rank=([0-9]{1,9})(?:&|$)/.exec(location.hash);
  return m ? Number(m[1]) : null;
}

const isClusterHash = () => /^#cluster(?:&|$)/.test(location.hash);

function setHash(want) {
  if (location.hash !== want) history.replaceState(null, "", `${location.pathname}${location.search}${want}`);
}

export class App {
  /** `page`: {store, stream, compare, invalidate, selectTab, resetViews}. */
  constructor(page) {
    this.page = page;
  }

  get store() {
    return this.page.store;
  }

  /** The open run's stream says how it is connected (run mode). */
  setConn(st, text) {
    this.streamConn = [st, text];
    this.showConn();
  }

  /**
   * The badge: the web's `/healthz` first (a 503 means no broker answers it: "connecting"
   * would wait forever), then, for an open run, its stream; the cluster view and a
   * comparison have no stream, so a healthy web is what they are connected to.
   */
  showConn() {
    let [st, text] = this.streamConn || ["connecting", "connecting"];
    if (this.health === "down") [st, text] = ["error", "no broker answers"];
    else if (this.health === "offline") [st, text] = ["error", "offline"];
    else if (this.health === "up" && this.store.mode !== "run") [st, text] = ["live", "live"];
    $("conn").dataset.state = st;
    setText($("conn-text"), text);
  }

  /** Ask the web's `/healthz` (exempt from the token and the Host check) how it is. */
  async refreshHealth() {
    try {
      const resp = await fetch("/healthz", { credentials: "same-origin", cache: "no-store" });
      this.health = resp.status === 200 ? "up" : "down";
    } catch {
      this.health = "offline";
    }
    this.showConn();
  }

  async refreshRuns() {
    const store = this.store;
    let runs;
    try {
      runs = await api("/api/runs");
    } catch (err) {
      this.health = "offline";
      this.showConn();
      return;
    }
    if (!Array.isArray(runs)) return;
    store.runs = runs;
    this.renderPicker();
    if (store.mode === "cluster") return; // it lists the runs itself; nothing is opened
    if (store.mode === "compare") {
      this.page.compare.runsChanged();
      return;
    }
    const wanted = runFromHash();
    if (store.run === null) {
      if (wanted && runs.some((r) => r.run === wanted)) this.openRun(wanted, true);
      else if (wanted) this.waitForRun(wanted);
      else if (runs.length) this.openRun(runs[0].run, false);
      else this.showEmpty(true);
    } else if (!store.picked && runs.length && runs[0].run !== store.run) {
      // Nobody chose this run: when it has ended and a newer one started, follow the newest.
      const st = store.header && store.header.status;
      if (st === "complete" || st === "failed") this.openRun(runs[0].run, false);
    }
  }

  renderPicker() {
    const store = this.store;
    const sel = $("run-picker");
    const runs = store.runs.slice();
    if (store.run !== null && !runs.some((r) => r.run === store.run)) {
      runs.unshift({ run: store.run, status: store.header?.status ?? "", label: store.header?.label });
    }
    const labels = runs.map(runLabel);
    // the same options as last time (the usual poll of thousands of runs): nothing rebuilt
    const key = `${store.run}\u0000${runs.map((r, i) => `${r.run}\u0001${r.status}\u0001${labels[i]}`).join("\u0000")}`;
    if (key === this.pickerKey && sel.options.length === runs.length) return;
    this.pickerKey = key;
    const opts = runs.map((r, i) => {
      const o = h("option", null, labels[i]);
      o.value = r.run;
      o.dataset.status = r.status || "";
      return o;
    });
    sel.replaceChildren(...opts);
    if (store.run !== null) sel.value = store.run;
  }

  /** The open run's picker entry follows its header (status, label, epochs). */
  updatePickerEntry() {
    const store = this.store;
    const hd = store.header;
    if (!hd) return;
    const entry = store.runs.find((r) => r.run === store.run);
    if (entry) {
      entry.status = hd.status;
      entry.label = hd.label;
      entry.total_epochs = hd.total_epochs;
      entry.epochs_done = store.records.length;
      const opt = [...$("run-picker").options].find((o) => o.value === store.run);
      if (opt) setText(opt, runLabel(entry));
    }
  }

  /**
   * The link names a run this list does not hold (yet: a list fetched a moment before the
   * run's first frame, or a run that starts soon). Never open another run in its place and
   * overwrite the link: say so, and the 2 s refresh opens it when it appears.
   */
  waitForRun(run) {
    const box = $("empty-state");
    setText(box.querySelector("h2"), `Waiting for run ${run}`);
    setText(box.querySelector("p"), "It opens here on its first frame; or pick another run above.");
    this.showEmpty(true);
  }

  showEmpty(empty) {
    $("empty-state").hidden = !empty;
    $("run-view").hidden = empty || this.store.mode !== "run";
  }

  /** The cluster view (#cluster): every run and host; the open run's stream is closed. */
  openCluster() {
    const { store, stream } = this.page;
    if (store.mode === "compare") {
      this.page.compare.close();
      $("compare-btn").setAttribute("aria-pressed", "false");
    }
    store.mode = "cluster";
    stream.close();
    $("run-view").hidden = true;
    $("empty-state").hidden = true;
    $("cluster-link").setAttribute("aria-current", "page");
    setHash("#cluster");
    this.page.cluster.open();
    this.showConn();
  }

  leaveCluster() {
    if (this.store.mode !== "cluster") return;
    this.store.mode = "run";
    this.page.cluster.close();
    $("cluster-link").removeAttribute("aria-current");
  }

  openCompare(sel) {
    this.leaveCluster();
    this.store.mode = "compare";
    $("run-view").hidden = true;
    $("empty-state").hidden = true;
    $("compare-btn").setAttribute("aria-pressed", "true");
    setHash(compareHash(sel));
    this.page.compare.open(sel);
    this.showConn();
  }

  closeCompare() {
    const { store, stream } = this.page;
    store.mode = "run";
    this.page.compare.close();
    $("compare-btn").setAttribute("aria-pressed", "false");
    const run = store.run ?? (store.runs[0] && store.runs[0].run);
    if (run) {
      history.replaceState(null, "", `${location.pathname}${location.search}#run=${enc(run)}`);
      if (run === store.run && stream.live) {
        $("run-view").hidden = false;
        this.page.invalidate("header", "records", "ranks");
      } else {
        this.openRun(run, true);
      }
    } else {
      this.showEmpty(true);
    }
  }

  /** The compare button: toggle the comparison, starting from the open run. */
  toggleCompare() {
    const { store, steps } = this.page;
    if (store.mode === "compare") {
      this.closeCompare();
      return;
    }
    const runs = store.run ? [store.run] : [];
    // a step run compares by step (its one closing epoch is one dot); an epoch run by epoch
    this.openCompare({ runs, metric: "loss", x: steps.hasSteps && store.records.length < 2 ? "step" : "epoch" });
  }

  openRun(run, picked, rank = null) {
    const { store, stream } = this.page;
    this.leaveCluster();
    if (store.mode === "compare") {
      store.mode = "run";
      this.page.compare.close();
      $("compare-btn").setAttribute("aria-pressed", "false");
    }
    if (run === store.run && stream.live) {
      $("run-view").hidden = false;
      if (rank !== null) this.page.selectTab(rank);
      return;
    }
    stream.close();
    store.reset(run);
    this.page.resetViews(run);
    store.picked = picked;
    this.showEmpty(false);
    setHash(`#run=${enc(run)}`);
    $("csv-link").href = `/api/runs/${enc(run)}/history.csv`;
    $("csv-link").setAttribute("download", `${run}.csv`);
    this.renderPicker();
    this.page.selectTab(rank ?? "home");
    this.page.invalidate("header", "records", "ranks");
    stream.open(store.gen);
  }

  /** The run is gone (404 on its snapshot): pick again from the list. */
  runMissing() {
    this.store.run = null;
    this.refreshRuns();
  }

  /** Follow the URL hash (on load and on hashchange). */
  fromHash() {
    const store = this.store;
    if (isClusterHash()) {
      if (store.mode !== "cluster") this.openCluster();
      return true;
    }
    const cmp = parseCompareHash(location.hash);
    if (cmp) {
      this.openCompare(cmp);
      return true;
    }
    const want = runFromHash();
    const rank = rankFromHash();
    if (want && (want !== store.run || store.mode !== "run" || !this.page.stream.live)) {
      this.openRun(want, true, rank);
    } else if (want && rank !== null) {
      this.page.selectTab(rank);
    }
    return false;
  }
}
