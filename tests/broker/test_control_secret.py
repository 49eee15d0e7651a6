"""The broker's side of the control channel's trust (issue 38 finding 6): a broker with a data
dir creates ``control.secret`` (0600) at its first start, keeps it across restarts and
forwards every request for dumps signed with it; without a data dir nor a secret file it
forwards the web's bytes unsigned, as before; a secret file that cannot be used stops the
start with one line and is left as it was; the agents' default path is the default data
dir's; ``up`` says the trust model in one line and names a publish port in use."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from broker import feed
from broker.config import default_data_dir
from broker.server import BrokerServer, StartError
from rank_agent.controlauth import Verifier, default_secret_file
from rank_agent.controlwire import ControlRequest, control_topic, decode_request
from rankboard.up import control_line
from tests.support import REPO
from tests.support.brokers import Pusher, RunningBroker
from tests.support.polling import wait_for
from tests.support.procs import Proc

RUN = "signed"
LOCAL = "tcp://127.0.0.1:*"


def forwarded(broker: RunningBroker) -> list[bytes]:
    """One request for dumps sent to ``broker`` as a web does, as the run's ranks get it."""
    ctx = zmq.Context()
    rank = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    pusher = Pusher(broker.endpoints["ingest"])
    try:
        for sock in (rank, dealer):
            sock.linger = 0
        rank.setsockopt(zmq.SUBSCRIBE, control_topic(RUN))
        rank.connect(broker.endpoints["publish"])
        dealer.connect(broker.endpoints["snapshot"])
        pusher.register(RUN, 0, 1)
        wait_for(lambda: broker.server.runs.get(RUN), timeout=10, what="the run")
        got: list[list[bytes]] = []

        def arrived() -> bool:  # the SUB joins late (slow joiner): ask again past the gate
            dealer.send_multipart(feed.encode_stacks_request(ControlRequest(
                run=RUN, request_id=f"q{time.monotonic_ns()}", kind="stacks")))
            if rank.poll(1100):
                got.append(rank.recv_multipart())
            return bool(got)

        wait_for(arrived, timeout=20, what="a forwarded request")
        return got[0]
    finally:
        pusher.close()
        rank.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def test_a_data_dir_gets_a_private_secret_that_signs_every_request(tmp_path: Path) -> None:
    broker = RunningBroker(BrokerServer(LOCAL, LOCAL, LOCAL, data_dir=tmp_path))
    try:
        parts = forwarded(broker)
    finally:
        broker.stop()
    secret = tmp_path / "control.secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    key = secret.read_bytes().strip()
    assert len(key) == 64
    assert Verifier(key).check(parts, time.time()) is None
    assert decode_request(parts).run == RUN  # and an agent without the secret reads it

    again = RunningBroker(BrokerServer(LOCAL, LOCAL, LOCAL, data_dir=tmp_path))  # a restart
    try:
        assert Verifier(key).check(forwarded(again), time.time()) is None
    finally:
        again.stop()
    assert secret.read_bytes().strip() == key


def test_without_a_data_dir_or_secret_requests_go_unsigned_as_before() -> None:
    broker = RunningBroker(BrokerServer(LOCAL, LOCAL, LOCAL))
    try:
        parts = forwarded(broker)
    finally:
        broker.stop()
    assert Verifier(b"k" * 32).check(parts, time.time()) == "unsigned"
    assert decode_request(parts).run == RUN


def test_an_explicit_secret_file_is_used_and_a_bad_one_stops_the_start(tmp_path: Path) -> None:
    mine = tmp_path / "mine.secret"
    mine.write_text("m" * 40 + "\n")
    broker = RunningBroker(BrokerServer(LOCAL, LOCAL, LOCAL, data_dir=tmp_path / "d",
                                        control_secret_file=mine))
    try:
        assert Verifier(b"m" * 40).check(forwarded(broker), time.time()) is None
    finally:
        broker.stop()
    assert not (tmp_path / "d" / "control.secret").exists()

    mine.write_text("short\n")
    server = BrokerServer(LOCAL, LOCAL, LOCAL, data_dir=tmp_path / "d", control_secret_file=mine)
    with pytest.raises(StartError) as info:
        server.bind()
    server.close()
    assert str(info.value) == (f"control secret {mine} holds 5 characters; a control secret "
                               "has at least 16")
    assert mine.read_text() == "short\n"
    # nothing is left bound or locked: the same data dir starts at once with a good file
    mine.write_text("n" * 40)
    RunningBroker(BrokerServer(LOCAL, LOCAL, LOCAL, data_dir=tmp_path / "d",
                               control_secret_file=mine)).stop()


def test_the_agents_default_is_the_default_data_dirs_secret(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_secret_file() == default_data_dir() / "control.secret"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_secret_file() == default_data_dir() / "control.secret"


def test_up_says_who_the_ranks_obey(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    own = control_line(default_data_dir() / "control.secret", ["tcp://127.0.0.1:5586"])
    assert own == (f"control channel: ranks of this user on this host read {tmp_path}/rankboard/"
                   "control.secret by default and obey only this broker; any other rank obeys "
                   "whatever process on this host binds tcp://127.0.0.1:5586 (CURVE aside)")
    other = control_line(tmp_path / "x" / "control.secret", ["tcp://h:1", "tcp://h:4"])
    assert other.startswith("control channel: ranks given RANKBOARD_CONTROL_SECRET_FILE="
                            f"{tmp_path}/x/control.secret obey only this broker; ")
    assert other.endswith("binds tcp://h:1,tcp://h:4 (CURVE aside)")


def test_up_with_its_publish_port_taken_is_one_line_naming_the_port(tmp_path: Path) -> None:
    ctx = zmq.Context()
    squatter = ctx.socket(zmq.PUB)
    try:
        port = squatter.bind_to_random_port("tcp://127.0.0.1")
        env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
        result = subprocess.run(
            [sys.executable, "-m", "rankboard", "up", "--data-dir", str(tmp_path / "data"),
             "--ingest", LOCAL, "--publish", f"tcp://127.0.0.1:{port}", "--snapshot", LOCAL,
             "--port", "0", "--log-level", "WARNING"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
    finally:
        squatter.close(linger=0)
        ctx.term()
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"rankboard up: broker: cannot bind tcp://127.0.0.1:{port}: the "
                               f"publish port {port} is already in use (another broker, or a "
                               "local process squatting it (ranks without the control secret "
                               "obey whatever holds it)); see `ss -ltnp 'sport = :")
    assert "Traceback" not in result.stderr


def test_up_says_the_trust_model_and_its_shards_share_one_secret(tmp_path: Path) -> None:
    data = tmp_path / "data"
    up = Proc(["up", "--data-dir", str(data), "--shards", "2", "--ingest", LOCAL, "--publish",
               LOCAL, "--snapshot", LOCAL, "--port", "0"],
              {"XDG_STATE_HOME": str(tmp_path / "state")})
    try:
        line = up.wait_line(r"^control channel: ", timeout=60).string
        up.wait_dashboard(timeout=60)
    finally:
        up.stop()
    secret = data / "control.secret"
    assert line.startswith(f"control channel: ranks given RANKBOARD_CONTROL_SECRET_FILE={secret} "
                           "obey only this broker; any other rank obeys whatever process on "
                           "this host binds tcp://127.0.0.1:")
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert not list(data.glob("shard-*/control.secret"))  # one secret: a rank reads one
    err = up.output("stderr")
    assert err.count(f"requests for dumps signed with {secret}") == 2, err[-3000:]
