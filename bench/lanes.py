"""The broker's per-frame rules for ``steps`` and ``resources`` frames, each written out as
one function with no module structure (issue 17's sixth and seventh passes): what the
broker's per-frame path would cost with its calls and objects fused away, the bound its
structure is measured against. ``bench/frame_instructions.py`` counts them (``lane``),
times them (``time``) and runs them behind the floor's PULL loop (``rate``); BENCHMARKS.md
says what they showed.

These copy the rules of ``broker/`` (the sink's bounds and liveness, the closer's pending
columns and watermark, the GPU rules' quiet test, the journal's notes) on purpose: a call
into the broker would measure its structure again. The frames they take are the
benchmarks' own, every one valid and of a registered rank.
"""
from __future__ import annotations

import collections
from typing import Callable, List, Tuple


def make_lane(reg: List[bytes]) -> Tuple[Callable[[bytes], None], Callable[[], int]]:
    """``frame_instructions.lane``'s per-frame function for the runs ``reg`` registers, and
    a count of the frames it accepted."""
    import heapq

    import msgspec

    from broker.steps.closer import STEP_MS_WINDOW
    from rank_agent import protocol

    decode, check_of = protocol.decoder.decode, protocol.check_of
    max_bytes, steps_type = protocol.MAX_FRAME_BYTES, protocol.Steps

    class Rank:
        __slots__ = ("highest", "ms", "active", "last_seen", "status", "stalled", "collective")

        def __init__(self) -> None:
            self.highest = -1
            self.ms: collections.deque = collections.deque(maxlen=STEP_MS_WINDOW)
            self.active = True
            self.last_seen = 0.0
            self.status = "ok"
            self.stalled = False
            self.collective = False

    class Run:
        def __init__(self, ws: int) -> None:
            self.world_size = ws
            self.names: set = set()
            self.updated_at = 0.0
            self.ranks: dict[int, Rank] = {}
            self.last_closed = self.lo = self.hi = self.top = -1
            self.late = self.seq = self.noted_seq = self.accepted = 0
            self.dirty = False
            self.force: collections.deque = collections.deque()
            self.count: dict[int, int] = {}
            self.heap: List[int] = []
            self.cols: List[list] = [[] for _ in range(9)]
            self.groups: List[list] = []
            self.gnames: List[str] | None = None

    runs: dict[str, Run] = {}
    for raw in reg:
        f = decode(raw)
        run = runs.setdefault(f.run, Run(f.world_size))
        run.ranks[f.rank] = Rank()
        run.count[-1] = run.count.get(-1, 0) + 1
    now = 1000.0

    def one(raw: bytes) -> None:
        if len(raw) > max_bytes:
            return
        try:
            f = decode(raw)
            check = check_of(type(f))
            if check is not None:
                check(f)
        except (msgspec.DecodeError, protocol.LimitExceeded):
            return
        s = runs.get(f.run)
        if s is None or type(f) is not steps_type:
            return
        rank = f.rank
        ws = s.world_size
        if ws is not None and rank >= ws:
            return
        metrics = f.metrics
        if metrics and not s.names.issuperset(metrics):
            s.names.update(metrics)  # (the cap's check, for a new name only)
        s.updated_at = now
        st = s.ranks[rank]
        st.last_seen = now
        if st.status == "stale":
            st.status = "ok"
        s.dirty = True
        st.stalled = st.collective = False  # (sections 3, 7.2)
        steps = f.steps
        top, first, old = steps[-1], steps[0], st.highest
        if top <= s.last_closed:
            s.late += len(steps)
        else:
            if first <= s.last_closed:
                raise RuntimeError("the lane's frames are never late")
            if s.lo < 0 or first < s.lo:
                s.lo = first
            if top > s.hi:
                s.hi = top
            step, time_, ms, samples, tokens, frank, fk, mvals, fresh = s.cols
            step += steps
            time_ += f.times
            ms += f.step_ms
            samples += f.samples
            tokens += f.tokens
            frank.append(rank)
            fk.append(len(steps))
            names = list(metrics)
            if names == s.gnames:
                s.groups[-1][1] += 1
            else:
                s.gnames = names
                s.groups.append([names, 1])
            mvals += metrics.values()
            if top > s.top:
                s.top = top
                force = s.force
                if force and force[-1][0] == now:
                    force[-1] = (now, top)
                else:
                    force.append((now, top))
        step_ms = f.step_ms
        if None in step_ms:
            st.ms.extend([v for v in step_ms if v is not None])
        else:
            st.ms.extend(step_ms)
        if top > old:
            st.highest = top
            if st.active:
                count = s.count
                c = count[old] - 1
                if c:
                    count[old] = c
                else:
                    del count[old]
                c = count.get(top, 0)
                count[top] = c + 1
                if not c:
                    heapq.heappush(s.heap, top)
        s.accepted += 1
        if s.seq != s.noted_seq:
            s.noted_seq = s.seq

    return one, lambda: sum(r.accepted for r in runs.values())


def make_resources_lane(reg: List[bytes]) -> Tuple[Callable[[bytes], None], Callable[[], None],
                                                   Callable[[], int]]:
    """``frame_instructions.resources_lane``'s per-frame function, the batch's end (the
    held samples applied) and a count of the frames accepted."""
    import msgspec

    from rank_agent import protocol

    decode, check_of = protocol.decoder.decode, protocol.check_of
    max_bytes, resources_type = protocol.MAX_FRAME_BYTES, protocol.Resources

    class Rank:
        __slots__ = ("last_seen", "status", "sample_json")

        def __init__(self) -> None:
            self.last_seen = 0.0
            self.status = "ok"
            self.sample_json: object = None

    class Run:
        def __init__(self, ws: int) -> None:
            self.world_size = ws
            self.updated_at = 0.0
            self.ranks: dict[int, Rank] = {}
            self.latest: dict[int, object] = {}
            self.dirty: set[int] = set()
            self.prev: dict[int, dict[int, object]] = {}
            self.pending: dict[int, tuple] = {}
            self.accepted = self.replaced = 0

    runs: dict[str, Run] = {}
    for raw in reg:
        f = decode(raw)
        runs.setdefault(f.run, Run(f.world_size)).ranks[f.rank] = Rank()
    held: dict[str, dict[int, tuple]] = {}
    now = 1000.0

    def one(raw: bytes) -> None:
        if len(raw) > max_bytes:
            return
        try:
            f = decode(raw)
            check = check_of(type(f))
            if check is not None:
                check(f)
        except (msgspec.DecodeError, protocol.LimitExceeded):
            return
        run = f.run
        s = runs.get(run)
        if s is None or type(f) is not resources_type:
            return
        rank = f.rank
        ws = s.world_size
        if ws is not None and rank >= ws:
            return
        ranks = held.get(run)
        if ranks is None:
            ranks = held[run] = {}
        if ranks.pop(rank, None) is not None:
            s.replaced += 1
            s.accepted += 1
        ranks[rank] = (f, raw)
        gpus = f.sample.gpus
        if gpus:
            known = s.prev.get(rank)
            if known is None:
                known = s.prev[rank] = {}
            for gpu in gpus:
                prev = known.get(gpu.device_index)
                known[gpu.device_index] = gpu
                ecc, nvlink = gpu.ecc_uncorrected, gpu.nvlink_errors
                width, reasons = gpu.pcie_link_width, gpu.throttle_reasons
                if (gpu.xid_errors or gpu.remapped_rows_failed or gpu.remapped_rows_pending
                        or reasons
                        or (width is not None and gpu.pcie_link_width_max is not None
                            and width < gpu.pcie_link_width_max)
                        or (ecc and (prev is None or prev.ecc_uncorrected is None))
                        or (nvlink is not None and prev is not None
                            and prev.nvlink_errors is not None)):
                    raise RuntimeError("the lane's samples are quiet")

    def release() -> None:
        for run, ranks in held.items():
            s = runs[run]
            for rank, (f, _raw) in ranks.items():
                s.updated_at = now
                st = s.ranks[rank]
                st.last_seen = now
                if st.status == "stale":
                    st.status = "ok"
                s.latest[rank] = f.sample
                s.dirty.add(rank)
                st.sample_json = None
                s.pending[rank] = (now, f)
                s.accepted += 1
        held.clear()

    return one, release, lambda: sum(r.accepted for r in runs.values())
