"""``rankboard up``'s dashboard address (PROTOCOL 8.5): 8585 at once unless told otherwise,
the v1 launcher rule only with ``--port-from-rank``, and a port in use as one line that says
how to pick another. The parse rules are pure; the refusals run the real command."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rankboard.cli import build_parser
from rankboard.config import UpConfig, from_args
from tests.support import REPO

ANY = "tcp://127.0.0.1:*"


def _up(*argv: str) -> UpConfig:
    cfg = from_args(build_parser().parse_args(["up", *argv]))
    assert isinstance(cfg, UpConfig)
    return cfg


@pytest.mark.parametrize("argv", [[], ["--workers", "2"], ["--shards", "2"],
                                  ["--shards", "2", "--workers", "3"]])
def test_up_without_port_binds_8585_at_once(argv: list[str]) -> None:
    assert _up(*argv).web.port == 8585


def test_up_port_from_rank_keeps_the_lazy_rule_and_port_is_kept() -> None:
    assert _up("--port-from-rank").web.port is None  # None: LazyBinder (PROTOCOL 6's v1 rule)
    assert _up("--port-from-rank", "--workers", "2").web.port is None
    assert _up("--port", "9000").web.port == 9000
    assert _up("--port", "0").web.port == 0


def _rankboard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rankboard", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_port_with_port_from_rank_is_a_usage_error(tmp_path: Path) -> None:
    done = _rankboard("up", "--port", "9000", "--port-from-rank", "--data-dir", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "rankboard up: --port and --port-from-rank exclude each other: give one"]
    assert done.stdout == ""


@pytest.mark.parametrize("extra", [[], ["--workers", "2"], ["--shards", "2"]])
def test_a_port_in_use_is_one_line_naming_it_and_how_to_pick_another(
        tmp_path: Path, extra: list[str]) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = _rankboard("up", "--port", str(port), "--ingest", ANY, "--publish", ANY,
                          "--snapshot", ANY, "--data-dir", str(tmp_path), *extra)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines == [f"rankboard up: cannot bind the web to 127.0.0.1:{port}: Address already "
                     "in use; pick another port with --port N"], done.stderr
    assert done.stdout == ""  # no broker started, no dashboard line
