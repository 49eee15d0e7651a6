"""Each rank's newest ``resources`` frame of a batch held back from the sink
(:class:`broker.coalesce.HeldSamples`, ``Runs(hold_samples=True)``): the end state is the
one of applying every frame in order, and what a replaced sample still does (feed the GPU
alert rules, count as accepted, be rejected when out of range) it does. Pure: no sockets;
a "batch" is the frames between two ``release_samples`` calls, all at one ``now``, as the
server's receive loop gives them."""
from __future__ import annotations

import json
import random
from typing import Any

import pytest

from broker.runs import Runs
from rank_agent import protocol as wire

RUN = "held"
ENC = wire.encoder.encode


def gpu(index: int, *, xid: list[int] | None = None, ecc: int | None = None,
        throttle: list[str] | None = None, util: float = 90.0) -> wire.GpuSample:
    return wire.GpuSample(device_index=index, name="NVIDIA H100", util_percent=util,
                          xid_errors=xid or [], ecc_uncorrected=ecc,
                          throttle_reasons=throttle or [])  # type: ignore[arg-type]


def resources(run: str, rank: int, cpu: float, gpus: list[wire.GpuSample] | None = None) -> bytes:
    return ENC(wire.Resources(run=run, rank=rank, sample=wire.ResourceSample(
        cpu_percent=cpu, gpus=gpus or [gpu(0)])))


def register(run: str, rank: int, world: int = 4) -> bytes:
    return ENC(wire.Register(run=run, rank=rank, world_size=world, host=f"h{rank // 2}",
                             local_rank=rank % 2, total_epochs=3))


class Recorded:
    """What the journal would be handed: (run, frame type, rank, cpu of a sample)."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, str, int, Any]] = []

    def __call__(self, sink: Any, raw: Any, frame: Any, now: float) -> None:
        sample = getattr(frame, "sample", None)
        self.frames.append((sink.run, type(frame).__name__, frame.rank,
                            sample.cpu_percent if sample is not None else None))


def make(hold: bool, **kw: Any) -> tuple[Runs, list[tuple[str, str, int | None, str]], Recorded]:
    alerts: list[tuple[str, str, int | None, str]] = []
    rec = Recorded()
    runs = Runs(hold_samples=hold, recorder=rec,
                on_alert=lambda run, kind, rank, message, host, now: alerts.append(
                    (run, kind, rank, message)), **kw)
    return runs, alerts, rec


def feed(runs: Runs, batches: list[list[bytes]], t0: float = 1000.0) -> list[tuple[str, Any]]:
    events: list[tuple[str, Any]] = []
    for i, batch in enumerate(batches):
        now = t0 + i
        for raw in batch:
            events += runs.ingest(raw, now)
        events += runs.release_samples(now)
        events += runs.tick(now)
    return events



def replaced(runs: Runs) -> int:
    """Frames the batch's holding replaced (:attr:`HeldSamples.replaced`)."""
    assert runs._held is not None
    return runs._held.replaced

def test_a_batch_applies_each_ranks_newest_sample_and_counts_every_frame() -> None:
    runs, _, rec = make(True)
    batch = [register(RUN, r) for r in range(4)]
    feed(runs, [batch])
    flood = [resources(RUN, r, float(10 * k + r)) for k in range(10) for r in range(4)]
    feed(runs, [flood])
    assert runs.accepted == 4 + 40
    assert replaced(runs) == 36
    # the sink and the journal saw each rank's newest sample once
    sampled = [f for f in rec.frames if f[1] == "Resources"]
    assert sorted(sampled) == [(RUN, "Resources", r, float(90 + r)) for r in range(4)]
    sink = runs.get(RUN)
    assert sink is not None
    cpu = {r["rank"]: r["resources"]["cpu_percent"] for r in sink.ranks()}
    assert cpu == {r: float(90 + r) for r in range(4)}


def test_a_replaced_sample_still_raises_its_gpu_alerts() -> None:
    """An XID is in one sample only: the sample that carries it is replaced within the batch,
    and its alert must still be raised (and the webhook told)."""
    runs, alerts, _ = make(True)
    feed(runs, [[register(RUN, r) for r in range(4)]])
    feed(runs, [[resources(RUN, 1, 1.0, [gpu(0, xid=[79])]), resources(RUN, 1, 2.0)]])
    assert replaced(runs) == 1
    assert [(a[1], a[2]) for a in alerts] == [("gpu_xid", 1)]
    sink = runs.get(RUN)
    assert sink is not None
    assert [(a["kind"], a["rank"]) for a in sink.header()["alerts"]] == [("gpu_xid", 1)]


def test_a_frame_of_the_run_releases_its_held_samples_first() -> None:
    """A ``metrics`` frame's own sample replaces the rank's: the held (older) sample must
    not be applied after it."""
    runs, _, rec = make(True)
    feed(runs, [[register(RUN, r, world=1) for r in range(1)]])
    own = wire.ResourceSample(cpu_percent=55.0)
    metrics = ENC(wire.Metrics(run=RUN, rank=0, epoch=0, avg_loss=1.0, batches=1, samples=1,
                               epoch_ms=1.0, resources=own))
    feed(runs, [[resources(RUN, 0, 11.0), metrics]])
    sink = runs.get(RUN)
    assert sink is not None
    assert sink.ranks()[0]["resources"]["cpu_percent"] == 55.0
    assert [f[1] for f in rec.frames[-2:]] == ["Resources", "Metrics"]


def test_a_sample_of_a_rank_out_of_range_is_rejected_not_held() -> None:
    runs, _, _ = make(True)
    feed(runs, [[register(RUN, r) for r in range(4)]])
    feed(runs, [[resources(RUN, 7, 1.0), resources(RUN, 7, 2.0), resources(RUN, 0, 3.0)]])
    assert runs.rejected["rank_out_of_range"] == 2
    assert runs.accepted == 4 + 1


def test_held_samples_of_a_run_evicted_by_a_new_one_are_applied_first() -> None:
    runs, _, rec = make(True, max_runs=1)
    feed(runs, [[register(RUN, 0, world=1)]])
    events = feed(runs, [[resources(RUN, 0, 42.0), register("newcomer", 0, world=1)]])
    assert (RUN, "Resources", 0, 42.0) in rec.frames
    assert rec.frames.index((RUN, "Resources", 0, 42.0)) < rec.frames.index(
        ("newcomer", "Register", 0, None))
    assert any(run == RUN and ev.kind == "evicted" for run, ev in events)


@pytest.mark.parametrize("seed", range(12))
def test_holding_ends_where_applying_every_frame_in_order_ends(seed: int) -> None:
    """Random traffic over two runs (samples with XIDs, ECC counts and throttling, metrics
    frames with and without their own sample, hardware, finishes, ranks out of range),
    cut into random batches: the sinks end identical (header with alerts, ranks, records,
    sequence numbers), as do the counters and the alerts handed on (as a multiset: a held
    sample's alerts are raised when it is applied, later in its batch)."""
    rnd = random.Random(seed)
    runs_ = ["a", "b"]
    frames: list[bytes] = [register(run, r) for run in runs_ for r in range(4)]
    ecc = {(run, r): 0 for run in runs_ for r in range(6)}
    epoch = {run: 0 for run in runs_}
    for _ in range(400):
        run = rnd.choice(runs_)
        rank = rnd.randrange(5)  # rank 4 is out of range (world 4)
        roll = rnd.random()
        if roll < 0.75:
            if rnd.random() < 0.2:
                ecc[(run, rank)] += 1
            g = gpu(0, xid=[rnd.choice([13, 31, 79])] if rnd.random() < 0.1 else None,
                    ecc=ecc[(run, rank)],
                    throttle=["hw_thermal"] if rnd.random() < 0.1 else None,
                    util=rnd.uniform(0, 100))
            frames.append(resources(run, rank, rnd.uniform(0, 100), [g]))
        elif roll < 0.9:
            own = wire.ResourceSample(cpu_percent=rnd.uniform(0, 100)) if rnd.random() < 0.5 else None
            frames.append(ENC(wire.Metrics(run=run, rank=rank, epoch=epoch[run], avg_loss=1.0,
                                           batches=1, samples=8, epoch_ms=5.0, resources=own)))
            if rnd.random() < 0.3:
                epoch[run] += 1
        elif roll < 0.97:
            frames.append(ENC(wire.Hardware(run=run, rank=rank, summary=f"cpu | gpu {rnd.randrange(3)}")))
        else:
            frames.append(ENC(wire.Finish(run=run, rank=rank, status=rnd.choice(["ok", "error"]))))
    batches: list[list[bytes]] = []
    i = 0
    while i < len(frames):
        n = rnd.randint(1, 60)
        batches.append(frames[i:i + n])
        i += n

    held, held_alerts, _ = make(True)
    plain, plain_alerts, _ = make(False)
    feed(held, batches)
    feed(plain, batches)
    assert replaced(held) > 0  # the traffic did exercise the holding
    assert held.accepted == plain.accepted
    assert held.rejected == plain.rejected
    for run in runs_:
        a, b = held.get(run), plain.get(run)
        assert a is not None and b is not None
        assert a.snapshot() == b.snapshot()
    assert sorted(held_alerts) == sorted(plain_alerts)


def _sink_state(sink: Any) -> str:
    return json.dumps([sink.started_at, sink.updated_at, sink.ranks(), sink.header()],
                      sort_keys=True, default=str)


def test_a_batch_of_held_samples_ends_where_applying_each_with_held_ends() -> None:
    """``RunSink.apply_held`` (one call per run per batch) against ``apply`` per frame (which
    also feeds the GPU rules: these quiet samples raise nothing): the same events, state
    and rejections, including a rank past the world size
    (never held through ``Runs``, but the sink checks it as ``apply`` does), stale ranks
    coming back and a rank seen first in the batch."""
    from broker.run.sink import Rejected, RunSink

    def frames() -> list[wire.Resources]:
        return [wire.Resources(run=RUN, rank=r, sample=wire.ResourceSample(
            cpu_percent=float(10 * r + i), gpus=[gpu(0)])) for i, r in enumerate([0, 5, 2, 3])]

    def setup() -> RunSink:
        sink = RunSink(RUN, stale_after=5.0)
        for r in (0, 1, 2):
            sink.apply(wire.decoder.decode(register(RUN, r)), 10.0)
        sink.tick(20.0)  # ranks 0-2 stale
        return sink

    one, batch = setup(), setup()
    assert [r["status"] for r in one.ranks()] == ["stale"] * 3
    events: list[Any] = []
    rejected: list[str] = []
    for f in frames():
        try:
            events += one.apply(f, 30.0)
        except Rejected as exc:
            rejected.append(f"{f.rank}: {exc.detail}")
    got, why = batch.apply_held(frames(), 30.0)
    assert [f"{f.rank}: {w}" for f, w in why] == rejected == ["5: rank 5 >= world_size 4"]
    assert got == events
    assert one.tick(31.0) == batch.tick(31.0)  # (the ranks event: their liveness)
    assert _sink_state(batch) == _sink_state(one)
    ranks = {r["rank"]: r for r in batch.ranks()}
    assert [ranks[r]["status"] for r in (0, 1, 2, 3)] == ["ok", "stale", "ok", "ok"]
    assert [ranks[r]["resources"]["cpu_percent"] for r in (0, 2, 3)] == [0.0, 22.0, 33.0]


def test_a_batch_feeds_the_gpu_rules_every_sample_in_arrival_order() -> None:
    """The GPU rules see every held sample of the run, replaced or not, in the order they
    arrived (one call for the batch): alerts and the webhook's calls come in that order,
    and a throttle seen in two consecutive samples of a GPU (replaced within the batch)
    raises as it would frame by frame."""
    runs, alerts, _ = make(True)
    feed(runs, [[register(RUN, r) for r in range(4)]])
    batch = [resources(RUN, 2, 1.0, [gpu(0, xid=[13])]),
             resources(RUN, 0, 2.0, [gpu(0, throttle=["hw_thermal"])]),
             resources(RUN, 1, 3.0, [gpu(0, xid=[79])]),
             resources(RUN, 0, 4.0, [gpu(0, throttle=["hw_thermal"])]),
             resources(RUN, 2, 5.0)]
    feed(runs, [batch])
    assert [(a[1], a[2]) for a in alerts] == [("gpu_xid", 2), ("gpu_xid", 1),
                                              ("gpu_throttle", 0)]
    ref, ref_alerts, _ = make(False)
    feed(ref, [[register(RUN, r) for r in range(4)]])
    feed(ref, [batch])
    assert ref_alerts == alerts


def test_a_failing_gpu_rule_is_counted_and_the_samples_still_apply(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the GPU rules (not bad input) is counted as ``internal`` once for the batch,
    and the batch's samples are applied all the same."""
    from broker.run.gpualerts import GpuAlertRules

    runs, _, rec = make(True)
    feed(runs, [[register(RUN, r) for r in range(4)]])

    def broken(self: Any, items: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(GpuAlertRules, "feed_many", broken)
    feed(runs, [[resources(RUN, r, float(r)) for r in range(4)]])
    assert runs.rejected["internal"] == 1
    sink = runs.get(RUN)
    assert sink is not None
    assert {r["rank"]: r["resources"]["cpu_percent"] for r in sink.ranks()} == {
        r: float(r) for r in range(4)}


def test_held_samples_journaled_in_one_call_write_what_one_a_frame_writes(tmp_path: Any) -> None:
    """``Journal.accept_samples`` (the server's ``sample_recorder``: one call per run and
    batch) leaves the journal files, and the runs replayed from them, as ``accept`` per
    held frame does (issue 33)."""
    from broker.journal.journal import Journal

    rnd = random.Random(33)
    frames = [register(run, r) for run in ("a", "b") for r in range(4)]
    for i in range(600):
        run, rank = rnd.choice("ab"), rnd.randrange(4)
        if rnd.random() < 0.9:
            frames.append(resources(run, rank, float(i), [gpu(0, util=float(i % 100))]))
        else:
            frames.append(ENC(wire.Metrics(run=run, rank=rank, epoch=i // 150, avg_loss=1.0,
                                           batches=1, samples=8, epoch_ms=5.0)))
    batches, i = [], 0
    while i < len(frames):
        n = rnd.randint(1, 80)
        batches.append(frames[i:i + n])
        i += n
    files = []
    for one_call in (True, False):
        journal = Journal(tmp_path / f"d{one_call}")
        journal.load()
        runs = Runs(hold_samples=True, recorder=journal.accept)
        if one_call:
            runs.sample_recorder = journal.accept_samples
        for b, batch in enumerate(batches):
            for raw in batch:
                runs.ingest(raw, 1000.0 + b)
            runs.release_samples(1000.0 + b)
            journal.flush()
        journal.close()
        found = sorted((tmp_path / f"d{one_call}").rglob("*.journal"))
        files.append({p.name: p.read_bytes() for p in found})
        assert runs.rejected_total == 0
    assert files[0] == files[1] and len(files[0]) == 2
    replayed = [Journal(tmp_path / f"d{one_call}").load() for one_call in (True, False)]
    assert {r: s.snapshot() for r, s in replayed[0].items()} == {
        r: s.snapshot() for r, s in replayed[1].items()}
