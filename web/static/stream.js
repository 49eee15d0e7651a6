// rankboard live feed of one run: the JSON snapshot (GET /api/runs/<run>) and one
// EventSource (/api/runs/<run>/events: run / epoch / ranks / steps / stacks / complete), with our
// own reconnect when the browser gives up. It only calls the store (and the `steps`
// handler); a page fed from embedded JSON simply has no Stream.

import { apiWithHeaders, enc, serverNow } from "./api.js";

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
    this.heard = false; // this EventSource has had a `run` event (the run exists)
    this.ranksLoads = 0; // snapshot answers handled (applied, or older than the ranks held)
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

  /** Load the store's run (its generation `gen`): the live events, and the ranks once
   * each connection is subscribed. The stream replays the header and the records but not the
   * ranks, and a `ranks` event published between a snapshot and the stream's subscription
   * would be missed until the ranks next change (never, for a finished run). */
  open(gen) {
    this._connect(gen);
  }

  /** The snapshot's ranks, fetched after this connection's first `run` event (so no `ranks`
   * event can fall between the two); the store keeps whichever of them and the stream's
   * `ranks` events is newer by run sequence number (a `ranks` event can overtake the answer). */
  _loadRanks(gen) {
    const store = this.store;
    apiWithHeaders(`/api/runs/${enc(store.run)}`).then(({ data, headers }) => {
      if (gen !== store.gen || !data) return;
      if (Number.isInteger(data.attempt) && Number.isInteger(store.attempt) && data.attempt < store.attempt) {
        // (8.1) an answer from before a restart this page has seen since: its ranks are the
        // old processes' (the new attempt's come with its `ranks` events)
        this.ranksLoads += 1;
        return;
      }
      const seq = headers.get("X-Rankboard-Ranks-Seq");
      store.applyRanks(data.ranks, false, 0, seq === null ? null : Number(seq));
      this.ranksLoads += 1;
    }).catch((err) => {
      // (else the stream's next `ranks` event, or its reconnection, brings them)
      if (gen === store.gen && err.status === 404) this.hooks.onMissing();
    });
  }

  _connect(gen) {
    const store = this.store;
    if (gen !== store.gen) return;
    const es = new EventSource(`/api/runs/${enc(store.run)}/events`, { withCredentials: true });
    this.es = es;
    this.fresh = true;
    this.heard = false;
    this.hooks.onConn("connecting", "connecting");
    const on = (kind, fn) => es.addEventListener(kind, (ev) => {
      if (gen !== store.gen) return;
      let data;
      try {
        data = JSON.parse(ev.data);
      } catch {
        return;
      }
      fn(data, ev);
    });
    es.addEventListener("open", () => {
      if (gen !== store.gen) return;
      this.fresh = true; // a (re)connection: its first `run` event sets the steps cut
      this.hooks.onConn("live", "live");
    });
    on("run", (d) => {
      const first = this.fresh;
      this.fresh = false;
      this.heard = true;
      store.applyHeader(d, first);
      if (first) this._loadRanks(gen);
    });
    on("epoch", (d) => store.addRecord(d));
    on("ranks", (d, ev) => store.applyRanks(d, true, serverNow(), Number(ev.lastEventId)));
    on("steps", (d) => this.hooks.onSteps(d));
    on("stacks", (d) => this.hooks.onStacks && this.hooks.onStacks(d));
    on("complete", (d) => store.setStatus(d && d.status));
    es.addEventListener("error", () => {
      if (gen !== store.gen) return;
      if (es.readyState === EventSource.CLOSED) {
        // never a `run` event: maybe no such run (an EventSource cannot see the 404)
        if (!this.heard) this._loadRanks(gen);
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
