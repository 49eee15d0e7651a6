// rankboard failure card (PROTOCOL 8.2): a run that died leads with the rank that failed
// first — "rank 5 (node-b) failed first, 12:03:04: torch.OutOfMemoryError: CUDA out of
// memory…" — its traceback folded (innermost frame first, as one reads it when looking for
// the cause), then the other groups of failed ranks by exception type ("7 ranks
// DistBackendError …") and the ranks that went silent. It reads the header's `failure`
// only (the live page and report.html alike). Every string in it comes from a training job:
// it goes into the DOM through textContent (dom.js h/setText), never as HTML.

import { $, h, setText } from "./dom.js";
import { formatClock, fmtInt, isNum } from "./fmt.js";

/** Characters of a message shown on the headline (the whole message is below it). */
const HEADLINE_CHARS = 200;

/** "0–4, 6, 9" for sorted ranks; "…" when `count` says more exist than are listed. */
export function rankRanges(ranks, count) {
  const list = Array.isArray(ranks) ? ranks : [];
  const parts = [];
  for (let i = 0; i < list.length; i++) {
    let j = i;
    while (j + 1 < list.length && list[j + 1] === list[j] + 1) j++;
    parts.push(j > i ? `${list[i]}–${list[j]}` : String(list[i]));
    i = j;
  }
  if (isNum(count) && count > list.length) parts.push("…");
  return parts.join(", ");
}

/** The message's first line, cut for a headline ("…" when anything was left out). */
export function firstLine(message) {
  const text = typeof message === "string" ? message : "";
  const nl = text.indexOf("\n");
  let line = nl >= 0 ? text.slice(0, nl) : text;
  let more = nl >= 0 && text.slice(nl + 1).trim() !== "";
  if (line.length > HEADLINE_CHARS) {
    line = line.slice(0, HEADLINE_CHARS);
    more = true;
  }
  return more ? `${line}…` : line;
}

const plural = (n, one, many) => `${fmtInt(n)} ${n === 1 ? one : many}`;

/** The headline of a failure's `first` (the sentence the card leads with). */
export function headline(first) {
  if (!first || typeof first !== "object") return "";
  const host = first.host ? ` (${first.host})` : "";
  const when = isNum(first.at) ? `, ${formatClock(first.at)}` : "";
  if (first.kind === "silent") {
    return `rank ${first.rank}${host} went silent first${when}: killed, or crashed below Python`;
  }
  const type = first.type ? String(first.type) : "";
  const line = firstLine(first.message);
  const what = !type ? "finished with error (no exception sent)" : line ? `${type}: ${line}` : type;
  return `rank ${first.rank}${host} failed first${when}: ${what}`;
}

/** A traceback's frames as text, innermost first (the order one looks for a cause in). */
export function tracebackText(frames) {
  const list = Array.isArray(frames) ? frames.slice().reverse() : [];
  return list.map((f) => {
    const where = `${f.file ?? "?"}:${f.line ?? "?"} in ${f.function ?? "?"}`;
    return f.code ? `${where}\n    ${f.code}` : where;
  }).join("\n");
}

/** One line per group of failed ranks: "7 ranks DistBackendError: … (ranks 1–7)". */
export function groupLine(g) {
  const count = isNum(g.count) ? g.count : 0;
  const type = g.type ? String(g.type) : "finished with error (no exception sent)";
  const line = firstLine(g.message);
  const ranks = rankRanges(g.ranks, count);
  return `${plural(count, "rank", "ranks")} ${type}${line ? `: ${line}` : ""} (rank${count === 1 ? "" : "s"} ${ranks})`;
}

/** The silent ranks' line, or "" when none. */
export function silentLine(silent) {
  const count = silent && isNum(silent.count) ? silent.count : 0;
  if (!count) return "";
  return `${plural(count, "rank", "ranks")} went silent: killed, or crashed below Python (rank${count === 1 ? "" : "s"} ${rankRanges(silent.ranks, count)})`;
}

export class FailureView {
  /** `page`: {store}. The card is `#failure-card` (templates/index.html). */
  constructor(page) {
    this.page = page;
    this.key = null;
  }

  render() {
    const card = $("failure-card");
    if (!card) return;
    const hd = this.page.store.header;
    const failure = hd && hd.failure && typeof hd.failure === "object" ? hd.failure : null;
    const key = failure ? JSON.stringify(failure) : null;
    if (key === this.key) return; // unchanged: keep the reader's open traceback open
    this.key = key;
    card.hidden = !failure;
    if (!failure) {
      card.replaceChildren();
      return;
    }
    const first = failure.first || {};
    const title = h("h3", "card-title", "Why the run died");
    const lead = h("p", "failure-first", headline(first));
    lead.dataset.testid = "failure-first";
    card.replaceChildren(title, lead);
    const message = typeof first.message === "string" ? first.message : "";
    if (message.includes("\n") || message.length > HEADLINE_CHARS) {
      const pre = h("pre", "failure-message mono", message);
      pre.dataset.testid = "failure-message";
      card.append(pre);
    }
    const frames = Array.isArray(first.frames) ? first.frames : [];
    if (frames.length) {
      const fold = h("details", "failure-traceback");
      fold.dataset.testid = "failure-traceback";
      fold.append(h("summary", "", `traceback of rank ${first.rank}, innermost first (${plural(frames.length, "frame", "frames")})`),
        h("pre", "mono", tracebackText(frames)));
      card.append(fold);
    }
    const groups = Array.isArray(failure.groups) ? failure.groups : [];
    // the other groups: every group but one holding only the first rank itself
    const others = groups.filter((g) => !(g.count === 1 && Array.isArray(g.ranks) && g.ranks[0] === first.rank && first.kind === "error"));
    if (others.length || failure.groups_more > 0) {
      const list = h("ul", "failure-groups");
      list.dataset.testid = "failure-groups";
      for (const g of others) list.append(h("li", "", groupLine(g)));
      if (isNum(failure.groups_more) && failure.groups_more > 0) {
        list.append(h("li", "muted", `and ${plural(failure.groups_more, "more exception type", "more exception types")}`));
      }
      card.append(list);
    }
    const silent = silentLine(failure.silent);
    if (silent) {
      const p = h("p", "failure-silent", silent);
      p.dataset.testid = "failure-silent";
      card.append(p);
    }
    setText(title, "Why the run died");
  }
}
