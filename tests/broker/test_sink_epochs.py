"""Epochs at the sink (PROTOCOL.md 2.3), driven with frames and a fake clock: when an epoch
closes, late and duplicate reports, its alerts and figures, and the resources its record
carries."""
from __future__ import annotations

import math

import msgspec
import pytest

from broker.run.sink import RunSink
from rank_agent.protocol import (
    GpuSample,
    ResourceSample,
)
from tests.support.sinkframes import (
    RUN,
    fin,
    kinds,
    met,
    of_kind,
    reg,
    registered,
    res,
)

# ---------------------------------------------------------------- epochs


def test_epoch_closes_when_every_rank_reported() -> None:
    sink = registered(2, hosts=["a", "b"])
    sink.apply(reg(0, 2, "a", total_epochs=4), 0.0)
    assert sink.apply(met(0, 0, loss=1.0, b=1, samples=10, epoch_ms=500.0), 10.0) == []
    events = sink.apply(met(1, 0, loss=4.0, b=3, samples=30, epoch_ms=1000.0), 11.0)
    # The registers' coalesced header first (no tick ran), then the record, then the
    # header again for status waiting -> training.
    assert kinds(events) == ["run", "epoch", "run"]
    assert events[0].data["total_epochs"] == 4 and events[0].data["status"] == "waiting"
    record = events[1].data
    assert record["epoch"] == 0 and record["total_epochs"] == 4
    assert record["metrics"] == {"loss": pytest.approx(3.25)}
    assert record["duration_secs"] == 1.0
    assert record["elapsed_secs"] == 11.0
    assert record["eta_secs"] == pytest.approx(1.0 * 3)
    assert record["missing_ranks"] == []
    assert [g["throughput"] for g in record["gpu_metrics"]] == [0.02, 0.03]
    assert events[2].data["status"] == "training" and sink.status == "training"


def test_duplicate_metrics_before_close_last_write_wins() -> None:
    sink = registered(2)
    sink.apply(met(0, 0, loss=100.0, b=5, samples=9, epoch_ms=9000.0,
                   scalars={"acc": (9.0, 1), "gone": (1.0, 1)}), 1.0)
    sink.apply(met(0, 0, loss=2.0, scalars={"acc": (1.0, 1)}), 2.0)
    (record,) = of_kind(sink.apply(met(1, 0, loss=4.0, scalars={"acc": (3.0, 1)}), 3.0), "epoch")
    assert record["metrics"] == {"loss": 3.0, "acc": 2.0}  # nothing of the first report left
    assert record["duration_secs"] == 0.0
    assert [g["chunk_ratio"] for g in record["gpu_metrics"]] == [0.5, 0.5]
    assert sink.late_metrics == 0


def test_duplicate_metrics_after_close_is_late_but_resources_apply() -> None:
    sink = registered(2)
    sink.apply(met(0, 0), 1.0)
    sink.apply(met(1, 0), 1.0)
    events = sink.apply(met(0, 0, loss=50.0, resources=ResourceSample(cpu_percent=42.0)), 2.0)
    assert events == [] and sink.late_metrics == 1
    assert len(sink.records) == 1 and sink.records[0]["metrics"]["loss"] == 1.0
    assert sink.ranks()[0]["resources"]["cpu_percent"] == 42.0
    assert sink.ranks()[0]["loss"] == 1.0  # the dropped frame is not the rank's loss either
    # An epoch at or below the last closed one is late too, even one nobody sent before.
    sink.apply(met(0, 2), 3.0)
    sink.apply(met(1, 2), 3.0)
    sink.apply(met(1, 1), 4.0)
    assert sink.late_metrics == 2


def test_incomplete_epochs_force_closed_by_a_later_complete_one_in_order() -> None:
    sink = registered(3)
    sink.apply(met(0, 0, loss=1.0), 1.0)  # epoch 0: rank 0 only
    sink.apply(met(1, 1, loss=2.0), 1.0)  # epoch 1: rank 1 only
    sink.apply(met(0, 2), 2.0)
    sink.apply(met(1, 2), 2.0)
    events = sink.apply(met(2, 2), 3.0)  # epoch 2 complete: 0 and 1 close first
    records = of_kind(events, "epoch")
    assert [r["epoch"] for r in records] == [0, 1, 2]
    assert [r["missing_ranks"] for r in records] == [[1, 2], [0, 2], []]
    assert records[0]["metrics"]["loss"] == 1.0 and records[1]["metrics"]["loss"] == 2.0
    assert [e.seq for e in events if e.kind == "epoch"] == sink.record_seqs


def test_epoch_after_a_later_one_closed_is_late() -> None:
    sink = registered(2)
    sink.apply(met(0, 0), 1.0)
    sink.apply(met(0, 1), 1.0)
    sink.apply(met(1, 1), 1.0)  # closes 0 (missing rank 1) and 1
    sink.apply(met(1, 0), 2.0)
    assert sink.late_metrics == 1 and len(sink.records) == 2


def test_finishing_rank_lets_pending_epoch_close() -> None:
    sink = registered(3)
    sink.apply(met(0, 0), 1.0)
    sink.apply(met(1, 0), 1.0)
    events = sink.apply(fin(2), 2.0)
    (record,) = of_kind(events, "epoch")
    assert record["missing_ranks"] == [2]  # finished, but sent nothing for epoch 0
    # A finished rank is not waited for any more...
    assert of_kind(sink.apply(met(0, 1), 3.0), "epoch") == []
    assert of_kind(sink.apply(met(1, 1), 3.0), "epoch")[0]["missing_ranks"] == [2]


def test_finished_rank_report_counts_but_is_not_waited_for() -> None:
    sink = registered(2)
    sink.apply(met(0, 0, loss=2.0), 1.0)
    sink.apply(fin(0), 1.0)  # rank 0 is done; its epoch-0 report still counts
    (record,) = of_kind(sink.apply(met(1, 0, loss=4.0), 2.0), "epoch")
    assert record["metrics"]["loss"] == 3.0 and record["missing_ranks"] == []


def test_no_close_before_world_size_known() -> None:
    sink = RunSink(RUN)
    sink.apply(met(0, 0), 1.0)
    sink.apply(met(0, 1), 1.0)
    assert sink.records == []
    events = sink.apply(reg(0, 1), 2.0)
    assert [r["epoch"] for r in of_kind(events, "epoch")] == [0, 1]


def test_nan_loss_stays_nan_and_raises_alert() -> None:
    sink = registered(2)
    sink.tick(0.0)  # the registers' (coalesced) header goes out
    sink.apply(met(0, 3, loss=math.nan), 1.0)
    events = sink.apply(met(1, 3, loss=1.0), 2.0)
    (record,) = of_kind(events, "epoch")
    assert math.isnan(record["metrics"]["loss"])
    (alert,) = of_kind(events, "run")[0]["alerts"]
    assert alert["kind"] == "nonfinite_loss" and alert["rank"] is None and alert["at"] == 2.0
    assert "3" in alert["message"]
    assert math.isnan(sink.ranks()[0]["loss"])


def test_finite_loss_raises_no_alert() -> None:
    sink = registered(1)
    sink.apply(met(0, 0, loss=1e300), 1.0)
    assert sink.header()["alerts"] == []


def test_zero_batches() -> None:
    sink = registered(2)
    sink.apply(met(0, 0, loss=5.0, b=0, samples=8, epoch_ms=4.0, scalars={"acc": (1.0, 1)}), 1.0)
    (record,) = of_kind(sink.apply(met(1, 0, loss=7.0, b=0, scalars={"acc": (3.0, 1)}), 1.0), "epoch")
    assert record["metrics"] == {"loss": 0.0, "acc": 2.0}
    assert [g["chunk_ratio"] for g in record["gpu_metrics"]] == [0.5, 0.5]
    assert [g["throughput"] for g in record["gpu_metrics"]] == [2.0, 0.0]


def test_eta_and_elapsed_over_epochs() -> None:
    sink = RunSink(RUN)
    sink.apply(reg(0, 1, total_epochs=3), 100.0)
    sink.apply(met(0, 0, epoch_ms=2000.0), 110.0)
    rec1 = of_kind(sink.apply(met(0, 1, epoch_ms=4000.0), 120.0), "epoch")[0]
    assert rec1["elapsed_secs"] == 20.0 and rec1["eta_secs"] == pytest.approx(3.0)
    rec2 = of_kind(sink.apply(met(0, 2, epoch_ms=4000.0), 130.0), "epoch")[0]
    assert rec2["eta_secs"] is None  # nothing remains


# ---------------------------------------------------------------- resources in records


def test_record_resources_use_every_ranks_latest_sample() -> None:
    sink = registered(3, hosts=["a", "a", "b"])
    sink.apply(res(0, gpu_util_percent=10.0), 1.0)  # host a's first rank: no CPU reading
    sink.apply(res(1, cpu_percent=30.0, gpu_util_percent=20.0), 1.0)
    sink.apply(res(1, cpu_percent=50.0, gpu_util_percent=40.0), 2.0)  # latest wins
    sink.apply(res(2, cpu_percent=10.0), 2.0)  # rank 2 will not report the epoch
    sink.apply(met(0, 0), 3.0)
    sink.apply(met(1, 0), 3.0)
    (record,) = of_kind(sink.apply(fin(2), 4.0), "epoch")
    assert record["missing_ranks"] == [2]
    assert record["resources"]["cpu_percent"] == 30.0  # (a: 50 from rank 1, b: 10) / 2
    assert record["resources"]["gpu_util_percent"] == 25.0
    assert [g["device_index"] for g in record["gpu_metrics"]] == [0, 1]


def test_ranks_without_samples_and_without_any_sample() -> None:
    sink = registered(2)
    sink.apply(met(0, 0), 1.0)
    (record,) = of_kind(sink.apply(met(1, 0), 1.0), "epoch")
    assert record["resources"] == {
        "cpu_percent": None, "ram_used_bytes": None, "ram_total_bytes": None,
        "gpu_util_percent": None, "vram_allocated_bytes": None, "vram_total_bytes": None, "gpus": [],
    }
    assert sink.ranks()[0]["resources"] is None


def test_gpus_relabelled_including_unknown_host_and_later_register() -> None:
    sink = RunSink(RUN)
    sink.apply(reg(1, 3, "node-b", lr=2), 0.0)
    gpu = [GpuSample(device_index=0, name="H100", util_percent=5.0)]
    sink.apply(res(0, gpus=gpu), 1.0)  # rank 0 has not registered: no host
    sink.apply(res(1, gpus=gpu + [GpuSample(device_index=1, name="second")]), 1.0)
    sink.apply(res(2, cpu_percent=1.0), 1.0)  # no GPU: no entry
    sink.apply(met(0, 0), 2.0)
    sink.apply(met(1, 0), 2.0)
    (record,) = of_kind(sink.apply(met(2, 0), 2.0), "epoch")
    gpus = record["resources"]["gpus"]
    assert [(g["device_index"], g["name"]) for g in gpus] == [(0, "gr=0 H100"), (1, "node-b:lr=2 gr=1 H100")]
    assert all(list(g) == ["device_index", "name", "util_percent", "vram_allocated_bytes",
                           "vram_total_bytes", "temperature_c", "power_w"] for g in gpus)
    assert sink.ranks()[1]["resources"]["gpus"][0]["name"] == "H100"  # ranks keep the raw sample
    # Registering relabels the rank's GPU for the next record.
    sink.apply(reg(0, 3, "node-a", lr=0), 3.0)
    sink.apply(met(0, 1), 4.0)
    sink.apply(met(1, 1), 4.0)
    (record,) = of_kind(sink.apply(met(2, 1), 4.0), "epoch")
    assert record["resources"]["gpus"][0]["name"] == "node-a:lr=0 gr=0 H100"


def test_records_do_not_change_after_the_fact() -> None:
    sink = registered(1)
    sink.apply(res(0, cpu_percent=1.0, gpus=[GpuSample(device_index=0, name="g")]), 1.0)
    (record,) = of_kind(sink.apply(met(0, 0), 1.0), "epoch")
    frozen = msgspec.msgpack.encode(record)
    sink.apply(res(0, cpu_percent=2.0, gpus=[GpuSample(device_index=0, name="h")]), 2.0)
    sink.apply(reg(0, 1, "elsewhere"), 2.0)
    sink.apply(met(0, 1), 3.0)
    assert msgspec.msgpack.encode(sink.records[0]) == frozen
