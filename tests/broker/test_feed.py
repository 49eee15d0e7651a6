"""The broker -> web feed codec: round trips and malformed messages."""
from __future__ import annotations

import math
import subprocess
import sys

import msgspec
import pytest

from broker import feed
from broker.run.sink import Event


def test_event_round_trip_keeps_nan_none_and_nesting() -> None:
    record = {"epoch": 3, "metrics": {"loss": float("nan"), "acc": 0.5}, "eta_secs": None,
              "gpus": [{"device_index": 0, "name": "h:lr=0 gr=0 A100"}]}
    parts = feed.encode_event("run-1.a:b", Event(7, "epoch", record))
    assert parts[0] == b"r:run-1.a:b"
    update = feed.decode_update(parts)
    assert isinstance(update, feed.EventUpdate)
    assert (update.run, update.seq, update.kind) == ("run-1.a:b", 7, "epoch")
    assert math.isnan(update.data["metrics"]["loss"])
    assert update.data["eta_secs"] is None
    assert update.data["gpus"] == record["gpus"]


def test_event_encodes_tuples_as_lists() -> None:
    update = feed.decode_update(feed.encode_event("r", Event(1, "complete", {"x": (1, "ok")})))
    assert update is not None and update.data == {"x": [1, "ok"]}


def test_heartbeat_round_trip() -> None:
    parts = feed.encode_heartbeat("abc", 12.5, 10, {"decode": 2, "schema": 1}, 3, late_metrics=4)
    assert parts[0] == feed.TOPIC_HEARTBEAT
    hb = feed.decode_update(parts)
    assert hb == feed.Heartbeat("abc", 12.5, 10, {"decode": 2, "schema": 1}, 4, 3)


def test_heartbeat_without_late_metrics_reads_zero() -> None:
    body = msgspec.msgpack.encode({"instance": "i", "time": 1.0, "accepted": 0, "rejected": {},
                                   "runs": 0})
    hb = feed.decode_update([feed.TOPIC_HEARTBEAT, body])
    assert isinstance(hb, feed.Heartbeat) and hb.late_metrics == 0


def test_port_round_trip() -> None:
    parts = feed.encode_port("r1", 3, 8585)
    assert parts[0] == b"!port"
    assert feed.decode_update(parts) == feed.PortUpdate("r1", 3, 8585)


def test_unknown_bang_topic_is_ignored() -> None:
    assert feed.decode_update([b"!future", msgspec.msgpack.encode({"x": 1})]) is None


@pytest.mark.parametrize(
    "parts",
    [
        [b"r:x"],
        [b"r:x", b"\xc1"],
        [b"r:x", msgspec.msgpack.encode({"seq": 1})],
        [b"r:x", msgspec.msgpack.encode([1, 2])],
        [b"!hb", msgspec.msgpack.encode({"instance": "i"})],
        [b"!port", msgspec.msgpack.encode({"run": "r", "rank": "x", "port": 1})],
        [b"r:x", b"", b"extra"],
    ],
)
def test_malformed_updates_raise_feed_error(parts: list[bytes]) -> None:
    with pytest.raises(feed.FeedError):
        feed.decode_update(parts)


def test_snapshot_request_round_trip() -> None:
    assert feed.encode_snapshot_request() == [b"SNAP"]
    assert feed.decode_snapshot_request(feed.encode_snapshot_request()) is None
    assert feed.decode_snapshot_request(feed.encode_snapshot_request("r1")) == "r1"
    for bad in ([], [b"SNAPX"], [b"SNAP", b"a", b"b"], [b"SNAP", b"\xff"]):
        with pytest.raises(feed.FeedError):
            feed.decode_snapshot_request(bad)


def test_snapshot_reply_round_trip() -> None:
    snap = {"run": "r1", "seq": 9, "header": {"run": "r1"}, "ranks": [],
            "records": [[4, {"epoch": 0}]], "complete": [9, "complete"]}
    assert feed.decode_snapshot_reply(feed.encode_run_snapshot(snap)) == ("RUN", snap)
    assert feed.decode_snapshot_reply(feed.encode_snapshot_end("inst", 1)) == (
        "END", {"instance": "inst", "runs": 1})
    for bad in ([b"RUN"], [b"NOPE", b"\x80"], [b"RUN", b"\xc1"], [b"END", b"\x01"]):
        with pytest.raises(feed.FeedError):
            feed.decode_snapshot_reply(bad)


def test_feed_imports_only_msgspec() -> None:
    code = ("import sys; import broker.feed; "
            "bad = [m for m in ('zmq', 'gevent', 'flask', 'broker.run.sink', 'rank_agent') "
            "if m in sys.modules]; sys.exit(repr(bad) if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_heartbeat_v3_fields_round_trip_and_default_for_an_older_broker() -> None:
    import msgspec

    beat = feed.decode_update(feed.encode_heartbeat(
        "i", 1.0, 2, {"schema": 1}, 3, webhooks_sent=4, webhooks_failed=5, webhooks_dropped=6,
        journal={"early_flushes": 7, "dropped_bytes": 8, "damaged_entries": 9,
                 "runs_not_loaded": 10}))
    assert isinstance(beat, feed.Heartbeat)
    assert (beat.webhooks_sent, beat.webhooks_failed, beat.webhooks_dropped) == (4, 5, 6)
    assert beat.journal == {"early_flushes": 7, "dropped_bytes": 8, "damaged_entries": 9,
                            "runs_not_loaded": 10}
    # a broker from before v3 sends none of them
    old = {"instance": "i", "time": 1.0, "accepted": 2, "rejected": {}, "late_metrics": 0,
           "runs": 3}
    beat = feed.decode_update([feed.TOPIC_HEARTBEAT, msgspec.msgpack.encode(old)])
    assert isinstance(beat, feed.Heartbeat)
    assert (beat.webhooks_sent, beat.webhooks_failed, beat.webhooks_dropped, beat.journal) == (0, 0, 0, {})
