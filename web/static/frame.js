// rankboard's one render loop: everything the page redraws goes through onFrame(), so a
// burst of events costs one animation frame. Work asked for while the frame runs (a chart
// told to redraw by the step view's flush) runs in that same frame, not the next one.

const pending = new Map(); // key -> fn
let scheduled = false;
let running = false;

function flush() {
  scheduled = false;
  running = true;
  try {
    for (let pass = 0; pass < 8 && pending.size; pass++) {
      const fns = [...pending.values()];
      pending.clear();
      for (const fn of fns) {
        try {
          fn();
        } catch (err) {
          console.warn("rankboard: a frame task failed", err); // one bad value never stops the page
        }
      }
    }
  } finally {
    running = false;
    if (pending.size && !scheduled) {
      scheduled = true;
      requestAnimationFrame(flush);
    }
  }
}

/** Run `fn` in the next animation frame (once per `key`, the latest fn wins). */
export function onFrame(key, fn) {
  pending.set(key, fn);
  if (!scheduled && !running) {
    scheduled = true;
    requestAnimationFrame(flush);
  }
}

export function cancelFrame(key) {
  pending.delete(key);
}

/** Something drawn out of view redraws at most this often (ms): bounded work, never frozen. */
const OFFSCREEN_MS = 1000;

/**
 * Whether `obj`'s draw is to wait because it is out of view (`visible` false) and drew less
 * than OFFSCREEN_MS ago; then a later `obj.render()` is timed for when the draw is due. It
 * used to skip every draw until scrolled to: a stall panel opening above the step charts
 * pushed them below the fold, and a full-page screenshot (or anything else that shows the
 * page without scrolling it) saw them frozen at the step the panel opened (issue 34).
 * `obj` keeps `_drewOnce`, `_drewAt`, `_stale` and `_staleTimer`; `drewNow(obj)` notes a draw.
 */
export function deferOffscreen(obj, visible) {
  if (visible || !obj._drewOnce) return false;
  const wait = obj._drewAt + OFFSCREEN_MS - performance.now();
  if (wait <= 0) return false;
  obj._stale = true;
  if (!obj._staleTimer) {
    obj._staleTimer = setTimeout(() => {
      obj._staleTimer = null;
      if (obj._stale) obj.render();
    }, wait);
  }
  return true;
}

/** Note that `obj` draws now (see deferOffscreen). */
export function drewNow(obj) {
  obj._stale = false;
  obj._drewOnce = true;
  obj._drewAt = performance.now();
}
