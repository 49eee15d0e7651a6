"""The GPU alerts and webhook hooks wired into the sink and Runs (PROTOCOL.md 3, 3.1):
every live sample feeds the rules, from a ``resources`` frame or a ``metrics`` frame's
``resources``; alerts are listed in the header like the other per-rank kinds and handed to
``on_alert`` with the rank's host; a run end goes to ``on_run_end``; a journal replay raises
no GPU alert and hands nothing to either hook (sinks go live only when Runs takes them in)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from broker.journal.journal import Journal
from broker.run.sink import RunSink
from broker.runs import Runs
from rank_agent.protocol import GpuSample, Resources, ResourceSample
from tests.support.frames import enc, finish, metrics, register

RUN = "r1"


def gpu(index: int = 0, **kw: Any) -> GpuSample:
    return GpuSample(device_index=index, name="H100", **kw)


def res(rank: int, *gpus: GpuSample) -> Resources:
    return Resources(run=RUN, rank=rank, sample=ResourceSample(gpus=list(gpus)))


class Hooks:
    """What Runs hands to the webhooks, recorded."""

    def __init__(self) -> None:
        self.alerts: list[tuple[str, str, int | None, str, str | None, float]] = []
        self.ends: list[tuple[str, str, float]] = []

    def runs(self, **kw: Any) -> Runs:
        return Runs(on_alert=lambda *a: self.alerts.append(a),
                    on_run_end=lambda *a: self.ends.append(a), **kw)

    def kinds(self) -> list[tuple[str, int | None]]:
        return [(a[1], a[2]) for a in self.alerts]


def header_alerts(runs: Runs) -> list[tuple[str, int | None, str]]:
    sink = runs.get(RUN)
    assert sink is not None
    return [(a["kind"], a["rank"], a["message"]) for a in sink.header()["alerts"]]


def test_an_xid_in_a_resources_frame_is_an_alert_with_the_rank_host() -> None:
    hooks = Hooks()
    runs = hooks.runs()
    runs.ingest(enc(register(RUN, 0, 2, host="node-a")), 1.0)
    runs.ingest(enc(res(0, gpu(0), gpu(3, xid_errors=[79, 48]))), 2.0)
    assert hooks.alerts == [(RUN, "gpu_xid", 0, "XID 79, 48 on GPU 3", "node-a", 2.0)]
    assert header_alerts(runs) == [("gpu_xid", 0, "XID 79, 48 on GPU 3")]
    # the tally /metrics exports rides in the rank's entry
    (r0,) = runs.get(RUN).ranks()  # type: ignore[union-attr]
    assert r0["gpu_xids"] == [{"gpu": 3, "count": 2, "last": 48}]


def test_a_metrics_frames_resources_feed_the_same_rules_as_a_resources_frame() -> None:
    hooks = Hooks()
    runs = hooks.runs()
    runs.ingest(enc(register(RUN, 0, 1)), 1.0)
    hot = gpu(0, throttle_reasons=["hw_thermal"], sm_clock_mhz=900.0)
    runs.ingest(enc(res(0, hot)), 2.0)
    assert hooks.alerts == []  # one throttled sample is not enough
    runs.ingest(enc(metrics(RUN, 0, 0, resources=ResourceSample(gpus=[hot]))), 3.0)
    assert hooks.kinds() == [("gpu_throttle", 0)]
    assert header_alerts(runs) == [("gpu_throttle", 0, "hw_thermal throttling on GPU 0 (SM 900 MHz)")]


def test_sw_power_cap_alone_raises_nothing() -> None:
    hooks = Hooks()
    runs = hooks.runs()
    runs.ingest(enc(register(RUN, 0, 1)), 1.0)
    for t in range(5):
        runs.ingest(enc(res(0, gpu(0, throttle_reasons=["sw_power_cap"]))), 2.0 + t)
    assert hooks.alerts == [] and header_alerts(runs) == []


def test_the_header_lists_a_gpu_alert_within_the_coalescing_interval() -> None:
    runs = Runs(ranks_interval=1.0)
    runs.ingest(enc(register(RUN, 0, 1)), 1.0)
    runs.tick(1.0)
    runs.ingest(enc(res(0, gpu(0, remapped_rows_failed=True))), 1.5)
    events = runs.tick(2.5)
    headers = [e.data for _, e in events if e.kind == "run"]
    assert headers and headers[-1]["alerts"][0]["kind"] == "gpu_row_remap"


def test_run_end_goes_to_the_hook_once() -> None:
    hooks = Hooks()
    runs = hooks.runs()
    runs.ingest(enc(register(RUN, 0, 2)), 1.0)
    runs.ingest(enc(register(RUN, 1, 2)), 1.0)
    runs.ingest(enc(finish(RUN, 0)), 2.0)
    assert hooks.ends == []
    runs.ingest(enc(finish(RUN, 1, "error")), 3.0)
    assert hooks.ends == [(RUN, "failed", 3.0)]
    assert hooks.kinds() == [("rank_error", 1)]
    runs.ingest(enc(finish(RUN, 1, "error")), 4.0)  # a repeat ends nothing again
    assert hooks.ends == [(RUN, "failed", 3.0)]


def test_stale_alerts_reach_the_hook_with_the_host() -> None:
    hooks = Hooks()
    runs = hooks.runs(stale_after=10.0)
    for rank in range(4):
        runs.ingest(enc(register(RUN, rank, 4, host=f"n{rank // 2}")), 1.0)
    runs.tick(11.5)
    assert sorted((a[1], a[2], a[4]) for a in hooks.alerts) == [
        ("stale", 0, "n0"), ("stale", 1, "n0"), ("stale", 2, "n1"), ("stale", 3, "n1")]


def test_a_sink_not_taken_in_by_runs_raises_no_gpu_alert() -> None:
    """What a journal replay is: the sink's rules, fed outside Runs."""
    sink = RunSink(RUN)
    seen: list[Any] = []
    sink.on_alert = lambda *a: seen.append(a)
    sink.apply(register(RUN, 0, 1), 1.0)
    sink.apply(res(0, gpu(0, xid_errors=[79])), 2.0)
    sink.apply(finish(RUN, 0, "error"), 3.0)
    assert seen == [] and len(sink.gpu_rules) == 0
    assert [a["kind"] for a in sink.header()["alerts"]] == ["rank_error"]  # still listed


def test_ranks_past_the_world_size_leave_the_gpu_rules() -> None:
    runs = Runs()
    runs.ingest(enc(res(5, gpu(0, xid_errors=[13]))), 1.0)  # before any register
    sink = runs.get(RUN)
    assert sink is not None and len(sink.gpu_rules) == 1 and 5 in sink.gpu_rules.xids
    runs.ingest(enc(register(RUN, 0, 2)), 2.0)
    assert len(sink.gpu_rules) == 0 and sink.gpu_rules.xids == {}


def test_a_replayed_journal_hands_nothing_to_the_hooks(tmp_path: Path) -> None:
    """A restart posts nothing for what its journal replays (PROTOCOL 3.1): the journal's
    frames (an XID sample, a rank's error, a run's end) are replayed before Runs takes the
    sinks in; a rank silent since the restart turns stale, listed but not handed over."""
    hooks = Hooks()
    with Journal(tmp_path) as journal:
        runs = hooks.runs(recorder=journal.accept)
        runs.ingest(enc(register(RUN, 0, 2, host="a")), 1.0)
        runs.ingest(enc(register(RUN, 1, 2, host="a")), 1.0)
        runs.ingest(enc(res(0, gpu(0, xid_errors=[79]))), 2.0)
        runs.ingest(enc(metrics(RUN, 0, 0)), 2.5)  # writes the held sample out
        runs.ingest(enc(finish(RUN, 1, "error")), 3.0)
        runs.ingest(enc(register("done", 0, 1)), 3.0)
        runs.ingest(enc(finish("done", 0)), 4.0)
        journal.flush()
    assert sorted(hooks.kinds()) == [("gpu_xid", 0), ("rank_error", 1)]
    assert hooks.ends == [("done", "complete", 4.0)]

    after = Hooks()
    with Journal(tmp_path) as journal:
        runs = after.runs(stale_after=5.0, recorder=journal.accept)
        runs.restore(journal.load(stale_after=5.0, now=100.0))
        sink = runs.get(RUN)
        assert sink is not None and sink.live and runs.get("done").live  # type: ignore[union-attr]
        runs.tick(106.0)
        assert ("stale", 0) in [(a["kind"], a["rank"]) for a in sink.header()["alerts"]]
        assert after.alerts == [] and after.ends == []
        # live frames of a restored run are posted again
        runs.ingest(enc(res(1, gpu(2, xid_errors=[48]))), 107.0)
        assert after.kinds() == [("gpu_xid", 1)]
        runs.ingest(enc(register(RUN, 0, 2, host="a")), 108.0)
        runs.tick(114.0)  # rank 0 was heard from since the restart: its staleness is news
        assert ("stale", 0) in after.kinds()


def test_a_run_brought_back_by_the_loader_is_live(tmp_path: Path) -> None:
    hooks = Hooks()
    with Journal(tmp_path) as journal:
        runs = hooks.runs(max_runs=1, recorder=journal.accept,
                          loader=lambda run: journal.load_run(run), on_evict=journal.forget)
        runs.ingest(enc(register(RUN, 0, 1)), 1.0)
        runs.ingest(enc(register("other", 0, 1)), 2.0)  # evicts RUN
        assert runs.get(RUN) is None
        runs.ingest(enc(res(0, gpu(0, ecc_uncorrected=3))), 3.0)  # brings RUN back
        assert hooks.kinds() == [("gpu_ecc", 0)]


def test_a_stalled_rank_is_handed_to_the_hook_and_not_from_a_replay(tmp_path: Path) -> None:
    """v3 diagnosis raises ``stalled`` through the same path: posted live, never replayed."""
    from rank_agent.protocol import StackFrame, Stacks, ThreadStack

    stall = Stacks(run=RUN, rank=1, reason="stall", taken_at=10.0, idle_s=75.4, threads=[
        ThreadStack(name="MainThread", main=True, frames=[
            StackFrame(file="dist.py", line=7, function="all_reduce")])])
    hooks = Hooks()
    with Journal(tmp_path) as journal:
        runs = hooks.runs(recorder=journal.accept)
        runs.ingest(enc(register(RUN, 1, 2, host="node-b")), 1.0)
        runs.ingest(enc(stall), 10.0)
        journal.flush()
    assert hooks.alerts == [(RUN, "stalled", 1, "stalled 75s in all_reduce (dist.py:7)", "node-b", 10.0)]
    after = Hooks()
    with Journal(tmp_path) as journal:
        runs = after.runs()
        runs.restore(journal.load(now=20.0))
        assert runs.get(RUN) is not None and after.alerts == []
