// rankboard ranks on the overview: the rank table, the health KPI and rank counts, the
// alerts, and (through the other views) the tabs, "resources now" and the straggler board,
// all from one list of rank row models per render.

import { $, setText } from "./dom.js";
import { DASH, fmtInt, isNum } from "./fmt.js";
import { isBig, rankRows } from "./model.js";
import { RankTable, renderAlerts } from "./ranks.js";

export class RanksView {
  /** `page`: {store, steps, selectTab, tabs, overview, stragglers}. */
  constructor(page) {
    this.page = page;
    this.table = new RankTable($("rank-table"), $("rank-pager"), {
      onOpen: (rank) => page.selectTab(rank),
      onChange: () => this.render(),
    });
  }

  reset() {
    this.table.reset();
  }

  render() {
    const { store, steps, tabs, overview, stragglers } = this.page;
    const rows = rankRows(store, steps.lastStep);
    const big = isBig(store);
    const hd = store.header;
    const world = hd && isNum(hd.world_size) ? hd.world_size : null;
    store.rows = rows;
    const health = rows.some((r) => r.health.level !== "none");
    this.table.update(rows, { epochs: store.records.length > 0, steps: store.stepRanks, big, health });
    tabs.render(rows, big);

    const hosts = (hd && hd.hosts) || [];
    setText($("ranks-sub"), `${fmtInt(hosts.length)} host${hosts.length === 1 ? "" : "s"} · ${fmtInt(rows.length)}${world ? ` of ${fmtInt(world)}` : ""} rank${(world ?? rows.length) === 1 ? "" : "s"}`);

    // health KPI and header count: a rank that finished ok is healthy, not missing
    const counts = {};
    for (const r of store.ranks) counts[r.status] = (counts[r.status] || 0) + 1;
    const ok = counts.ok || 0;
    const healthy = ok + (counts.finished || 0);
    const denom = world ?? store.ranks.length;
    setText($("kpi-ranks"), denom ? `${fmtInt(healthy)}/${fmtInt(denom)}` : DASH);
    $("kpi-ranks").classList.toggle("bad", !!(counts.stale || counts.error || counts.stalled));
    const sub = ["stalled", "stale", "error", "finished"].filter((k) => counts[k]).map((k) => `${fmtInt(counts[k])} ${k}`);
    setText($("kpi-ranks-sub"), sub.length ? sub.join(" · ") : denom ? "all reporting" : "");
    const live = !hd || hd.status === "training" || hd.status === "waiting";
    // a stalled rank's process is alive (it sent the dump): "7 stalled", not 7 missing ranks
    const alive = ok + (counts.stalled || 0);
    const stalledNote = counts.stalled ? ` · ${fmtInt(counts.stalled)} stalled` : "";
    setText($("rank-count"), !denom ? DASH : live ? `${fmtInt(alive)}/${fmtInt(denom)} live${stalledNote}` : fmtInt(denom));

    overview.resourcesNow(rows, big);
    stragglers.render(rows);
    this.alerts();
  }

  alerts() {
    const store = this.page.store;
    const alerts = (store.header && store.header.alerts) || [];
    const rankStatus = new Map(store.ranks.map((r) => [r.rank, r.status]));
    renderAlerts($("alerts"), alerts, rankStatus, store.expandedAlerts, (kind) => {
      if (store.expandedAlerts.has(kind)) store.expandedAlerts.delete(kind);
      else store.expandedAlerts.add(kind);
      this.alerts();
    }, store.header);
  }
}
