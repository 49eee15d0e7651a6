// rankboard step -> wall time: /steps buckets carry no time, so the step view derives it
// (see steps.js): exact (step, time) anchors from live records, and a piecewise-linear map
// between steps and times for the chart axes. No DOM.

/** Growable (step, value) pairs in typed arrays. */
export class Pairs {
  constructor() {
    this.s = new Float64Array(256);
    this.v = new Float64Array(256);
    this.n = 0;
  }

  push(s, v) {
    if (this.n === this.s.length) {
      const s2 = new Float64Array(this.n * 2);
      const v2 = new Float64Array(this.n * 2);
      s2.set(this.s);
      v2.set(this.v);
      this.s = s2;
      this.v = v2;
    }
    this.s[this.n] = s;
    this.v[this.n] = v;
    this.n++;
  }

  /** Keep every other point of the older half (bounded memory, shape kept). */
  thin() {
    const half = this.n >> 1;
    let j = 0;
    for (let i = 0; i < this.n; i++) {
      if (i < half && i % 2) continue;
      this.s[j] = this.s[i];
      this.v[j] = this.v[i];
      j++;
    }
    this.n = j;
  }
}

/** Piecewise-linear, non-decreasing step -> unix time, with its inverse. */
export class TimeMap {
  constructor(steps, times) {
    this.s = steps;
    this.t = times;
    this.n = steps.length;
  }

  _seg(arr, x) {
    let a = 0;
    let b = this.n - 1;
    while (b - a > 1) {
      const m = (a + b) >> 1;
      if (arr[m] <= x) a = m;
      else b = m;
    }
    return a;
  }

  at(step) {
    const { s, t, n } = this;
    if (!n) return step;
    if (n === 1) return t[0] + (step - s[0]);
    const i = Math.min(n - 2, Math.max(0, this._seg(s, step)));
    const ds = s[i + 1] - s[i];
    return t[i] + (ds > 0 ? ((step - s[i]) / ds) * (t[i + 1] - t[i]) : 0);
  }

  inv(time) {
    const { s, t, n } = this;
    if (!n) return time;
    if (n === 1) return s[0] + (time - t[0]);
    const i = Math.min(n - 2, Math.max(0, this._seg(t, time)));
    const dt = t[i + 1] - t[i];
    return s[i] + (dt > 0 ? ((time - t[i]) / dt) * (s[i + 1] - s[i]) : 0);
  }
}
