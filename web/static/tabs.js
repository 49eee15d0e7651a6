// rankboard navigation between the overview and one rank's panel: rank tabs for a small
// run, the searchable rank picker for a big one.

import { $, bidi, button, h } from "./dom.js";
import { RankPicker } from "./ranks.js";

export class Tabs {
  /** `page`: {store, rankPanel}. */
  constructor(page) {
    this.page = page;
    this.picker = new RankPicker($("rank-picker-host"), { onPick: (rank) => this.select(rank) });
  }

  reset() {
    $("rank-tabs").replaceChildren();
  }

  /** One tab per rank (kept in place as ranks come), or the picker for a big run. */
  render(rows, big) {
    const store = this.page.store;
    const box = $("rank-tabs");
    $("rank-picker-host").hidden = !big;
    box.hidden = big;
    if (big) {
      if (box.childElementCount) box.replaceChildren();
      this.picker.update(rows, store.tab === "home" ? null : store.tab);
      return;
    }
    const existing = new Map([...box.children].map((b) => [Number(b.dataset.rank), b]));
    let prev = null;
    for (const row of rows) {
      const rank = row.rank;
      let b = existing.get(rank);
      if (!b) {
        b = button("tab rank-tab", null, () => this.select(rank));
        b.dataset.rank = String(rank);
        b.id = `tab-rank-${rank}`;
        b.setAttribute("aria-selected", String(store.tab === rank));
        b.append(h("span", "dot"), h("span", "tab-text", `rank ${rank}`));
        b.classList.toggle("active", store.tab === rank);
        if (prev) prev.after(b);
        else box.prepend(b);
      }
      b.firstChild.dataset.status = row.status || "unknown";
      b.title = row.host ? `rank ${rank} on ${bidi(row.host)}` : `rank ${rank}`;
      prev = b;
    }
  }

  /** Show the overview ("home") or rank `tab`'s panel. */
  select(tab) {
    const store = this.page.store;
    const home = tab === "home";
    $("panel-home").hidden = !home;
    $("panel-rank").hidden = home;
    $("tab-home").classList.toggle("active", home);
    $("tab-home").setAttribute("aria-selected", String(home));
    for (const b of $("rank-tabs").children) {
      const on = !home && Number(b.dataset.rank) === tab;
      b.classList.toggle("active", on);
      b.setAttribute("aria-selected", String(on));
    }
    if (store.rows) this.picker.update(store.rows, home ? null : tab);
    if (!home) {
      this.page.rankPanel.resetZoom();
      window.scrollTo({ top: 0 });
    }
    store.setTab(tab);
  }
}
