// rankboard live feed of one run: the JSON snapshot (GET /api/runs/<run>) and one
// EventSource (/api/runs/<run>/events: run / epoch / ranks / steps / stacks / complete), with our
// own reconnect when the browser gives up. It only calls the store (and the `steps`
// handler); a page fed from embedded JSON simply has no Stream.

import { api, enc, serverNow } from "./api.js";

export class Stream {
  /**
   * `hooks`: onConn(state, text) (the connection badge), onSteps(data) (`steps` events),
   * onStacks(data) (`stacks` events: new dumps, the page reads /stacks), onMissing() (the
   * run is gone: 404 on its snapshot).
   */
  constructor(store, hooks) {
    this.store = store;
    this.hooks = hooks;
    this.es = null;
    this.fresh = false; // the next `run` event is the first of a connection
  }

  /** Is the open run's EventSource there (open, or reconnecting)? */
  get live() {
    return this.es !== null;
  }

  close() {
    if (this.es) {
      this.es.close();
      this.es = null;
    }
  }

  /** Load the store's run (its generation `gen`): the snapshot, then the live events. */
  open(gen) {
    const store = this.store;
    api(`/api/runs/${enc(store.run)}`).then((data) => {
      if (gen !== store.gen || !data) return;
      store.loadSnapshot(data);
    }).catch((err) => {
      if (gen !== store.gen) return;
      if (err.status === 404) this.hooks.onMissing();
    });
    this._connect(gen);
  }

  _connect(gen) {
    const store = this.store;
    if (gen !== store.gen) return;
    const es = new EventSource(`/api/runs/${enc(store.run)}/events`, { withCredentials: true });
    this.es = es;
    this.fresh = true;
    this.hooks.onConn("connecting", "connecting");
    const on = (kind, fn) => es.addEventListener(kind, (ev) => {
      if (gen !== store.gen) return;
      let data;
      try {
        data = JSON.parse(ev.data);
      } catch {
        return;
      }
      fn(data);
    });
    es.addEventListener("open", () => {
      if (gen !== store.gen) return;
      this.fresh = true; // a (re)connection: its first `run` event sets the steps cut
      this.hooks.onConn("live", "live");
    });
    on("run", (d) => {
      const first = this.fresh;
      this.fresh = false;
      store.applyHeader(d, first);
    });
    on("epoch", (d) => store.addRecord(d));
    on("ranks", (d) => store.applyRanks(d, true, serverNow()));
    on("steps", (d) => this.hooks.onSteps(d));
    on("stacks", (d) => this.hooks.onStacks && this.hooks.onStacks(d));
    on("complete", (d) => store.setStatus(d && d.status));
    es.addEventListener("error", () => {
      if (gen !== store.gen) return;
      if (es.readyState === EventSource.CLOSED) {
        // The browser gave up (e.g. a non-200 answer): retry ourselves. A fresh
        // EventSource replays everything; records are keyed by epoch, so no duplicates.
        this.hooks.onConn("error", "disconnected, retrying");
        setTimeout(() => {
          if (gen === store.gen && this.es === es) this._connect(gen);
        }, 3000);
      } else {
        this.hooks.onConn("connecting", "reconnecting");
      }
    });
  }
}
