"""BrokerServer over real loopback sockets (ephemeral ports): PUSH in, SUB + DEALER out."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import zmq

from broker import feed
from broker.server import BindError, BrokerServer, DataDirError, is_loopback_endpoint
from rank_agent import protocol
from tests.support.brokers import LOOPBACK_ANY, FeedClient, RunningBroker
from tests.support.frames import enc, finish, metrics, register
from tests.support.polling import wait_for


def _heartbeat(pred: Callable[[feed.Heartbeat], bool]) -> Callable[[feed.Update], bool]:
    return lambda u: isinstance(u, feed.Heartbeat) and pred(u)


def test_constructor_does_no_io_and_bind_reports_real_ports(ctx: zmq.Context) -> None:
    taken = ctx.socket(zmq.PULL)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        server = BrokerServer(f"tcp://127.0.0.1:{port}", LOOPBACK_ANY, LOOPBACK_ANY)  # no raise
        server.close()
    finally:
        taken.close(linger=0)
    with BrokerServer(LOOPBACK_ANY, LOOPBACK_ANY, LOOPBACK_ANY) as server:
        eps = server.bind()
        assert set(eps) == {"ingest", "publish", "snapshot"}
        for ep in eps.values():
            assert ep.startswith("tcp://127.0.0.1:") and not ep.endswith("*")
        assert server.bind() == eps  # idempotent


def test_frames_become_sequenced_events(broker: RunningBroker, client: FeedClient,
                                        push: zmq.Socket) -> None:
    client.until(lambda u: True, what="subscription live")
    push.send(enc(register(world_size=2, rank=0)))
    push.send(enc(register(world_size=2, rank=1, host="h1")))
    push.send(enc(metrics(rank=0)))
    push.send(enc(metrics(rank=1)))
    events = client.events("r1", until=lambda u: u.kind == "epoch")
    seqs = [u.seq for u in events]
    assert seqs == list(range(1, len(seqs) + 1))
    assert events[0].kind == "run" and events[0].data["world_size"] == 2
    assert events[-1].data["epoch"] == 0 and events[-1].data["missing_ranks"] == []


def test_late_subscriber_gets_snapshot_then_updates_without_gap_or_duplicate(
        ctx: zmq.Context, broker: RunningBroker, push: zmq.Socket) -> None:
    enough = threading.Event()
    sent = []

    def rank_stream() -> None:  # one rank training as fast as it can until told to stop
        push.send(enc(register(run="s", total_epochs=0)))
        epoch = 0
        while not enough.is_set() and epoch < 100_000:
            push.send(enc(metrics(run="s", epoch=epoch, avg_loss=1.0 / (epoch + 1))))
            sent.append(epoch)
            epoch += 1
            enough.wait(0.001)  # pacing the load, not synchronisation
        push.send(enc(finish(run="s")))

    sender = threading.Thread(target=rank_stream, daemon=True)
    sender.start()
    try:
        wait_for(lambda: (s := broker.server.runs.get("s")) is not None and len(s.records) >= 20,
                 what="stream under way")
        late = FeedClient(ctx, broker.endpoints["publish"], broker.endpoints["snapshot"])
        try:
            late.until(lambda u: True, what="subscription live")  # subscribed before SNAP
            [snap], end = late.snapshot("s")
            assert end["instance"] == broker.server.instance
            epochs = [rec["epoch"] for _, rec in snap["records"]]
            assert epochs == list(range(len(epochs))) and len(epochs) >= 20
            expect = snap["seq"] + 1
            after = 0

            def check(u: feed.EventUpdate) -> bool:
                nonlocal expect, after
                if u.seq <= snap["seq"]:
                    return False  # already in the snapshot
                assert u.seq == expect, f"gap or duplicate: got {u.seq}, expected {expect}"
                expect += 1
                if u.kind == "epoch":
                    epochs.append(u.data["epoch"])
                    after += 1
                    if after == 20:
                        enough.set()
                return u.kind == "complete"

            late.events("s", until=check, timeout=30)
        finally:
            late.close()
    finally:
        enough.set()
        sender.join(10)
    assert after >= 20
    assert epochs == list(range(len(epochs)))
    assert epochs[-1] in (sent[-1], sent[-1] - 1)  # the last epoch closes at finish


def test_bad_frames_are_counted_in_heartbeats_while_valid_ones_arrive(
        broker: RunningBroker, client: FeedClient, push: zmq.Socket) -> None:
    push.send(b"\xc1not msgpack")
    push.send(enc(register(run="ok")))
    push.send(enc({"type": "bogus", "run": "ok", "rank": 0}))
    push.send(enc(protocol.Metadata(run="ok", rank=0, json="{")))
    push.send(enc(metrics(run="ok")))
    client.events("ok", until=lambda u: u.kind == "epoch")
    hb, _ = client.until(_heartbeat(lambda h: h.accepted == 2), what="heartbeat counters")
    assert hb.rejected == {"decode": 1, "schema": 1, "bad_metadata_json": 1}
    assert hb.runs == 1 and hb.instance == broker.server.instance


def test_oversize_message_does_not_stop_the_loop(ctx: zmq.Context, broker: RunningBroker,
                                                 client: FeedClient, push: zmq.Socket) -> None:
    push.send(b"\x00" * (protocol.MAX_FRAME_BYTES + 1))  # reaches Runs: counted
    huge = ctx.socket(zmq.PUSH)
    try:
        huge.linger = 0
        huge.connect(broker.endpoints["ingest"])
        # beyond the transport cap: ZeroMQ drops it and disconnects that peer only
        huge.send(b"\x00" * (broker.server.max_message_bytes + 1))
        push.send(enc(register(run="after")))
        client.events("after", until=lambda u: u.kind == "run")
        client.until(_heartbeat(lambda h: h.rejected.get("oversize") == 1 and h.accepted == 1),
                     what="oversize counted")
    finally:
        huge.close(linger=0)
    assert broker.thread.is_alive()


def test_register_with_port_is_announced(broker: RunningBroker, client: FeedClient,
                                         push: zmq.Socket) -> None:
    # the !port message goes out once: wait until the SUB has joined (a heartbeat came
    # through), or a slow join under load loses it (ZeroMQ's slow-joiner)
    client.until(lambda u: isinstance(u, feed.Heartbeat), what="a heartbeat")
    push.send(enc(register(run="p", rank=0, world_size=2)))  # port 0: no announcement
    push.send(enc(register(run="p", rank=1, world_size=2, port=8600)))
    port, before = client.until(lambda u: isinstance(u, feed.PortUpdate), what="!port")
    assert port == feed.PortUpdate("p", 1, 8600)
    seen = [u for u in before if isinstance(u, feed.PortUpdate)]
    assert seen == []


def test_snapshot_of_all_one_and_unknown_run(broker: RunningBroker, client: FeedClient,
                                             push: zmq.Socket) -> None:
    client.dealer.send_multipart([b"WHAT"])  # ignored, and the next request is still served
    empty, end = client.snapshot()
    assert empty == [] and end == {"instance": broker.server.instance, "runs": 0}
    for run in ("a", "b"):
        push.send(enc(register(run=run)))
    wait_for(lambda: len(broker.server.runs) == 2, what="two runs")
    runs, _ = client.snapshot()
    assert sorted(s["run"] for s in runs) == ["a", "b"]
    [one], _ = client.snapshot("b")
    assert one["run"] == "b" and one["seq"] >= 1 and one["header"]["run"] == "b"
    assert client.snapshot("nope") == ([], {"instance": broker.server.instance, "runs": 0})


def test_address_in_use_is_a_one_line_bind_error(ctx: zmq.Context) -> None:
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        server = BrokerServer(LOOPBACK_ANY, f"tcp://127.0.0.1:{port}", LOOPBACK_ANY)
        with pytest.raises(BindError) as info:
            server.bind()
        server.close()
    finally:
        taken.close(linger=0)
    assert str(info.value).startswith(f"cannot bind tcp://127.0.0.1:{port}: the publish port "
                                      f"{port} is already in use (another broker, or a local "
                                      "process squatting it")
    assert "\n" not in str(info.value)


def test_run_with_stop_event_and_thread_safe_stop() -> None:
    server = BrokerServer(LOOPBACK_ANY, LOOPBACK_ANY, LOOPBACK_ANY, poll_interval=0.05)
    stop = threading.Event()
    t = threading.Thread(target=server.run, args=(stop,), daemon=True)
    t.start()
    wait_for(lambda: server.endpoints, what="bound")
    stop.set()
    t.join(5)
    assert not t.is_alive()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    server._stop_requested = False
    t.start()
    server.stop()
    t.join(5)
    assert not t.is_alive()
    server.close()
    server.close()  # idempotent


@pytest.mark.parametrize("endpoint, loopback", [
    ("tcp://127.0.0.1:5585", True), ("tcp://localhost:5585", True), ("tcp://[::1]:5585", True),
    ("ipc:///tmp/x", True), ("inproc://x", True), ("tcp://*:5585", False),
    ("tcp://0.0.0.0:5585", False), ("tcp://10.0.0.5:5585", False), ("tcp://eth0:5585", False),
])
def test_is_loopback_endpoint(endpoint: str, loopback: bool) -> None:
    assert is_loopback_endpoint(endpoint) is loopback


def test_public_ingest_without_curve_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="broker.server"):
        with BrokerServer("tcp://0.0.0.0:*", LOOPBACK_ANY, LOOPBACK_ANY) as server:
            eps = server.bind()
    text = caplog.text
    assert "without CURVE" in text
    assert all(ep in text for ep in eps.values())


def test_curve_admits_only_authorized_clients(tmp_path: Path, ctx: zmq.Context,
                                              start_broker: Callable[..., RunningBroker]) -> None:
    import zmq.auth

    authorized = tmp_path / "authorized"
    authorized.mkdir()
    _, server_secret = zmq.auth.create_certificates(str(tmp_path), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(authorized), "client")
    _, stranger_secret = zmq.auth.create_certificates(str(tmp_path), "stranger")
    rb = start_broker(curve_secret_key=server_secret, curve_authorized=authorized)
    server_public, _ = zmq.auth.load_certificate(server_secret)

    def pusher(secret_file: str) -> zmq.Socket:
        pub, sec = zmq.auth.load_certificate(secret_file)
        s = ctx.socket(zmq.PUSH)
        s.linger = 0
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, server_public
        s.connect(rb.endpoints["ingest"])
        return s

    good, bad, plain = pusher(client_secret), pusher(stranger_secret), ctx.socket(zmq.PUSH)
    try:
        plain.linger = 0
        plain.connect(rb.endpoints["ingest"])
        for sock, run in ((bad, "bad"), (plain, "plain")):
            sock.send(enc(register(run=run)), zmq.NOBLOCK)
        good.send(enc(register(run="good")))
        wait_for(lambda: "good" in rb.server.runs, what="authorized frame")
        good.send(enc(register(run="good2")))
        wait_for(lambda: "good2" in rb.server.runs, what="second authorized frame")
        assert "bad" not in rb.server.runs and "plain" not in rb.server.runs
    finally:
        for s in (good, bad, plain):
            s.close(linger=0)


def test_curve_needs_both_halves() -> None:
    with pytest.raises(ValueError):
        BrokerServer(curve_secret_key="x")


def test_journal_restart_keeps_records_and_raises_ids(
        tmp_path: Path, ctx: zmq.Context, start_broker: Callable[..., RunningBroker]) -> None:
    pytest.importorskip("broker.journal.journal")
    first = start_broker(data_dir=tmp_path)
    c1 = FeedClient(ctx, first.endpoints["publish"], first.endpoints["snapshot"])
    p1 = ctx.socket(zmq.PUSH)
    try:
        p1.linger = 0
        p1.connect(first.endpoints["ingest"])
        p1.send(enc(register(run="j")))
        for e in range(3):
            p1.send(enc(metrics(run="j", epoch=e)))
        wait_for(lambda: (s := first.server.runs.get("j")) is not None and len(s.records) == 3,
                 what="three records")
        [before], _ = c1.snapshot("j")
    finally:
        p1.close(linger=0)
        c1.close()
    first.stop()

    second = start_broker(data_dir=tmp_path)
    assert second.server.instance != first.server.instance
    c2 = FeedClient(ctx, second.endpoints["publish"], second.endpoints["snapshot"])
    p2 = ctx.socket(zmq.PUSH)
    try:
        [after], _ = c2.snapshot("j")
        assert after["records"] == before["records"]
        assert after["seq"] >= before["seq"]
        c2.until(lambda u: True, what="subscription live")
        p2.linger = 0
        p2.connect(second.endpoints["ingest"])
        p2.send(enc(metrics(run="j", epoch=3)))
        [ev] = c2.events("j", until=lambda u: u.kind == "epoch")[-1:]
        assert ev.seq > before["seq"] and ev.data["epoch"] == 3
    finally:
        p2.close(linger=0)
        c2.close()


def test_data_dir_held_by_another_broker_is_a_one_line_error(
        tmp_path: Path, start_broker: Callable[..., RunningBroker]) -> None:
    pytest.importorskip("broker.journal.journal")
    start_broker(data_dir=tmp_path)
    second = BrokerServer(LOOPBACK_ANY, LOOPBACK_ANY, LOOPBACK_ANY, data_dir=tmp_path)
    with pytest.raises(DataDirError) as info:
        second.bind()
    second.close()
    assert "in use by another broker" in str(info.value) and "\n" not in str(info.value)
    assert second.endpoints and second._pull is None  # its sockets were closed again


def test_importing_the_broker_leaves_the_collector_alone_and_tune_gc_raises_it() -> None:
    """``tune_gc`` is process-wide, so only the broker's entry point calls it: importing
    the server changes nothing (fresh interpreter), calling it sets the young threshold."""
    import subprocess
    import sys

    from broker.server import GC_YOUNG_THRESHOLD

    code = ("import gc; default = gc.get_threshold(); import broker.server as s; "
            "assert gc.get_threshold() == default, gc.get_threshold(); "
            "assert s.tune_gc() == default; print(*gc.get_threshold())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[0]) == GC_YOUNG_THRESHOLD


def test_a_starting_broker_beats_fast_so_a_web_sees_it_return(
        ctx: zmq.Context, start_broker: Callable[..., RunningBroker]) -> None:
    """Webs learn of a restarted broker from its heartbeats, and the first ones are lost
    while a web's SUB reconnects: for its first two intervals the broker beats every poll
    interval (a web saw a returning broker one whole interval late, ~1 s, before)."""
    started = time.monotonic()
    broker = start_broker(heartbeat_interval=1.0, poll_interval=0.05)
    client = FeedClient(ctx, broker.endpoints["publish"], broker.endpoints["snapshot"])

    def beats_until(deadline: float) -> list[float]:
        """When each heartbeat arrived, until ``deadline`` (monotonic)."""
        at: list[float] = []
        while (left := deadline - time.monotonic()) > 0:
            if client.sub.poll(int(left * 1000) + 1):
                if isinstance(feed.decode_update(client.sub.recv_multipart()), feed.Heartbeat):
                    at.append(time.monotonic())
        return at

    try:
        client.until(lambda u: isinstance(u, feed.Heartbeat), what="a first heartbeat")
        early = beats_until(time.monotonic() + 0.8)
        assert len(early) >= 3, f"{len(early)} heartbeats in the 0.8 s after the first"
        # once up for two intervals, it beats at its interval again
        late = [t for t in beats_until(started + 5.0) if t - started > 2.6]
        assert late and all(b - a > 0.5 for a, b in zip(late, late[1:])), late
    finally:
        client.close()
