"""Issue 32, finding 5 on the web: a big run's ``ranks`` events carry an entry's hardware
only when it changed, at most ``HARDWARE_EVENT_CHARS`` of it an event, so no ``ranks``
event outgrows a client's queue (20,480 ranks x 4 KB dropped every viewer)."""
from __future__ import annotations

import json
from typing import Any

from tests.web.test_hub import drain, ev, ready_hub
from web.runstate import HARDWARE_EVENT_CHARS

RUN = "r1"


def ranks(n: int, hw: str, **changed: str) -> list[dict[str, Any]]:
    return [{"rank": r, "host": "h", "status": "ok", "hardware": changed.get(f"r{r}", hw)}
            for r in range(n)]


def events(sub: Any) -> list[Any]:
    out = []
    for _, data in drain(sub):
        body = data.decode().split("data: ", 1)[1]
        out.append((len(data), json.loads(body.replace("\ndata: ", "\n"))))
    return out


def test_a_small_run_carries_every_hardware_string() -> None:
    hub = ready_hub()
    sub, _, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
    hub.handle_pub(ev(2, "ranks", ranks(4, "cpu | gpu")))
    hub.handle_pub(ev(3, "ranks", ranks(4, "cpu | gpu")))
    for _, payload in events(sub):
        assert [r["hardware"] for r in payload] == ["cpu | gpu"] * 4


def test_a_big_run_sends_hardware_once_within_the_event_bound() -> None:
    hub = ready_hub()
    sub, _, _ = hub.subscribe(RUN, 0)  # type: ignore[misc]
    n, hw = 2048, "x" * 4000  # 8 MB of hardware an event, unbounded
    per_event = HARDWARE_EVENT_CHARS // len(hw)
    seq = 2
    seen: dict[int, str] = {}
    for _ in range(n // per_event + 2):
        hub.handle_pub(ev(seq, "ranks", ranks(n, hw)))
        seq += 1
        ((size, payload),) = events(sub)
        assert size < HARDWARE_EVENT_CHARS + 512 * 1024
        assert len(payload) == n  # every rank listed, every time
        for r in payload:
            if "hardware" in r:
                assert r["rank"] not in seen  # never sent twice
                seen[r["rank"]] = r["hardware"]
    assert len(seen) == n  # all of it went out, spread over events
    hub.handle_pub(ev(seq, "ranks", ranks(n, hw, r7="changed")))
    ((_, payload),) = events(sub)
    assert [r["rank"] for r in payload if "hardware" in r] == [7]
    snap = hub.runs[RUN].ranks
    assert all("hardware" in r for r in snap)  # /api/runs keeps every string
