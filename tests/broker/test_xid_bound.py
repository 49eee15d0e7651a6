"""Issue 32, finding 3: a rank's XID tallies are bounded by the GPUs it is remembered with
(``broker.run.gpualerts.MAX_GPUS_PER_RANK``), however many device indices it invents."""
from __future__ import annotations

from broker.run.gpualerts import MAX_GPUS_PER_RANK, GpuAlertRules
from broker.run.sink import RunSink
from rank_agent.protocol import GpuSample, Register, Resources, ResourceSample


def xid_sample(*indices: int) -> ResourceSample:
    return ResourceSample(gpus=[GpuSample(device_index=i, name="H100", xid_errors=[79])
                                for i in indices])


def test_a_rank_inventing_device_indices_keeps_at_most_the_cap_of_tallies() -> None:
    rules = GpuAlertRules()
    for start in range(0, 5000, 50):
        rules.feed(0, xid_sample(*range(start, start + 50)))
    assert len(rules.xids[0]) <= MAX_GPUS_PER_RANK
    assert set(rules.xids[0]) <= set(rules._prev[0])  # only GPUs it is remembered with
    assert 4999 in rules.xids[0]  # the newest are the ones kept


def test_a_real_gpu_keeps_its_tally() -> None:
    rules = GpuAlertRules()
    for _ in range(10):
        rules.feed(0, xid_sample(0, 1))
    assert rules.xids[0] == {0: [10, 79], 1: [10, 79]}


def test_the_ranks_event_stays_small() -> None:
    """The sink's ``ranks`` event lists at most the cap of XID tallies for that rank (it
    was 30 MiB after one rank's invented indices)."""
    sink = RunSink("r")
    sink.live = True  # as the broker makes every sink it takes in (not a journal replay)
    sink.apply(Register(run="r", rank=0, world_size=1, host="h"), 1.0)
    for start in range(0, 3200, 32):
        frame = Resources(run="r", rank=0, sample=xid_sample(*range(start, start + 32)))
        sink.gpu_health_many([frame], 2.0)
        sink.apply(frame, 2.0)
    ranks = [e for e in sink.tick(10.0) if e.kind == "ranks"]
    assert ranks, "no ranks event"
    (entry,) = ranks[-1].data
    assert 0 < len(entry["gpu_xids"]) <= MAX_GPUS_PER_RANK
