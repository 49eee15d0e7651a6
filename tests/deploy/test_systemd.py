"""deploy/systemd: the units parse (``systemd-analyze verify``), their hardening is what
``systemd-analyze security`` calls OK, the command lines they run are ones rankboard's own
parser accepts, and the sysusers file creates the user they run as."""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from rankboard.cli import build_parser
from tests.support.deploy import DEPLOY, tool

UNITS = ["rankboard-broker.service", "rankboard-web.service"]
INSTALLED = "/opt/rankboard/bin/rankboard"


def unit_settings(name: str) -> dict[str, list[str]]:
    """``{key: [values]}`` of a unit file (continuation lines joined, comments dropped)."""
    text = (DEPLOY / "systemd" / name).read_text().replace("\\\n", " ")
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


@pytest.fixture
def units(tmp_path: Path) -> list[Path]:
    """Copies of the units whose ExecStart names an executable that exists here (verify
    checks it); everything else byte for byte."""
    copies = []
    for name in UNITS:
        text = (DEPLOY / "systemd" / name).read_text()
        assert INSTALLED in text
        copy = tmp_path / name
        copy.write_text(text.replace(INSTALLED, "/bin/true"))
        copies.append(copy)
    return copies


def test_units_verify(units: list[Path]) -> None:
    analyze = tool("systemd-analyze", "systemd")
    done = subprocess.run([analyze, "verify", "--man=no", *map(str, units)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


@pytest.mark.parametrize("index", range(len(UNITS)))
def test_units_are_hardened(units: list[Path], index: int) -> None:
    analyze = tool("systemd-analyze", "systemd")
    done = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(units[index])],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    exposure = float(done.stdout.split("Overall exposure level for")[1].split(":")[1].split()[0])
    assert exposure <= 2.0, done.stdout[-3000:]  # systemd's own scale: <= 2 is "OK"
    settings = unit_settings(UNITS[index])
    for key, value in [("User", "rankboard"), ("NoNewPrivileges", "yes"),
                       ("ProtectSystem", "strict"), ("PrivateTmp", "yes"),
                       ("CapabilityBoundingSet", "")]:
        assert settings.get(key) == [value], (key, settings.get(key))


def test_broker_keeps_its_journal_in_its_state_directory() -> None:
    settings = unit_settings("rankboard-broker.service")
    assert settings["StateDirectory"] == ["rankboard"]
    assert "--data-dir /var/lib/rankboard" in settings["ExecStart"][0]


@pytest.mark.parametrize("name", UNITS)
def test_exec_start_is_a_valid_rankboard_command_line(name: str) -> None:
    settings = unit_settings(name)
    [exec_start] = settings["ExecStart"]
    argv = shlex.split(exec_start.replace("%d", "/run/credentials/unit"))
    assert argv[0] == INSTALLED
    args = build_parser().parse_args(argv[1:])  # SystemExit on any unknown or bad flag
    credentials = {v.split(":")[0] for v in settings.get("LoadCredential", [])}
    if args.command == "broker":  # all three sockets public: CURVE is not optional then
        assert args.curve_secret_key is not None and args.curve_authorized is not None
        assert args.curve_web_authorized is not None
        assert args.curve_secret_key.name in credentials
    else:
        assert args.workers > 1 and args.metrics_port is not None
        assert args.curve_client_key is not None and args.curve_client_key.name in credentials
        assert settings["KillMode"] == ["mixed"]  # the supervisor stops its workers itself
        assert settings["EnvironmentFile"]  # the token: never on the command line
        assert "--token" not in argv


def test_sysusers_creates_the_service_user(tmp_path: Path) -> None:
    sysusers = tool("systemd-sysusers", "systemd")
    target = tmp_path / "usr" / "lib" / "sysusers.d"
    target.mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    (target / "rankboard.conf").write_text((DEPLOY / "systemd" / "rankboard.sysusers.conf").read_text())
    done = subprocess.run([sysusers, f"--root={tmp_path}"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text()
    user = [line for line in passwd.splitlines() if line.startswith("rankboard:")]
    assert user and user[0].endswith(":/usr/sbin/nologin"), passwd
