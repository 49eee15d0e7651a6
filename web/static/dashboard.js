// rankboard dashboard page: the bootstrap. It builds the store, the stream and the views,
// wires them, and schedules rendering: the store says which parts changed, and the views
// that read those parts render at most once per animation frame.
//
// Data flow: GET /api/runs (picker, app.js) -> Stream (stream.js: GET /api/runs/<run> and
// EventSource /api/runs/<run>/events) -> Store (store.js, no DOM) -> views (headerview,
// overview, ranksview, stragglers, rankpanel, tabs, stallview; steps.js, compare.js and
// stallview.js (/stacks, on SSE `stacks` events) own their data fetches). Step series
// come from /steps up to the `steps_done` of each connection's first
// `run` event, then from live `steps` events (steps.js). All text from a training job goes
// into the DOM through textContent; the model graph is only ever an <img>.
//
// Scale: a run with more than BIG ranks gets a rank picker instead of tabs, a host-grouped
// heatmap instead of GPU tiles, a paginated worst-first rank table and grouped alerts, so
// its page stays about three screens tall.

import { serverNow } from "./api.js";
import { App } from "./app.js";
import { AttemptView } from "./attemptview.js";
import { ClusterView } from "./cluster.js";
import { CompareView } from "./compare.js";
import { $ } from "./dom.js";
import { FailureView } from "./failureview.js";
import { onFrame } from "./frame.js";
import { HeaderView } from "./headerview.js";
import { Overview } from "./overview.js";
import { RankPanel } from "./rankpanel.js";
import { RanksView } from "./ranksview.js";
import { ResourcesView } from "./resourcesview.js";
import { StallView } from "./stallview.js";
import { StepView } from "./steps.js";
import { Store } from "./store.js";
import { Stragglers } from "./stragglers.js";
import { Stream } from "./stream.js";
import { Tabs } from "./tabs.js";

// ---------------------------------------------------------------- render scheduling

const dirty = new Set();
let renderQueued = false;

function invalidate(...parts) {
  for (const p of parts) dirty.add(p);
  if (renderQueued) return;
  renderQueued = true;
  onFrame("dashboard", renderNow);
}

function renderNow() {
  renderQueued = false;
  const parts = new Set(dirty);
  dirty.clear();
  const { header, overview, ranks, rankPanel } = page;
  try {
    if (parts.has("header")) {
      header.render();
      page.failure.render(); // 8.2: a failed run leads with its first failure
      app.updatePickerEntry();
    }
    if (parts.has("records")) {
      overview.records();
      page.resources.render();
    }
    if (parts.has("records") || parts.has("ranks") || parts.has("header") || parts.has("steps")) {
      header.layout();
      overview.kpis();
    }
    if (parts.has("records") || parts.has("header") || parts.has("steps") || parts.has("ranks")) page.attempts.render(); // 8.1
    if (parts.has("records") || parts.has("ranks") || parts.has("header")) ranks.render();
    if (parts.has("records") || parts.has("ranks") || parts.has("tab")) rankPanel.render();
    if (parts.has("stacks") || parts.has("ranks") || parts.has("tab") || parts.has("header")) page.stall.render();
    header.tick();
  } catch (err) {
    console.warn("rankboard: render failed", err); // never let one bad value kill the page
  }
}

// ---------------------------------------------------------------- the page

const store = new Store();
store.subscribe(invalidate);

/** What every view may reach: the store, the other views, and the two page actions. */
const page = {
  store,
  invalidate,
  selectTab: (tab) => page.tabs.select(tab),
  /** A new run: each view forgets the last one. */
  resetViews(run) {
    page.tabs.reset();
    page.header.reset();
    page.overview.reset();
    page.resources.reset(run);
    page.rankPanel.resetZoom();
    page.steps.reset(run);
    page.ranks.reset();
    page.stragglers.reset();
    page.stall.reset();
    page.attempts.reset();
  },
};
const app = new App(page);

function build() {
  page.steps = new StepView($("step-section"), {
    straggler: () => page.stragglers.text(),
    onChange: () => invalidate("steps"),
  });
  page.header = new HeaderView(page);
  page.overview = new Overview(page);
  page.resources = new ResourcesView(page);
  page.rankPanel = new RankPanel(page);
  page.tabs = new Tabs(page);
  page.stragglers = new Stragglers(page);
  page.ranks = new RanksView(page);
  page.stall = new StallView(page);
  page.failure = new FailureView(page);
  page.attempts = new AttemptView(page); // 8.1: the cost line, the epoch chart's restarts
  page.cluster = new ClusterView($("cluster-view"), {
    // the cluster view's /api/runs answers keep the picker current: no second poll
    onRuns: (runs) => {
      store.runs = runs;
      app.renderPicker();
    },
  });
  page.compare = new CompareView($("compare-view"), {
    runs: () => store.runs,
    close: () => app.closeCompare(),
  });
  page.stream = new Stream(store, {
    onConn: (st, text) => app.setConn(st, text),
    onSteps: (d) => page.steps.onSteps(d),
    onStacks: (d) => page.stall.onStacks(d),
    onMissing: () => app.runMissing(),
  });
  store.hooks.header = (hd, first) => {
    page.steps.onHeader(hd, first);
    // stacks events are live only: what came before this connection is read once it is up
    // (a read at open, before the stream, could miss frames that arrived in between)
    if (first) page.stall.refresh();
  };
  store.subscribe((...parts) => {
    if (parts.includes("ranks")) page.stall.onRanks();
    if (parts.includes("ranks") || parts.includes("header")) page.resources.refresh();
  });
  store.hooks.stepTimes = (t, stepMs) => page.stragglers.push(t, stepMs);
}

// ---------------------------------------------------------------- hooks for tests/benchmarks

/**
 * Read-only views of what the page drew, for the browser tests and benchmarks (a test
 * reads a chart's data back from here, never from the API). `applyRanksNow` applies one
 * `ranks` payload and renders synchronously, as the benchmark of that cost needs.
 */
function exposeHooks() {
  const { steps, compare, stragglers, overview } = page;
  window.__rankboard = Object.freeze({
    stepChart: (name) => steps.snapshot(name),
    stepData: (name) => steps.data(name),
    stepCut: () => steps.cut,
    liveSteps: () => steps.liveSteps(),
    stepFetches: () => steps.fetches.slice(),
    firstDraw: () => steps.firstDraw,
    compareChart: () => compare.snapshot(),
    cluster: () => page.cluster.snapshot(),
    stripColumns: () => stragglers.strip.cols.length,
    heatmapCells: () => overview.heatmap.drawnCells || 0,
    stacksFetches: () => page.stall.fetches,
    resources: () => ({ kind: page.resources.kind, points: page.resources.points.length,
      fetches: page.resources.fetches }),
    stacksEvents: () => page.stall.events,
    ranksLoads: () => page.stream.ranksLoads,
    epochChart: () => overview.metrics.snapshot(), // 8.1: faint epochs, restart markers
    attemptFetches: () => page.attempts.fetches.slice(),
    stepRewinds: () => steps.rewinds,
    stripTimes: () => stragglers.strip.cols.map((c) => c.t),
    applyRanksNow: (ranks) => {
      store.applyRanks(ranks, true, serverNow());
      renderNow();
      overview.heatmap.draw();
      stragglers.strip.draw();
    },
  });
}

// ---------------------------------------------------------------- boot

function boot() {
  build();
  exposeHooks();
  $("run-picker").addEventListener("change", (e) => app.openRun(e.target.value, true));
  $("tab-home").addEventListener("click", () => page.selectTab("home"));
  $("hardware").addEventListener("click", () => $("hardware").classList.toggle("expanded"));
  $("compare-btn").addEventListener("click", () => app.toggleCompare());
  window.addEventListener("hashchange", () => app.fromHash());
  const refresh = () => {
    app.refreshHealth(); // the badge in every mode (the cluster view and compare have no stream)
    if (store.mode !== "cluster") app.refreshRuns(); // the cluster view polls the runs itself
  };
  window.addEventListener("focus", refresh);
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) refresh();
  });
  setInterval(() => {
    page.header.tick();
    // a hang sends no step: the KPIs' "no step for N s" ages without an event
    if (store.run !== null && store.mode === "run") page.overview.kpis();
  }, 1000);
  setInterval(() => {
    if (!document.hidden) refresh();
  }, 10000);
  // while there is no run at all, look more often
  setInterval(() => {
    if (store.run === null && store.mode === "run" && !document.hidden) refresh();
  }, 2000);
  app.fromHash();
  refresh();
}

boot();
