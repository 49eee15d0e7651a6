// rankboard GPU health (contract v3, PROTOCOL sections 2 and 3): a rank's latest sample's
// health fields as short tags ("THERM", "XID 79", "ECC 3", "PCIe x8/16", "NVL 12", "REMAP")
// with a severity each, the rank's overall level for the table's sort and the per-rank
// picture's "colour by health", and a one-line "what to do" per GPU alert kind. No DOM:
// the rank table, the GPU tiles, the heatmap and a saved report all read the same answer.

import { fmtInt, isNum } from "./fmt.js";

/** Levels by rank, worst last: no GPU figures, nothing wrong, look at it (throttle, PCIe,
 * NVLink), act on it (XID, uncorrected ECC, row remapping). */
const RANK = { none: 0, ok: 1, warn: 2, bad: 3 };

/** Clock event reasons worth a tag (`sw_power_cap` alone is normal at full load). */
const THROTTLE = {
  hw_thermal: ["THERM", "hardware thermal slowdown: the GPU is too hot and clocks are cut hard (check cooling, fans, inlet temperature)"],
  sw_thermal: ["SW-THERM", "software thermal slowdown: the driver lowers clocks to keep the GPU under its temperature limit"],
  hw_slowdown: ["HW-SLOW", "hardware slowdown: clocks cut by the board (over-temperature or power-supply signal)"],
  hw_power_brake: ["PWR-BRAKE", "power brake: the system asserted the power-brake signal (power supply or chassis)"],
};

/** What each GPU alert kind means and what to do about it (as README "Alerts" says). */
export const GPU_ALERT_HINTS = {
  gpu_xid: "The driver reported an XID error. Look the code up in NVIDIA's XID catalogue; 48, 63, 64, 74, 79, 92, 94, 95 usually mean draining the node and resetting or replacing the GPU.",
  gpu_throttle: "Hardware or thermal throttling in two samples running. Check cooling, fans, inlet temperature and the power supply of that node.",
  gpu_ecc: "Uncorrected ECC errors increased. Drain the node and reset the GPU; replace it if they recur.",
  gpu_row_remap: "A memory row remap is pending (reset the GPU when the job allows) or failed (take the GPU out of service).",
  gpu_pcie: "The PCIe link runs narrower than its maximum. Reseat the card or riser and check the slot; host transfers are slower meanwhile.",
  gpu_nvlink: "NVLink CRC, replay or recovery errors increased. Check the NVLink bridge or baseboard; recurring errors mean a hardware ticket.",
};

/** Short names of the GPU alert kinds for the alert list. */
export const GPU_ALERT_TEXT = {
  gpu_xid: "GPU XID", gpu_throttle: "GPU throttle", gpu_ecc: "GPU ECC", gpu_row_remap: "GPU row remap",
  gpu_pcie: "GPU PCIe", gpu_nvlink: "GPU NVLink",
};

/** The level an alert kind shows at (the heatmap's colours and the list's). */
export const GPU_ALERT_LEVEL = {
  gpu_xid: "bad", gpu_ecc: "bad", gpu_row_remap: "bad", gpu_throttle: "warn", gpu_pcie: "warn", gpu_nvlink: "warn",
};

const HEALTH_KEYS = ["sm_clock_mhz", "ecc_uncorrected", "remapped_rows_pending", "remapped_rows_failed",
  "pcie_link_gen", "pcie_link_width", "nvlink_errors"];

/** Whether a GPU entry carries any health field (an older agent sends none). */
function hasHealth(g) {
  if (Array.isArray(g.throttle_reasons) && g.throttle_reasons.length) return true;
  if (Array.isArray(g.xid_errors) && g.xid_errors.length) return true;
  return HEALTH_KEYS.some((k) => g[k] !== null && g[k] !== undefined);
}

function gpuLabel(g) {
  const name = typeof g.name === "string" && g.name ? ` (${g.name})` : "";
  return `GPU ${isNum(g.device_index) ? g.device_index : "?"}${name}`;
}

/**
 * The tags of one GPU entry of a sample: `[{key, text, level, title}]`, worst first.
 * `xidFallback`: XID codes to show when this sample has none (a rank's gpu_xid alert: an
 * XID is an event, in one sample only, but the rank's alert stays listed).
 */
export function gpuTags(g, xidFallback = null) {
  const tags = [];
  const who = gpuLabel(g);
  const xids = (Array.isArray(g.xid_errors) ? g.xid_errors : []).filter(isNum);
  if (xids.length) {
    tags.push({ key: "xid", text: `XID ${xids.join(",")}`, level: "bad",
      title: `${who}: XID ${xids.join(", ")} in the latest sample. ${GPU_ALERT_HINTS.gpu_xid}` });
  } else if (xidFallback) {
    tags.push({ key: "xid", text: xidFallback.codes.length ? `XID ${xidFallback.codes.join(",")}` : "XID", level: "bad",
      title: `${xidFallback.message || "XID reported"} (an earlier sample). ${GPU_ALERT_HINTS.gpu_xid}` });
  }
  if (isNum(g.ecc_uncorrected) && g.ecc_uncorrected > 0) {
    tags.push({ key: "ecc", text: `ECC ${fmtInt(g.ecc_uncorrected)}`, level: "bad",
      title: `${who}: ${fmtInt(g.ecc_uncorrected)} volatile uncorrected ECC errors since the driver loaded. ${GPU_ALERT_HINTS.gpu_ecc}` });
  }
  if (g.remapped_rows_failed === true) {
    tags.push({ key: "remap", text: "REMAP FAIL", level: "bad",
      title: `${who}: a memory row remap failed: take the GPU out of service.` });
  } else if (g.remapped_rows_pending === true) {
    tags.push({ key: "remap", text: "REMAP", level: "bad",
      title: `${who}: a memory row remap is pending: reset the GPU when the job allows.` });
  }
  const reasons = Array.isArray(g.throttle_reasons) ? g.throttle_reasons : [];
  const clock = isNum(g.sm_clock_mhz) ? ` SM clock ${fmtInt(Math.round(g.sm_clock_mhz))} MHz.` : "";
  for (const r of ["hw_thermal", "hw_power_brake", "hw_slowdown", "sw_thermal"]) {
    if (!reasons.includes(r)) continue;
    const [text, what] = THROTTLE[r];
    tags.push({ key: `throttle-${r}`, text, level: "warn", title: `${who}: ${what}.${clock}` });
  }
  if (isNum(g.pcie_link_width) && isNum(g.pcie_link_width_max) && g.pcie_link_width < g.pcie_link_width_max) {
    const gen = isNum(g.pcie_link_gen) && isNum(g.pcie_link_gen_max) ? `, gen ${g.pcie_link_gen} of ${g.pcie_link_gen_max}` : "";
    tags.push({ key: "pcie", text: `PCIe x${g.pcie_link_width}/${g.pcie_link_width_max}`, level: "warn",
      title: `${who}: the PCIe link trained down to x${g.pcie_link_width} of x${g.pcie_link_width_max}${gen}. ${GPU_ALERT_HINTS.gpu_pcie}` });
  }
  if (isNum(g.nvlink_errors) && g.nvlink_errors > 0) {
    tags.push({ key: "nvlink", text: `NVL ${fmtInt(g.nvlink_errors)}`, level: "warn",
      title: `${who}: ${fmtInt(g.nvlink_errors)} NVLink CRC, replay and recovery errors (summed over links, since boot). ${GPU_ALERT_HINTS.gpu_nvlink}` });
  }
  return tags;
}

/** The codes and message of a rank's gpu_xid alert ("XID 79, 48 on GPU 1"), or null. */
function xidAlert(alerts) {
  const a = alerts && alerts.find((x) => x.kind === "gpu_xid");
  if (!a) return null;
  const message = typeof a.message === "string" ? a.message : "";
  const m = /XID ([0-9][0-9, ]*)/.exec(message);
  const codes = m ? m[1].split(",").map((s) => s.trim()).filter((s) => /^\d+$/.test(s)) : [];
  return { codes, message };
}

/**
 * A rank's GPU health from its latest `resources` (and its alerts from the run header, for
 * the XID that only one sample carried): `{level, tags, score, text, title}`. `level` is
 * "none" when the rank reports no GPU health at all (no GPU, or an agent before v3).
 */
export function rankHealth(resources, alerts = null) {
  const gpus = (resources && Array.isArray(resources.gpus) ? resources.gpus : []).filter((g) => g && typeof g === "object");
  const fallback = xidAlert(alerts);
  const tags = [];
  let any = false;
  gpus.forEach((g, i) => {
    if (hasHealth(g)) any = true;
    tags.push(...gpuTags(g, i === 0 ? fallback : null));
  });
  if (!gpus.length && fallback) tags.push(...gpuTags({}, fallback));
  let level = any || tags.length ? "ok" : "none";
  for (const t of tags) if (RANK[t.level] > RANK[level]) level = t.level;
  tags.sort((a, b) => RANK[b.level] - RANK[a.level]);
  const score = RANK[level] * 100 + tags.length;
  let title;
  if (level === "none") title = "no GPU health figures from this rank (no GPU, or an agent before contract v3)";
  else if (level === "ok") {
    const capped = gpus.some((g) => Array.isArray(g.throttle_reasons) && g.throttle_reasons.includes("sw_power_cap"));
    title = `GPU healthy: no XID, ECC, row remap, throttling, PCIe or NVLink trouble${capped ? " (at its power cap: normal at full load)" : ""}`;
  } else title = tags.map((t) => t.title).join("\n");
  return { level, tags, score, text: tags.map((t) => t.text).join(" · "), title };
}

/** The level's position for the heatmap (null: no GPU, drawn grey). */
export function levelValue(level) {
  return level === "none" ? null : RANK[level] ?? null;
}
