"""Alert webhooks end to end (PROTOCOL.md 3, 3.1): a real broker (``BrokerServer`` serving in a
thread on ephemeral loopback ports, journal in a tmp dir) POSTing to a real HTTP receiver on
loopback, real wire frames pushed over ZeroMQ, a real web process for ``/metrics`` and real
``rankboard`` processes for the command line.

The notifier's grouping window, retry delays and timeout are constructor arguments, so the
tests give the broker a fast one; the ``rankboard up`` test runs the real 5 s window. Every
wait polls with a deadline.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import pytest
import zmq

from broker.server import BrokerServer
from broker.webhooks.notifier import ENV_VAR, WebhookNotifier
from rank_agent.protocol import GpuSample, Resources, ResourceSample
from tests.support import REPO
from tests.support.brokers import LOOPBACK_ANY, FeedClient, Pusher, RunningBroker
from tests.support.http import fetch
from tests.support.polling import wait_for
from tests.support.procs import Endpoints, Proc, start_web
from tests.support.receiver import Receiver

FAST = {"window": 0.3, "retry_delays": (0.05, 0.1, 0.2), "timeout": 5.0}


class Rig:
    """Brokers on one data dir posting to ``receiver``; ``start()`` again = a restart."""

    def __init__(self, data_dir: Path, receiver: Receiver) -> None:
        self.data_dir = data_dir
        self.receiver = receiver
        self.broker: RunningBroker | None = None
        self.pusher: Pusher | None = None

    def start(self, stale_after: float = 30.0, **notifier: Any) -> BrokerServer:
        self.stop()
        hooks = WebhookNotifier([self.receiver.url], **{**FAST, **notifier})
        server = BrokerServer(LOOPBACK_ANY, LOOPBACK_ANY, LOOPBACK_ANY, data_dir=self.data_dir,
                              stale_after=stale_after, webhooks=hooks)
        self.broker = RunningBroker(server)
        self.pusher = Pusher(self.broker.endpoints["ingest"])
        return server

    @property
    def server(self) -> BrokerServer:
        assert self.broker is not None
        return self.broker.server

    def push(self, *frames: Any) -> None:
        assert self.pusher is not None
        self.pusher.send(*frames)

    def idle(self) -> None:
        """Wait until nothing is grouped, queued or in flight."""
        wait_for(lambda: self.server.webhooks.pending() == 0, what="an idle notifier")

    def stop(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None
        if self.broker is not None:
            self.broker.stop()
            self.broker = None


@pytest.fixture
def rig(tmp_path: Path, receiver: Receiver) -> Iterator[Rig]:
    r = Rig(tmp_path / "data", receiver)
    yield r
    r.stop()


def xid_sample(run: str, rank: int, code: int, index: int = 1) -> Resources:
    return Resources(run=run, rank=rank, sample=ResourceSample(gpus=[GpuSample(
        device_index=index, name="NVIDIA H100", xid_errors=[code], sm_clock_mhz=1980.0,
        ecc_uncorrected=0, pcie_link_gen=5, pcie_link_gen_max=5, pcie_link_width=16,
        pcie_link_width_max=16, nvlink_errors=0)]))


def accepted(server: BrokerServer, n: int, timeout: float = 15.0) -> None:
    wait_for(lambda: server.runs.accepted >= n, timeout, what=f"{n} frames accepted")


def test_1024_ranks_going_stale_together_are_exactly_one_post(rig: Rig, receiver: Receiver) -> None:
    server = rig.start(stale_after=1.5, window=1.0)  # a loaded machine may spread the registers
    for rank in range(1024):
        rig.pusher.register("big", rank, 1024, host=f"node{rank // 8:03d}", local_rank=rank % 8)  # type: ignore[union-attr]
    accepted(server, 1024)
    wait_for(lambda: receiver.count() >= 1, what="the stale POST")
    rig.idle()
    (body,) = receiver.bodies()
    assert body["status"] == "firing" and body["kind"] == "stale" and body["run"] == "big"
    assert body["count"] == 1024 and body["ranks"] == list(range(1024))
    assert body["hosts"] == [f"node{i:03d}" for i in range(128)]
    assert body["text"] == body["content"] and body["text"].startswith(
        "[rankboard] big: stale on 1,024 ranks (node000…): ")
    assert server.webhooks.counters() == {"sent": 1, "failed": 0, "dropped": 0}


def test_an_xid_sample_posts_gpu_xid_naming_the_code_and_gpu(rig: Rig, receiver: Receiver) -> None:
    server = rig.start()
    rig.pusher.register("r", 0, 2, host="node-a")  # type: ignore[union-attr]
    rig.push(xid_sample("r", 0, 79, index=3))
    wait_for(lambda: receiver.count() >= 1, what="the XID POST")
    rig.idle()
    (body,) = receiver.bodies()
    assert (body["kind"], body["ranks"], body["hosts"]) == ("gpu_xid", [0], ["node-a"])
    assert body["message"] == "XID 79 on GPU 3"
    assert "XID 79 on GPU 3" in body["text"]
    # listed in the header like the other per-rank kinds
    sink = server.runs.get("r")
    assert sink is not None
    assert [(a["kind"], a["rank"]) for a in sink.header()["alerts"]] == [("gpu_xid", 0)]


def test_run_end_posts_resolved_at_once(rig: Rig, receiver: Receiver) -> None:
    rig.start(window=30.0)  # nothing waits for a grouping window
    rig.pusher.register("done", 0, 1, host="h")  # type: ignore[union-attr]
    rig.push(Resources(run="done", rank=0, sample=ResourceSample(cpu_percent=1.0)))
    from tests.support.frames import finish

    rig.push(finish("done", 0))
    wait_for(lambda: receiver.count() >= 1, timeout=5.0, what="the resolved POST")
    (body,) = receiver.bodies()
    assert body["status"] == "resolved" and body["kind"] == "run_complete"
    assert (body["run"], body["ranks"], body["hosts"], body["count"]) == ("done", [], [], 0)


def test_a_hanging_receiver_leaves_ingest_unaffected(rig: Rig, receiver: Receiver) -> None:
    receiver.hang = True  # holds each POST open for 10 s
    server = rig.start(timeout=8.0)
    ctx = zmq.Context()
    feed = FeedClient(ctx, server.endpoints["publish"], server.endpoints["snapshot"])
    try:
        rig.pusher.register("hang", 0, 4, host="node-a")  # type: ignore[union-attr]
        rig.push(xid_sample("hang", 0, 79))
        wait_for(lambda: receiver.count() == 1, what="a POST held by the receiver")
        base = server.runs.accepted
        t0 = time.monotonic()
        n = 5000
        for i in range(n):
            rig.push(xid_sample("hang", i % 4, 1 + i % 100))  # every frame raises an alert
        accepted(server, base + n, timeout=6.0)
        took = time.monotonic() - t0
        assert took < 6.0 and receiver.count() == 1, (took, receiver.count())
        # served: a snapshot holds the latest samples, while the POST still hangs
        (snap,), _ = feed.snapshot("hang")
        last = {r["rank"]: r["resources"]["gpus"][0]["xid_errors"] for r in snap["ranks"]}
        assert last == {k: [1 + (n - 4 + k) % 100] for k in range(4)}
        assert receiver.count() == 1 and server.webhooks.counters()["sent"] == 0
    finally:
        feed.close()
        ctx.term()


def test_a_restart_posts_nothing_for_what_its_journal_replays(rig: Rig, receiver: Receiver) -> None:
    from tests.support.frames import finish, metrics

    server = rig.start()
    rig.pusher.register("r", 0, 2, host="a")  # type: ignore[union-attr]
    rig.pusher.register("r", 1, 2, host="a")  # type: ignore[union-attr]
    rig.push(xid_sample("r", 0, 79))
    rig.push(metrics("r", 0, 0))  # the journal writes rank 0's held sample before this
    rig.push(finish("r", 1, "error"))
    rig.pusher.register("done", 0, 1, host="b")  # type: ignore[union-attr]
    rig.push(finish("done", 0))
    accepted(server, 7)
    wait_for(lambda: receiver.count() == 3, what="three POSTs")
    rig.idle()
    assert sorted((b["run"], b["kind"]) for b in receiver.bodies()) == [
        ("done", "run_complete"), ("r", "gpu_xid"), ("r", "rank_error")]

    server = rig.start(stale_after=1.0)  # the restart: same data dir, same receiver
    sink = server.runs.get("r")
    assert sink is not None and server.runs.get("done") is not None
    # the replay rebuilt the listed alerts, and rank 0 (silent since) turns stale...
    wait_for(lambda: ("stale", 0) in [(a["kind"], a["rank"]) for a in sink.header()["alerts"]],
             what="rank 0 stale after the restart")
    rig.idle()
    assert receiver.count() == 3  # ...and none of it is posted
    assert server.webhooks.counters() == {"sent": 0, "failed": 0, "dropped": 0}
    # a live alert after the restart is
    rig.push(xid_sample("r", 0, 48))
    wait_for(lambda: receiver.count() == 4, what="a live POST after the restart")
    assert receiver.bodies()[-1]["message"] == "XID 48 on GPU 1"


def test_metrics_shows_webhook_counters_and_gpu_gauges(rig: Rig, receiver: Receiver,
                                                       spawn: Callable[..., Proc]) -> None:
    server = rig.start()
    eps = server.endpoints
    web = start_web(spawn, Endpoints(eps["ingest"], eps["publish"], eps["snapshot"]))
    assert web.port is not None
    rig.pusher.register("m", 0, 1, host="h0")  # type: ignore[union-attr]
    rig.push(xid_sample("m", 0, 79, index=2))
    wait_for(lambda: server.webhooks.counters()["sent"] == 1, what="the XID POST")
    labels = 'gpu="2",host="h0",rank="0",run="m"'

    def scrape() -> str:
        text = fetch(web.port, "/metrics").text  # type: ignore[arg-type]
        return text if ("rankboard_webhooks_sent_total 1.0" in text
                        and f"rankboard_gpu_xid_errors_total{{{labels}}} 1.0" in text) else ""

    text = wait_for(scrape, what="the webhook counter and the XID tally on /metrics")
    assert "rankboard_webhooks_failed_total 0.0" in text
    assert "rankboard_webhooks_dropped_total 0.0" in text
    assert f"rankboard_gpu_last_xid{{{labels}}} 79.0" in text
    assert f"rankboard_gpu_pcie_link_width{{{labels}}} 16.0" in text
    assert f"rankboard_gpu_sm_clock_mhz{{{labels}}} 1980.0" in text
    assert re.search(r'rankboard_journal_total\{kind="early_flushes"\} \d', text)
    assert "SECRET" not in text


@pytest.fixture
def spawn() -> Iterator[Callable[..., Proc]]:
    procs: list[Proc] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Proc:
        proc = Proc(list(args), env)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.close()


def test_up_hands_the_urls_to_its_broker_by_environment_only(
        spawn: Callable[..., Proc], receiver: Receiver, tmp_path: Path) -> None:
    up = spawn("up", "--ingest", LOOPBACK_ANY, "--publish", LOOPBACK_ANY,
               "--snapshot", LOOPBACK_ANY, "--data-dir", str(tmp_path / "data"), "--port", "0",
               "--alert-webhook", receiver.url, "--public-url", "https://board.example.org/")
    ingest = up.wait_line(r"broker ingest bound at (\S+)", stream="stderr").group(1)
    up.wait_dashboard()
    (child,) = [p for p in psutil.Process(up.proc.pid).children(recursive=True)
                if "broker" in p.cmdline()]
    assert not any("SECRET" in arg or "/hooks/" in arg for arg in child.cmdline()), child.cmdline()
    assert child.environ().get(ENV_VAR) == receiver.url
    pusher = Pusher(ingest)
    try:
        pusher.register("up-run", 0, 1, host="h")
        pusher.send(xid_sample("up-run", 0, 79))
        wait_for(lambda: receiver.count() >= 1, timeout=20.0, what="the POST from up's broker")
    finally:
        pusher.close()
        assert up.stop(signal.SIGTERM) == 0
        psutil.wait_procs([child], timeout=10)
    (body,) = receiver.bodies()
    assert body["kind"] == "gpu_xid" and body["url"] == "https://board.example.org/#run=up-run"
    out = up.output("stderr") + up.output("stdout")
    # the URL's secret part never shows (the control channel's trust line names the
    # RANKBOARD_CONTROL_SECRET_FILE variable: a name, not the webhook's token)
    assert "SECRET-TOKEN" not in out and "/hooks/" not in out
    assert f"alert webhooks: http://127.0.0.1:{receiver.server.server_address[1]}" in out


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_bad_webhook_url_is_one_line_without_its_secret(how: str, tmp_path: Path) -> None:
    bad = "ftp://hooks.example.org/services/SECRET-TOKEN"
    args = [sys.executable, "-m", "rankboard", "broker", "--data-dir", str(tmp_path / "d"),
            "--ingest", LOOPBACK_ANY, "--publish", LOOPBACK_ANY, "--snapshot", LOOPBACK_ANY]
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if how == "flag":
        args += ["--alert-webhook", bad]
    else:
        env[ENV_VAR] = f"https://ok.example.org/x {bad}"
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == ["rankboard broker: alert webhook ftp://hooks.example.org is not an http(s) "
                     "URL with a host"], done.stderr
    assert "SECRET" not in done.stderr + done.stdout


def test_a_bad_public_url_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "rankboard", "up", "--public-url", "board",
                           "--data-dir", str(tmp_path / "d")], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--public-url" in done.stderr
