"""Issue 32, finding 5 on the web: a ``ranks`` event is bounded in bytes, samples included
(``web/ranksbound.py``). A small run's events are what they always were, byte for byte; a
big run's carry each rank's sample only when it changed, in rotation within a byte room, and
every sample still reaches a page that keeps what it has (``web/static/store.js``)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from tests.web.test_hub import drain, ev, ready_hub
from web import ranksbound, sse
from web.runstate import public_rank

RUN = "r1"


def gpu(i: int, util: float = 0.0) -> dict[str, Any]:
    return {"device_index": i, "name": "NVIDIA H100 80GB HBM3", "util_percent": util,
            "vram_allocated_bytes": 71_234_567_890 + i, "vram_total_bytes": 85_520_809_984,
            "temperature_c": 41.0, "power_w": 118.25, "sm_clock_mhz": 1980.0,
            "throttle_reasons": [], "xid_errors": [], "ecc_uncorrected": 0,
            "remapped_rows_pending": False, "remapped_rows_failed": False, "pcie_link_gen": 5,
            "pcie_link_gen_max": 5, "pcie_link_width": 16, "pcie_link_width_max": 16,
            "nvlink_errors": 0}


def entries(n: int, gpus: int = 8, **utils: float) -> list[dict[str, Any]]:
    """``n`` ranks with an 8-GPU sample each (``r<N>=util``: that rank's GPU 0 busy)."""
    return [{"rank": r, "host": f"node-{r // 8}", "local_rank": r % 8, "status": "ok",
             "last_seen": 5.0, "epoch": 1, "hardware": "cpu | gpu",
             "resources": {"cpu_percent": 10.0, "ram_used_bytes": 1, "ram_total_bytes": 2,
                           "gpu_util_percent": None, "vram_allocated_bytes": None,
                           "vram_total_bytes": None,
                           "gpus": [gpu(i, utils.get(f"r{r}", 0.0) if i == 0 else 0.0)
                                    for i in range(gpus)]},
             "step": None, "step_ms": None, "data_ms": None, "slowest_share": None}
            for r in range(n)]


def events(sub: Any) -> list[tuple[int, list[Any]]]:
    out = []
    for _, data in drain(sub):
        body = data.decode().split("data: ", 1)[1]
        out.append((len(data), json.loads(body)))
    return out


def test_a_small_run_gets_the_whole_array_byte_for_byte() -> None:
    hub = ready_hub()
    sub, _, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
    for seq in (2, 3):
        hub.handle_pub(ev(seq, "ranks", entries(64)))
        ((_, data),) = drain(sub)
        assert data == sse.json_event("ranks", seq, [public_rank(r) for r in entries(64)])


@pytest.fixture
def small_bound(monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """The bounds scaled down 48 times: a few hundred ranks behave as 65,536 would."""
    event, room = 256 * 1024, 40 * 1024
    monkeypatch.setattr(ranksbound, "RANKS_EVENT_BYTES", event)
    monkeypatch.setattr(ranksbound, "RESOURCES_EVENT_BYTES", room)
    return event, room


def test_a_big_run_rotates_its_samples_within_the_event_bound(
        small_bound: tuple[int, int]) -> None:
    event_bytes, room = small_bound
    hub = ready_hub()
    sub, _, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
    n = 512  # ~2 MiB of samples an event unbounded
    whole = len(sse.json_event("ranks", 2, entries(n)))
    assert whole > 6 * event_bytes
    page: dict[int, Any] = {}  # what the page holds (store.js keeps an absent key's value)
    carried: dict[int, int] = {}
    seq = 2
    for _ in range(40):
        hub.handle_pub(ev(seq, "ranks", entries(n)))
        seq += 1
        ((size, payload),) = events(sub)
        assert size <= event_bytes + 1024  # aimed at the bound, base measured
        assert [r["rank"] for r in payload] == list(range(n))  # every rank, every time
        for r in payload:
            if "resources" in r:
                carried[r["rank"]] = carried.get(r["rank"], 0) + 1
                page[r["rank"]] = r["resources"]
        if len(page) == n:
            break
    assert len(page) == n  # every sample arrived, spread over events
    assert set(carried.values()) == {1}  # none carried twice while unchanged
    assert page == {r["rank"]: r["resources"] for r in entries(n)}
    # one rank's sample changes: the next event carries that one only
    hub.handle_pub(ev(seq, "ranks", entries(n, r7=93.0)))
    ((_, payload),) = events(sub)
    assert [r["rank"] for r in payload if "resources" in r] == [7]
    assert payload[7]["resources"]["gpus"][0]["util_percent"] == 93.0
    assert all("resources" in r for r in hub.runs[RUN].ranks)  # /api/runs keeps every one


def test_changing_samples_rotate_least_recently_carried_first(
        small_bound: tuple[int, int]) -> None:
    """Active ranks change every second: each event carries the samples carried longest
    ago, so every rank's sample on the page is refreshed within a few events."""
    hub = ready_hub()
    sub, _, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
    n = 512
    last: dict[int, int] = {}
    for seq in range(2, 40):
        util = float(seq)  # every rank's sample differs from the event before
        hub.handle_pub(ev(seq, "ranks", entries(n, **{f"r{r}": util for r in range(n)})))
        ((_, payload),) = events(sub)
        for r in payload:
            if "resources" in r:
                assert r["resources"]["gpus"][0]["util_percent"] == util  # the latest
                last[r["rank"]] = seq
    assert len(last) == n
    stalest = 39 - min(last.values())
    assert stalest <= 12  # 512 samples of ~4 KB, ~48 a bounded event: a full turn each ~11


def test_a_run_whose_samples_shrink_gets_whole_events_again(
        small_bound: tuple[int, int]) -> None:
    hub = ready_hub()
    sub, _, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
    hub.handle_pub(ev(2, "ranks", entries(512)))
    ((_, payload),) = events(sub)
    assert not all("resources" in r for r in payload)
    hub.handle_pub(ev(3, "ranks", entries(512, gpus=0)))  # ~70 KiB of samples now
    hub.handle_pub(ev(4, "ranks", entries(512, gpus=0)))
    (_, _), (_, payload) = events(sub)
    assert all("resources" in r for r in payload)

