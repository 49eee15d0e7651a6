// rankboard profile view: a rank's sampling profile (a `request` dump with `profile`
// entries, PROTOCOL 2.5) as its heaviest stacks with their share of the samples, and an
// icicle of the same samples (outermost call on top, each box as wide as its share), so
// "where does the time go" reads at a glance; shown side by side with the median rank's
// profile for a straggler. Every function name and file comes from a training job: it
// reaches the DOM through textContent only (dom.js `h`), never as markup.

import { h } from "./dom.js";
import { fmtDur, fmtInt, isNum } from "./fmt.js";
import { extremesByMedian } from "./slowness.js";

/** How many of the heaviest stacks a profile lists. */
export const TOP_STACKS = 12;
/** Icicle rows (call depth) and the narrowest box drawn (share of the samples). */
const ICICLE_DEPTH = 14;
const ICICLE_MIN = 0.01;

/** "fn (file.py:12)" -> "fn": a profile entry's function name. */
export function entryFunction(entry) {
  const s = String(entry);
  const i = s.lastIndexOf(" (");
  return i > 0 ? s.slice(0, i) : s;
}

/** A profile's entries, heaviest first, each with its share of the samples counted. */
export function heaviest(profile, n = TOP_STACKS) {
  const entries = (Array.isArray(profile) ? profile : []).filter((e) => e && Array.isArray(e.stack) && isNum(e.count));
  const total = entries.reduce((a, e) => a + e.count, 0) || 1;
  return entries.slice().sort((a, b) => b.count - a.count).slice(0, n)
    .map((e) => ({ stack: e.stack, count: e.count, share: e.count / total }));
}

/** The icicle's tree: node = {name, count, children: Map}; outermost frames at the root. */
export function icicleTree(profile) {
  const root = { name: "all", count: 0, children: new Map() };
  for (const e of Array.isArray(profile) ? profile : []) {
    if (!e || !Array.isArray(e.stack) || !isNum(e.count)) continue;
    root.count += e.count;
    let node = root;
    for (const frame of e.stack.slice(0, ICICLE_DEPTH)) {
      const key = String(frame);
      let child = node.children.get(key);
      if (!child) node.children.set(key, (child = { name: key, count: 0, children: new Map() }));
      child.count += e.count;
      node = child;
    }
  }
  return root;
}

function icicle(profile) {
  const root = icicleTree(profile);
  const box = h("div", "icicle");
  box.dataset.testid = "icicle";
  if (!root.count) return box;
  // one row per depth; each row holds the boxes of that depth, placed by left offset
  let level = [{ node: root, left: 0 }];
  for (let depth = 0; depth <= ICICLE_DEPTH && level.length; depth++) {
    const row = h("div", "icicle-row");
    const next = [];
    for (const { node, left } of level) {
      const width = node.count / root.count;
      if (width < ICICLE_MIN) continue;
      const cell = h("div", "icicle-cell", depth === 0 ? `all (${fmtInt(root.count)} samples)` : entryFunction(node.name));
      cell.style.left = `${(left * 100).toFixed(3)}%`;
      cell.style.width = `${(width * 100).toFixed(3)}%`;
      cell.title = `${node.name}\n${(width * 100).toFixed(1)}% of samples`;
      row.append(cell);
      let x = left;
      const kids = [...node.children.values()].sort((a, b) => b.count - a.count);
      for (const kid of kids) {
        next.push({ node: kid, left: x });
        x += kid.count / root.count;
      }
    }
    box.append(row);
    level = next;
  }
  return box;
}

/**
 * One rank's profile: title, samples and seconds, the icicle, then its heaviest stacks
 * (innermost call first, the whole stack on click).
 */
export function profileBlock(dump, title) {
  const block = h("div", "profile");
  block.dataset.testid = "profile";
  block.dataset.rank = String(dump.rank);
  const head = h("div", "profile-head");
  head.append(h("span", "profile-title", title));
  const secs = isNum(dump.seconds) ? ` over ${fmtDur(dump.seconds)}` : "";
  head.append(h("span", "muted", `${fmtInt(dump.samples)} samples${secs}`));
  block.append(head);
  const top = heaviest(dump.profile);
  if (!top.length) {
    block.append(h("p", "muted", "no samples (the training thread did not run Python)"));
    return block;
  }
  block.append(icicle(dump.profile));
  const list = h("ol", "profile-stacks");
  for (const e of top) {
    const item = h("li", "profile-stack");
    const details = h("details");
    const summary = h("summary");
    const bar = h("span", "share-bar");
    const fill = h("span", "share-fill");
    fill.style.width = `${(e.share * 100).toFixed(1)}%`;
    bar.append(fill);
    summary.append(bar, h("span", "share-pct mono", `${(e.share * 100).toFixed(1)}%`));
    const inner = e.stack.slice().reverse();
    summary.append(h("span", "stack-line mono", inner.slice(0, 3).map(entryFunction).join(" ← ")
      + (inner.length > 3 ? " ← …" : "")));
    details.append(summary);
    const frames = h("ol", "frames mono");
    for (const f of inner) frames.append(h("li", "frame-entry", f));
    details.append(frames);
    item.append(details);
    list.append(item);
  }
  block.append(list);
  return block;
}

/**
 * The profiles of one request: the chosen rank's, and beside it the median rank's (by
 * `step_ms` among the ranks that answered), the view that shows what a straggler does
 * differently. `stepMs`: rank -> step_ms; `waited`: in a hang, the rank the others wait
 * for (chosen before the straggler).
 */
export function profilePair(profiles, focus, stepMs, straggler = null, waited = null) {
  const wrap = h("div", "profiles");
  if (!profiles.length) return wrap;
  const byRank = new Map(profiles.map((d) => [d.rank, d]));
  const timed = profiles.filter((d) => isNum(stepMs.get(d.rank)))
    .sort((a, b) => stepMs.get(a.rank) - stepMs.get(b.rank));
  let main = byRank.get(focus);
  let why = "";
  // the page's one notion of slow (slowness.js): the marked straggler first; else the
  // slowest rank only where it stands out from the median rank
  const slow = timed.length > 1 ? extremesByMedian(timed.map((d) => ({ id: d.rank, time: stepMs.get(d.rank) }))).slow : null;
  if (!main && byRank.has(waited)) {
    // a hang: the rank the others wait for, beside a waiting (median) one
    main = byRank.get(waited);
    why = " (the others wait for it)";
  } else if (!main && byRank.has(straggler)) {
    main = byRank.get(straggler);
    why = " (straggler)";
  } else if (!main && slow !== null) {
    main = byRank.get(slow);
    why = " (slowest)";
  } else if (!main) {
    main = timed.length ? timed[0] : profiles[0];
  }
  const label = (d, what) => `rank ${d.rank}${what}${isNum(stepMs.get(d.rank)) ? ` · ${stepMs.get(d.rank).toFixed(1)} ms/step` : ""}`;
  wrap.append(profileBlock(main, label(main, why)));
  const median = timed.length ? timed[Math.floor((timed.length - 1) / 2)] : null;
  if (median && median !== main) {
    wrap.classList.add("side-by-side");
    wrap.append(profileBlock(median, label(median, " (median)")));
  }
  return wrap;
}
