"""Epoch aggregation rules of PROTOCOL.md 2.3, one pure function at a time (no sink, no I/O)."""
from __future__ import annotations

import math

import pytest

from broker.run import aggregate as agg
from rank_agent.protocol import GpuSample, Metrics, ResourceSample
from tests.support.aggregate import gpu_entries

RUN = "run-1"


def gathered(reports: list[Metrics]) -> agg.EpochReports:
    """One epoch's reports as the sink gathers them (rank i: the i-th report)."""
    out = agg.EpochReports()
    for i, m in enumerate(reports):
        out.put(i, m)
    return out


def loss_of(reports: list[Metrics]) -> float:
    return gathered(reports).loss()


def scalars_of(reports: list[Metrics]) -> dict[str, float]:
    return gathered(reports).scalar_means()


def epoch_ms_of(reports: list[Metrics]) -> float:
    return gathered(reports).epoch_ms()


def met(rank: int, loss: float = 1.0, b: int = 1, **kw) -> Metrics:
    return Metrics(run=RUN, rank=rank, epoch=0, avg_loss=loss, batches=b, **kw)


def gpu(name: str = "H100", index: int = 0, **kw) -> GpuSample:
    return GpuSample(device_index=index, name=name, **kw)


# ---------------------------------------------------------------- loss


def test_loss_is_batch_weighted() -> None:
    assert loss_of([met(0, 1.0, b=1), met(1, 4.0, b=3)]) == pytest.approx(3.25)


def test_loss_is_zero_when_no_batches() -> None:
    assert loss_of([met(0, 5.0, b=0), met(1, 7.0, b=0)]) == 0.0


@pytest.mark.parametrize("b", [0, 2])
def test_nan_loss_stays_nan(b: int) -> None:
    assert math.isnan(loss_of([met(0, 1.0, b=b), met(1, math.nan, b=b)]))


# ---------------------------------------------------------------- scalars


def test_scalars_weighted_by_batches_over_reporting_ranks() -> None:
    reports = [
        met(0, b=1, scalars={"acc": (2.0, 2)}),  # 1.0
        met(1, b=3, scalars={"acc": (6.0, 2)}),  # 3.0
        met(2, b=100),  # does not report acc: not part of its mean
    ]
    assert scalars_of(reports) == {"acc": pytest.approx((1.0 * 1 + 3.0 * 3) / 4)}


def test_scalar_count_zero_means_not_reported() -> None:
    reports = [met(0, b=1, scalars={"acc": (100.0, 0)}), met(1, b=1, scalars={"acc": (3.0, 1)})]
    assert scalars_of(reports) == {"acc": 3.0}
    assert scalars_of([met(0, scalars={"acc": (1.0, 0)})]) == {}


def test_scalars_unweighted_when_their_batches_sum_to_zero() -> None:
    reports = [met(0, b=0, scalars={"x": (1.0, 1)}), met(1, b=0, scalars={"x": (4.0, 2)})]
    assert scalars_of(reports) == {"x": pytest.approx(1.5)}


def test_scalars_sorted_by_name() -> None:
    out = scalars_of([met(0, scalars={"zeta": (1.0, 1), "alpha": (1.0, 1), "mid": (1.0, 1)})])
    assert list(out) == ["alpha", "mid", "zeta"]


# ---------------------------------------------------------------- per-rank gpu_metrics


def test_gpu_metrics_throughput_and_chunk_ratio() -> None:
    reports = [
        met(0, b=1, samples=100, epoch_ms=50.0),
        met(2, b=3, samples=300, epoch_ms=1000.0, share_complete_ms=100.0),
        met(3, b=0, samples=10, epoch_ms=0.0),
    ]
    out = agg.gpu_metrics([0, 2, 3], reports)
    assert out == [
        {"device_index": 0, "throughput": 2.0, "chunk_ratio": 0.25, "shard_size": 0},
        {"device_index": 2, "throughput": 3.0, "chunk_ratio": 0.75, "shard_size": 0},
        {"device_index": 3, "throughput": 0.0, "chunk_ratio": 0.0, "shard_size": 0},
    ]


def test_gpu_metrics_zero_share_time_is_zero_throughput_even_with_epoch_ms() -> None:
    out = agg.gpu_metrics([0], [met(0, samples=10, epoch_ms=5.0, share_complete_ms=0.0)])
    assert out[0]["throughput"] == 0.0


def test_chunk_ratio_equal_shares_when_no_batches() -> None:
    out = agg.gpu_metrics([0, 1, 2, 3], [met(r, b=0) for r in range(4)])
    assert [g["chunk_ratio"] for g in out] == [0.25] * 4


def test_epoch_ms_is_max() -> None:
    assert epoch_ms_of([met(0, epoch_ms=5.0), met(1, epoch_ms=9.0), met(2)]) == 9.0
    assert epoch_ms_of([met(0, epoch_ms=math.nan), met(1, epoch_ms=3.0)]) == 3.0


# ---------------------------------------------------------------- resources


def resources(samples, hosts, placement=None):
    placement = placement or {}
    return agg.cluster_resources(samples, hosts, gpu_entries(samples, placement))


def test_cpu_per_host_first_rank_with_reading_then_mean_over_hosts() -> None:
    samples = {
        0: ResourceSample(ram_used_bytes=1, ram_total_bytes=10),  # first on host a: no CPU
        1: ResourceSample(cpu_percent=40.0),  # a's CPU comes from here
        2: ResourceSample(cpu_percent=99.0),  # a, later in local order: ignored
        3: ResourceSample(cpu_percent=10.0),  # host b
    }
    out = resources(samples, [[0, 1, 2], [3]])
    assert out["cpu_percent"] == pytest.approx(25.0)  # unweighted over hosts: (40 + 10) / 2


def test_ram_first_rank_with_both_fields_summed_over_hosts() -> None:
    samples = {
        0: ResourceSample(ram_used_bytes=5),  # only one field: skipped
        1: ResourceSample(ram_used_bytes=2, ram_total_bytes=8),
        2: ResourceSample(ram_used_bytes=100, ram_total_bytes=100),  # not first on host a
        3: ResourceSample(ram_used_bytes=1, ram_total_bytes=4),
    }
    out = resources(samples, [[0, 1, 2], [3]])
    assert (out["ram_used_bytes"], out["ram_total_bytes"]) == (3, 12)


def test_cpu_and_ram_may_come_from_different_ranks_of_a_host() -> None:
    samples = {
        0: ResourceSample(cpu_percent=20.0),  # CPU, but no RAM
        1: ResourceSample(cpu_percent=80.0, ram_used_bytes=3, ram_total_bytes=9),
    }
    out = resources(samples, [[0, 1]])
    assert out["cpu_percent"] == 20.0
    assert (out["ram_used_bytes"], out["ram_total_bytes"]) == (3, 9)


def test_host_order_follows_local_rank_order_given() -> None:
    samples = {0: ResourceSample(cpu_percent=1.0), 1: ResourceSample(cpu_percent=9.0)}
    assert resources(samples, [[1, 0]])["cpu_percent"] == 9.0


def test_ranks_without_host_left_out_of_cpu_ram_but_in_gpu_figures() -> None:
    samples = {
        0: ResourceSample(cpu_percent=10.0, ram_used_bytes=1, ram_total_bytes=2, gpu_util_percent=50.0,
                          vram_allocated_bytes=3, vram_total_bytes=4),
        1: ResourceSample(cpu_percent=90.0, ram_used_bytes=7, ram_total_bytes=8, gpu_util_percent=100.0,
                          vram_allocated_bytes=5, vram_total_bytes=6),
    }
    out = resources(samples, [[0]])  # rank 1 has no host
    assert out["cpu_percent"] == 10.0
    assert (out["ram_used_bytes"], out["ram_total_bytes"]) == (1, 2)
    assert out["gpu_util_percent"] == 75.0
    assert (out["vram_allocated_bytes"], out["vram_total_bytes"]) == (8, 10)


def test_zero_sums_and_empty_means_are_none() -> None:
    samples = {0: ResourceSample(ram_used_bytes=0, ram_total_bytes=0, vram_allocated_bytes=0), 1: ResourceSample()}
    out = resources(samples, [[0, 1]])
    assert out == {
        "cpu_percent": None,
        "ram_used_bytes": None,
        "ram_total_bytes": None,
        "gpu_util_percent": None,
        "vram_allocated_bytes": None,
        "vram_total_bytes": None,
        "gpus": [],
    }


def test_cpu_mean_of_zero_readings_is_zero_not_none() -> None:
    assert resources({0: ResourceSample(cpu_percent=0.0)}, [[0]])["cpu_percent"] == 0.0


def test_gpus_one_per_rank_first_gpu_relabelled_in_rank_order() -> None:
    samples = {
        3: ResourceSample(gpus=[gpu("B200", 1, util_percent=7.0), gpu("other", 2)]),
        0: ResourceSample(gpus=[gpu("H100", 0, temperature_c=50.0, power_w=300.0)]),
        1: ResourceSample(cpu_percent=1.0),  # no GPU: no entry
        2: ResourceSample(gpus=[gpu("A100", 0)]),  # host unknown
    }
    placement = {0: ("node-a", 0), 3: ("node-b", 1)}
    out = resources(samples, [[0], [3]], placement)["gpus"]
    assert out == [
        {"device_index": 0, "name": "node-a:lr=0 gr=0 H100", "util_percent": None,
         "vram_allocated_bytes": None, "vram_total_bytes": None, "temperature_c": 50.0, "power_w": 300.0},
        {"device_index": 2, "name": "gr=2 A100", "util_percent": None,
         "vram_allocated_bytes": None, "vram_total_bytes": None, "temperature_c": None, "power_w": None},
        {"device_index": 3, "name": "node-b:lr=1 gr=3 B200", "util_percent": 7.0,
         "vram_allocated_bytes": None, "vram_total_bytes": None, "temperature_c": None, "power_w": None},
    ]


# ---------------------------------------------------------------- eta


def test_eta_mean_of_last_five_times_remaining() -> None:
    durations = [100.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert agg.eta_secs(durations, 10, 5) == pytest.approx(3.0 * 4)


@pytest.mark.parametrize("total, epoch", [(None, 0), (0, 0), (3, 2), (3, 7)])
def test_eta_none_when_unknown_or_nothing_remains(total, epoch) -> None:
    assert agg.eta_secs([1.0], total, epoch) is None


# ---------------------------------------------------------------- the record


def test_record_shape_and_values() -> None:
    reports = {
        0: met(0, 2.0, b=1, samples=10, epoch_ms=2000.0, scalars={"acc": (1.0, 1), "loss": (9.0, 1)}),
        2: met(2, 4.0, b=1, samples=10, epoch_ms=1000.0, scalars={"acc": (3.0, 1)}),
    }
    rec = agg.epoch_record(
        epoch=1, world_size=4, reports=reports, samples={}, hosts=[], gpus={},
        total_epochs=5, past_durations=[4.0], elapsed_secs=12.5,
    )
    assert list(rec) == [
        "epoch", "total_epochs", "duration_secs", "elapsed_secs", "eta_secs",
        "metrics", "resources", "gpu_metrics", "missing_ranks",
    ]
    assert list(rec["metrics"]) == ["loss", "acc"]
    assert rec["metrics"] == {"loss": 3.0, "acc": 2.0}  # a scalar named "loss" cannot shadow it
    assert rec["duration_secs"] == 2.0
    assert rec["elapsed_secs"] == 12.5
    assert rec["eta_secs"] == pytest.approx((4.0 + 2.0) / 2 * 3)
    assert rec["missing_ranks"] == [1, 3]
    assert [g["device_index"] for g in rec["gpu_metrics"]] == [0, 2]
    assert list(rec["resources"]) == list(agg.SAMPLE_KEYS) + ["gpus"]


def test_record_total_epochs_none_when_unknown() -> None:
    rec = agg.epoch_record(
        epoch=0, world_size=1, reports={0: met(0)}, samples={}, hosts=[], gpus={},
        total_epochs=None, past_durations=[], elapsed_secs=0.0,
    )
    assert rec["total_epochs"] is None and rec["eta_secs"] is None


def test_sample_dict_has_every_key() -> None:
    d = agg.sample_dict(ResourceSample(cpu_percent=1.0, gpus=[gpu()]))
    assert list(d) == list(agg.SAMPLE_KEYS) + ["gpus"]
    # the ranks array carries every GpuSample field, the v3 health fields included (PROTOCOL 4)
    assert list(d["gpus"][0]) == list(GpuSample.__struct_fields__)
    assert list(d["gpus"][0])[: len(agg.GPU_KEYS)] == list(agg.GPU_KEYS)
    assert "throttle_reasons" in d["gpus"][0]


def test_record_does_not_depend_on_report_order() -> None:
    # Naive left-to-right sums of these differ by order; the record must not.
    losses = [1e16, 1.0, -1e16, 3.0]
    frames = [met(r, loss, b=1, scalars={"x": (loss, 1)}) for r, loss in enumerate(losses)]
    results = set()
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [0, 2, 1, 3]):
        gathered = agg.EpochReports()
        for r in order:
            gathered.put(r, frames[r])
        results.add((gathered.loss(), gathered.scalar_means()["x"]))
    assert results == {(1.0, 1.0)}


def test_infinite_losses_of_both_signs_make_nan() -> None:
    assert math.isnan(loss_of([met(0, math.inf), met(1, -math.inf)]))
    assert loss_of([met(0, math.inf), met(1, 1.0)]) == math.inf


def test_epoch_reports_pop_forgets_everything_of_the_rank() -> None:
    gathered = agg.EpochReports()
    gathered.put(0, met(0, 1.0, b=1, epoch_ms=10.0, scalars={"x": (1.0, 1)}))
    gathered.put(1, met(1, 9.0, b=1, epoch_ms=99.0, scalars={"x": (5.0, 1), "y": (1.0, 1)}))
    assert 1 in gathered and gathered.pop(1) is not None and 1 not in gathered
    assert (gathered.loss(), gathered.scalar_means(), gathered.epoch_ms()) == (1.0, {"x": 1.0}, 10.0)
    assert gathered.pop(1) is None
