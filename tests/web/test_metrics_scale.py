"""Issue 32, finding 4: ``/metrics`` is built off the web's event loop, its per-rank and
per-GPU series bounded (web/scrape.py, web/metricsranks.py)."""
from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest

from tests.support import scrapeprobe
from tests.web.test_metrics_gpu import entry, health_gpu, scrape
from web import metricsranks


def series(text: str, family: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(family + "{")]


def test_healthz_answers_promptly_while_a_large_scrape_runs() -> None:
    """32,768 ranks: unbounded and on the loop, the scrape held /healthz for seconds."""
    proc, port = scrapeprobe.start(32768)
    try:
        out = scrapeprobe.probe(port)
    finally:
        scrapeprobe.stop(proc)
    assert out["status"] == 200
    assert 'rankboard_run_ranks{run="big",status="ok"} 32768.0' in out["text"]
    assert out["healthz_s"], "no probe answered while the scrape ran"
    assert max(out["healthz_s"]) < 0.5, out["healthz_s"]


def many(n: int, gpus: int = 1, **gpu_fields: Any) -> list[dict[str, Any]]:
    ranks = []
    for r in range(n):
        e = entry([health_gpu(i) for i in range(gpus)])
        e["rank"] = r
        ranks.append(e)
    return ranks


def test_every_rank_and_gpu_has_series_under_the_caps() -> None:
    text = scrape(many(8, gpus=2))
    assert len(series(text, "rankboard_rank_cpu_percent")) == 8
    assert len(series(text, "rankboard_gpu_sm_clock_mhz")) == 16
    assert 'rankboard_metrics_omitted{kind="ranks"} 0.0' in text


def test_past_the_rank_cap_only_notable_ranks_have_series(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metricsranks, "MAX_RANK_SERIES", 4)
    ranks = many(10)
    ranks[2]["status"] = "stale"
    ranks[5]["status"] = "stalled"
    ranks[6]["resources"]["gpus"][0]["throttle_reasons"] = ["hw_thermal"]
    ranks[8]["gpu_xids"] = [{"gpu": 0, "count": 2, "last": 79}]
    ranks[9]["status"] = "stale"  # notable, but past the cap of 4
    text = scrape(ranks)
    assert sorted(line.split('rank="')[1].split('"')[0]
                  for line in series(text, "rankboard_rank_cpu_percent")) == ["2", "5", "6", "8"]
    assert 'rankboard_metrics_omitted{kind="ranks"} 6.0' in text
    assert 'rankboard_run_ranks{run="r1",status="ok"} 7.0' in text
    assert 'rankboard_run_ranks{run="r1",status="stale"} 2.0' in text
    assert 'rankboard_run_rank_stat{field="cpu",run="r1",stat="mean"} 1.0' in text
    assert 'rankboard_run_gpus{health="unhealthy",run="r1"} 1.0' in text
    assert 'rankboard_run_gpus{health="healthy",run="r1"} 9.0' in text
    assert 'rankboard_run_gpu_xid_errors_total{run="r1"} 2.0' in text


def test_past_the_gpu_cap_only_unhealthy_gpus_have_series(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metricsranks, "MAX_GPU_SERIES", 8)
    ranks = many(2, gpus=8)  # 16 GPUs > 8
    ranks[1]["rank"] = 3
    ranks[1]["resources"]["gpus"][3]["ecc_uncorrected"] = 1
    ranks[0]["gpu_xids"] = [{"gpu": 5, "count": 1, "last": 48}]
    text = scrape(ranks)
    gpus = sorted((line.split('rank="')[1][0], line.split('gpu="')[1][0])
                  for line in series(text, "rankboard_gpu_ecc_uncorrected"))
    assert gpus == [("0", "5"), ("3", "3")]  # (rank, gpu): the XID one and the ECC one
    assert 'rankboard_metrics_omitted{kind="gpus"} 14.0' in text
    assert len(series(text, "rankboard_rank_cpu_percent")) == 2  # ranks are under their cap


def test_hostile_gpus_per_rank_stay_bounded() -> None:
    """1,024 ranks x 64 GPUs (65,536 GPUs) past the caps: only aggregates remain."""
    text = scrape(many(1024, gpus=64))
    assert len(series(text, "rankboard_gpu_sm_clock_mhz")) == 0
    assert 'rankboard_run_gpus{health="healthy",run="r1"} 65536.0' in text
    assert len(text) < 1024 * 1024  # unbounded: ~1.1 million GPU series, ~150 MiB


def test_a_direct_generate_latest_reads_the_hub_now() -> None:
    """Tests and tools that call generate_latest(make_registry(hub)) get a fresh view."""
    from tests.web.test_metrics_gpu import ev, ready_hub
    from web.metrics import make_registry
    hub = ready_hub()
    registry = make_registry(hub)
    assert "rankboard_rank_cpu_percent{" not in generate_latest(registry).decode()
    hub.handle_pub(ev(2, "ranks", many(1)))
    assert "rankboard_rank_cpu_percent{" in generate_latest(registry).decode()
