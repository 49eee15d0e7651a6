// rankboard step buckets: a series of the `/steps` shape (PROTOCOL 4) in growable typed
// arrays, [first_step, last_step, mean, lo, hi, rank_min, rank_max, count] per bucket, with
// the merge the step view uses to stay within a point budget. No DOM.

import { isNum } from "./fmt.js";

const fin = (v) => (isNum(v) ? v : NaN);

/** Bucket columns in growable typed arrays; absent values are NaN. */
export class Buckets {
  constructor(cap = 64) {
    this.n = 0;
    this._alloc(cap);
  }

  _alloc(cap) {
    const old = this.n ? this : null;
    const f = () => new Float64Array(cap);
    const cols = { s0: f(), s1: f(), mean: f(), lo: f(), hi: f(), rmin: f(), rmax: f(), cnt: f() };
    const bad = new Uint8Array(cap);
    if (old) {
      for (const k of Object.keys(cols)) cols[k].set(this[k].subarray(0, this.n));
      bad.set(this.bad.subarray(0, this.n));
    }
    Object.assign(this, cols);
    this.bad = bad;
    this.cap = cap;
  }

  get length() {
    return this.n;
  }

  /** Append one bucket (steps ascending); `bad`: the mean is non-finite. */
  push(s0, s1, mean, lo, hi, rmin, rmax, cnt, bad = false) {
    if (this.n === this.cap) this._alloc(this.cap * 2);
    const i = this.n++;
    this.s0[i] = s0;
    this.s1[i] = s1;
    this.mean[i] = mean;
    this.lo[i] = lo;
    this.hi[i] = hi;
    this.rmin[i] = rmin;
    this.rmax[i] = rmax;
    this.cnt[i] = cnt;
    this.bad[i] = bad ? 1 : 0;
  }

  /** Append one step's point as a bucket of its own: `value` its mean (and its lo and hi:
   * one step's mean is the whole range of means), `rmin`..`rmax` the ranks' band; any of
   * them non-finite or absent is NaN, and a non-finite `value` marks the bucket bad. */
  pushStep(step, value, rmin = NaN, rmax = NaN) {
    const m = fin(value);
    this.push(step, step, m, m, m, fin(rmin), fin(rmax), 1, !isNum(value));
  }

  /** From the API's `buckets` array. */
  static fromApi(rows) {
    const b = new Buckets(Math.max(16, rows.length));
    for (const r of rows) {
      if (!Array.isArray(r) || r.length < 8) continue;
      b.push(r[0], r[1], fin(r[2]), fin(r[3]), fin(r[4]), fin(r[5]), fin(r[6]), r[7], r[2] === null);
    }
    return b;
  }

  get first() {
    return this.n ? this.s0[0] : null;
  }

  get last() {
    return this.n ? this.s1[this.n - 1] : null;
  }

  /** Index of the first bucket whose last step is >= `step` (binary search). */
  lowerBound(step) {
    let a = 0;
    let b = this.n;
    while (a < b) {
      const m = (a + b) >> 1;
      if (this.s1[m] < step) a = m + 1;
      else b = m;
    }
    return a;
  }

  /** Merge neighbours pairwise (extremes exact, means count-weighted): half the buckets. */
  compact() {
    const n = this.n;
    let j = 0;
    for (let i = 0; i < n; i += 2, j++) {
      if (i + 1 >= n) {
        this._copy(i, j);
        continue;
      }
      const c0 = this.cnt[i];
      const c1 = this.cnt[i + 1];
      const m0 = this.mean[i];
      const m1 = this.mean[i + 1];
      let mean;
      if (Number.isNaN(m0)) mean = m1;
      else if (Number.isNaN(m1)) mean = m0;
      else mean = (m0 * c0 + m1 * c1) / (c0 + c1);
      this.s0[j] = this.s0[i];
      this.s1[j] = this.s1[i + 1];
      this.mean[j] = mean;
      this.lo[j] = nanMin(this.lo[i], this.lo[i + 1]);
      this.hi[j] = nanMax(this.hi[i], this.hi[i + 1]);
      this.rmin[j] = nanMin(this.rmin[i], this.rmin[i + 1]);
      this.rmax[j] = nanMax(this.rmax[i], this.rmax[i + 1]);
      this.cnt[j] = c0 + c1;
      this.bad[j] = this.bad[i] | this.bad[i + 1];
    }
    this.n = j;
  }

  _copy(i, j) {
    for (const k of ["s0", "s1", "mean", "lo", "hi", "rmin", "rmax", "cnt", "bad"]) this[k][j] = this[k][i];
  }

  /** Append every bucket of `other` whose first step is above our last. */
  appendFrom(other) {
    const last = this.last;
    for (let i = 0; i < other.n; i++) {
      if (last !== null && other.s0[i] <= last) continue;
      this.push(other.s0[i], other.s1[i], other.mean[i], other.lo[i], other.hi[i],
        other.rmin[i], other.rmax[i], other.cnt[i], other.bad[i] === 1);
    }
  }
}

export function nanMin(a, b) {
  if (Number.isNaN(a)) return b;
  if (Number.isNaN(b)) return a;
  return a < b ? a : b;
}

export function nanMax(a, b) {
  if (Number.isNaN(a)) return b;
  if (Number.isNaN(b)) return a;
  return a > b ? a : b;
}
