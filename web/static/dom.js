// rankboard's one element helper: every node the page builds comes from h(), and text only
// ever goes in through textContent (strings from a training job never reach innerHTML).

// Bidirectional controls (issue 38, item 7): a label or host name holding U+202E (right-to-left
// override) without its U+202C reversed every character after it to the end of the line, the
// page's own text included ("rank 3" beside it read "3 knar"). Text with any of them goes in
// isolated: between U+2068 FIRST STRONG ISOLATE and U+2069 POP DIRECTIONAL ISOLATE, the
// text form of <bdi>, which ends whatever the string left open and takes its direction from
// its own first strong character. Text without them goes in as it is.
const BIDI_CONTROLS = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/;

/** `text` isolated from the text around it when it holds a bidirectional control (above);
 * for a user string put into a longer string (a title, a template): `${bidi(host)} · 3 ranks`. */
export function bidi(text) {
  const t = text === null || text === undefined ? "" : String(text);
  return BIDI_CONTROLS.test(t) ? `\u2068${t}\u2069` : t;
}

/** An element with a class and text content (never HTML), isolated if it needs (bidi()). */
export function h(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = bidi(text);
  return e;
}

/** Set an element's text (isolated if it needs: bidi()) only when it changed (a same-text
 * write still invalidates style). */
export function setText(el, text) {
  const t = bidi(text);
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
