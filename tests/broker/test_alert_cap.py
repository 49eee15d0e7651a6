"""Issue 32, finding 5: a run's alert list is capped per kind (the latest
``MAX_ALERTS_PER_KIND`` and a count) and each message in length, so no ``run`` event grows
past what an SSE client may queue."""
from __future__ import annotations

from broker.run.alerts import MAX_ALERT_MESSAGE, MAX_ALERTS_PER_KIND, RunAlerts


def nowhere(rank: int) -> None:
    return None


def test_the_list_keeps_the_latest_per_kind_and_a_count() -> None:
    alerts = RunAlerts()
    for r in range(1000):
        alerts.raise_("r", "stalled", r, f"stalled 70s in {'x' * 4000}", float(r), nowhere, False)
    alerts.raise_("r", "stale", 5, "rank 5 silent", 1.0, nowhere, False)
    alerts.raise_("r", "stalled", 3, "stalled again", 2000.0, nowhere, False)  # back in, newest
    listed = alerts.listed()
    stalled = [a for a in listed if a["kind"] == "stalled" and a["rank"] is not None]
    assert len(stalled) == MAX_ALERTS_PER_KIND
    assert {a["rank"] for a in stalled} == {3, *range(901, 1000)}
    assert [a for a in listed if a["kind"] == "stale"] == [
        {"kind": "stale", "rank": 5, "message": "rank 5 silent", "at": 1.0, "host": None}]
    (summary,) = [a for a in listed if a["rank"] is None]
    assert summary["message"] == "1001 stalled alerts raised, the latest 100 listed"
    assert summary["at"] == 2000.0
    assert all(len(a["message"]) <= MAX_ALERT_MESSAGE for a in listed)
    assert stalled[0]["message"].endswith("…")


def test_a_re_raise_updates_in_place_without_counting_again() -> None:
    alerts = RunAlerts()
    for _ in range(500):
        alerts.raise_("r", "gpu_xid", 1, "XID 79 on GPU 0", 1.0, nowhere, False)
    assert alerts.listed() == [{"kind": "gpu_xid", "rank": 1, "message": "XID 79 on GPU 0",
                                "at": 1.0, "host": None}]
