"""The control channel's trust (issue 38 finding 6, ``rank_agent/controlauth.py``), pure:
what the broker signs the agent accepts once, within the window; unsigned, wrongly signed,
tampered, retargeted, late and replayed messages are refused and counted by reason; an agent
without the secret still reads a signed request; where an agent and a broker find the
secret, and what a secret file that cannot be used does."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from rank_agent.controlauth import (
    MIN_SECRET_CHARS,
    SECRET_ENV,
    SECRET_FILE_ENV,
    WINDOW_S,
    SecretError,
    Verifier,
    agent_secret,
    broker_secret,
    default_secret_file,
    sign_request,
)
from rank_agent.controlwire import ControlRequest, control_topic, decode_request, encode_request

KEY = b"k" * 64
NOW = 1_800_000_000.0


def req(request_id: str = "r1", run: str = "run-a", **kw: object) -> ControlRequest:
    return ControlRequest(run=run, request_id=request_id, kind="stacks", **kw)  # type: ignore[arg-type]


def fresh() -> Verifier:
    return Verifier(KEY)


def test_a_signed_request_is_accepted_once_and_decodes_as_before() -> None:
    profile = ControlRequest(run="run-a", request_id="p", kind="profile", ranks=[3, 5], hz=250,
                             seconds=0.5)
    parts = sign_request(KEY, profile, NOW)
    v = fresh()
    assert v.check(parts, NOW + 1) is None
    assert decode_request(parts) == profile  # an agent without the secret reads it too
    assert v.check(parts, NOW + 1) == "replayed"
    assert v.refused == {"unsigned": 0, "bad_mac": 0, "stale": 0, "replayed": 1}


def test_unsigned_wrong_key_tampered_and_retargeted_messages_are_refused() -> None:
    v = fresh()
    assert v.check(encode_request(req("plain")), NOW) == "unsigned"
    assert v.check(sign_request(b"w" * 64, req("wrong"), NOW), NOW) == "bad_mac"
    topic, body = sign_request(KEY, req("tamper", ranks=[1]), NOW)
    flipped = body.replace(b"tamper", b"tampeR")
    assert v.check([topic, flipped], NOW) == "bad_mac"
    # the same body under another run's topic: the topic is signed too
    assert v.check([control_topic("run-b"), body], NOW) == "bad_mac"
    assert v.check([topic], NOW) == "unsigned"
    assert v.check([topic, b""], NOW) == "unsigned"
    assert v.refused == {"unsigned": 3, "bad_mac": 3, "stale": 0, "replayed": 0}
    assert v.check([topic, body], NOW) is None  # the untouched one still passes


def test_a_request_outside_the_window_is_stale_either_side() -> None:
    v = fresh()
    assert v.check(sign_request(KEY, req("old"), NOW - WINDOW_S - 0.5), NOW) == "stale"
    assert v.check(sign_request(KEY, req("new"), NOW + WINDOW_S + 0.5), NOW) == "stale"
    assert v.check(sign_request(KEY, req("nan"), float("nan")), NOW) == "stale"
    assert v.check(sign_request(KEY, req("edge"), NOW - WINDOW_S + 0.5), NOW) is None
    assert v.refused["stale"] == 3


def test_the_replay_memory_is_bounded() -> None:
    v = fresh()
    for i in range(3000):
        assert v.check(sign_request(KEY, req(f"r{i}"), NOW), NOW) is None
    assert len(v._seen) <= 1024


def test_the_agent_reads_the_variable_then_the_file_then_the_default(tmp_path: Path) -> None:
    secret = tmp_path / "s"
    secret.write_text("f" * 40 + "\n")
    default = tmp_path / "xdg" / "rankboard" / "control.secret"
    env = {"XDG_STATE_HOME": str(tmp_path / "xdg")}
    assert default_secret_file(env) == default
    key, why = agent_secret(env)
    assert key is None and str(default) in why
    default.parent.mkdir(parents=True)
    default.write_text("d" * 64)
    assert agent_secret(env) == (b"d" * 64, str(default))
    assert agent_secret({**env, SECRET_FILE_ENV: str(secret)}) == (b"f" * 40, str(secret))
    assert agent_secret({**env, SECRET_FILE_ENV: str(secret), SECRET_ENV: "e" * 20})[0] == b"e" * 20


def test_a_configured_secret_that_cannot_be_used_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="cannot read control secret .*missing"):
        agent_secret({SECRET_FILE_ENV: str(tmp_path / "missing")})
    with pytest.raises(SecretError, match=f"at least {MIN_SECRET_CHARS}"):
        agent_secret({SECRET_ENV: "short"})
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    with pytest.raises(SecretError, match="not a secret"):
        agent_secret({SECRET_FILE_ENV: str(big)})


def test_the_broker_creates_its_secret_once_private(tmp_path: Path) -> None:
    path = tmp_path / "control.secret"
    key, created = broker_secret(path)
    assert created and len(key) == 64 and int(key, 16) >= 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert broker_secret(path) == (key, False)  # a restart reads the same
    assert sorted(p.name for p in tmp_path.iterdir()) == ["control.secret"]  # no temp left


def test_the_broker_never_replaces_a_secret_it_cannot_use(tmp_path: Path) -> None:
    path = tmp_path / "control.secret"
    path.write_text("short\n")
    with pytest.raises(SecretError, match="at least"):
        broker_secret(path)
    assert path.read_text() == "short\n"


def test_only_the_default_endpoints_ranks_read_the_default_secret(tmp_path: Path) -> None:
    """A rank of a second broker (its own --data-dir and ports, as every test broker is) must
    not read the default broker's secret: it would refuse its own broker's requests as
    ``bad_mac``. The default file is the default endpoint's (``rankboard up``'s defaults)."""
    from rank_agent.controlauth import broker_secret, default_secret_file

    env = {"XDG_STATE_HOME": str(tmp_path)}
    default_secret_file(env).parent.mkdir(parents=True)
    key, _ = broker_secret(default_secret_file(env))
    assert agent_secret(env, endpoint="tcp://127.0.0.1:5586")[0] == key
    assert agent_secret(env, endpoint="tcp://localhost:5586")[0] == key
    other, why = agent_secret(env, endpoint="tcp://127.0.0.1:40001")
    assert other is None and "default broker's" in why
    named = tmp_path / "mine.secret"
    named.write_text("y" * 40)
    assert agent_secret(dict(env, RANKBOARD_CONTROL_SECRET_FILE=str(named)),
                        endpoint="tcp://127.0.0.1:40001")[0] == b"y" * 40
