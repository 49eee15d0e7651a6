// Whether an alert is over (resolved) and since when, from what the page already holds.
// The header lists each (kind, rank) once with the time it was last raised, and keeps it
// after the rank recovers (PROTOCOL 3): the list is a history. A condition that the ranks
// array shows has cleared (a stale rank reporting again, a stalled rank stepping again), and
// every condition of a run that has ended, reads as resolved, not as a live red banner.

import { formatClock } from "./fmt.js";

/** Kinds that describe a state a rank can leave (the rest are events: they happened). */
const CONDITION = { stale: "stale", stalled: "stalled" };
/** Kinds that describe a state that ends with the run (GPU states sampled while training, a
 * rank waiting for its data while it steps: the demo's finished step run kept a red one). */
const ENDS_WITH_RUN = new Set(["stale", "stalled", "gpu_throttle", "gpu_pcie", "data_straggler"]);

/**
 * `{over, when, why}` for alert `a`: `rankStatus` maps rank -> status (the ranks array),
 * `run` is `{status, updated_at}` from the header. `when` is unix seconds or null.
 */
export function alertState(a, rankStatus, run) {
  const ended = !!run && (run.status === "complete" || run.status === "failed");
  const cond = CONDITION[a.kind];
  if (cond && a.rank !== null && a.rank !== undefined) {
    const st = rankStatus.get(a.rank);
    if (st !== undefined && st !== cond && st !== "error") {
      return ended
        ? { over: true, when: run.updated_at ?? null, why: "run ended" }
        : { over: true, when: null, why: cond === "stalled" ? "stepping again" : "reporting again" };
    }
  }
  if (ended && ENDS_WITH_RUN.has(a.kind)) return { over: true, when: run.updated_at ?? null, why: "run ended" };
  return { over: false, when: null, why: "" };
}

/** The short text of a resolved alert: "resolved · run ended 14:03:07". */
export function resolvedText(s) {
  if (!s.over) return "";
  return `resolved · ${s.why}${typeof s.when === "number" ? ` ${formatClock(s.when)}` : ""}`;
}

/**
 * What an alert says on the page: a `stalled` alert's "(/opt/venv/.../torch/c10d.py:2050)"
 * as the stall view writes a file, "(torch/c10d.py:2050)"; the whole message stays in the
 * title (and in webhooks, which carry the broker's text).
 */
export function alertMessage(a) {
  const text = String(a.message ?? "");
  if (a.kind !== "stalled") return text;
  return text.replace(/\(([^()]*):(\d+)\)$/, (all, file, line) => {
    const parts = file.split("/");
    return `(${parts.length > 2 ? parts.slice(-2).join("/") : file}:${line})`;
  });
}
