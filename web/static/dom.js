// rankboard's one element helper: every node the page builds comes from h(), and text only
// ever goes in through textContent (strings from a training job never reach innerHTML).

/** An element with a class and text content (never HTML). */
export function h(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

/** Set an element's text only when it changed (a same-text write still invalidates style). */
export function setText(el, text) {
  const t = text === null || text === undefined ? "" : String(text);
  if (el.textContent !== t) el.textContent = t;
}

/** A `<button type="button">`. */
export function button(cls, text, onClick) {
  const b = h("button", cls, text);
  b.type = "button";
  if (onClick) b.addEventListener("click", onClick);
  return b;
}

export const $ = (id) => document.getElementById(id);

/** Read a CSS custom property of `node`, with a fallback. */
export function cssVar(node, name, fallback) {
  const v = getComputedStyle(node).getPropertyValue(name).trim();
  return v || fallback;
}

/** Stable colour for a status dot. */
export function statusDot(status) {
  const s = h("span", "dot");
  s.dataset.status = status || "unknown";
  return s;
}
