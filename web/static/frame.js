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
