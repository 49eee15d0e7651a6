// rankboard attempts (PROTOCOL 8.1): a restarted or resumed job is one run, and the page says
// so. Pure functions of the run header's `attempt`/`attempts` and of closed records, no DOM
// and no network, so each rule is a fast test through the page's hooks:
//   * which attempt closed the line's last step (epoch), so a live record from a newer one at
//     or below it is known for a rewind (`heldAttempt`, `isRewind`);
//   * the restart markers a chart draws at each attempt's first step (epoch), "restart 2",
//     and their hover: why the previous attempt ended (its `cause`);
//   * which superseded records each chart fetches to draw faint (`supersededRanges`);
//   * the header's cost line, "attempt 3 · 1,200 steps re-run ≈ 41 GPU-hours".
// Text from a run (exception types and messages, hosts) is returned as text: callers put it in
// the DOM through textContent or draw it on a canvas, never as HTML.

import { fmtInt, isNum } from "./fmt.js";

/** The superseded series drawn faint: those of the latest this many attempts that have any
 * (the report embeds the same number, PROTOCOL 8.1). */
export const GHOST_ATTEMPTS = 8;
/** The restart markers' colour (the numbers markers of 8.3 are red). */
export const RESTART_COLOR = "#5794f2";

/** The header's `attempts` entries that have an integer `attempt`, oldest first. */
export function attemptsOf(header) {
  const list = header && Array.isArray(header.attempts) ? header.attempts : [];
  return list.filter((a) => a && Number.isInteger(a.attempt)).sort((a, b) => a.attempt - b.attempt);
}

/** The current attempt (0-based): the header's `attempt`, else the latest listed, else 0. */
export function currentAttempt(header) {
  if (header && Number.isInteger(header.attempt)) return header.attempt;
  const list = attemptsOf(header);
  return list.length ? list[list.length - 1].attempt : 0;
}

/**
 * The attempt whose record is the line's last step (`kind` "step") or epoch ("epoch"): the
 * latest attempt that closed one (a later attempt's first record supersedes every earlier
 * record at or after it, so the line ends with the latest closer's last). 0 when none did or
 * the header predates attempts.
 */
export function heldAttempt(header, kind) {
  const key = kind === "epoch" ? "last_epoch" : "last_step";
  let out = 0;
  for (const a of attemptsOf(header)) if (isNum(a[key]) && a.attempt > out) out = a.attempt;
  return out;
}

/**
 * Whether a live record is a rewind (PROTOCOL 8.1, SSE): it comes from an attempt newer than
 * `held` (the attempt of what the page holds) and its step (epoch) `at` is at or below
 * `last`, the last one held. A record without `attempt` (a broker before 8.1) never is.
 */
export function isRewind(recAttempt, at, held, last) {
  return Number.isInteger(recAttempt) && recAttempt > held && isNum(last) && at <= last;
}

/** The first line of `message`, cut to `max` characters ("…" when cut). */
function firstLine(message, max = 200) {
  const line = String(message ?? "").split("\n", 1)[0];
  return line.length > max ? `${line.slice(0, max - 1)}…` : line;
}

/**
 * Why attempt `prev` (0-based) ended, from its `cause` (its `failure.first` when it ended,
 * PROTOCOL 8.1/8.2): "attempt 1 ended: rank 5 (node-b) failed: torch.OutOfMemoryError: CUDA
 * out of memory", "… rank 3 (node-a) went silent", or "attempt 1 ended without a failure".
 */
export function causeText(prev, cause) {
  const head = `attempt ${fmtInt(prev + 1)} ended`;
  if (!cause || typeof cause !== "object") return `${head} without a failure`;
  const who = Number.isInteger(cause.rank) ? `rank ${cause.rank}${cause.host ? ` (${cause.host})` : ""}` : "a rank";
  if (cause.kind === "silent") return `${head}: ${who} went silent`;
  const type = String(cause.type ?? "");
  const msg = firstLine(cause.message);
  const what = type && msg ? `${type}: ${msg}` : type || msg;
  return `${head}: ${who} failed${what ? `: ${what}` : ""}`;
}

/**
 * The restart markers of a step chart (`kind` "step") or an epoch chart ("epoch"): one at
 * each attempt's first step (epoch), for attempts past the first that closed one,
 * [{step, text: "restart k", hover: causeText(previous), color}]. The page counts restarts
 * from 1: attempt 1 (0-based) is "restart 1".
 */
export function restartMarkers(header, kind) {
  const key = kind === "epoch" ? "first_epoch" : "first_step";
  const list = attemptsOf(header);
  const byIndex = new Map(list.map((a) => [a.attempt, a]));
  const out = [];
  for (const a of list) {
    if (a.attempt < 1 || !isNum(a[key])) continue;
    const prev = byIndex.get(a.attempt - 1);
    out.push({
      step: a[key], text: `restart ${fmtInt(a.attempt)}`, color: RESTART_COLOR,
      hover: causeText(a.attempt - 1, prev ? prev.cause : null),
    });
  }
  return out;
}

/**
 * The superseded records to draw faint: for each of the latest GHOST_ATTEMPTS attempts with
 * `superseded_steps` (`superseded_epochs`) > 0, [{attempt, start}], `start` the first step
 * (epoch) a later attempt closed: from there on its records left the line (the ones before
 * are the line itself). Oldest first.
 */
export function supersededRanges(header, kind) {
  const sup = kind === "epoch" ? "superseded_epochs" : "superseded_steps";
  const first = kind === "epoch" ? "first_epoch" : "first_step";
  const list = attemptsOf(header);
  const out = [];
  for (let i = 0; i < list.length; i++) {
    const a = list[i];
    if (!(isNum(a[sup]) && a[sup] > 0)) continue;
    let start = null;
    for (let j = i + 1; j < list.length; j++) {
      const s = list[j][first];
      if (isNum(s) && (start === null || s < start)) start = s;
    }
    out.push({ attempt: a.attempt, start });
  }
  return out.slice(-GHOST_ATTEMPTS);
}

/** A key that changes whenever the superseded records to draw change. */
export function supersededKey(header, kind) {
  return supersededRanges(header, kind).map((r) => `${r.attempt}:${r.start}`).join(",")
    + `|${attemptsOf(header).map((a) => `${a.superseded_steps}/${a.superseded_epochs}`).join(",")}`;
}

/**
 * The median step time (ms) of the line as the page holds it: the per-step means of the step
 * time chart's buckets, each bucket's mean weighted by the steps it holds (a bucket of the
 * fetched history stands for its `count` steps), NaN means left out. null when none.
 */
export function medianStepMs(buckets) {
  if (!buckets || !buckets.n) return null;
  const idx = [];
  let total = 0;
  for (let i = 0; i < buckets.n; i++) {
    if (Number.isNaN(buckets.mean[i]) || !(buckets.cnt[i] > 0)) continue;
    idx.push(i);
    total += buckets.cnt[i];
  }
  if (!idx.length) return null;
  idx.sort((a, b) => buckets.mean[a] - buckets.mean[b]);
  let acc = 0;
  for (const i of idx) {
    acc += buckets.cnt[i];
    if (acc * 2 >= total) return buckets.mean[i];
  }
  return buckets.mean[idx[idx.length - 1]];
}

/** GPU-hours as the header says them: whole hours from 10 on, else two significant digits. */
export function fmtGpuHours(h) {
  if (!isNum(h)) return "—";
  return h >= 10 ? fmtInt(Math.round(h)) : String(+h.toPrecision(2));
}

/**
 * The header's line of what restarts cost, or null for a run that never restarted:
 * "attempt 3 · 1,200 steps re-run ≈ 41 GPU-hours". Steps re-run are the attempts'
 * `superseded_steps` summed; the GPU-hours are each attempt's superseded steps × the line's
 * median step time `stepMs` × the world size of the attempt that ran them (its `world_size`;
 * the run's when absent), so an elastic job is charged what each attempt had. Without a
 * step time the hours are left out; a run of epochs only says its epochs re-run.
 */
export function restartCost(header, stepMs) {
  const cur = currentAttempt(header);
  if (!(cur > 0)) return null;
  let steps = 0;
  let rankSteps = 0;
  let epochs = 0;
  const world = header && isNum(header.world_size) ? header.world_size : null;
  for (const a of attemptsOf(header)) {
    if (isNum(a.superseded_steps) && a.superseded_steps > 0) {
      steps += a.superseded_steps;
      const w = isNum(a.world_size) && a.world_size > 0 ? a.world_size : world;
      rankSteps += a.superseded_steps * (isNum(w) ? w : NaN);
    }
    if (isNum(a.superseded_epochs) && a.superseded_epochs > 0) epochs += a.superseded_epochs;
  }
  let text = `attempt ${fmtInt(cur + 1)}`;
  if (steps > 0) {
    text += ` · ${fmtInt(steps)} ${steps === 1 ? "step" : "steps"} re-run`;
    const hours = (rankSteps * stepMs) / 3.6e6;
    if (isNum(stepMs) && stepMs > 0 && Number.isFinite(hours)) text += ` ≈ ${fmtGpuHours(hours)} GPU-hours`;
  } else if (epochs > 0) {
    text += ` · ${fmtInt(epochs)} ${epochs === 1 ? "epoch" : "epochs"} re-run`;
  }
  return text;
}
