"""Web replicas: two independent ``rankboard web`` processes on different ports, fed by one
broker (as webs on different hosts would be), serve the same records with the same ids."""
from __future__ import annotations

from typing import Any, Callable

from tests.support.brokers import Pusher
from tests.support.http import SSEClient, fetch, get_json
from tests.support.polling import wait_for
from tests.support.pool import assert_increasing_ids, epoch_events
from tests.support.procs import Proc, start_web


def test_two_webs_on_one_broker_serve_identical_streams(
        spawn: Callable[..., Proc], broker: Any, pusher: Pusher) -> None:
    webs = [start_web(spawn, broker), start_web(spawn, broker)]
    ports = [w.port for w in webs]
    assert ports[0] != ports[1] and None not in ports
    pusher.register("replica", 0, 1)
    pusher.epoch("replica", 0, 1)
    for port in ports:
        wait_for(lambda port=port: (r := fetch(port, "/api/runs/replica/history")).status == 200
                 and len(r.json()) == 1, what=f"the first record on {port}")

    streams = [SSEClient(port, "/api/runs/replica/events") for port in ports]
    try:
        for epoch in range(1, 8):
            pusher.epoch("replica", epoch, 1, loss=0.5 ** epoch)
        got = [s.events_until(lambda ev: ev["event"] == "epoch" and ev["data"]["epoch"] == 7)
               for s in streams]
    finally:
        for s in streams:
            s.close()
    for events in got:
        assert_increasing_ids(events)
    assert [e for _, e, _ in epoch_events(got[0])] == list(range(8))
    assert epoch_events(got[0]) == epoch_events(got[1])
    # and after the fact: the same history, the same header ids on a resumed stream
    assert get_json(ports[0], "/api/runs/replica/history") == get_json(
        ports[1], "/api/runs/replica/history")
    resume_at = epoch_events(got[0])[3][0]
    for port in ports:
        with SSEClient(port, "/api/runs/replica/events",
                       {"Last-Event-ID": str(resume_at)}) as again:
            events = again.events_until(lambda ev: ev["event"] == "epoch"
                                        and ev["data"]["epoch"] == 7)
        assert int(events[0]["id"]) == resume_at
        assert [e for _, e, _ in epoch_events(events)] == [4, 5, 6, 7]
